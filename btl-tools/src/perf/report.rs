//! Writing results: an OSU-style table, JSON, or CSV.
//!
//! Ratios are async-btl's value divided by the baseline's at the same test
//! and size: for latency below 1 means async-btl is faster, for bandwidth
//! and message rate above 1 means it is faster.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::machine::Header;
use super::{Sample, Test};

/// How [`Report::combine`] chooses a point's value among repeated runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pick {
    /// The best run (lowest latency, highest bandwidth or rate): what the
    /// machine can do, and what a series that caught a fast phase of a
    /// shared VM shows.
    #[default]
    Best,
    /// The middle run: less sensitive to one run that caught a fast (or
    /// slow) phase.
    Median,
}

/// A whole run: header and samples.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Machine, date, settings.
    pub header: Header,
    /// Every measured point, in the order measured.
    pub results: Vec<Sample>,
    /// async-btl / baseline at each test and size both measured.
    pub ratios: Vec<Ratio>,
}

/// async-btl's value over a baseline's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ratio {
    /// The test.
    pub test: Test,
    /// Message size.
    pub size: usize,
    /// The async-btl series (`async-btl/sm`, ...).
    pub wire: String,
    /// The baseline's name.
    pub baseline: String,
    /// async-btl / baseline.
    pub ratio: f64,
}

impl Ratio {
    /// Whether it compares `wire` with `baseline` at `test` and `size`.
    fn is(&self, test: Test, size: usize, wire: &str, baseline: &str) -> bool {
        self.test == test && self.size == size && self.wire == wire && self.baseline == baseline
    }
}

impl Report {
    /// Build a report, computing the ratios.
    pub fn new(header: Header, results: Vec<Sample>) -> Report {
        let mut ratios = Vec::new();
        for s in results.iter().filter(|s| is_btl(&s.wire)) {
            for b in results
                .iter()
                .filter(|b| !is_btl(&b.wire) && b.test == s.test && b.size == s.size)
            {
                if b.value > 0.0 {
                    ratios.push(Ratio {
                        test: s.test,
                        size: s.size,
                        wire: s.wire.clone(),
                        baseline: b.wire.clone(),
                        ratio: s.value / b.value,
                    });
                }
            }
        }
        Report {
            header,
            results,
            ratios,
        }
    }

    /// The best of several runs with the same settings: for each test,
    /// series and size, the lowest latency or the highest bandwidth or
    /// rate any run measured, and the ratios recomputed from those. The
    /// header is the first run's, with a note saying how the values were
    /// chosen and how far apart the runs were. `None` for no runs.
    ///
    /// Each run measures async-btl first and then its baselines, so
    /// repeating the whole run interleaves the series in time: on a noisy
    /// machine that compares like with like far better than one run.
    pub fn best_of(runs: Vec<Report>) -> Option<Report> {
        Report::combine(runs, Pick::Best)
    }

    /// Several runs with the same settings as one report: per test, series
    /// and size, the value `pick` chooses among the runs that measured it.
    /// The ratios: with [`Pick::Best`], recomputed from the best values
    /// (see [`Report::best_of`]); with [`Pick::Median`], the middle one of
    /// each run's own ratio, so that a pair measured in the same phase of a
    /// machine whose speed drifts is compared with itself, not with the
    /// other series' middle run taken at another time.
    pub fn combine(runs: Vec<Report>, pick: Pick) -> Option<Report> {
        let n = runs.len();
        let mut runs = runs.into_iter();
        let first = runs.next()?;
        let mut header = first.header;
        let mut points = first.results;
        // Every run's own ratio of each pair, in run order.
        let mut paired: Vec<(Ratio, Vec<f64>)> = Vec::new();
        let mut pair = |ratios: Vec<Ratio>| {
            for r in ratios {
                let at = paired
                    .iter()
                    .position(|(p, _)| p.is(r.test, r.size, &r.wire, &r.baseline));
                match at {
                    Some(i) => paired[i].1.push(r.ratio),
                    None => {
                        let v = vec![r.ratio];
                        paired.push((r, v));
                    }
                }
            }
        };
        pair(first.ratios);
        // Every run's value of each point, in run order.
        let mut values: Vec<Vec<f64>> = points.iter().map(|s| vec![s.value]).collect();
        for r in runs {
            pair(r.ratios);
            header.floors.extend(r.header.floors);
            for s in r.results {
                let at = points
                    .iter()
                    .position(|b| b.test == s.test && b.wire == s.wire && b.size == s.size);
                match at {
                    Some(i) => values[i].push(s.value),
                    None => {
                        values.push(vec![s.value]);
                        points.push(s);
                    }
                }
            }
        }
        let mut spread = 1.0f64;
        for (p, v) in points.iter_mut().zip(&mut values) {
            let hib = p.unit.higher_is_better();
            best_first(v, hib);
            let (best, worst) = (v[0], v[v.len() - 1]);
            p.value = match pick {
                Pick::Best => best,
                Pick::Median => middle(v),
            };
            if best > 0.0 {
                let s = if hib {
                    best / worst.max(f64::MIN_POSITIVE)
                } else {
                    worst / best
                };
                spread = spread.max(s);
            }
        }
        if n > 1 {
            let how = match pick {
                Pick::Best => "best",
                Pick::Median => "median",
            };
            let ratios = match pick {
                Pick::Best => "ratios of those values",
                Pick::Median => "each ratio the median of the runs' own ratios",
            };
            header.notes.push(format!(
                "{how} of {n} runs (each run measures async-btl and its baselines; {ratios}); the widest spread between a point's best and worst run was {spread:.2}x"
            ));
        }
        let mut report = Report::new(header, points);
        if pick == Pick::Median {
            for r in &mut report.ratios {
                let runs = paired
                    .iter_mut()
                    .find(|(p, _)| p.is(r.test, r.size, &r.wire, &r.baseline));
                if let Some((_, v)) = runs {
                    best_first(v, r.test.unit().higher_is_better());
                    r.ratio = middle(v);
                }
            }
        }
        Some(report)
    }

    /// The tests present, in report order.
    pub fn tests(&self) -> Vec<Test> {
        let mut t: Vec<Test> = self.results.iter().map(|s| s.test).collect();
        t.sort();
        t.dedup();
        t
    }

    /// The series (wires) measured for `test`, async-btl first.
    pub fn wires(&self, test: Test) -> Vec<String> {
        let mut w: Vec<String> = Vec::new();
        for s in self.results.iter().filter(|s| s.test == test) {
            if !w.contains(&s.wire) {
                w.push(s.wire.clone());
            }
        }
        w.sort_by_key(|x| !is_btl(x));
        w
    }

    fn value(&self, test: Test, wire: &str, size: usize) -> Option<f64> {
        self.results
            .iter()
            .find(|s| s.test == test && s.wire == wire && s.size == size)
            .map(|s| s.value)
    }

    /// The header as `# ` comment lines.
    pub fn header_lines(&self) -> String {
        let h = &self.header;
        let mut o = String::new();
        let _ = writeln!(o, "# {} — {}", h.tool, h.date);
        let _ = writeln!(
            o,
            "# machine: {} | {} cores (this rank may run on {}) | {} | host {}",
            h.machine.cpu,
            h.machine.cores,
            h.machine.usable_cores,
            h.machine.kernel,
            h.machine.host
        );
        let _ = writeln!(o, "# command: {}", h.command);
        for (k, v) in &h.settings {
            let _ = writeln!(o, "# {k}: {v}");
        }
        for n in &h.notes {
            let _ = writeln!(o, "# note: {n}");
        }
        if !h.floors.is_empty() {
            let each: Vec<String> = h
                .floors
                .iter()
                .map(|f| {
                    let v = |x: Option<f64>| x.map_or("n/a".to_string(), |x| format!("{x:.3}"));
                    format!("{} -> {}", v(f.before), v(f.after))
                })
                .collect();
            let _ = writeln!(
                o,
                "# floor: 8 B ping-pong between two threads on the ranks' cores, no library (us, before -> after each run): {}",
                each.join(", ")
            );
        }
        if let Some(d) = h.floor_drift().filter(|d| *d > super::machine::FLOOR_DRIFT) {
            let _ = writeln!(
                o,
                "# warning: the machine's own hop changed {d:.1}x during these runs: points measured at different times (async-btl and its baselines, or two runs) may come from different speeds of the machine; compare within a run whose floor held"
            );
        }
        o
    }

    /// The OSU-style table.
    pub fn table(&self) -> String {
        let mut o = self.header_lines();
        let _ = writeln!(
            o,
            "# ratio = async-btl / baseline (us: below 1 is better; MB/s, msg/s and op/s: above 1 is better)"
        );
        for test in self.tests() {
            let wires = self.wires(test);
            let btl = wires.iter().find(|w| is_btl(w)).cloned();
            let bases: Vec<&String> = wires.iter().filter(|w| !is_btl(w)).collect();
            let unit = test.unit().label();
            let _ = writeln!(o, "\n# {test} ({unit})");
            let _ = write!(o, "# {:<10}", "Size");
            for w in &wires {
                let _ = write!(o, " {:>14}", w);
            }
            if btl.is_some() {
                for b in &bases {
                    let _ = write!(o, " {:>10}", format!("x {b}"));
                }
            }
            o.push('\n');
            let mut sizes: Vec<usize> = self
                .results
                .iter()
                .filter(|s| s.test == test)
                .map(|s| s.size)
                .collect();
            sizes.sort_unstable();
            sizes.dedup();
            for size in sizes {
                let _ = write!(o, "{:<12}", size);
                for w in &wires {
                    let _ = write!(o, " {:>14}", fmt_value(self.value(test, w, size)));
                }
                if let Some(bw) = &btl {
                    for b in &bases {
                        // The report's own ratio (with `--pick median`, the
                        // middle of the runs' ratios, not the values').
                        let r = self
                            .ratios
                            .iter()
                            .find(|x| x.is(test, size, bw, b))
                            .map_or_else(|| "-".into(), |x| format!("{:.3}", x.ratio));
                        let _ = write!(o, " {:>10}", r);
                    }
                }
                o.push('\n');
            }
        }
        o
    }

    /// Pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// CSV with the header as `#` comment lines.
    pub fn csv(&self) -> String {
        let mut o = self.header_lines();
        o.push_str("test,wire,size,value,unit,iters,warmup,window\n");
        for s in &self.results {
            let _ = writeln!(
                o,
                "{},{},{},{},{},{},{},{}",
                s.test,
                s.wire,
                s.size,
                s.value,
                s.unit.label(),
                s.iters,
                s.warmup,
                s.window
            );
        }
        o
    }
}

/// Whether a series is async-btl (as opposed to a baseline).
pub fn is_btl(wire: &str) -> bool {
    wire.starts_with("async-btl")
}

fn fmt_value(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v >= 1e5 => format!("{v:.0}"),
        // Below a microsecond (a native atomic takes tens of nanoseconds):
        // to the nanosecond.
        Some(v) if v < 1.0 => format!("{v:.3}"),
        Some(v) => format!("{v:.2}"),
    }
}

/// Sort `v` best first: highest first where higher is better, else
/// lowest first.
fn best_first(v: &mut [f64], higher_is_better: bool) {
    v.sort_by(|a, b| {
        let o = a.total_cmp(b);
        if higher_is_better {
            o.reverse()
        } else {
            o
        }
    });
}

/// The middle of `v`, sorted best first (of an even count, the better of
/// the two middle ones).
fn middle(v: &[f64]) -> f64 {
    v[(v.len() - 1) / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::machine::{Header, Machine};
    use crate::perf::Unit;

    fn sample(wire: &str, size: usize, value: f64) -> Sample {
        Sample {
            test: Test::Lat,
            wire: wire.into(),
            size,
            value,
            unit: Unit::Micros,
            iters: 1,
            warmup: 0,
            window: 1,
        }
    }

    fn header() -> Header {
        Header {
            tool: "btl-perf test".into(),
            date: "2026-11-30T00:00:00Z".into(),
            machine: Machine::probe(),
            command: "btl-perf".into(),
            settings: Default::default(),
            notes: vec![],
            floors: vec![],
        }
    }

    #[test]
    fn floors_of_every_run_are_kept_and_a_drift_is_flagged() {
        use crate::perf::machine::Floor;
        let run = |before: f64, after: f64| {
            let mut h = header();
            h.floors.push(Floor {
                before: Some(before),
                after: Some(after),
            });
            Report::new(h, vec![sample("async-btl/sm", 8, 1.0)])
        };
        let steady = Report::combine(vec![run(0.07, 0.07), run(0.07, 0.08)], Pick::Median)
            .expect("two runs");
        assert_eq!(steady.header.floors.len(), 2, "one pair per run");
        let text = steady.header_lines();
        assert!(text.contains("0.070 -> 0.070, 0.070 -> 0.080"), "{text}");
        assert!(!text.contains("# warning"), "{text}");
        // The second run started in the slow phase.
        let mixed = Report::combine(vec![run(0.07, 0.07), run(0.29, 0.28)], Pick::Median)
            .expect("two runs");
        assert!((mixed.header.floor_drift().unwrap() - 0.29 / 0.07).abs() < 1e-9);
        let text = mixed.header_lines();
        assert!(
            text.contains("# warning: the machine's own hop changed 4.1x"),
            "{text}"
        );
        // A reading that failed shows as such and does not count.
        let mut h = header();
        h.floors.push(Floor {
            before: None,
            after: Some(0.07),
        });
        let failed = Report::new(h, vec![sample("async-btl/sm", 8, 1.0)]);
        assert!(failed.header_lines().contains("n/a -> 0.070"));
        assert_eq!(failed.header.floor_drift(), Some(1.0));
        // Not read (not pinned): no floor line, no drift.
        let none = Report::new(header(), vec![sample("async-btl/sm", 8, 1.0)]);
        assert_eq!(none.header.floor_drift(), None);
        assert!(!none.header_lines().contains("# floor"));
        // Old reports without the field still parse.
        let mut v: serde_json::Value = serde_json::from_str(&none.json()).unwrap();
        v["header"].as_object_mut().unwrap().remove("floors");
        let back: Report = serde_json::from_value(v).unwrap();
        assert!(back.header.floors.is_empty());
    }

    #[test]
    fn best_of_takes_each_points_best_run_and_recomputes_ratios() {
        let bw = |wire: &str, v: f64| Sample {
            test: Test::Bw,
            unit: Unit::MBps,
            ..sample(wire, 8, v)
        };
        let runs = vec![
            Report::new(
                header(),
                vec![
                    sample("async-btl/sm", 8, 2.0),
                    sample("tcp", 8, 10.0),
                    bw("async-btl/sm", 50.0),
                ],
            ),
            Report::new(
                header(),
                vec![
                    sample("async-btl/sm", 8, 1.0),
                    sample("tcp", 8, 20.0),
                    bw("async-btl/sm", 40.0),
                ],
            ),
            Report::new(
                header(),
                vec![sample("async-btl/sm", 8, 4.0), sample("unix", 8, 5.0)],
            ),
        ];
        let r = Report::best_of(runs).unwrap();
        let v = |t: Test, w: &str| {
            r.results
                .iter()
                .find(|s| s.test == t && s.wire == w)
                .map(|s| s.value)
        };
        assert_eq!(v(Test::Lat, "async-btl/sm"), Some(1.0));
        assert_eq!(v(Test::Lat, "tcp"), Some(10.0));
        assert_eq!(
            v(Test::Lat, "unix"),
            Some(5.0),
            "a point only one run has is kept"
        );
        assert_eq!(
            v(Test::Bw, "async-btl/sm"),
            Some(50.0),
            "bandwidth: the highest"
        );
        let tcp = r.ratios.iter().find(|x| x.baseline == "tcp").unwrap();
        assert!((tcp.ratio - 0.1).abs() < 1e-12);
        // Latency of sm spread from 1.0 to 4.0 across the runs.
        let note = r.header.notes.last().unwrap();
        assert!(
            note.contains("best of 3 runs") && note.contains("4.00x"),
            "{note}"
        );
        assert!(Report::best_of(Vec::new()).is_none());
    }

    #[test]
    fn median_takes_each_points_middle_run() {
        let runs: Vec<Report> = [3.0, 1.0, 2.0, 9.0]
            .iter()
            .map(|v| {
                Report::new(
                    header(),
                    vec![sample("async-btl/sm", 8, *v), sample("tcp", 8, 10.0)],
                )
            })
            .collect();
        let r = Report::combine(runs, Pick::Median).unwrap();
        let sm = r.results.iter().find(|s| s.wire == "async-btl/sm").unwrap();
        assert_eq!(sm.value, 2.0, "of 1, 2, 3, 9: the better middle one");
        let tcp = r.ratios.iter().find(|x| x.baseline == "tcp").unwrap();
        assert!((tcp.ratio - 0.2).abs() < 1e-12);
        let note = r.header.notes.last().unwrap();
        assert!(
            note.contains("median of 4 runs") && note.contains("9.00x"),
            "{note}"
        );
    }

    #[test]
    fn a_median_ratio_pairs_each_run_with_itself() {
        // Three runs, async-btl's and tcp's latency each: the middle values
        // are 2.0 and 2.5 (0.8), but each run's own ratio is 0.5, 1.2 and
        // 0.5.
        let runs: Vec<Report> = [(1.0, 2.0), (3.0, 2.5), (2.0, 4.0)]
            .iter()
            .map(|(b, t)| {
                Report::new(
                    header(),
                    vec![sample("async-btl/sm", 8, *b), sample("tcp", 8, *t)],
                )
            })
            .collect();
        let median = Report::combine(runs.clone(), Pick::Median).unwrap();
        let tcp = median.ratios.iter().find(|x| x.baseline == "tcp").unwrap();
        assert!((tcp.ratio - 0.5).abs() < 1e-12, "{}", tcp.ratio);
        let t = median.table();
        assert!(t.contains("0.500") && !t.contains("0.800"), "{t}");
        let note = median.header.notes.last().unwrap();
        assert!(note.contains("median of the runs' own ratios"), "{note}");
        // Best of: the best values' ratio, 1.0 / 2.0.
        let best = Report::combine(runs, Pick::Best).unwrap();
        let tcp = best.ratios.iter().find(|x| x.baseline == "tcp").unwrap();
        assert!((tcp.ratio - 0.5).abs() < 1e-12, "{}", tcp.ratio);
        // Bandwidth: the better middle of 0.9, 1.1 and 0.7 is 0.9.
        let runs: Vec<Report> = [(90.0, 100.0), (110.0, 100.0), (70.0, 100.0)]
            .iter()
            .map(|(b, t)| {
                let mut s = sample("async-btl/sm", 8, *b);
                let mut u = sample("tcp", 8, *t);
                for x in [&mut s, &mut u] {
                    x.test = Test::Bw;
                    x.unit = Test::Bw.unit();
                }
                Report::new(header(), vec![s, u])
            })
            .collect();
        let r = Report::combine(runs, Pick::Median).unwrap();
        assert!(
            (r.ratios[0].ratio - 0.9).abs() < 1e-12,
            "{}",
            r.ratios[0].ratio
        );

        // Of an even count, the better of the two middle ratios: for
        // latency the lower (of 0.5, 0.6, 0.7, 0.8: 0.6), for bandwidth
        // the higher (0.7).
        let even = |test: Test| -> f64 {
            let runs: Vec<Report> = [0.7, 0.5, 0.8, 0.6]
                .iter()
                .map(|r| {
                    let mut s = sample("async-btl/sm", 8, 100.0 * r);
                    let mut u = sample("tcp", 8, 100.0);
                    for x in [&mut s, &mut u] {
                        x.test = test;
                        x.unit = test.unit();
                    }
                    Report::new(header(), vec![s, u])
                })
                .collect();
            Report::combine(runs, Pick::Median).unwrap().ratios[0].ratio
        };
        assert!((even(Test::Lat) - 0.6).abs() < 1e-12, "{}", even(Test::Lat));
        assert!((even(Test::Bw) - 0.7).abs() < 1e-12, "{}", even(Test::Bw));
    }

    #[test]
    fn ratios_and_table() {
        let header = Header {
            tool: "btl-perf test".into(),
            date: "2026-11-30T00:00:00Z".into(),
            machine: Machine::probe(),
            command: "btl-perf".into(),
            settings: Default::default(),
            notes: vec![],
            floors: vec![],
        };
        let r = Report::new(
            header,
            vec![
                sample("async-btl/sm", 8, 1.0),
                sample("unix", 8, 20.0),
                sample("tcp", 8, 25.0),
            ],
        );
        assert_eq!(r.ratios.len(), 2);
        assert!((r.ratios[0].ratio - 0.05).abs() < 1e-12);
        let t = r.table();
        assert!(t.contains("x unix") && t.contains("0.050"), "{t}");
        let j: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(j["results"].as_array().unwrap().len(), 3);
        assert!(r.csv().lines().any(|l| l == "lat,tcp,8,25,us,1,0,1"));
    }
}
