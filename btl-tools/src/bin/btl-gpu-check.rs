//! `btl-gpu-check`: the GPU check of `smcuda`'s GPU layer between two
//! processes of this host (it starts the second itself): device buffers
//! exported, imported and copied into and out of with checksums, the
//! ordering of a copy behind a peer's event, free and allocate again,
//! and bandwidth beside a local device-to-device copy. Prints a summary
//! and writes the figures as JSON.

use std::process::{Command, ExitCode};

use async_btl::gpu_check::{child, run, Options, Report};
use clap::Parser;

/// Command-line arguments of btl-gpu-check.
#[derive(Debug, Parser)]
#[command(
    name = "btl-gpu-check",
    version,
    about = "Check smcuda's GPU layer between two processes: IPC handles, copies with \
             checksums, ordering on events, reallocation, bandwidth (BTL_SMCUDA_GPU picks \
             `cuda` or the `test-double`)."
)]
struct Args {
    /// The largest transfer in bytes (also each buffer's size).
    #[arg(long, default_value_t = 256 << 20)]
    max_size: u64,
    /// The device both processes use.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Bytes each bandwidth point moves at least.
    #[arg(long, default_value_t = 4 << 30)]
    bandwidth_bytes: u64,
    /// Whole-buffer fills queued before the ordering check's event.
    #[arg(long, default_value_t = 256)]
    order_fills: u32,
    /// Write the report as JSON here (else to standard output after the
    /// summary).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Fail (exit status 3) when no GPU is found, instead of reporting it.
    #[arg(long)]
    require_gpu: bool,
    /// Run as the second process (started by the first).
    #[arg(long, hide = true)]
    child: bool,
}

fn summary(r: &Report) -> String {
    let mut s = format!(
        "backend: {}\n",
        if r.backend.is_empty() {
            "none"
        } else {
            &r.backend
        }
    );
    if let Some(why) = &r.reason {
        s += &format!("{why}\n");
    }
    for m in &r.modes {
        match &m.skipped {
            Some(why) => s += &format!("{}: skipped: {why}\n", m.mode),
            None => {
                s += &format!(
                    "{}: {} sizes up to {} B checked; ordered: {}; registered range: {}; realloc: new buffer id {}, same address {}, read new bytes {}; cache hits/opens/stale/remapped {:?}\n",
                    m.mode,
                    m.sizes.len(),
                    m.sizes.last().copied().unwrap_or(0),
                    m.ordered,
                    m.registered,
                    m.new_buffer_id,
                    m.same_address,
                    m.realloc_read_new,
                    m.cache
                );
                for b in &m.bandwidth {
                    s += &format!(
                        "  {:>10} B  put {:8.1} GB/s ({:.2}x local)  get {:8.1} GB/s ({:.2}x local)  local {:8.1} GB/s\n",
                        b.size,
                        b.put,
                        b.put / b.local,
                        b.get,
                        b.get / b.local,
                        b.local
                    );
                }
            }
        }
    }
    for f in &r.failures {
        s += &format!("FAILED: {f}\n");
    }
    s += &format!("{:.1} s\n", r.seconds);
    s
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.child {
        return ExitCode::from(child() as u8);
    }
    let opts = Options {
        max_size: args.max_size.max(8),
        device: args.device,
        bandwidth_bytes: args.bandwidth_bytes,
        order_fills: args.order_fills.max(1),
        ..Options::default()
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("btl-gpu-check: cannot find its own binary: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut second = Command::new(exe);
    second.arg("--child");
    let report = run(&opts, second);
    print!("{}", summary(&report));
    let json = match serde_json::to_string_pretty(&report) {
        Ok(j) => j + "\n",
        Err(e) => {
            eprintln!("btl-gpu-check: cannot encode the report: {e}");
            return ExitCode::FAILURE;
        }
    };
    match &args.json {
        Some(path) => {
            if let Err(e) = std::fs::write(path, json) {
                eprintln!("btl-gpu-check: writing {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
        None => print!("{json}"),
    }
    if !report.available {
        return if args.require_gpu {
            ExitCode::from(3)
        } else {
            ExitCode::SUCCESS
        };
    }
    if report.failures.is_empty() && report.modes.iter().any(|m| m.skipped.is_none()) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
