//! Small SVG building blocks for the report's charts: linear and logarithmic scales with
//! readable ticks, axes with labels and units, legends laid out so nothing is cut, and text
//! escaping. Output is inline SVG (no namespace needed inside HTML) styled by the site's CSS
//! classes, so every point costs a few dozen bytes.

use std::fmt::Write;

/// Escapes text for XML content and attribute values (the model's SVG writer's escaping).
pub use crate::model::timeline_svg::xml_escape as esc;

/// A number in at most four significant digits, without trailing zeros (`0.0123`, `1.5`, `3072`).
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    let text = if a == 0.0 {
        "0".to_string()
    } else if a >= 1000.0 {
        format!("{v:.0}")
    } else {
        let decimals = (3 - a.log10().floor() as i32).clamp(0, 8) as usize;
        format!("{v:.decimals$}")
    };
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// Maps data values onto pixels, linearly or by logarithm.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub lo: f64,
    pub hi: f64,
    pub log: bool,
    /// Pixel positions of `lo` and `hi` (`px0 > px1` for a y axis growing upwards).
    pub px0: f64,
    pub px1: f64,
}

impl Scale {
    /// A scale covering `values` with a margin; a log scale ignores values that are not
    /// positive. Degenerate ranges are widened so that the scale is always usable.
    pub fn fit(values: impl IntoIterator<Item = f64>, log: bool, px0: f64, px1: f64) -> Scale {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values {
            if v.is_finite() && (!log || v > 0.0) {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
        if !lo.is_finite() {
            (lo, hi) = if log { (0.1, 10.0) } else { (0.0, 1.0) };
        }
        if log {
            if hi / lo < 1.5 {
                lo /= 1.25;
                hi *= 1.25;
            }
            lo /= 1.15;
            hi *= 1.15;
        } else {
            if hi - lo < 1e-12 {
                lo -= 0.5_f64.max(lo.abs() * 0.1);
                hi += 0.5_f64.max(hi.abs() * 0.1);
            }
            let pad = (hi - lo) * 0.06;
            lo -= pad;
            hi += pad;
        }
        Scale { lo, hi, log, px0, px1 }
    }

    fn t(&self, v: f64) -> f64 {
        if self.log {
            (v.max(1e-300).ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }

    /// The pixel of `v` (clamped to a little outside the range so nothing is drawn far away).
    pub fn px(&self, v: f64) -> f64 {
        let t = self.t(v).clamp(-0.05, 1.05);
        self.px0 + t * (self.px1 - self.px0)
    }

    pub fn contains(&self, v: f64) -> bool {
        (0.0..=1.0).contains(&self.t(v))
    }

    /// Tick values inside the range: 1-2-5 steps (linear), powers of ten with 2 and 5
    /// between them when the range is short (log).
    pub fn ticks(&self, max_ticks: usize) -> Vec<f64> {
        let max_ticks = max_ticks.max(2);
        if self.log {
            let (a, b) = (self.lo.log10().floor() as i32, self.hi.log10().ceil() as i32);
            // The densest round set that fits, but at least three ticks when one can.
            let sets: [&[f64]; 5] = [
                &[1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
                &[1.0, 2.0, 3.0, 5.0],
                &[1.0, 2.0, 5.0],
                &[1.0, 3.0],
                &[1.0],
            ];
            for mults in sets {
                let ticks: Vec<f64> = (a..=b)
                    .flat_map(|e| mults.iter().map(move |m| m * 10f64.powi(e)))
                    .filter(|v| self.contains(*v))
                    .collect();
                if ticks.len() <= max_ticks && ticks.len() >= 3.min(max_ticks) {
                    return ticks;
                }
                if ticks.len() < 3 {
                    break;
                }
            }
            let step = ((b - a) as usize).div_ceil(max_ticks).max(1);
            let ticks: Vec<f64> = (a..=b)
                .step_by(step)
                .map(|e| 10f64.powi(e))
                .filter(|v| self.contains(*v))
                .collect();
            if ticks.len() >= 2 {
                return ticks;
            }
            // Less than a decade: fall through to linear ticks between the ends.
        }
        let span = self.hi - self.lo;
        let raw = span / max_ticks as f64;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| span / s <= max_ticks as f64)
            .unwrap_or(10.0 * mag);
        let mut v = (self.lo / step).ceil() * step;
        let mut out = Vec::new();
        while v <= self.hi + step * 1e-9 && out.len() <= max_ticks + 1 {
            if !self.log || v > 0.0 {
                out.push(if v.abs() < step * 1e-9 { 0.0 } else { v });
            }
            v += step;
        }
        out
    }
}

/// Rough width of `text` at `size` px in the sans-serif face (generous, so labels fit).
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.62
}

/// A pixel coordinate written compactly: one decimal, none when it is whole (`12`, `12.5`).
#[derive(Clone, Copy)]
pub struct P(pub f64);

impl std::fmt::Display for P {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenths = (self.0 * 10.0).round();
        if !tenths.is_finite() {
            f.write_str("0")
        } else if tenths % 10.0 == 0.0 {
            write!(f, "{}", tenths / 10.0)
        } else {
            write!(f, "{:.1}", tenths / 10.0)
        }
    }
}

/// An SVG document being written, with its plot area.
pub struct Canvas {
    pub out: String,
    pub width: f64,
    pub height: f64,
}

impl Canvas {
    /// Starts a chart of `width` × `height` px titled `title` (read by screen readers and shown
    /// as a tooltip).
    pub fn new(width: f64, height: f64, title: &str) -> Canvas {
        let mut out = String::with_capacity(4096);
        let _ = write!(
            out,
            "<svg class=\"chart\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\"><title>{}</title>",
            esc(title),
            w = width.ceil(),
            h = height.ceil()
        );
        Canvas {
            out,
            width: width.ceil(),
            height: height.ceil(),
        }
    }

    pub fn finish(mut self) -> String {
        self.out.push_str("</svg>");
        self.out
    }

    pub fn text(&mut self, x: f64, y: f64, class: &str, text: &str) {
        let _ = write!(
            self.out,
            "<text x=\"{}\" y=\"{}\" class=\"{class}\">{}</text>",
            P(x),
            P(y),
            esc(text)
        );
    }

    pub fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, class: &str) {
        let _ = write!(
            self.out,
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" class=\"{class}\"/>",
            P(x1),
            P(y1),
            P(x2),
            P(y2)
        );
    }

    /// Straight segments `(x1, y1, x2, y2)` as one path element.
    pub fn segments(&mut self, segments: &[(f64, f64, f64, f64)], class: &str) {
        if segments.is_empty() {
            return;
        }
        self.out.push_str("<path d=\"");
        for (x1, y1, x2, y2) in segments {
            let _ = write!(self.out, "M{} {}L{} {}", P(*x1), P(*y1), P(*x2), P(*y2));
        }
        let _ = write!(self.out, "\" class=\"{class}\"/>");
    }

    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, class: &str, tip: Option<&str>) {
        let _ = write!(
            self.out,
            "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" class=\"{class}\"",
            P(x),
            P(y),
            P(w.max(0.0)),
            P(h.max(0.0))
        );
        self.close(tip, "rect");
    }

    /// A circle; `class` may be empty when a group around it gives the style.
    pub fn circle(&mut self, x: f64, y: f64, r: f64, class: &str, tip: Option<&str>) {
        let _ = write!(self.out, "<circle cx=\"{}\" cy=\"{}\" r=\"{r}\"", P(x), P(y));
        if !class.is_empty() {
            let _ = write!(self.out, " class=\"{class}\"");
        }
        self.close(tip, "circle");
    }

    /// Many untitled dots of radius `r` as one path of zero-length strokes with round caps
    /// (a third of the bytes of as many circles); `class` gives the stroke colour (`s0`...).
    pub fn dots(&mut self, points: &[(f64, f64)], r: f64, class: &str) {
        if points.is_empty() {
            return;
        }
        let _ = write!(
            self.out,
            "<path class=\"dots {class}\" stroke-width=\"{}\" d=\"",
            P(2.0 * r)
        );
        for (x, y) in points {
            let _ = write!(self.out, "M{} {}h0", P(*x), P(*y));
        }
        self.out.push_str("\"/>");
    }

    /// Opens a group whose class styles what is inside; close it with [`Canvas::end_group`].
    pub fn group(&mut self, class: &str) {
        let _ = write!(self.out, "<g class=\"{class}\">");
    }

    pub fn end_group(&mut self) {
        self.out.push_str("</g>");
    }

    pub fn polyline(&mut self, points: &[(f64, f64)], class: &str) {
        let pts: Vec<String> = points.iter().map(|(x, y)| format!("{},{}", P(*x), P(*y))).collect();
        let _ = write!(self.out, "<polyline points=\"{}\" class=\"{class}\"/>", pts.join(" "));
    }

    fn close(&mut self, tip: Option<&str>, element: &str) {
        match tip {
            Some(t) => {
                let _ = write!(self.out, "><title>{}</title></{element}>", esc(t));
            }
            None => self.out.push_str("/>"),
        }
    }

    /// A horizontal axis at the bottom of the plot area with ticks, grid lines and a label
    /// with the unit.
    pub fn x_axis(&mut self, x: &Scale, top: f64, bottom: f64, ticks: &[f64], label: &str) {
        let grid: Vec<_> = ticks.iter().map(|t| (x.px(*t), top, x.px(*t), bottom)).collect();
        self.segments(&grid, "grid");
        let marks: Vec<_> = ticks
            .iter()
            .map(|t| (x.px(*t), bottom, x.px(*t), bottom + 4.0))
            .collect();
        self.segments(&marks, "axis");
        for &t in ticks {
            self.text(x.px(t), bottom + 15.0, "tick mid", &num(t));
        }
        self.line(x.px0, bottom, x.px1, bottom, "axis");
        self.text((x.px0 + x.px1) / 2.0, bottom + 31.0, "label mid", label);
    }

    /// A vertical axis at `left` with ticks, grid lines and a rotated label with the unit.
    pub fn y_axis(&mut self, y: &Scale, left: f64, right: f64, ticks: &[f64], label: &str) {
        let grid: Vec<_> = ticks.iter().map(|t| (left, y.px(*t), right, y.px(*t))).collect();
        self.segments(&grid, "grid");
        let marks: Vec<_> = ticks.iter().map(|t| (left - 4.0, y.px(*t), left, y.px(*t))).collect();
        self.segments(&marks, "axis");
        for &t in ticks {
            self.text(left - 6.0, y.px(t) + 3.5, "tick end", &num(t));
        }
        self.line(left, y.px0, left, y.px1, "axis");
        if label.is_empty() {
            return; // small multiples: the section's text names the unit once
        }
        let cy = (y.px0 + y.px1) / 2.0;
        let _ = write!(
            self.out,
            "<text x=\"12\" y=\"{}\" class=\"label mid\" transform=\"rotate(-90 12 {})\">{}</text>",
            P(cy),
            P(cy),
            esc(label)
        );
    }

    /// Legend rows from `top`: each item a swatch (drawn by `swatch` at its centre) and a text,
    /// flowed left to right within the canvas width. Returns the y below the legend.
    pub fn legend(&mut self, left: f64, top: f64, items: &[LegendItem]) -> f64 {
        let (mut x, mut y) = (left, top + 12.0);
        let max_x = self.width - 8.0;
        for item in items {
            let w = 22.0 + text_width(&item.text, 11.0) + 14.0;
            if x > left && x + w > max_x {
                x = left;
                y += 18.0;
            }
            match &item.mark {
                Mark::Dot(class) => self.circle(x + 8.0, y - 4.0, 4.0, class, None),
                Mark::Ring(class) => self.circle(x + 8.0, y - 4.0, 5.5, class, None),
                Mark::Line(class) => self.line(x, y - 4.0, x + 16.0, y - 4.0, class),
                Mark::Box(class) => self.rect(x + 2.0, y - 10.0, 12.0, 12.0, class, None),
            }
            self.text(x + 22.0, y, "legend", &item.text);
            x += w;
        }
        y + 10.0
    }
}

/// How a legend item is drawn.
#[derive(Debug, Clone)]
pub enum Mark {
    Dot(String),
    Ring(String),
    Line(String),
    Box(String),
}

#[derive(Debug, Clone)]
pub struct LegendItem {
    pub mark: Mark,
    pub text: String,
}

impl LegendItem {
    pub fn new(mark: Mark, text: impl Into<String>) -> LegendItem {
        LegendItem {
            mark,
            text: text.into(),
        }
    }
}

/// The height a legend of `items` takes at `width` (the same flow as [`Canvas::legend`]).
pub fn legend_height(width: f64, left: f64, items: &[LegendItem]) -> f64 {
    let (mut x, mut rows) = (left, 1.0);
    for item in items {
        let w = 22.0 + text_width(&item.text, 11.0) + 14.0;
        if x > left && x + w > width - 8.0 {
            x = left;
            rows += 1.0;
        }
        x += w;
    }
    if items.is_empty() {
        0.0
    } else {
        rows * 18.0 + 12.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_are_compact() {
        assert_eq!(P(12.0).to_string(), "12");
        assert_eq!(P(12.46).to_string(), "12.5");
        assert_eq!(P(-0.04).to_string(), "-0");
        assert_eq!(P(f64::NAN).to_string(), "0");
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(num(0.012345), "0.01235");
        assert_eq!(num(1.5), "1.5");
        assert_eq!(num(3072.0), "3072");
        assert_eq!(num(100.0), "100");
        assert_eq!(num(0.0), "0");
        assert_eq!(num(f64::NAN), "-");
    }

    #[test]
    fn log_ticks_are_round_and_inside() {
        let s = Scale::fit([0.013, 4.2], true, 0.0, 100.0);
        let t = s.ticks(8);
        assert!(t.len() >= 2 && t.len() <= 8, "{t:?}");
        assert!(t.iter().all(|v| s.contains(*v)));
        assert!(t.contains(&0.1) && t.contains(&1.0), "{t:?}");
        // A narrow range still gets at least two ticks.
        let narrow = Scale::fit([0.51, 0.53], true, 0.0, 100.0);
        assert!(narrow.ticks(6).len() >= 2, "{:?}", narrow.ticks(6));
    }

    #[test]
    fn linear_ticks_step_by_1_2_5() {
        let s = Scale::fit([0.0, 97.0], false, 0.0, 100.0);
        let t = s.ticks(6);
        assert!(t.len() >= 3, "{t:?}");
        let step = t[1] - t[0];
        assert!([10.0, 20.0, 50.0].contains(&step), "{t:?}");
        let flat = Scale::fit([5.0, 5.0], false, 0.0, 100.0);
        assert!(flat.ticks(5).len() >= 2);
        let empty = Scale::fit([], true, 0.0, 100.0);
        assert!(empty.px(1.0).is_finite());
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
