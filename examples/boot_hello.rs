//! Every rank publishes a greeting and prints everyone's.
//!
//! Runs with no flags: started by hand it launches itself as 4 local ranks
//! (`BTL_NP=8` for more). Under `btl-run`, `mpirun` or `srun` it runs as one
//! rank of their job.
//!
//! ```text
//! cargo run --example boot_hello
//! btl-run -n 3 target/debug/examples/boot_hello
//! ```

use std::time::Duration;

use async_btl::bootstrap::{all_gather, JobInfo};
use async_btl::launch::run_self_if_unlaunched;

fn main() {
    if let Some(code) = run_self_if_unlaunched(4) {
        std::process::exit(code);
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a terminal: piped or captured logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    if let Err(e) = run() {
        eprintln!("boot_hello: {e}");
        std::process::exit(1);
    }
}

#[tokio::main(flavor = "current_thread")]
async fn run() -> async_btl::Result<()> {
    let Some(job) = JobInfo::from_env()? else {
        return Err(async_btl::Error::Config("no launcher found".into()));
    };
    let hello = format!("hello from rank {} (pid {})", job.rank, std::process::id());
    let all = all_gather(&job, hello.into_bytes(), Duration::from_secs(30)).await?;
    for (rank, blob) in all.iter().enumerate() {
        println!(
            "{} of {} heard rank {rank}: {}",
            job.rank,
            job.size,
            String::from_utf8_lossy(blob)
        );
    }
    Ok(())
}
