//! `kernelforge tune --model M --decode-step`, first part: the decode attention kernel of each
//! cache-length bucket, chosen by whole decode steps among the near-ties `tune --model` timed
//! alone.
//!
//! `tune --model` times decode attention alone, at the longest cache of each bucket. Points
//! within a few percent of each other there can differ more than that in the step, where the
//! kernel follows the QKV projection's GEMM and the cache is shorter (batch 256 of GPT-2 small,
//! H200: one warp a block won alone by 0.3% and cost the step 2.4%). So for each batch and
//! bucket, the winner and the candidates within [`NEAR`] of it are timed in greedy decode steps
//! whose caches stay inside the bucket, in rounds, and the fastest, when it beats the winner alone
//! by more than [`MARGIN`], becomes the bucket's winner in the database; every timed candidate keeps its
//! `step_ms`, so a reader sees why the bucket runs what it runs.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use indexmap::IndexMap;
use indicatif::{ProgressBar, ProgressStyle};

use crate::gpu::{Compiler, Gpu};
use crate::model::gpu::{point_text, GpuBackend};
use crate::model::{DecodeEngine, GPT2Config, GPT2Model, GPT2Weights};
use crate::ops::model_dims::decode_context_buckets;
use crate::spec::Dtype;
use crate::tune::db::{default_path, DbHeader, Entry, TuningDb};
use crate::tune::workloads::decode_attention_workloads;

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
/// Rounds of timing (every point once a round).
const ROUNDS: usize = 5;

/// A candidate as the step runs it: family and every parameter of its point.
type Point = (String, IndexMap<String, i64>);

/// One (batch, bucket)'s outcome.
pub(super) struct AttentionInStep {
    pub batch: usize,
    /// The bucket's longest cache.
    pub bucket: usize,
    /// The prompt before the timed steps, and how many steps (their caches stay in the bucket).
    pub prompt: usize,
    pub steps: usize,
    /// The winner alone (before this run) and the candidate the step chose, each with its
    /// wall ms per step (`None` for a winner alone that was not timed in the step).
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

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// `entry` with `chosen` as its winner (its time alone from the candidates) and each timed
/// point's wall ms per step recorded on its candidate.
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

/// Times the near-ties of every (batch, bucket) of `cfg` in `dtype` on GPU 0 in greedy decode
/// steps on the graph engine, and stores each bucket's choice ([`step_choice`]) as its winner
/// in the GPU's default tuning database (which `tune --model` filled). With `reuse`, a bucket
/// whose candidates were timed in the step before is read back.
pub(super) fn tune_decode_attention(
    root: &Path,
    cfg: &GPT2Config,
    dtype: Dtype,
    batches: &[usize],
    seed: u64,
    reuse: bool,
) -> Result<Vec<AttentionInStep>> {
    // The database is found from the GPU and NVRTC; a backend is built only when a bucket is
    // timed (a run on a database that holds every bucket's step times answers in a second).
    let device = Gpu::new(0).context("opening GPU 0")?;
    let compiler = Compiler::new(&device.info.arch()).context("setting up NVRTC")?;
    let header = DbHeader::for_device(&device, &compiler);
    let db_path = default_path(&header);
    let mut db = TuningDb::open(&db_path, header)?;
    let mut backend: Option<GpuBackend> = None;
    let buckets = decode_context_buckets(cfg.n_ctx);
    let mut out = Vec::new();
    for &b in batches {
        let workloads = decode_attention_workloads(&cfg.dims(), b as i64, dtype);
        for (i, (workload, &len)) in workloads.iter().zip(&buckets).enumerate() {
            let below = if i == 0 { 0 } else { buckets[i - 1] };
            let Some((prompt, steps)) = bucket_run(below, len) else {
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
            let ties = near_ties(&entry);
            let alone = ties[0].clone();
            if reuse && entry.candidates.iter().any(|c| c.step_ms.is_some()) {
                let step_ms = entry
                    .candidates
                    .iter()
                    .find(|c| c.is_point(&alone.0, &alone.1))
                    .and_then(|c| c.step_ms);
                out.push(AttentionInStep {
                    batch: b,
                    bucket: len,
                    prompt,
                    steps,
                    chosen: (alone.clone(), step_ms.unwrap_or(f64::NAN)),
                    alone: (alone, None),
                    timed: entry.candidates.iter().filter(|c| c.step_ms.is_some()).count(),
                    from_db: true,
                });
                continue;
            }
            if ties.len() < 2 {
                continue;
            }
            let gpu = match &mut backend {
                Some(gpu) => gpu,
                None => {
                    let model = Arc::new(GPT2Model {
                        config: cfg.clone(),
                        weights: GPT2Weights::random(cfg, seed),
                        source: "random weights (decode attention by whole steps)".into(),
                    });
                    let max_batch = batches.iter().copied().max().unwrap_or(1);
                    let mut gpu =
                        GpuBackend::with_root(root, model, max_batch, false, dtype).context("opening GPU 0")?;
                    gpu.set_decode_engine(DecodeEngine::Graph)?;
                    backend.insert(gpu)
                }
            };
            let timed = time_in_steps(gpu, b, len, (prompt, steps), &ties)?;
            let (chosen, chosen_ms) = step_choice(&timed);
            db.insert(&key, with_step_times(entry, &timed, &chosen));
            db.save()
                .with_context(|| format!("saving decode attention of batch {b} to {}", db_path.display()))?;
            out.push(AttentionInStep {
                batch: b,
                bucket: len,
                prompt,
                steps,
                alone: (alone, Some(timed[0].1)), // timed in the order of `ties`
                chosen: (chosen, chosen_ms),
                timed: timed.len(),
                from_db: false,
            });
        }
    }
    Ok(out)
}

/// Each of `ties` as bucket `len`'s attention, timed in greedy steps of `b` sequences
/// (`prompt`, `steps`): [`ROUNDS`] rounds of every point in turn, so that a drift of the clocks
/// or the host weighs on all of them alike, and each point's median over the rounds.
fn time_in_steps(
    gpu: &mut GpuBackend,
    b: usize,
    len: usize,
    (prompt, steps): (usize, usize),
    ties: &[Point],
) -> Result<Vec<(Point, f64)>> {
    let bar = ProgressBar::new((ties.len() * ROUNDS) as u64).with_style(
        ProgressStyle::with_template("{bar:20} {pos}/{len} decode attention, {prefix}: {msg} ({elapsed})")
            .expect("a valid progress template"),
    );
    bar.set_prefix(format!("batch {b}, cache up to {len}"));
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); ties.len()];
    for _ in 0..ROUNDS {
        for ((family, params), times) in ties.iter().zip(&mut runs) {
            bar.set_message(format!("{family} {}", point_text(params)));
            let point: Vec<(String, i64)> = params.iter().map(|(k, v)| (k.clone(), *v)).collect();
            gpu.set_decode_attention_point(len, Some((family.clone(), point)));
            let ms = gpu.time_greedy_decode(b, &[prompt], steps, 1).with_context(|| {
                format!(
                    "batch {b}: decode steps after {prompt} tokens with {family} {}",
                    point_text(params)
                )
            })?;
            times.push(ms);
            bar.inc(1);
        }
    }
    gpu.set_decode_attention_point(len, None);
    bar.finish_and_clear();
    Ok(ties.iter().cloned().zip(runs.into_iter().map(median)).collect())
}

impl AttentionInStep {
    /// Whether the step chose another point than the one that won alone.
    pub fn switched(&self) -> bool {
        self.chosen.0 != self.alone.0
    }

    /// The `decode_attention` rows of `tune --json`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "batch": self.batch,
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

/// The table `tune --decode-step` prints for decode attention.
pub(super) fn attention_table(rows: &[AttentionInStep]) -> String {
    let mut s = format!(
        "decode attention by whole steps (greedy, wall ms per step; the winner alone and the candidates within {:.0}% of it)\n\
         batch  cache    steps    alone ms  chosen ms  kernel the step runs\n",
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
            "{:>5}  <={:<5} {:>4}+{:<3} {:>8} {:>10}  {} {} ({verdict})\n",
            r.batch,
            r.bucket,
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
mod tests {
    use super::*;
    use crate::tune::records::Candidate;

    fn params(warps: i64, rows: i64) -> IndexMap<String, i64> {
        [("keys_per_split", 256), ("warps", warps), ("rows_at_once", rows)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    fn candidate(warps: i64, rows: i64, ms: Option<f64>, rejected: bool) -> Candidate {
        Candidate {
            family: "attention_decode_groups".into(),
            params: params(warps, rows),
            median_ms: ms,
            spread_ms: ms.map(|m| m * 0.01),
            error: Some(1e-3),
            rejected: rejected.then(|| "wrong result".to_string()),
            resources: Vec::new(),
            step_ms: None,
        }
    }

    fn entry() -> Entry {
        let mut e = Entry::timed("attention_decode_groups", params(1, 4), Default::default(), 0.0314);
        e.candidates = vec![
            candidate(1, 4, Some(0.0314), false),
            candidate(4, 1, Some(0.0400), false), // 27% slower alone: not timed
            candidate(4, 2, Some(0.0315), false),
            candidate(8, 2, Some(0.0320), true), // rejected
            candidate(2, 2, Some(0.0322), false),
            candidate(2, 4, Some(0.0325), false), // a fifth near tie: over MOST
            candidate(8, 8, None, false),         // never timed
        ];
        e
    }

    #[test]
    fn the_near_ties_are_the_winner_then_the_fastest_verified_points_within_reach() {
        let ties = near_ties(&entry());
        let warps_rows: Vec<(i64, i64)> = ties.iter().map(|p| (p.1["warps"], p.1["rows_at_once"])).collect();
        assert_eq!(warps_rows, vec![(1, 4), (4, 2), (2, 2), (2, 4)]);
        let mut alone = entry();
        alone.candidates.truncate(2);
        assert_eq!(near_ties(&alone).len(), 1, "no other point within 5%");
    }

    #[test]
    fn the_step_winner_becomes_the_entry_with_its_own_time_alone_and_every_step_time_recorded() {
        let e = entry();
        let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
        let timed = [(point(1, 4), 0.684), (point(4, 2), 0.668), (point(2, 2), 0.671)];
        let chosen = with_step_times(e, &timed, &point(4, 2));
        assert_eq!(chosen.params, params(4, 2));
        assert_eq!(chosen.median_ms, 0.0315);
        let step = |w, r| {
            chosen
                .candidates
                .iter()
                .find(|c| c.params == params(w, r))
                .unwrap()
                .step_ms
        };
        assert_eq!(step(1, 4), Some(0.684));
        assert_eq!(step(4, 2), Some(0.668));
        assert_eq!(step(4, 1), None);
        // the winner alone kept: nothing moves but the step times
        let kept = with_step_times(entry(), &timed[..1], &point(1, 4));
        assert_eq!((kept.params, kept.median_ms), (params(1, 4), 0.0314));
    }

    #[test]
    fn another_point_replaces_the_winner_alone_only_when_clearly_faster_in_the_step() {
        let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
        let timed = [(point(1, 4), 0.607), (point(4, 2), 0.600), (point(2, 2), 0.603)];
        assert_eq!(step_choice(&timed), (point(4, 2), 0.600), "1.2% faster: switched");
        let close = [(point(4, 2), 0.431), (point(2, 4), 0.430)];
        assert_eq!(step_choice(&close), (point(4, 2), 0.431), "0.2% faster: kept");
        let clear = [(point(4, 2), 0.431), (point(2, 4), 0.428)];
        assert_eq!(step_choice(&clear).0, point(2, 4), "0.7% faster: switched");
        let slower = [(point(4, 2), 0.431), (point(2, 4), 0.450)];
        assert_eq!(step_choice(&slower).0, point(4, 2));
    }

    #[test]
    fn every_timed_step_keeps_its_cache_inside_the_bucket() {
        assert_eq!(bucket_run(0, 128), Some((16, 64)));
        assert_eq!(bucket_run(128, 256), Some((129, 64)));
        assert_eq!(bucket_run(512, 1024), Some((513, 64)));
        // a tiny model's one bucket: the steps the context leaves
        assert_eq!(bucket_run(0, 64), Some((16, 48)));
        assert_eq!(bucket_run(0, 20), None);
        for (below, len) in [(0, 128), (128, 256), (256, 300), (0, 64)] {
            let (prompt, steps) = bucket_run(below, len).unwrap();
            assert!(
                prompt + 1 > below && prompt + steps <= len,
                "{below}..{len}: {prompt} + {steps}"
            );
        }
    }

    #[test]
    fn the_table_says_which_point_the_step_chose_and_what_won_alone() {
        let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
        let rows = [
            AttentionInStep {
                batch: 256,
                bucket: 128,
                prompt: 16,
                steps: 64,
                alone: (point(1, 4), Some(0.684)),
                chosen: (point(4, 2), 0.668),
                timed: 4,
                from_db: false,
            },
            AttentionInStep {
                batch: 64,
                bucket: 256,
                prompt: 129,
                steps: 64,
                alone: (point(4, 4), None),
                chosen: (point(4, 4), 0.401),
                timed: 3,
                from_db: true,
            },
        ];
        let t = attention_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[2].contains("0.684") && lines[2].contains("0.668"), "{t}");
        assert!(
            lines[2].contains("warps=4 rows_at_once=2") && lines[2].contains("the winner alone was"),
            "{t}"
        );
        assert!(
            lines[3].contains("from the database") && lines[3].contains("129+64"),
            "{t}"
        );
        assert_eq!(rows[0].json()["chosen"]["params"]["warps"], 4);
        assert!(rows[0].switched() && !rows[1].switched());
    }
}
