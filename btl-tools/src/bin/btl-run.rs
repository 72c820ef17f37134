//! `btl-run`: start N local ranks of a program as one async-btl job.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use async_btl::launch::LocalJob;
use clap::Parser;

const LONG_ABOUT: &str = "Start N ranks of PROGRAM on this node as one async-btl job.

Each rank gets BTL_RANK, BTL_SIZE, BTL_LOCAL_RANK, BTL_LOCAL_SIZE,
BTL_RENDEZVOUS (a rendezvous server that btl-run hosts on 127.0.0.1),
BTL_RENDEZVOUS_HOST=launcher, a random BTL_JOB_KEY and a BTL_JOB_ID.
Every line a rank writes is prefixed with \"[rank] \" (stdout to stdout,
stderr to stderr). Ranks read stdin from /dev/null.

When a rank fails, the others get SIGTERM, then SIGKILL after the grace
period, and btl-run exits with the first failure's code (128 + signal
number for a rank killed by a signal). With --keep-going they run on
instead, and see the failure as a lost peer (Error::PeerLost on what was
pending on it); btl-run still exits with the first failure's code. Ctrl-C and SIGTERM are forwarded
to the ranks; a second one kills them. If btl-run itself is killed, the
ranks die with it.";

/// Command-line arguments of btl-run.
#[derive(Debug, Parser)]
#[command(name = "btl-run", version, about = "Start N ranks of PROGRAM on this node as one async-btl job.", long_about = LONG_ABOUT, after_help = EXAMPLES)]
struct Args {
    /// Number of ranks to start.
    #[arg(short = 'n', long = "np", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    ranks: u32,

    /// Stop every rank after SECS seconds and exit with code 124.
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    timeout: Option<Duration>,

    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, value_name = "SECS", value_parser = seconds, default_value = "3")]
    grace: Duration,

    /// Forward output as it is, without the rank prefix.
    #[arg(long)]
    no_prefix: bool,

    /// When a rank fails, let the others run on (they see the failure as
    /// a lost peer); exit with the first failure's code when all are done.
    #[arg(long)]
    keep_going: bool,

    /// Set an environment variable for every rank (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = key_value)]
    env: Vec<(String, String)>,

    /// The program to run, and its arguments (put `--` before them if they
    /// start with a dash).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<OsString>,
}

const EXAMPLES: &str = "Examples:
  btl-run -n 4 ./target/debug/examples/ping
  btl-run -n 2 --timeout 60 --env RUST_LOG=debug -- my-prog --size 1M
  RUST_LOG=debug btl-run -n 2 prog     (btl-run's own log goes to stderr)";

fn seconds(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs)
        .map_err(|_| format!("{text:?} is not a usable number of seconds"))
}

fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{text:?} is not of the form KEY=VALUE")),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let mut command = args.command.into_iter();
    let Some(program) = command.next() else {
        eprintln!("btl-run: no program given");
        return ExitCode::from(2);
    };
    let mut job = LocalJob::new(program, args.ranks)
        .args(command)
        .prefix_output(!args.no_prefix)
        .timeout(args.timeout)
        .kill_grace(args.grace)
        .keep_going(args.keep_going);
    for (k, v) in args.env {
        job = job.env(k, v);
    }
    // A current-thread runtime: the ranks are started from this (main)
    // thread, so their death signal fires only when btl-run itself exits.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("btl-run: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(job.run()) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("btl-run: {e}");
            ExitCode::from(1)
        }
    }
}
