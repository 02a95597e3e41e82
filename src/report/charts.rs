//! The report's charts as inline SVG: the roofline (arithmetic intensity against achieved
//! throughput, the measured ceilings drawn), the strip plot of every timed variant of a
//! workload, one small plot per parameter, and horizontal bar charts for the model's time.
//! Colours and faint points are CSS classes (`c0`..`c9`, `faint`) of the site's style sheet.

use std::fmt::Write;

use super::svg::{esc, legend_height, num, text_width, Canvas, LegendItem, Mark, Scale, P};
use crate::tune::db::Ceilings;

/// Number of distinct colour classes (`c0`..`c9`).
pub const COLOURS: usize = 10;

/// A point on the roofline: arithmetic intensity (FLOP/byte) and throughput (FLOP/s).
#[derive(Debug, Clone)]
pub struct RoofPoint {
    pub intensity: f64,
    pub flops_per_s: f64,
    /// Drawn next to the point (winners: their workload's number); `None` for faint points.
    pub label: Option<String>,
    pub colour: usize,
    pub tip: String,
}

/// The roofline: log-log, compute ceilings as horizontal roofs, the copy bandwidth as the
/// slanted one, winners as labelled points and every other tried variant as a faint one.
/// `series` names the colours used by winners (a dtype each).
pub fn roofline(points: &[RoofPoint], ceilings: &Ceilings, series: &[(usize, String)]) -> String {
    let bw = ceilings.copy_gb_per_s.filter(|b| *b > 0.0).map(|b| b * 1e9);
    let roofs: Vec<(f64, String)> = [
        (ceilings.fp32_tflops, "FP32 FMA peak (computed)"),
        (ceilings.tf32_tflops, "cuBLAS TF32"),
        (ceilings.bf16_tflops, "cuBLAS BF16"),
    ]
    .into_iter()
    .filter_map(|(p, name)| {
        p.filter(|p| *p > 0.0)
            .map(|p| (p * 1e12, format!("{name} {} TFLOP/s", num(p))))
    })
    .collect();
    // The roofs are labelled in the right margin: wide enough for the longest label.
    let right = roofs
        .iter()
        .map(|(_, n)| text_width(n, 11.0) + 16.0)
        .chain(bw.map(|b| text_width(&format!("copy {} GB/s", num(b / 1e9)), 11.0) + 16.0))
        .fold(40.0, f64::max);
    let (w, left, top) = (960.0, 64.0, 16.0);
    let plot_h = 440.0;
    let bottom = top + plot_h;
    let mut xs: Vec<f64> = points.iter().map(|p| p.intensity).collect();
    // Room right of the last points for their labels (the roofs' labels follow the plot).
    if let Some(max) = xs.iter().copied().filter(|x| *x > 0.0).reduce(f64::max) {
        xs.push(max * 1.8);
    }
    let mut ys: Vec<f64> = points.iter().map(|p| p.flops_per_s / 1e12).collect();
    for (peak, _) in &roofs {
        ys.push(peak / 1e12 * 1.3);
        if let Some(b) = bw {
            xs.push(peak / b); // the ridge point
        }
    }
    let x = Scale::fit(xs.iter().copied(), true, left, w - right);
    let y = Scale::fit(ys.iter().copied(), true, bottom, top);
    let mut legend = vec![LegendItem::new(Mark::Dot("faint c9".into()), "other variants tried")];
    for (colour, name) in series {
        legend.push(LegendItem::new(
            Mark::Ring(format!("win c{}", colour % COLOURS)),
            format!("winner, {name} (number = workload)"),
        ));
    }
    if roofs.is_empty() && bw.is_none() {
        legend.push(LegendItem::new(Mark::Line("roof".into()), "ceilings not measured"));
    } else {
        legend.push(LegendItem::new(Mark::Line("roof".into()), "measured ceilings"));
    }
    let h = bottom + 40.0 + legend_height(w, left, &legend);
    let mut c = Canvas::new(w, h, "Roofline: arithmetic intensity against achieved throughput");
    c.y_axis(&y, left, w - right, &y.ticks(8), "achieved TFLOP/s (log)");
    c.x_axis(
        &x,
        top,
        bottom,
        &x.ticks(9),
        "arithmetic intensity, FLOP per byte moved (log)",
    );
    // Roofs: min(peak, bandwidth × intensity), sampled at the ends and the ridge.
    let roof_at = |peak: Option<f64>, ai: f64| -> f64 {
        match (peak, bw) {
            (Some(p), Some(b)) => p.min(b * ai),
            (Some(p), None) => p,
            (None, Some(b)) => b * ai,
            (None, None) => f64::NAN,
        }
    };
    let curves: Vec<(Option<f64>, String)> = if roofs.is_empty() {
        bw.map(|b| (None, format!("copy {} GB/s", num(b / 1e9))))
            .into_iter()
            .collect()
    } else {
        roofs.iter().map(|(p, n)| (Some(*p), n.clone())).collect()
    };
    for (peak, name) in &curves {
        let mut pts = vec![x.lo, x.hi];
        if let (Some(p), Some(b)) = (peak, bw) {
            if x.contains(p / b) {
                pts.insert(1, p / b);
            }
        }
        let line: Vec<(f64, f64)> = pts
            .iter()
            .map(|ai| (x.px(*ai), y.px(roof_at(*peak, *ai) / 1e12)))
            .collect();
        c.polyline(&line, "roof");
        let end = roof_at(*peak, x.hi) / 1e12;
        c.text(w - right + 6.0, y.px(end) + 4.0, "roof-label", name);
    }
    if let (Some(b), false) = (bw, roofs.is_empty()) {
        // Label the slanted roof along it, just above, where it enters the plot.
        let (a0, a1) = (x.lo * 1.15, x.lo * 2.0);
        let (x0, y0) = (x.px(a0), y.px(b * a0 / 1e12));
        let angle = (y.px(b * a1 / 1e12) - y0).atan2(x.px(a1) - x0).to_degrees();
        c.out.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" class=\"roof-label\" transform=\"rotate({} {} {})\">{}</text>",
            P(x0),
            P(y0 - 5.0),
            P(angle),
            P(x0),
            P(y0 - 5.0),
            esc(&format!("copy {} GB/s", num(b / 1e9)))
        ));
    }
    c.group("faint c9");
    for p in points.iter().filter(|p| p.label.is_none()) {
        c.circle(x.px(p.intensity), y.px(p.flops_per_s / 1e12), 2.5, "", Some(&p.tip));
    }
    c.end_group();
    // Winners, each labelled; a label that would sit on an earlier one moves down a line.
    let mut placed: Vec<(f64, f64)> = Vec::new();
    for p in points.iter().filter(|p| p.label.is_some()) {
        let (px, py) = (x.px(p.intensity), y.px(p.flops_per_s / 1e12));
        c.circle(px, py, 4.5, &format!("win c{}", p.colour % COLOURS), Some(&p.tip));
        let label = p.label.as_deref().unwrap_or("");
        let (lx, mut ly) = (px + 6.0, py - 5.0);
        while placed
            .iter()
            .any(|(x0, y0)| (lx - x0).abs() < text_width(label, 10.5) + 4.0 && (ly - y0).abs() < 11.0)
        {
            ly += 11.0;
        }
        placed.push((lx, ly));
        c.text(lx, ly, "point-label", label);
    }
    c.legend(left, bottom + 38.0, &legend);
    c.finish()
}

/// One row of a strip plot: a family and its timed variants `(ms, tooltip)`.
#[derive(Debug, Clone)]
pub struct StripRow {
    pub label: String,
    pub colour: usize,
    pub points: Vec<(f64, String)>,
}

/// What the times of a strip plot are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StripTimes {
    /// Kernel time: a screening run per variant, the winner re-timed with the full plan.
    Kernel,
    /// Wall time of a whole greedy decode step per point (`tune --decode-step`).
    DecodeStep,
}

impl StripTimes {
    /// The plot's title, its axis and the winner's legend entry.
    fn words(self, winner_ms: f64) -> (&'static str, &'static str, String) {
        match self {
            StripTimes::Kernel => (
                "Kernel time of every timed variant, by family",
                "kernel time, ms (log scale)",
                format!("winner, {} ms after re-timing", num(winner_ms)),
            ),
            StripTimes::DecodeStep => (
                "Time per decode step of every timed point",
                "wall time per greedy decode step, ms (log scale)",
                format!("winner, {} ms per step", num(winner_ms)),
            ),
        }
    }
}

/// Every timed variant of a workload on a log time axis, a row per family; the winner ringed,
/// the vendor peer (time, name) as a dashed line.
pub fn strip_plot(
    rows: &[StripRow],
    times_are: StripTimes,
    winner: Option<(f64, &str)>,
    peer: Option<(f64, &str)>,
) -> String {
    let baseline_ms = peer.map(|p| p.0);
    let label_w = rows
        .iter()
        .map(|r| text_width(&r.label, 11.0))
        .fold(60.0, f64::max)
        .min(260.0);
    let (w, left, right, top) = (900.0, label_w + 16.0, 24.0, 12.0);
    let row_h = 24.0;
    let bottom = top + row_h * rows.len().max(1) as f64;
    let times = rows
        .iter()
        .flat_map(|r| r.points.iter().map(|p| p.0))
        .chain(baseline_ms)
        .chain(winner.map(|w| w.0));
    let x = Scale::fit(times, true, left, w - right);
    let mut legend: Vec<LegendItem> = rows
        .iter()
        .map(|r| {
            let best = r.points.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
            LegendItem::new(
                Mark::Dot(format!("c{}", r.colour % COLOURS)),
                format!("{} ({} timed, best {} ms)", r.label, r.points.len(), num(best)),
            )
        })
        .collect();
    let (title, axis, winner_words) = times_are.words(winner.map_or(0.0, |w| w.0));
    if winner.is_some() {
        legend.push(LegendItem::new(Mark::Ring("win-ring".into()), winner_words));
    }
    if let Some((b, name)) = peer {
        legend.push(LegendItem::new(
            Mark::Line("peer".into()),
            format!("peer: {name}, {} ms", num(b)),
        ));
    }
    let h = bottom + 40.0 + legend_height(w, 8.0, &legend);
    let mut c = Canvas::new(w, h, title);
    c.x_axis(&x, top, bottom, &x.ticks(10), axis);
    c.line(left, top, left, bottom, "axis");
    for (i, r) in rows.iter().enumerate() {
        let cy = top + row_h * (i as f64 + 0.5);
        c.text(left - 6.0, cy + 4.0, "tick end", &r.label);
        for (j, (ms, tip)) in r.points.iter().enumerate() {
            // Deterministic jitter so equal times stay visible.
            let jitter = ((j * 7919) % 11) as f64 - 5.0;
            c.circle(
                x.px(*ms),
                cy + jitter,
                3.0,
                &format!("pt c{}", r.colour % COLOURS),
                Some(tip),
            );
        }
        if let Some((ms, family)) = winner {
            if family == r.label {
                c.circle(x.px(ms), cy, 7.0, "win-ring", Some(&format!("winner {} ms", num(ms))));
            }
        }
    }
    if let Some(b) = baseline_ms {
        c.line(x.px(b), top, x.px(b), bottom, "peer");
    }
    c.legend(8.0, bottom + 38.0, &legend);
    c.finish()
}

/// The geometry of a small plot (`param_plot`): size and plot area.
const SMALL: (f64, f64, f64, f64, f64, f64) = (230.0, 132.0, 46.0, 10.0, 20.0, 112.0);

/// A small plot's time axis: log, over the page's shared range.
fn small_y(y_range: (f64, f64)) -> Scale {
    let (_, _, _, _, top, bottom) = SMALL;
    Scale {
        lo: y_range.0,
        hi: y_range.1,
        log: true,
        px0: bottom,
        px1: top,
    }
}

/// The id of the axes every small plot of a page draws with `<use>` (see [`param_plot_axes`]).
pub const PARAM_AXES_ID: &str = "param-axes";

/// The axes a page's small plots share (one `y_range`, one size): grid, ticks and the two axis
/// lines, defined once per page in a hidden SVG and drawn by each plot with `<use>`: a page
/// of 40 plots would otherwise repeat them 40 times. The style sheet's rules do not reach into
/// a `<use>`'s copy, so the lines take their colours from the chart's custom properties
/// (`--grid`, `--axis`) and the labels their font from the `use` element (style.css).
pub fn param_plot_axes(y_range: (f64, f64)) -> String {
    let (w, _, left, right, top, bottom) = SMALL;
    let y = small_y(y_range);
    let ticks = y.ticks(4);
    let mut grid = String::new();
    let mut marks = String::new();
    let mut labels = String::new();
    for &t in &ticks {
        let py = P(y.px(t));
        let _ = write!(grid, "M{} {py}H{}", P(left), P(w - right));
        let _ = write!(marks, "M{} {py}H{}", P(left - 4.0), P(left));
        let _ = write!(
            labels,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            P(left - 6.0),
            P(y.px(t) + 3.5),
            esc(&num(t))
        );
    }
    format!(
        "<svg class=\"chart defs\" width=\"0\" height=\"0\" aria-hidden=\"true\"><defs><g id=\"{PARAM_AXES_ID}\">\
         <path d=\"{grid}\" style=\"stroke:var(--grid)\"/><path d=\"{marks}M{l} {b}V{t}M{l} {b}H{r}\" style=\"stroke:var(--axis)\"/>{labels}\
         </g></defs></svg>",
        l = P(left),
        b = P(bottom),
        t = P(top),
        r = P(w - right)
    )
}

/// One small plot: kernel time against the values of one parameter of one family. Every
/// variant is a faint dot; the line joins the best time reached with each value, so a flat
/// line means the knob did not matter. `y_range` is shared by a page's small plots, which
/// draw their axes from the page's [`param_plot_axes`].
pub fn param_plot(title: &str, values: &[(i64, Vec<f64>)], y_range: (f64, f64), colour: usize) -> String {
    let (w, h, left, right, _, bottom) = SMALL;
    let x = |i: usize| left + 14.0 + (w - left - right - 28.0) * (i as f64 + 0.5) / values.len().max(1) as f64;
    let y = small_y(y_range);
    let mut c = Canvas::new(w, h, &format!("{title}: time against the parameter's values"));
    c.text(left, 13.0, "small-title", title);
    let _ = write!(c.out, "<use href=\"#{PARAM_AXES_ID}\"/>");
    let mut best = Vec::new();
    for (i, (value, times)) in values.iter().enumerate() {
        let px = x(i);
        let step = values.len().max(1);
        let label_every = (values.len() / 6).max(1);
        if i % label_every == 0 || i + 1 == step {
            c.text(px, bottom + 14.0, "tick mid", &value.to_string());
        }
        c.group("faint");
        let dots: Vec<(f64, f64)> = times
            .iter()
            .enumerate()
            .map(|(j, t)| (px + ((j * 31) % 9) as f64 - 4.0, y.px(*t)))
            .collect();
        c.dots(&dots, 2.0, &format!("s{}", colour % COLOURS));
        c.end_group();
        if let Some(b) = times.iter().copied().reduce(f64::min) {
            best.push((px, y.px(b)));
        }
    }
    c.group(&format!("pt c{}", colour % COLOURS));
    for (x, y) in &best {
        c.circle(*x, *y, 3.0, "", None);
    }
    c.end_group();
    if best.len() > 1 {
        c.polyline(&best, &format!("best s{}", colour % COLOURS));
    }
    c.finish()
}

/// A bar of a bar chart.
#[derive(Debug, Clone)]
pub struct Bar {
    pub label: String,
    pub value: f64,
    pub colour: usize,
    pub tip: String,
}

/// Horizontal bars on a linear axis from zero, a value at the end of each bar.
pub fn bar_chart(title: &str, bars: &[Bar], unit: &str) -> String {
    let label_w = bars
        .iter()
        .map(|b| text_width(&b.label, 11.0))
        .fold(40.0, f64::max)
        .min(300.0);
    let (w, left, right, top) = (900.0, label_w + 16.0, 90.0, 10.0);
    let bar_h = 20.0;
    let bottom = top + bar_h * bars.len().max(1) as f64 + 4.0;
    let max = bars.iter().map(|b| b.value).fold(0.0, f64::max);
    let x = Scale {
        lo: 0.0,
        hi: if max > 0.0 { max * 1.05 } else { 1.0 },
        log: false,
        px0: left,
        px1: w - right,
    };
    let mut c = Canvas::new(w, bottom + 42.0, title);
    c.x_axis(&x, top, bottom, &x.ticks(8), unit);
    c.line(left, top, left, bottom, "axis");
    for (i, b) in bars.iter().enumerate() {
        let y0 = top + 2.0 + bar_h * i as f64;
        c.rect(
            left,
            y0 + 2.0,
            x.px(b.value.max(0.0)) - left,
            bar_h - 5.0,
            &format!("bar c{}", b.colour % COLOURS),
            Some(&b.tip),
        );
        c.text(left - 6.0, y0 + 14.0, "tick end", &b.label);
        c.text(x.px(b.value.max(0.0)) + 4.0, y0 + 14.0, "tick", &num(b.value));
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parses(svg: &str) {
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert_eq!(svg.matches("<svg").count(), 1);
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
    }

    #[test]
    fn charts_survive_empty_and_degenerate_data() {
        parses(&roofline(&[], &Ceilings::default(), &[]));
        parses(&strip_plot(&[], StripTimes::Kernel, None, None));
        parses(&param_plot("f · p", &[], (0.1, 1.0), 0));
        parses(&bar_chart("t", &[], "ms"));
        let one = StripRow {
            label: "f".into(),
            colour: 0,
            points: vec![(0.5, "x".into())],
        };
        let svg = strip_plot(
            std::slice::from_ref(&one),
            StripTimes::Kernel,
            Some((0.5, "f")),
            Some((0.5, "cuBLASLt bias (fused)")),
        );
        parses(&svg);
        assert!(svg.contains("peer: cuBLASLt bias (fused), 0.5 ms"), "{svg}");
        assert!(
            svg.contains("after re-timing") && svg.contains("kernel time, ms"),
            "{svg}"
        );
        let svg = strip_plot(
            &[one],
            StripTimes::DecodeStep,
            Some((0.5, "f")),
            Some((0.6, "graph engine")),
        );
        parses(&svg);
        assert!(
            svg.contains("0.5 ms per step") && svg.contains("per greedy decode step"),
            "{svg}"
        );
        assert!(!svg.contains("re-timing") && !svg.contains("kernel time"), "{svg}");
    }

    #[test]
    fn the_roofline_draws_every_measured_ceiling() {
        let c = Ceilings {
            fp32_tflops: Some(60.0),
            tf32_tflops: Some(400.0),
            bf16_tflops: None,
            copy_gb_per_s: Some(3000.0),
            measured_at: 0,
        };
        let p = RoofPoint {
            intensity: 100.0,
            flops_per_s: 40e12,
            label: Some("1".into()),
            colour: 0,
            tip: "w".into(),
        };
        let svg = roofline(&[p], &c, &[(0, "f32".into())]);
        parses(&svg);
        assert!(svg.contains("FP32 FMA peak (computed) 60 TFLOP/s"));
        assert!(svg.contains("cuBLAS TF32 400 TFLOP/s") && svg.contains("copy 3000 GB/s"));
        assert!(!svg.contains("BF16"));
    }
}
