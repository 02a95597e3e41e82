//! One megakernel decode step ([`Timeline`]) drawn as an SVG picture: a row per resident block,
//! time in µs across, each task a rectangle coloured by its op, the part it spent waiting for
//! its inputs hatched in a lighter shade, so that bubbles (blank or hatched) and stragglers show
//! at a glance. `kernelforge bench --decode-engine megakernel --timeline FILE.svg` writes it.

use std::collections::BTreeSet;
use std::fmt::{self, Write};

use super::engine::{TaskStamp, Timeline};

/// The ops of a decode step in step order, with their colours.
const OPS: [(&str, &str); 8] = [
    ("embed", "#8c564b"),
    ("qkv", "#1f77b4"),
    ("attention", "#ff7f0e"),
    ("attn_proj", "#2ca02c"),
    ("fc", "#d62728"),
    ("fc_proj", "#9467bd"),
    ("mlp", "#e377c2"),
    ("lm_head", "#17becf"),
];
/// Colours of ops not in [`OPS`], in name order.
const OTHER_COLOURS: [&str; 4] = ["#7f7f7f", "#bcbd22", "#aec7e8", "#393b79"];

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 64.0;
/// Legend entries per line.
const LEGEND_PER_LINE: usize = 6;

/// The SVG document for `timeline` under `title` (see the module docs). Never fails: an empty
/// timeline gives the axes and a note, tasks on blocks beyond `timeline.blocks` get rows too, and
/// stamps out of order (ready before start, end before ready) are clamped.
pub fn render_timeline_svg(timeline: &Timeline, title: &str) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = render(&mut s, timeline, title);
    s
}

/// XML text and attribute escaping.
pub fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\t' && c != '\n' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// The ops present, known ones in step order, then the others by name, each with its colour.
fn legend_ops(tasks: &[TaskStamp]) -> Vec<(String, &'static str)> {
    let present: BTreeSet<&str> = tasks.iter().map(|t| t.op.as_str()).collect();
    let mut ops: Vec<(String, &'static str)> = OPS
        .iter()
        .filter(|(op, _)| present.contains(op))
        .map(|(op, colour)| (op.to_string(), *colour))
        .collect();
    let others = present.iter().filter(|op| !OPS.iter().any(|(known, _)| known == *op));
    for (i, op) in others.enumerate() {
        ops.push((op.to_string(), OTHER_COLOURS[i % OTHER_COLOURS.len()]));
    }
    ops
}

/// A tick step of 1, 2 or 5 × 10^k giving about `target` ticks over `span`.
fn tick_step(span: f64, target: f64) -> f64 {
    let raw = (span / target).max(1e-9);
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&step| step >= raw)
        .unwrap_or(10.0 * magnitude)
}

fn render(s: &mut String, timeline: &Timeline, title: &str) -> fmt::Result {
    let tasks = &timeline.tasks;
    let rows = tasks
        .iter()
        .map(|t| t.block as usize + 1)
        .max()
        .unwrap_or(0)
        .max(timeline.blocks as usize)
        .max(1);
    let row_h = (640.0 / rows as f64).clamp(2.0, 18.0);
    let bar_h = if row_h >= 5.0 { row_h - 2.0 } else { row_h };
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = rows as f64 * row_h;
    let axis_y = TOP + plot_h;
    let ops = legend_ops(tasks);
    let legend_lines = (ops.len() + 1).div_ceil(LEGEND_PER_LINE);
    let legend_y = axis_y + 56.0;
    let height = legend_y + legend_lines as f64 * 20.0 + 10.0;

    let t0 = tasks.iter().map(|t| t.start_ns).min().unwrap_or(0);
    let t1 = tasks.iter().map(|t| t.end_ns.max(t.start_ns)).max().unwrap_or(0);
    let span_ns = (t1 - t0).max(1);
    let x = |t: u64| LEFT + t.saturating_sub(t0) as f64 / span_ns as f64 * plot_w;
    let us = |ns: u64| ns as f64 / 1e3;

    writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="11">"#
    )?;
    writeln!(
        s,
        r##"<defs><pattern id="wait" patternUnits="userSpaceOnUse" width="6" height="6" patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff" fill-opacity="0.45"/><rect width="3" height="6" fill="#fff" fill-opacity="0.45"/></pattern></defs>"##
    )?;
    writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#)?;
    writeln!(
        s,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        xml_escape(title)
    )?;

    // Where the blocks' time went, over rows × the step's span.
    let (mut waiting, mut running) = (0u64, 0u64);
    for t in tasks {
        let ready = t.ready_ns.clamp(t.start_ns, t.end_ns.max(t.start_ns));
        waiting += ready - t.start_ns;
        running += t.end_ns.saturating_sub(ready);
    }
    let capacity = rows as f64 * span_ns as f64;
    let summary = if tasks.is_empty() {
        format!("no tasks were stamped ({rows} blocks)")
    } else {
        format!(
            "{} tasks on {rows} blocks over {:.2} µs: blocks running {:.0}%, waiting for inputs {:.0}%, idle {:.0}%",
            tasks.len(),
            us(span_ns),
            100.0 * running as f64 / capacity,
            100.0 * waiting as f64 / capacity,
            (100.0 * (1.0 - (running + waiting) as f64 / capacity)).max(0.0)
        )
    };
    writeln!(
        s,
        r##"<text x="{LEFT}" y="42" fill="#444">{}</text>"##,
        xml_escape(&summary)
    )?;

    // Time axis: grid lines, ticks and labels in µs.
    let span_us = us(span_ns);
    let step = tick_step(span_us, 8.0);
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil() as usize
    };
    let mut i = 0u64;
    loop {
        let tick = i as f64 * step;
        if tick > span_us * (1.0 + 1e-9) || i > 1000 {
            break;
        }
        let tx = LEFT + tick / span_us * plot_w;
        writeln!(
            s,
            r##"<line x1="{tx:.2}" y1="{TOP}" x2="{tx:.2}" y2="{:.2}" stroke="#ddd"/><line x1="{tx:.2}" y1="{axis_y:.2}" x2="{tx:.2}" y2="{:.2}" stroke="#000"/><text x="{tx:.2}" y="{:.2}" text-anchor="middle">{tick:.decimals$}</text>"##,
            axis_y,
            axis_y + 5.0,
            axis_y + 18.0
        )?;
        i += 1;
    }
    writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{axis_y:.2}" x2="{:.2}" y2="{axis_y:.2}" stroke="#000"/><text x="{:.2}" y="{:.2}" text-anchor="middle">time (µs)</text>"##,
        LEFT + plot_w,
        LEFT + plot_w / 2.0,
        axis_y + 36.0
    )?;

    // Block axis: a label every few rows.
    let label_every = rows.div_ceil(32);
    for r in (0..rows).step_by(label_every) {
        writeln!(
            s,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="end" font-size="9">{r}</text>"#,
            LEFT - 6.0,
            TOP + (r as f64 + 0.5) * row_h + 3.0
        )?;
    }
    writeln!(
        s,
        r#"<text transform="translate(20 {:.2}) rotate(-90)" text-anchor="middle">block</text>"#,
        TOP + plot_h / 2.0
    )?;

    if tasks.is_empty() {
        writeln!(
            s,
            r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#888">no tasks</text>"##,
            LEFT + plot_w / 2.0,
            TOP + plot_h / 2.0
        )?;
    }
    for t in tasks {
        let colour = ops
            .iter()
            .find(|(op, _)| *op == t.op)
            .map_or(OTHER_COLOURS[0], |(_, c)| *c);
        let end = t.end_ns.max(t.start_ns);
        let ready = t.ready_ns.clamp(t.start_ns, end);
        let y = TOP + t.block as f64 * row_h + (row_h - bar_h) / 2.0;
        let (xs, xr, xe) = (x(t.start_ns), x(ready), x(end));
        let layer = t.layer.map_or(String::new(), |l| format!(" layer {l}"));
        writeln!(
            s,
            r#"<rect class="task" data-op="{}" x="{xs:.2}" y="{y:.2}" width="{:.2}" height="{bar_h:.2}" fill="{colour}"><title>block {}: {}{layer}, waited {:.2} µs, ran {:.2} µs, from {:.2} µs</title></rect>"#,
            xml_escape(&t.op),
            (xe - xs).max(0.5),
            t.block,
            xml_escape(&t.op),
            us(ready - t.start_ns),
            us(end - ready),
            us(t.start_ns.saturating_sub(t0)),
        )?;
        if ready > t.start_ns {
            writeln!(
                s,
                r#"<rect class="wait" x="{xs:.2}" y="{y:.2}" width="{:.2}" height="{bar_h:.2}" fill="url(#wait)"/>"#,
                (xr - xs).max(0.5)
            )?;
        }
    }

    // Legend: every op present, then the hatching.
    let entries = ops
        .iter()
        .map(|(op, colour)| (op.as_str(), *colour, false))
        .chain(std::iter::once(("waiting for inputs", "#7f7f7f", true)));
    for (k, (name, colour, hatched)) in entries.enumerate() {
        let lx = LEFT + (k % LEGEND_PER_LINE) as f64 * (plot_w / LEGEND_PER_LINE as f64);
        let ly = legend_y + (k / LEGEND_PER_LINE) as f64 * 20.0;
        write!(
            s,
            r#"<g class="legend"><rect x="{lx:.2}" y="{:.2}" width="14" height="10" fill="{colour}"/>"#,
            ly - 9.0
        )?;
        if hatched {
            write!(
                s,
                r#"<rect x="{lx:.2}" y="{:.2}" width="14" height="10" fill="url(#wait)"/>"#,
                ly - 9.0
            )?;
        }
        writeln!(
            s,
            r#"<text x="{:.2}" y="{ly:.2}">{}</text></g>"#,
            lx + 18.0,
            xml_escape(name)
        )?;
    }
    writeln!(s, "</svg>")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(block: u32, op: &str, layer: Option<u32>, start: u64, ready: u64, end: u64) -> TaskStamp {
        TaskStamp {
            block,
            op: op.to_string(),
            layer,
            start_ns: start,
            ready_ns: ready,
            data_ns: ready,
            end_ns: end,
        }
    }

    fn synthetic() -> Timeline {
        let mut tasks = vec![task(0, "embed", None, 0, 0, 800)];
        for l in 0..2u32 {
            let base = 800 + l as u64 * 10_000;
            for b in 0..4u32 {
                let s = base + b as u64 * 100;
                tasks.push(task(b, "qkv", Some(l), s, s + 300, s + 2_000));
                tasks.push(task(b, "attention", Some(l), s + 2_000, s + 2_500, s + 4_000));
                tasks.push(task(b, "attn_proj", Some(l), s + 4_000, s + 4_100, s + 5_000));
                tasks.push(task(b, "fc", Some(l), s + 5_000, s + 5_000, s + 7_000));
                tasks.push(task(b, "fc_proj", Some(l), s + 7_000, s + 7_600, s + 9_000));
            }
        }
        tasks.push(task(3, "lm_head", None, 21_000, 21_500, 30_000));
        Timeline { blocks: 4, tasks }
    }

    fn rects_of_class<'a>(doc: &'a roxmltree::Document, class: &str) -> Vec<roxmltree::Node<'a, 'a>> {
        doc.descendants()
            .filter(|n| n.has_tag_name("rect") && n.attribute("class") == Some(class))
            .collect()
    }

    fn legend_names(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.attribute("class") == Some("legend"))
            .filter_map(|g| g.descendants().find(|n| n.has_tag_name("text")))
            .filter_map(|t| t.text().map(str::to_string))
            .collect()
    }

    #[test]
    fn one_rect_per_task_and_a_legend_entry_per_op() {
        let tl = synthetic();
        let svg = render_timeline_svg(&tl, "gpt2 bf16 batch 1 <step 0.030 ms> & more");
        let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
        let tasks = rects_of_class(&doc, "task");
        assert_eq!(tasks.len(), tl.tasks.len());
        for (rect, t) in tasks.iter().zip(&tl.tasks) {
            assert_eq!(rect.attribute("data-op"), Some(t.op.as_str()));
            let w: f64 = rect.attribute("width").unwrap().parse().unwrap();
            assert!(w > 0.0 && w.is_finite());
        }
        // Waiting parts only where a task waited.
        let waited = tl.tasks.iter().filter(|t| t.ready_ns > t.start_ns).count();
        assert_eq!(rects_of_class(&doc, "wait").len(), waited);
        let legend = legend_names(&doc);
        for op in ["embed", "qkv", "attention", "attn_proj", "fc", "fc_proj", "lm_head"] {
            assert!(
                legend.iter().any(|l| l == op),
                "{op} missing from the legend {legend:?}"
            );
        }
        assert!(legend.iter().any(|l| l.contains("waiting")));
        // The title survives escaping, and the axis is labelled in µs.
        assert!(doc
            .descendants()
            .any(|n| n.text() == Some("gpt2 bf16 batch 1 <step 0.030 ms> & more")));
        assert!(svg.contains("time (µs)"));
        // Ticks at 0, 5, 10 ... 30 µs.
        for label in ["0", "5", "10", "30"] {
            assert!(doc.descendants().any(|n| n.text() == Some(label)), "tick {label}");
        }
    }

    #[test]
    fn the_legend_lists_only_the_ops_present_and_unknown_ones_too() {
        let tl = Timeline {
            blocks: 2,
            tasks: vec![task(0, "fc", Some(0), 0, 10, 50), task(1, "mystery", None, 5, 5, 60)],
        };
        let svg = render_timeline_svg(&tl, "t");
        let doc = roxmltree::Document::parse(&svg).unwrap();
        assert_eq!(legend_names(&doc), ["fc", "mystery", "waiting for inputs"]);
    }

    #[test]
    fn empty_and_odd_timelines_do_not_panic() {
        for tl in [
            Timeline::default(),
            Timeline {
                blocks: 132,
                tasks: Vec::new(),
            },
            // A block beyond `blocks`, ready before start, end before ready, zero-length.
            Timeline {
                blocks: 1,
                tasks: vec![task(5, "qkv", Some(0), 100, 50, 80), task(0, "lm_head", None, 7, 7, 7)],
            },
        ] {
            let svg = render_timeline_svg(&tl, "odd");
            let doc = roxmltree::Document::parse(&svg).expect("well-formed");
            assert_eq!(rects_of_class(&doc, "task").len(), tl.tasks.len());
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        }
    }

    #[test]
    fn tick_steps_are_round() {
        assert_eq!(tick_step(30.0, 8.0), 5.0);
        assert_eq!(tick_step(100.0, 8.0), 20.0);
        assert!((tick_step(0.008, 8.0) - 0.001).abs() < 1e-12);
    }
}
