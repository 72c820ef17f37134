//! The report header: what machine, when, and with which settings, so that
//! a figure can be repeated.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Facts about the machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo.
    pub cpu: String,
    /// Logical processors listed in /proc/cpuinfo.
    pub cores: usize,
    /// Processors this process may run on (after `--pin`: usually 1).
    pub usable_cores: usize,
    /// `uname -srm`.
    pub kernel: String,
    /// Host name.
    pub host: String,
}

impl Machine {
    /// Read the machine's description; unknown fields read "unknown".
    pub fn probe() -> Machine {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = info
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let cores = info
            .lines()
            .filter(|l| l.split(':').next().map(str::trim) == Some("processor"))
            .count();
        let usable_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (kernel, host) = uname();
        Machine {
            cpu,
            cores: cores.max(usable_cores),
            usable_cores,
            kernel,
            host,
        }
    }
}

fn field(chars: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn uname() -> (String, String) {
    // SAFETY: `utsname` is plain arrays of chars, for which all-zero is
    // valid; uname(2) fills the struct it is given and nothing else.
    let (rc, u) = unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        (libc::uname(&mut u), u)
    };
    if rc != 0 {
        return ("unknown".into(), "unknown".into());
    }
    (
        format!(
            "{} {} {}",
            field(&u.sysname),
            field(&u.release),
            field(&u.machine)
        ),
        field(&u.nodename),
    )
}

/// Everything a report starts with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    /// `btl-perf <version>`.
    pub tool: String,
    /// When the run started, UTC, ISO 8601.
    pub date: String,
    /// The machine.
    pub machine: Machine,
    /// The command line as given.
    pub command: String,
    /// Every setting used, by name.
    pub settings: BTreeMap<String, String>,
    /// Remarks on method the reader needs (e.g. UDP chunking).
    pub notes: Vec<String>,
    /// The machine's own hop (see [`super::floor`]) before and after each
    /// run, in run order; empty when not read (ranks not pinned to two
    /// cores).
    #[serde(default)]
    pub floors: Vec<Floor>,
}

/// [`super::floor::best_floor`] read before and after one run, µs (`None`:
/// the reading failed, e.g. the two threads could not be pinned apart).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Floor {
    /// Before the run's first measurement.
    pub before: Option<f64>,
    /// After its last (the external baselines included).
    pub after: Option<f64>,
}

/// A run whose floors differ by more than this factor mixed the machine's
/// phases (the phases of a shared machine can differ by about 4x).
pub const FLOOR_DRIFT: f64 = 1.5;

impl Header {
    /// The largest over the smallest of every floor read, when any was.
    pub fn floor_drift(&self) -> Option<f64> {
        let v = self
            .floors
            .iter()
            .flat_map(|f| [f.before, f.after])
            .flatten();
        let (lo, hi) = v.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
        (lo > 0.0 && lo.is_finite()).then(|| hi / lo)
    }
}

/// `now` as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc(secs)
}

/// Seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian).
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01, counting in 400-year eras that
    // start on March 1st so leap days fall at the end of a year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_083_199), "2026-11-30T23:59:59Z");
    }

    #[test]
    fn probe_reads_something() {
        let m = Machine::probe();
        assert!(m.cores >= 1 && !m.kernel.is_empty());
    }
}
