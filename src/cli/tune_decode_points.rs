//! `kernelforge tune --model M --decode-step`, first part: the kernels of a greedy decode step
//! on the graph engine chosen by whole steps among the near-ties `tune --model` timed alone:
//! decode attention in each cache-length bucket, then the step's matmuls.
//!
//! `tune --model` times every kernel alone. Points within a few percent of each other there
//! can differ more than that in the step:
//! - decode attention follows the QKV projection's GEMM and reads a shorter cache than the
//!   bucket's longest (batch 256 of GPT-2 small, H200: one warp a block won alone by 0.3% and
//!   cost the step 2.4%);
//! - a GEMM's blocks become resident while the kernel before it still runs and load their first
//!   weight stages then (`templates/matmul/tma_ring.cu.tera`), which a GEMM timed alone, with
//!   nothing before it, cannot show (batch 256: an fc projection point 3% slower alone made the
//!   step 1.7% faster).
//!
//! So for each batch, every attention bucket and every matmul the step runs, the winner and the
//! candidates within [`NEAR`] of it are timed in greedy decode steps (an attention bucket's
//! caches stay inside the bucket; the matmuls run after the first bucket's prompt), in rounds,
//! and the fastest, when it beats the winner alone by more than [`MARGIN`], becomes the key's
//! winner in the database; every timed candidate keeps its `step_ms`, so a reader sees why the
//! step runs what it runs.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use indexmap::IndexMap;
use indicatif::{ProgressBar, ProgressStyle};

use crate::gpu::{Compiler, Gpu};
use crate::model::gpu::{point_text, GpuBackend};
use crate::model::{DecodeEngine, GPT2Config, GPT2Model, GPT2Weights};
use crate::ops::model_dims::{decode_context_buckets, MATMUL_ROLES};
use crate::spec::Dtype;
use crate::stats::median;
use crate::tune::db::{default_path, DbHeader, Entry, TuneKey, TuningDb};
use crate::tune::workloads::{decode_attention_workloads, kernel_dtype};

/// How much slower alone than the winner a candidate may be and still be timed in the step.
const NEAR: f64 = 1.05;
/// Candidates timed in the step per bucket, the winner included.
const MOST: usize = 4;
/// How much faster in the step than the winner alone another candidate must be to replace it:
/// a switch by 0.2% went the other way in a longer bench (batch 128, H200: 0.8% slower there).
const MARGIN: f64 = 0.005;
/// The first bucket's prompt (as `bench`'s and `parity_hf.py`'s), and the most timed steps.
const SHORT_PROMPT: usize = 16;
const STEPS: usize = 64;
/// Fewer steps than this inside a bucket are not worth timing (a bucket of a tiny context).
const FEWEST_STEPS: usize = 8;
/// Rounds of timing (every point once a round, in turn, the order reversed every other round).
const ROUNDS: usize = 7;

/// A candidate as the step runs it: family and every parameter of its point.
type Point = (String, IndexMap<String, i64>);

/// What a key's choice came to: the winner alone (with its GPU ms a step, when it was timed
/// in this run), the point the step runs with its own, and how many points were timed.
type Outcome = ((Point, Option<f64>), (Point, f64), usize);

/// One chosen kernel of a batch's step.
pub(super) struct InStep {
    pub batch: usize,
    /// Which kernel: `attention`, or the matmul's role (`qkv`, `attn_proj`, `fc`, `fc_proj`,
    /// `lm_head`); `matmul` for one read back from the database.
    pub role: &'static str,
    /// The key the choice is stored under (`TuneKey::text`).
    pub key: String,
    /// Attention: the bucket's longest cache.
    pub bucket: Option<usize>,
    /// The prompt before the timed steps, and how many steps.
    pub prompt: usize,
    pub steps: usize,
    /// The winner alone (before this run) and the candidate the step chose, each with its
    /// GPU ms a step (`None` for a winner alone that was not timed in the step).
    pub alone: (Point, Option<f64>),
    pub chosen: (Point, f64),
    pub timed: usize,
    /// Read back from the tuning database, not measured in this run.
    pub from_db: bool,
}

/// The prompt and the number of greedy steps that keep every step's cache in the bucket of
/// `len` positions, `below` being the bucket under it (0 for the first): the cache holds
/// `prompt + 1` positions at the first step and `prompt + steps` at the last. `None` when the
/// bucket leaves fewer than [`FEWEST_STEPS`].
pub(super) fn bucket_run(below: usize, len: usize) -> Option<(usize, usize)> {
    let prompt = if below == 0 { SHORT_PROMPT } else { below + 1 };
    let steps = len.checked_sub(prompt)?.min(STEPS);
    (steps >= FEWEST_STEPS).then_some((prompt, steps))
}

/// The entry's winner, then its other verified candidates within [`NEAR`] of the winner's time
/// alone, fastest first, each point once, at most [`MOST`] in all.
pub(super) fn near_ties(entry: &Entry) -> Vec<Point> {
    let mut out: Vec<Point> = vec![(entry.family.clone(), entry.params.clone())];
    let mut timed: Vec<_> = entry
        .candidates
        .iter()
        .filter(|c| c.rejected.is_none())
        .filter_map(|c| c.median_ms.map(|ms| (ms, c)))
        .filter(|(ms, _)| *ms <= entry.median_ms * NEAR)
        .collect();
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (_, c) in timed {
        let point = (c.family.clone(), c.params.clone());
        if out.len() < MOST && !out.contains(&point) {
            out.push(point);
        }
    }
    out
}

/// Each point's GPU ms a step, paired by round (the first of `rounds` is the winner alone, every
/// point with its time in each round): the winner alone's median over the rounds times the
/// median over the rounds of the point's time over the winner alone's in the same round (the
/// winner alone: its median). Paired so, a drift of the clocks between rounds (at batch 256 the
/// same kernels measured 0.56-0.61 ms a step across a run) cancels out of the comparison, and
/// the times recorded are the ones [`step_choice`] compares.
pub(super) fn paired_step_times(rounds: &[(Point, Vec<f64>)]) -> Vec<(Point, f64)> {
    let alone = &rounds[0].1;
    let alone_ms = median(alone.clone());
    rounds
        .iter()
        .enumerate()
        .map(|(i, (point, times))| {
            let ratio = if i == 0 {
                1.0
            } else {
                median(times.iter().zip(alone).map(|(t, a)| t / a).collect())
            };
            (point.clone(), alone_ms * ratio)
        })
        .collect()
}

/// The point a bucket runs after its candidates were timed in the step (the first of `timed` is
/// the winner alone): the fastest, if it beats the winner alone by more than [`MARGIN`].
pub(super) fn step_choice(timed: &[(Point, f64)]) -> (Point, f64) {
    let alone = timed[0].clone();
    let fastest = timed
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .unwrap_or_else(|| alone.clone());
    if fastest.1 < alone.1 * (1.0 - MARGIN) {
        fastest
    } else {
        alone
    }
}

/// `entry` with `chosen` as its winner (its time alone from the candidates) and each timed
/// point's GPU ms a step ([`paired_step_times`]) recorded on its candidate.
pub(super) fn with_step_times(mut entry: Entry, timed: &[(Point, f64)], chosen: &Point) -> Entry {
    for c in &mut entry.candidates {
        if let Some((_, ms)) = timed.iter().find(|(p, _)| c.is_point(&p.0, &p.1)) {
            c.step_ms = Some(*ms);
        }
    }
    if (&entry.family, &entry.params) != (&chosen.0, &chosen.1) {
        if let Some(c) = entry.candidates.iter().find(|c| c.is_point(&chosen.0, &chosen.1)) {
            entry.median_ms = c.median_ms.unwrap_or(entry.median_ms);
            entry.spread_ms = c.spread_ms.unwrap_or(0.0);
        }
        entry.family = chosen.0.clone();
        entry.params = chosen.1.clone();
    }
    entry
}

/// Times the near-ties of every attention bucket and every matmul of a greedy decode step of
/// each batch of `cfg` in `dtype` on GPU 0 on the graph engine, and stores each key's choice
/// ([`step_choice`]) as its winner in the GPU's default tuning database (which `tune --model`
/// filled). With `reuse`, what was timed in the step before is read back.
pub(super) fn tune_decode_points(
    root: &Path,
    cfg: &GPT2Config,
    dtype: Dtype,
    batches: &[usize],
    seed: u64,
    reuse: bool,
) -> Result<Vec<InStep>> {
    // The database is found from the GPU and NVRTC; a backend is built only when something is
    // timed (a run on a database that holds the step times answers in a second).
    let device = Gpu::new(0).context("opening GPU 0")?;
    let compiler = Compiler::new(&device.info.arch()).context("setting up NVRTC")?;
    let header = DbHeader::for_device(&device, &compiler);
    let db_path = default_path(&header);
    let mut db = TuningDb::open(&db_path, header)?;
    let mut backend: Option<GpuBackend> = None;
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let open_backend = |backend: &mut Option<GpuBackend>| -> Result<()> {
        if backend.is_none() {
            let model = Arc::new(GPT2Model {
                config: cfg.clone(),
                weights: GPT2Weights::random(cfg, seed),
                source: "random weights (decode kernels by whole steps)".into(),
            });
            let mut gpu = GpuBackend::with_root(root, model, max_batch, false, dtype).context("opening GPU 0")?;
            gpu.set_decode_engine(DecodeEngine::Graph)?;
            *backend = Some(gpu);
        }
        Ok(())
    };
    let buckets = decode_context_buckets(cfg.n_ctx);
    let mut out = Vec::new();
    for &b in batches {
        // Decode attention, bucket by bucket.
        let workloads = decode_attention_workloads(&cfg.dims(), b as i64, dtype);
        for (i, (workload, &len)) in workloads.iter().zip(&buckets).enumerate() {
            let below = if i == 0 { 0 } else { buckets[i - 1] };
            let Some(run) = bucket_run(below, len) else {
                continue;
            };
            let key = workload.key();
            let Some(entry) = db.get(&key).cloned() else {
                eprintln!(
                    "decode attention, batch {b}, cache up to {len}: not in {} (tune --model first); left to the default",
                    db_path.display()
                );
                continue;
            };
            if reuse && entry.candidates.iter().any(|c| c.step_ms.is_some()) {
                out.push(InStep::new(
                    b,
                    "attention",
                    key.text(),
                    Some(len),
                    run,
                    read_back(&entry),
                    true,
                ));
                continue;
            }
            let ties = near_ties(&entry);
            if ties.len() < 2 {
                continue;
            }
            open_backend(&mut backend)?;
            let gpu = backend.as_mut().expect("opened");
            let what = format!("decode attention, batch {b}, cache up to {len}");
            let outcome = choose_in_steps(gpu, &mut db, &db_path, b, &key, entry, &ties, run, &what)?;
            out.push(InStep::new(b, "attention", key.text(), Some(len), run, outcome, false));
        }

        // The step's matmuls, after the first bucket's prompt.
        let Some(run) = buckets.first().and_then(|&len| bucket_run(0, len)) else {
            continue;
        };
        if reuse {
            // Chosen before: the batch's decode matmuls that hold step times.
            let settled: Vec<(&String, &Entry)> = db
                .entries()
                .filter(|(k, e)| is_decode_matmul_of(k, e, dtype, b))
                .filter(|(_, e)| e.candidates.iter().any(|c| c.step_ms.is_some()))
                .collect();
            if !settled.is_empty() {
                // Each one's role from its shape (the database keeps a description, not the
                // name), the rows in the step's order.
                let dims = cfg.dims();
                let mut rows: Vec<(&'static str, &String, &Entry)> = settled
                    .into_iter()
                    .map(|(key, entry)| {
                        let dim = |name| entry.shape.get(name).map_or(0, |&v| v as usize);
                        (dims.matmul_role(dim("N"), dim("K")).unwrap_or("matmul"), key, entry)
                    })
                    .collect();
                rows.sort_by_key(|(role, _, _)| {
                    MATMUL_ROLES
                        .iter()
                        .position(|r| r == role)
                        .unwrap_or(MATMUL_ROLES.len())
                });
                for (role, key, entry) in rows {
                    out.push(InStep::new(b, role, key.clone(), None, run, read_back(entry), true));
                }
                continue;
            }
        }
        open_backend(&mut backend)?;
        let gpu = backend.as_mut().expect("opened");
        let matmuls = gpu
            .decode_step_matmuls(b)
            .with_context(|| format!("the matmuls of a decode step of {b}"))?;
        for (role, key) in matmuls {
            let Some(entry) = db.get(&key).cloned() else {
                continue; // not tuned: the family default runs
            };
            let ties = near_ties(&entry);
            if ties.len() < 2 {
                continue;
            }
            let what = format!("decode {role}, batch {b}");
            let outcome = choose_in_steps(gpu, &mut db, &db_path, b, &key, entry, &ties, run, &what)?;
            out.push(InStep::new(b, role, key.text(), None, run, outcome, false));
        }
    }
    Ok(out)
}

/// Times `ties`, `entry`'s near-ties ([`near_ties`]), as the kernel of `key` in greedy steps of `b` sequences
/// ([`time_in_steps`]), stores the step's choice ([`step_choice`]) as the key's winner with every
/// timed point's step time, and saves the database: the winner alone with its step time, the
/// choice with its own, and how many points were timed.
#[allow(clippy::too_many_arguments)]
fn choose_in_steps(
    gpu: &mut GpuBackend,
    db: &mut TuningDb,
    db_path: &Path,
    b: usize,
    key: &TuneKey,
    entry: Entry,
    ties: &[Point],
    run: (usize, usize),
    what: &str,
) -> Result<Outcome> {
    let timed = paired_step_times(&time_in_steps(gpu, b, key, run, ties, what)?);
    let (chosen, chosen_ms) = step_choice(&timed);
    db.insert(key, with_step_times(entry, &timed, &chosen));
    db.save()
        .with_context(|| format!("saving {what} to {}", db_path.display()))?;
    // timed in the order of `ties`: the winner alone first
    Ok(((ties[0].clone(), Some(timed[0].1)), (chosen, chosen_ms), timed.len()))
}

/// Whether the entry `key` is a matmul of a decode step of `b` sequences (one row a sequence)
/// in `dtype`, the model's: in the dtype its matmuls run in at that row count.
fn is_decode_matmul_of(key: &str, entry: &Entry, dtype: Dtype, b: usize) -> bool {
    let rows = b as i64;
    key.starts_with(&format!("matmul|{}|", kernel_dtype("matmul", Some(rows), dtype)))
        && entry.shape.get("M") == Some(&rows)
        && entry.shape.get("T") == Some(&1)
}

/// What an entry chosen in the step before says: its winner (with its step time), which is the
/// point timed as the winner alone unless another replaced it, and how many were timed.
fn read_back(entry: &Entry) -> Outcome {
    let chosen: Point = (entry.family.clone(), entry.params.clone());
    let step_ms = entry
        .candidates
        .iter()
        .find(|c| c.is_point(&chosen.0, &chosen.1))
        .and_then(|c| c.step_ms)
        .unwrap_or(f64::NAN);
    let timed = entry.candidates.iter().filter(|c| c.step_ms.is_some()).count();
    ((chosen.clone(), None), (chosen, step_ms), timed)
}

/// Each of `ties` as the kernel of `key`, timed in greedy steps of `b` sequences (`prompt`,
/// `steps`): [`ROUNDS`] rounds of every point in turn (forwards, then backwards, so that a drift
/// within a round weighs on the first and the last alike), each point's GPU ms a step in every
/// round. The GPU time, not the wall time: the points share the engine's host path, and the
/// host's jitter would only blur them.
fn time_in_steps(
    gpu: &mut GpuBackend,
    b: usize,
    key: &TuneKey,
    (prompt, steps): (usize, usize),
    ties: &[Point],
    what: &str,
) -> Result<Vec<(Point, Vec<f64>)>> {
    let bar = ProgressBar::new((ties.len() * ROUNDS) as u64).with_style(
        ProgressStyle::with_template("{bar:20} {pos}/{len} {prefix}: {msg} ({elapsed})")
            .expect("a valid progress template"),
    );
    bar.set_prefix(what.to_string());
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); ties.len()];
    for round in 0..ROUNDS {
        let mut order: Vec<usize> = (0..ties.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let ((family, params), times) = (&ties[i], &mut runs[i]);
            bar.set_message(format!("{family} {}", point_text(params)));
            let point: Vec<(String, i64)> = params.iter().map(|(k, v)| (k.clone(), *v)).collect();
            gpu.set_step_point(key, Some((family.clone(), point)));
            let ms = gpu.time_greedy_decode(b, &[prompt], steps, 1).with_context(|| {
                format!(
                    "{what}: decode steps after {prompt} tokens with {family} {}",
                    point_text(params)
                )
            })?;
            times.push(ms.gpu_ms);
            bar.inc(1);
        }
    }
    gpu.set_step_point(key, None);
    bar.finish_and_clear();
    Ok(ties.iter().cloned().zip(runs).collect())
}

impl InStep {
    /// The row of `batch`'s step for the kernel `role` stored under `key` (`bucket`: an
    /// attention bucket's longest cache), timed in `run` (prompt, steps).
    fn new(
        batch: usize,
        role: &'static str,
        key: String,
        bucket: Option<usize>,
        (prompt, steps): (usize, usize),
        (alone, chosen, timed): Outcome,
        from_db: bool,
    ) -> InStep {
        InStep {
            batch,
            role,
            key,
            bucket,
            prompt,
            steps,
            alone,
            chosen,
            timed,
            from_db,
        }
    }

    /// Whether the step chose another point than the one that won alone.
    pub fn switched(&self) -> bool {
        self.chosen.0 != self.alone.0
    }

    /// Which kernel, for a person: `attention <=128`, `qkv: ln_qkv 2304x768` (the matmul's
    /// epilogue and N x K, from its key).
    pub fn what(&self) -> String {
        if let Some(len) = self.bucket {
            return format!("attention <={len}");
        }
        let mut fields = self.key.split('|');
        let kind = fields.nth(2).unwrap_or("?");
        let dim = |name: &str| {
            self.key
                .split(['|', ' '])
                .find_map(|f| f.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .unwrap_or("?")
                .to_string()
        };
        let matmul = format!("{kind} {}x{}", dim("N"), dim("K"));
        if self.role == "matmul" {
            matmul
        } else {
            format!("{}: {matmul}", self.role)
        }
    }

    /// The `decode_attention` and `decode_matmul` rows of `tune --json`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "batch": self.batch,
            "role": self.role,
            "key": self.key,
            "cache_up_to": self.bucket,
            "prompt": self.prompt,
            "steps": self.steps,
            "winner_alone": { "family": self.alone.0 .0, "params": self.alone.0 .1, "ms_per_step": self.alone.1 },
            "chosen": { "family": self.chosen.0 .0, "params": self.chosen.0 .1, "ms_per_step": self.chosen.1 },
            "points_timed": self.timed,
            "from_db": self.from_db,
        })
    }
}

/// The table `tune --decode-step` prints for the kernels chosen by whole steps.
pub(super) fn points_table(rows: &[InStep]) -> String {
    let mut s = format!(
        "decode kernels by whole steps (greedy, GPU ms a step, paired by round with the winner alone; the winner alone and the candidates within {:.0}% of it)\n\
         batch  kernel                          steps    alone ms  chosen ms  point the step runs\n",
        (NEAR - 1.0) * 100.0
    );
    for r in rows {
        let alone = r.alone.1.map_or("-".to_string(), |ms| format!("{ms:.3}"));
        let verdict = if r.from_db {
            "from the database".to_string()
        } else if r.switched() {
            format!("{} points; the winner alone was {}", r.timed, point_text(&r.alone.0 .1))
        } else {
            format!("{} points; the winner alone kept", r.timed)
        };
        s.push_str(&format!(
            "{:>5}  {:<31} {:>4}+{:<3} {:>8} {:>10}  {} {} ({verdict})\n",
            r.batch,
            r.what(),
            r.prompt,
            r.steps,
            alone,
            format!("{:.3}", r.chosen.1),
            r.chosen.0 .0,
            point_text(&r.chosen.0 .1),
        ));
    }
    s
}

#[cfg(test)]
mod tests;
