//! Timing with CUDA events: warm-up, then many timed launches, each on the next of several
//! input copies so that small problems are not flattered by a warm L2 cache, and each queued
//! behind a short GPU hold so that launch cost on the host is not counted; the median and the
//! 10th/90th percentiles are reported.

use cudarc::driver::sys::CUevent_flags;

use crate::gpu::{DeviceProblem, Gpu, GpuError, LoadedVariant, RunError};
use crate::ops::{HostData, Problem};
use crate::spec::Launch;

/// How long to measure.
#[derive(Debug, Clone, Copy)]
pub struct TimingPlan {
    pub warmup: usize,
    pub min_runs: usize,
    pub max_runs: usize,
    /// Stop once this much GPU time was measured (after `min_runs`, or after [`FEW_RUNS`] when
    /// those already took this long); 0: exactly `min_runs`.
    pub target_ms: f64,
}

/// Runs that are enough for a kernel whose runs fill `target_ms` by themselves: a 6 ms LM head
/// in f32 is not timed any better by 10 runs than by 3, and each extra run of every candidate is
/// tuning time (`tune --op` on that shape spent 15.6 of its 18.7 s timing).
pub const FEW_RUNS: usize = 3;

/// A kernel whose first warm-up run alone takes this many times a plan's target is measured by
/// that run: its warm-up and further runs would only add seconds (`tune --op` on the f32 LM head
/// spent 5.5 of its 11 s of timing on two `matmul_naive` points of 0.69 s a run, four runs each)
/// for a time that decides nothing but that it loses. Launch cost and clock ramp-up are lost in
/// a run that long.
pub const LONG_RUN_FACTOR: f64 = 10.0;

impl TimingPlan {
    /// Whether `taken` runs that took `total_ms` call for more.
    fn wants_more(&self, taken: usize, total_ms: f64) -> bool {
        // (A plan without a target, `target_ms` 0, asks for exactly `min_runs`.)
        let fewest = if self.target_ms > 0.0 {
            self.min_runs.min(FEW_RUNS)
        } else {
            self.min_runs
        };
        taken < self.max_runs && !(taken >= fewest && total_ms >= self.target_ms)
    }

    /// Whether a first run of `ms` is the whole measurement (see [`LONG_RUN_FACTOR`]); never
    /// for a plan without a target, which asks for exactly `min_runs`.
    fn settled_by_one_run(&self, ms: f64) -> bool {
        self.target_ms > 0.0 && ms >= LONG_RUN_FACTOR * self.target_ms
    }

    /// How many runs to enqueue before the next look at the times: [`FEW_RUNS`] first (a long
    /// kernel may need no more), then up to `min_runs`, then `min_runs` at a time.
    fn next_batch(&self, taken: usize) -> usize {
        let batch = match taken {
            0 => self.min_runs.min(FEW_RUNS),
            t if t < self.min_runs => self.min_runs - t,
            _ => self.min_runs,
        };
        batch.min(self.max_runs - taken).max(1)
    }
}

impl Default for TimingPlan {
    fn default() -> Self {
        TimingPlan {
            warmup: 3,
            min_runs: 10,
            max_runs: 200,
            target_ms: 60.0,
        }
    }
}

/// A measured kernel time.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timing {
    pub median_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    pub runs: usize,
}

impl Timing {
    /// From raw samples (milliseconds).
    pub fn from_samples(mut samples: Vec<f64>) -> Timing {
        assert!(!samples.is_empty(), "at least one sample");
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        Timing {
            median_ms: at(0.5),
            p10_ms: at(0.1),
            p90_ms: at(0.9),
            runs: samples.len(),
        }
    }

    pub fn spread_ms(&self) -> f64 {
        self.p90_ms - self.p10_ms
    }
}

/// Bytes of a problem's tensors.
pub fn problem_bytes(problem: &Problem) -> usize {
    problem
        .tensors
        .iter()
        .map(|t| match &t.data {
            HostData::F32(v) => v.len() * problem.storage.bytes(),
            HostData::I32(v) => v.len() * 4,
        })
        .sum()
}

/// How many copies of the inputs to rotate through so that together they exceed twice the L2
/// cache (50 MB on an H100): at least 1, at most 8.
pub fn rotation_count(problem: &Problem) -> usize {
    const L2_BYTES: usize = 50 << 20;
    let bytes = problem_bytes(problem).max(1);
    (2 * L2_BYTES).div_ceil(bytes).clamp(1, 8)
}

/// GPU time [`time_with`] holds the stream for before each timed call (see [`Gpu::hold`]): more
/// than the host needs to enqueue one call (cuBLAS's host side is a few microseconds).
pub const HOLD_NS: u64 = 30_000;

/// Times `body(i)` (which enqueues the work for copy `i % copies`) with CUDA events, each call
/// queued behind a [`Gpu::hold`] so that the events measure GPU time, not launch cost.
pub fn time_with(
    gpu: &Gpu,
    copies: usize,
    plan: &TimingPlan,
    mut body: impl FnMut(usize) -> Result<(), RunError>,
) -> Result<Timing, RunError> {
    let mut samples = Vec::new();
    sample(gpu, copies, plan, &mut body, &mut samples)?;
    Ok(Timing::from_samples(samples))
}

/// One contestant of [`time_in_turns`]: how many input copies it rotates through, and the
/// call that enqueues its work on copy `i % copies`.
pub struct Contestant<'a> {
    pub copies: usize,
    pub enqueue: Box<dyn FnMut(usize) -> Result<(), RunError> + 'a>,
}

/// Times several contestants in turns: `rounds` rounds, in each of which every contestant gets
/// a warm-up and `plan`'s runs. Under sustained load a GPU lowers its clocks (an H200 running
/// the LM head's GEMM went from 1980 to 1530 MHz within 100 ms, power capping), so kernels timed
/// one after the other are timed at different clocks; in turns, every contestant sees the same
/// drift. Returns one timing per contestant, in order.
pub fn time_in_turns(
    gpu: &Gpu,
    plan: &TimingPlan,
    rounds: usize,
    contestants: &mut [Contestant<'_>],
) -> Result<Vec<Timing>, RunError> {
    let mut samples = vec![Vec::new(); contestants.len()];
    for _ in 0..rounds.max(1) {
        for (c, s) in contestants.iter_mut().zip(&mut samples) {
            sample(gpu, c.copies, plan, &mut c.enqueue, s)?;
        }
    }
    Ok(samples.into_iter().map(Timing::from_samples).collect())
}

/// Appends to `samples` the times of `plan`'s runs of `body` after its warm-up; or, when the
/// first warm-up run alone settles it (a very long kernel, see [`LONG_RUN_FACTOR`]), that run's.
fn sample(
    gpu: &Gpu,
    copies: usize,
    plan: &TimingPlan,
    body: &mut dyn FnMut(usize) -> Result<(), RunError>,
    samples: &mut Vec<f64>,
) -> Result<(), RunError> {
    let event = || {
        gpu.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(GpuError::cuda("creating an event"))
    };
    let copies = copies.max(1);
    // Enqueues one call behind a hold, between two events (see `time_with`).
    let timed = |i: usize, body: &mut dyn FnMut(usize) -> Result<(), RunError>| {
        let (start, end) = (event()?, event()?);
        gpu.hold(HOLD_NS)?;
        start
            .record(&gpu.stream)
            .map_err(GpuError::cuda("recording an event"))?;
        body(i)?;
        end.record(&gpu.stream).map_err(GpuError::cuda("recording an event"))?;
        Ok::<_, RunError>((start, end))
    };
    let elapsed = |(start, end): (cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)| {
        start
            .elapsed_ms(&end)
            .map(f64::from)
            .map_err(GpuError::cuda("reading an event"))
    };
    for i in 0..plan.warmup {
        if i == 0 && plan.target_ms > 0.0 {
            let ms = elapsed(timed(0, body)?)?;
            if plan.settled_by_one_run(ms) {
                samples.push(ms);
                return Ok(());
            }
        } else {
            body(i % copies)?;
        }
    }
    gpu.synchronize()?;
    let (first, mut total) = (samples.len(), 0.0);
    let taken = |samples: &Vec<f64>| samples.len() - first;
    // Measure in batches so that the stopping rule sees real times without a sync per launch.
    while plan.wants_more(taken(samples), total) {
        let batch = plan.next_batch(taken(samples));
        let mut events = Vec::with_capacity(batch);
        for _ in 0..batch {
            events.push(timed((taken(samples) + events.len()) % copies, body)?);
        }
        for pair in events {
            let ms = elapsed(pair)?;
            samples.push(ms);
            total += ms;
        }
    }
    Ok(())
}

/// Times one loaded variant on `copies` uploaded copies of `problem`.
pub fn time_variant(
    gpu: &Gpu,
    loaded: &LoadedVariant,
    problem: &Problem,
    copies: &[DeviceProblem],
    launches: &[Launch],
    plan: &TimingPlan,
) -> Result<Timing, RunError> {
    loaded.fill_constants(gpu, problem)?;
    time_with(gpu, copies.len(), plan, |i| {
        loaded.launch(gpu, problem, &copies[i % copies.len()], launches)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let t = Timing::from_samples((1..=11).rev().map(|v| v as f64).collect());
        assert_eq!(t.median_ms, 6.0);
        assert_eq!(t.p10_ms, 2.0);
        assert_eq!(t.p90_ms, 10.0);
        assert_eq!(t.runs, 11);
        assert_eq!(t.spread_ms(), 8.0);
        assert_eq!(
            crate::stats::median((1..=11).rev().map(|v| v as f64).collect()),
            t.median_ms
        );
        assert_eq!(
            Timing::from_samples(vec![4.0, 1.0, 3.0, 2.0]).median_ms,
            3.0,
            "as the timing takes it"
        );
    }

    /// The runs `plan` takes of a kernel that always takes `ms`.
    fn runs_of(plan: &TimingPlan, ms: f64) -> usize {
        let (mut taken, mut total) = (0, 0.0);
        while plan.wants_more(taken, total) {
            let batch = plan.next_batch(taken);
            taken += batch;
            total += batch as f64 * ms;
        }
        taken
    }

    #[test]
    fn long_kernels_stop_after_a_few_runs_short_ones_fill_the_target() {
        let plan = TimingPlan {
            warmup: 1,
            min_runs: 10,
            max_runs: 50,
            target_ms: 10.0,
        };
        assert_eq!(runs_of(&plan, 6.0), FEW_RUNS, "18 ms in 3 runs is enough");
        assert_eq!(
            runs_of(&plan, 2.0),
            10,
            "3 runs fall short of 10 ms: then up to min_runs"
        );
        assert_eq!(runs_of(&plan, 0.5), 20, "then min_runs at a time until 10 ms");
        assert_eq!(runs_of(&plan, 0.01), 50, "max_runs caps a tiny kernel");
        let few = TimingPlan { min_runs: 2, ..plan };
        assert_eq!(runs_of(&few, 20.0), 2, "min_runs below FEW_RUNS still counts");
        let exact = TimingPlan { target_ms: 0.0, ..plan };
        assert_eq!(runs_of(&exact, 6.0), 10, "no target: exactly min_runs");
    }

    /// A first run of ten times the target is the whole measurement; a shorter one, or any run
    /// under a plan without a target, is not.
    #[test]
    fn a_very_long_first_run_settles_the_timing() {
        let plan = TimingPlan {
            warmup: 1,
            min_runs: 5,
            max_runs: 20,
            target_ms: 2.0,
        };
        assert!(plan.settled_by_one_run(690.0), "matmul_naive on the LM head");
        assert!(plan.settled_by_one_run(20.0));
        assert!(!plan.settled_by_one_run(19.9));
        assert!(!plan.settled_by_one_run(6.2), "the LM head's winner gets its runs");
        let exact = TimingPlan { target_ms: 0.0, ..plan };
        assert!(!exact.settled_by_one_run(690.0), "no target: exactly min_runs");
    }
}
