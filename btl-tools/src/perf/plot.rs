//! The SVG figure: latency and bandwidth against message size on log axes,
//! one line per series (async-btl per transport, each baseline).
//!
//! Drawn with plotters' SVG backend only: text is written as SVG `<text>`
//! elements, so no font library or system package is needed.

use plotters::prelude::*;

use super::report::{is_btl, Report};
use super::{Test, Unit};
use async_btl::{Error, Result};

/// Which tests go into the latency panel and the bandwidth panel: the
/// first latency test and the first bandwidth test present.
fn panels(r: &Report) -> (Option<Test>, Option<Test>) {
    let tests = r.tests();
    let lat = tests.iter().copied().find(|t| t.unit() == Unit::Micros);
    let bw = tests.iter().copied().find(|t| t.unit() == Unit::MBps);
    (lat, bw)
}

/// Series of `test`: (name, points sorted by size).
fn series(r: &Report, test: Test) -> Vec<(String, Vec<(f64, f64)>)> {
    r.wires(test)
        .into_iter()
        .map(|w| {
            let mut pts: Vec<(f64, f64)> = r
                .results
                .iter()
                .filter(|s| s.test == test && s.wire == w && s.value > 0.0)
                .map(|s| (s.size as f64, s.value))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (w, pts)
        })
        .filter(|(_, p)| !p.is_empty())
        .collect()
}

/// Number of series [`write_svg`] draws for this report (one line each).
pub fn series_count(r: &Report) -> usize {
    let (lat, bw) = panels(r);
    [lat, bw]
        .into_iter()
        .flatten()
        .map(|t| series(r, t).len())
        .sum()
}

fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::Misuse(format!("drawing the plot: {e}"))
}

/// Draw the report's latency and bandwidth panels into an SVG file.
pub fn write_svg(r: &Report, path: &std::path::Path) -> Result<()> {
    let (lat, bw) = panels(r);
    let tests: Vec<Test> = [lat, bw].into_iter().flatten().collect();
    if tests.is_empty() {
        return Err(Error::Misuse(
            "nothing to plot: run a latency or bandwidth test".into(),
        ));
    }
    let width = 640 * tests.len() as u32;
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let areas = root.split_evenly((1, tests.len()));
    let palette = [
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
    ];
    for (area, test) in areas.iter().zip(tests) {
        let ss = series(r, test);
        let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::MAX, 1.0f64, f64::MAX, 0.0f64);
        for (_, pts) in &ss {
            for (x, y) in pts {
                xmin = xmin.min(*x);
                xmax = xmax.max(*x);
                ymin = ymin.min(*y);
                ymax = ymax.max(*y);
            }
        }
        if xmin > xmax {
            (xmin, ymin, ymax) = (1.0, 1.0, 10.0);
        }
        let xr = (xmin.max(1.0) / 1.5)..(xmax * 1.5);
        let yr = (ymin.max(1e-3) / 2.0)..(ymax * 2.0);
        let unit = test.unit().label();
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{test} ({unit}) vs message size"),
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(xr.log_scale(), yr.log_scale())
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .y_desc(unit)
            .x_label_formatter(&|x| human_size(*x))
            .draw()
            .map_err(plot_err)?;
        for (i, (name, pts)) in ss.into_iter().enumerate() {
            let color = palette[i % palette.len()];
            let width = if is_btl(&name) { 3 } else { 2 };
            if pts.len() == 1 {
                // A test of one size (the atomics): a line of one point
                // shows nothing, so mark it.
                chart
                    .draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled())))
                    .map_err(plot_err)?;
            }
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(width)))
                .map_err(plot_err)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(width))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

/// 1024 → "1K", 1048576 → "1M".
fn human_size(x: f64) -> String {
    let v = x.round() as u64;
    if v >= 1 << 20 && v % (1 << 20) == 0 {
        format!("{}M", v >> 20)
    } else if v >= 1 << 10 && v % (1 << 10) == 0 {
        format!("{}K", v >> 10)
    } else {
        format!("{x:.0}")
    }
}
