//! `smcuda`: GPU memory between processes of one node through CUDA IPC —
//! the heir of Open MPI's `btl_smcuda` (its host-memory half is `sm`).
//!
//! [`transport`] carries put and get between device regions
//! (`Fabric::alloc_device_region`) of ranks on one node, one GPU copy
//! each, completed by the copy's event, and sends what it cannot carry
//! (refused IPC, host memory on one side) to the host-staged path. It
//! stands on:
//! - [`gpu`]: the GPU operations as one trait ([`gpu::Gpu`]): classify a
//!   pointer, allocate (VMM or legacy) and free, export and import memory
//!   and event handles, record, query and wait on events, queue copies and
//!   fills on streams, and ring a host function when a stream gets there;
//! - [`cuda`] (cargo feature `cuda`): that trait over the CUDA driver,
//!   loaded at run time (cudarc's `dynamic-loading`), so the build needs
//!   no toolkit and a host without a driver reports why, never panics. All
//!   unsafe CUDA calls are in that one file;
//! - [`double`]: a test double of a GPU whose device memory is host memory
//!   in memory files, so handles cross real processes, with injectable
//!   faults; chosen only by `BTL_SMCUDA_GPU=test-double`;
//! - [`handshake`]: whether and how two ranks use IPC (VMM descriptors,
//!   legacy handles, or the staged path with the reason): the decision
//!   both ranks make from the capabilities each publishes, and the
//!   request/answer messages of a lazy handshake;
//! - [`key`]: the handle a device region's key carries, exported by the
//!   owner and opened by peers;
//! - [`cache`]: the cache of peers' allocations mapped here, keyed by
//!   owner, base, length, buffer id and handle, bounded, never evicting a
//!   mapping an operation holds;
//! - [`check`]: the two-process GPU check behind `btl-gpu-check`.

pub(crate) mod cache;
pub(crate) mod check;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod double;
pub(crate) mod gpu;
pub(crate) mod handshake;
pub(crate) mod key;
pub(crate) mod transport;

use std::sync::Arc;

use crate::transport::registry::{Entry, Reach};
use gpu::{Gpu, GpuError};

/// The GPU implementation `BTL_SMCUDA_GPU` selects: `cuda` (the default)
/// or `test-double`.
pub(crate) fn open_gpu() -> Result<Arc<dyn Gpu>, GpuError> {
    let choice = std::env::var("BTL_SMCUDA_GPU").unwrap_or_default();
    match choice.as_str() {
        "test-double" => Ok(Arc::new(double::GpuDouble::from_env()?)),
        "" | "cuda" => open_cuda(),
        other => Err(GpuError::Unavailable(format!(
            "BTL_SMCUDA_GPU={other}: expected `cuda` or `test-double`"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Arc<dyn Gpu>, GpuError> {
    Ok(Arc::new(cuda::Cuda::open()?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Arc<dyn Gpu>, GpuError> {
    Err(GpuError::Unavailable(
        "built without the `cuda` cargo feature".into(),
    ))
}

/// What this host offers `smcuda`: its GPUs and what they support, or
/// why there are none.
fn probe() -> std::result::Result<String, String> {
    #[cfg(feature = "cuda")]
    if matches!(
        std::env::var("BTL_SMCUDA_GPU").as_deref(),
        Err(_) | Ok("" | "cuda")
    ) {
        return cuda::probe();
    }
    let g = open_gpu().map_err(|e| e.to_string())?;
    let devs = g.devices();
    Ok(format!(
        "{}: {} device(s){}",
        g.backend(),
        devs.len(),
        if devs.iter().all(|d| d.vmm) {
            ", VMM"
        } else {
            ", legacy IPC only"
        }
    ))
}

/// The registry's entry.
#[linkme::distributed_slice(crate::transport::registry::TRANSPORTS)]
static ENTRY: Entry = Entry {
    name: "smcuda",
    rank: 50,
    implicit: false,
    messages: false,
    one_sided: false,
    device_memory: true,
    reach: Reach::Node,
    not_built: None,
    probe,
    open: |core, _job| match open_gpu() {
        Ok(gpu) => Ok(Some(transport::SmcudaTransport::new(core.clone(), gpu)
            as Arc<dyn crate::transport::Transport>)),
        Err(e) => {
            tracing::debug!("smcuda not opened: {e}");
            Ok(None)
        }
    },
    alloc_shared: None,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_says_why_not_without_a_driver_and_never_panics() {
        // On a host with a GPU and a `cuda` build this reports devices;
        // everywhere else it must explain itself.
        match probe() {
            Ok(s) => assert!(s.contains("device"), "{s}"),
            Err(why) => assert!(
                why.contains("cuda") || why.contains("CUDA") || why.contains("GPU"),
                "{why}"
            ),
        }
    }
}
