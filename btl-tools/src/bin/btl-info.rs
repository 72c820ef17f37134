//! `btl-info`: which transports work on this host and why the others do
//! not, the limits in force, and the CPU topology.

use std::io::Write;
use std::process::ExitCode;

use btl_tools::info::{format_cpu_list, report, Report};
use clap::Parser;

/// Command-line arguments of btl-info.
#[derive(Debug, Parser)]
#[command(
    name = "btl-info",
    version,
    about = "Show which async-btl transports work on this host, the limits in force (BTL_* \
             variables) and the CPU topology."
)]
struct Args {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let report = report();
    let text = if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => json + "\n",
            Err(e) => {
                eprintln!("btl-info: cannot encode the report: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        render_text(&report)
    };
    // A closed pipe (`btl-info | head`) is not an error worth a message.
    if let Err(e) = std::io::stdout().write_all(text.as_bytes()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("btl-info: writing the report: {e}");
            return ExitCode::FAILURE;
        }
    }
    if report.host.config_error.is_some() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn yes_no(ok: bool) -> &'static str {
    if ok {
        "yes"
    } else {
        "no"
    }
}

fn render_text(r: &Report) -> String {
    let h = &r.host;
    let mut out: Vec<String> = Vec::new();
    out.push(format!("async-btl {} on {}", h.version, h.host));
    out.push("\ntransports (usable, what was found):".to_string());
    for t in &h.transports {
        out.push(format!(
            "  {:<8} {:<4} {}",
            t.name,
            yes_no(t.usable),
            t.detail
        ));
    }
    out.push(format!(
        "  {:<8} {:<4} {}",
        "cma",
        yes_no(h.cma.ok),
        h.cma.detail
    ));
    out.push(
        "\nroutes (messages, one-sided on host memory, put/get between device memory):".to_string(),
    );
    for r in &h.routes {
        let name = |t: &Option<String>| t.clone().unwrap_or_else(|| "none".into());
        let device = match (&r.device_memory, &r.one_sided) {
            (Some(t), _) => t.clone(),
            // `sm` builds the requests in its fragments, which a process
            // with device memory pins: one device copy into a fragment,
            // one out of it.
            (None, Some(t)) if t == "sm" => {
                "staged through the host in pinned sm fragments".to_string()
            }
            (None, Some(t)) => format!("staged through the host over {t}"),
            (None, None) => "none".into(),
        };
        out.push(format!(
            "  {:<11} {:<6} {:<6} {}",
            r.peer,
            name(&r.messages),
            name(&r.one_sided),
            device
        ));
    }

    let l = &h.limits;
    out.push("\nlimits (BTL_* environment):".to_string());
    if let Some(e) = &h.config_error {
        out.push(format!("  INVALID: {e}"));
        out.push("  (showing the defaults)".to_string());
    }
    out.push(format!(
        "  progress        {} (spin {} µs, heartbeat {} ms)",
        l.progress, l.spin_us, l.heartbeat_ms
    ));
    out.push(format!(
        "  sm eager        {} x {} B",
        l.sm_eager_count, l.sm_eager_size
    ));
    out.push(format!(
        "  sm max          {} x {} B",
        l.sm_max_count, l.sm_max_size
    ));
    let single = if l.sm_adapt_max > l.sm_single_copy_min {
        format!(
            "single copy or fragments (whichever measured cheaper) from {} B, single copy only from {} B",
            l.sm_single_copy_min, l.sm_adapt_max
        )
    } else {
        format!("single copy from {} B", l.sm_single_copy_min)
    };
    out.push(format!(
        "  sm paths        fast box up to {} B, fragments, {single}, split copy from {} B",
        l.sm_fast_box_max, l.sm_split_min
    ));
    out.push(if l.udp_bundle {
        format!(
            "  udp bundles     messages up to {} B, from the {}th in a row sent with {} segments in flight, gathered up to {} B or {} µs",
            l.udp_bundle_message_max,
            l.udp_bundle_after + 1,
            l.udp_bundle_after,
            l.udp_bundle_max,
            l.udp_bundle_wait_us
        )
    } else {
        "  udp bundles     off (BTL_UDP_BUNDLE=0): every message leaves at once".to_string()
    });
    let yes = |b: bool| if b { "yes" } else { "no" };
    out.push(if l.udp_gso {
        format!(
            "  udp offload     GSO {}, GRO {} (from this kernel; used on the data socket)",
            yes(l.udp_gso_kernel.0),
            yes(l.udp_gso_kernel.1)
        )
    } else {
        "  udp offload     off (BTL_UDP_GSO=0): datagram by datagram".to_string()
    });
    out.push(if l.udp_auth == "mac" {
        "  udp datagrams   each authenticated (BTL_UDP_AUTH=mac: AES-128-GCM tag, per-pair keys from the job key)".to_string()
    } else {
        "  udp datagrams   CRC32C only: catches corruption, not forgery (BTL_UDP_AUTH=mac authenticates them)".to_string()
    });
    out.push(format!(
        "  receive budget  {} B per tag, {} B in all",
        l.recv_budget, l.recv_total_budget
    ));
    out.push(format!(
        "  timeouts        boot {} ms, close {} ms, unanswered one-sided operation {} ms",
        l.boot_timeout_ms, l.close_timeout_ms, l.answer_timeout_ms
    ));
    let allowed = match l.allowed_transports.is_empty() {
        true => "all".to_string(),
        false => l.allowed_transports.join(","),
    };
    out.push(format!("  transports      {allowed}"));

    let t = &r.topology;
    let known = |n: Option<usize>| n.map_or("?".to_string(), |n| n.to_string());
    out.push(format!("\ntopology ({}):", t.source));
    out.push(format!(
        "  {} NUMA node(s), {} package(s), {} core(s), {} logical CPU(s): {}",
        t.numa_nodes.len(),
        known(t.packages),
        known(t.cores),
        t.cpus.len(),
        format_cpu_list(&t.cpus)
    ));
    for n in &t.numa_nodes {
        out.push(format!(
            "  node {}: CPUs {}",
            n.id,
            format_cpu_list(&n.cpus)
        ));
    }
    out.push(format!(
        "  this process may run on {} CPU(s): {}",
        t.binding.len(),
        format_cpu_list(&t.binding)
    ));
    if let Some(note) = &t.note {
        out.push(format!("  note: {note}"));
    }
    out.join("\n") + "\n"
}
