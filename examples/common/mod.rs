//! The start-up every example shares: launch itself when no launcher did,
//! open the fabric, run the example's body, close, and turn any failure into
//! a message on stderr and a non-zero exit code.

use std::future::Future;
use std::pin::Pin;

use async_btl::launch::run_self_if_unlaunched;
use async_btl::Fabric;

/// What an example's body returns: any error fails the rank.
pub type Outcome = Result<(), Box<dyn std::error::Error>>;

/// The body of an example, borrowing the open fabric.
pub type Body = for<'a> fn(&'a Fabric) -> Pin<Box<dyn Future<Output = Outcome> + 'a>>;

/// Run `body` as one rank and exit. Started by no launcher, start
/// `default_ranks` copies of this program first (`BTL_NP` overrides).
pub fn main(name: &str, default_ranks: u32, body: Body) -> ! {
    if let Some(code) = run_self_if_unlaunched(default_ranks) {
        std::process::exit(code);
    }
    init_logging();
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Into::into)
        .and_then(|rt| rt.block_on(run(body)));
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("{name}: {e}");
            std::process::exit(1)
        }
    }
}

async fn run(body: Body) -> Outcome {
    let fabric = Fabric::from_env().await?;
    // On failure the fabric is dropped without the goodbye round (peers may
    // be waiting on us and would never answer); dropping still unlinks our
    // shared memory, and peers see us as lost.
    body(&fabric).await?;
    fabric.close().await?;
    Ok(())
}

/// Fail with `message` unless `ok`.
pub fn ensure(ok: bool, message: impl FnOnce() -> String) -> Outcome {
    if ok {
        Ok(())
    } else {
        Err(message().into())
    }
}

/// Log to stderr at the level `RUST_LOG` asks for (`warn` without it),
/// coloured only when stderr is a terminal, so that a piped or captured log
/// (a launcher's prefixed output, a CI log, a file) holds no escape codes.
pub fn init_logging() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
}
