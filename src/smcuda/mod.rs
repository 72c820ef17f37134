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
//!   legacy handles, or the staged path with the reason): the lazy
//!   request/answer the transport runs over the core's control messages
//!   on its first device operation with a peer;
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

/// Which CUDA IPC `smcuda` offers its peers, from `BTL_SMCUDA_IPC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IpcChoice {
    /// VMM descriptors where every device has VMM, else legacy handles
    /// (the default, `auto`).
    Auto,
    /// VMM descriptors only: a device without VMM is an error.
    Vmm,
    /// Legacy IPC handles only (allocations are `cuMemAlloc`'s).
    Legacy,
    /// No IPC: device memory goes through the host with every peer.
    Off,
}

/// The variable that chooses [`IpcChoice`].
pub(crate) const IPC_VAR: &str = "BTL_SMCUDA_IPC";

/// `BTL_SMCUDA_IPC`: `auto` (or unset), `vmm`, `legacy` or `off`.
pub(crate) fn ipc_choice() -> Result<IpcChoice, String> {
    parse_ipc(&std::env::var(IPC_VAR).unwrap_or_default())
}

fn parse_ipc(v: &str) -> Result<IpcChoice, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(IpcChoice::Auto),
        "vmm" => Ok(IpcChoice::Vmm),
        "legacy" => Ok(IpcChoice::Legacy),
        "off" => Ok(IpcChoice::Off),
        _ => Err(format!(
            "{IPC_VAR}={v}: expected `auto`, `vmm`, `legacy` or `off`"
        )),
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
    let found = probe_gpu()?;
    Ok(match ipc_choice()? {
        IpcChoice::Auto => found,
        IpcChoice::Vmm => format!("{found}; {IPC_VAR}=vmm: VMM descriptors only"),
        IpcChoice::Legacy => format!("{found}; {IPC_VAR}=legacy: legacy IPC handles only"),
        IpcChoice::Off => format!("{found}; {IPC_VAR}=off: device memory goes through the host"),
    })
}

/// The GPUs `probe` reports.
fn probe_gpu() -> std::result::Result<String, String> {
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
        Ok(gpu) => {
            let ipc = ipc_choice().map_err(crate::Error::Config)?;
            let t = transport::SmcudaTransport::new(core.clone(), gpu, ipc)
                .map_err(crate::Error::Config)?;
            Ok(Some(t as Arc<dyn crate::transport::Transport>))
        }
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
    fn the_ipc_choice_reads_its_four_words_and_names_them_when_wrong() {
        assert_eq!(parse_ipc(""), Ok(IpcChoice::Auto));
        assert_eq!(parse_ipc(" Auto "), Ok(IpcChoice::Auto));
        assert_eq!(parse_ipc("vmm"), Ok(IpcChoice::Vmm));
        assert_eq!(parse_ipc("LEGACY"), Ok(IpcChoice::Legacy));
        assert_eq!(parse_ipc("off"), Ok(IpcChoice::Off));
        let e = parse_ipc("fast").unwrap_err();
        assert!(
            e.contains("BTL_SMCUDA_IPC=fast") && e.contains("`off`"),
            "{e}"
        );
    }

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
