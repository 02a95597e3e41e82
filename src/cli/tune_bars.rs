//! The progress display of `kernelforge tune`: one indicatif bar per GPU under one
//! [`MultiProgress`], each implementing the tuner's [`Progress`]. With one GPU the bar looks as
//! it always did (the stage as prefix); with several each prefix starts with `cuda:N`.

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::tune::tuner::Progress;

/// One GPU's bar.
pub struct DeviceBar {
    bar: ProgressBar,
    /// `cuda:1 ` when several GPUs share the display, else empty.
    label: String,
}

impl Progress for DeviceBar {
    fn stage(&self, message: &str, total: u64) {
        self.bar.set_position(0);
        self.bar.set_length(total);
        self.bar.set_prefix(format!("{}{message}", self.label));
    }
    fn advance(&self, message: &str) {
        self.bar.set_message(message.to_string());
        self.bar.inc(1);
    }
}

/// The bars of every GPU of a run, in device-list order.
pub struct TuneBars {
    multi: MultiProgress,
    bars: Vec<DeviceBar>,
}

impl TuneBars {
    /// A bar per entry of `devices` (CUDA ordinals; the same one may appear twice), each
    /// starting with `waiting[i]` as its prefix (what it is about to do).
    pub fn new(devices: &[usize], waiting: &[String]) -> TuneBars {
        let multi = MultiProgress::new();
        let style = ProgressStyle::with_template("{prefix:.bold} [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> ");
        let several = devices.len() > 1;
        let bars = devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let label = if several { format!("cuda:{d} ") } else { String::new() };
                let bar = multi.add(ProgressBar::new(0).with_style(style.clone()));
                bar.set_prefix(format!("{label}{}", waiting.get(i).map_or("", String::as_str)));
                DeviceBar { bar, label }
            })
            .collect();
        TuneBars { multi, bars }
    }

    /// What the spread draws on: one [`Progress`] per device.
    pub fn progress(&self) -> Vec<&dyn Progress> {
        self.bars.iter().map(|b| b as &dyn Progress).collect()
    }

    /// Clears the display (the table follows).
    pub fn finish(&self) {
        for b in &self.bars {
            b.bar.finish_and_clear();
        }
        let _ = self.multi.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_devices_prefix_their_bars() {
        let bars = TuneBars::new(&[0, 1], &["2 workloads".into(), "idle".into()]);
        let progress = bars.progress();
        assert_eq!(progress.len(), 2);
        progress[1].stage("compiling", 10);
        progress[1].advance("k");
        assert_eq!(bars.bars[1].bar.prefix(), "cuda:1 compiling");
        assert_eq!(bars.bars[1].bar.position(), 1);
        assert_eq!(bars.bars[0].bar.prefix(), "cuda:0 2 workloads");
        let one = TuneBars::new(&[0], &[String::new()]);
        one.progress()[0].stage("compiling", 3);
        assert_eq!(one.bars[0].bar.prefix(), "compiling", "one GPU keeps today's look");
        bars.finish();
        one.finish();
    }
}
