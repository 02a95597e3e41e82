//! `kernelforge tune --model M --decode-step`: the decode megakernel's point for each batch,
//! found by timing greedy decode steps of the model's shape (random weights: the time does not
//! depend on their values) and compared with the graph engine timed beside it on the same GPU.
//! The winner goes to the GPU's tuning database under the `decode_step` op, where `generate`
//! and `bench` find it: their default decode engine is then whichever of the two was faster.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::gpu::{Compiler, Gpu};
use crate::model::gpu::{decode_step_key, fitted_default, most_rows, point_text, GpuBackend, MEGAKERNEL_FAMILY};
use crate::model::{DecodeEngine, GPT2Config, GPT2Model, GPT2Weights};
use crate::spec::{Catalog, Dtype};
use crate::tune::db::{default_path, DbHeader, Entry, TuningDb};
use crate::tune::decode_search::{coordinate_descent, Point};
use crate::tune::records::Candidate;
use crate::tune::workloads::op_dtype;

/// Timed steps per run and runs per context (median).
const STEPS: usize = 64;
const REPEATS: usize = 3;
/// Parameters the search does not move: the head size is the model's, and the fewest
/// `max_rows` that hold the batch always win (more rows only cost registers).
const FIXED: [&str; 2] = ["head_dim", "max_rows"];
/// What the database names as the megakernel's peer.
const PEER: &str = "graph engine (the kernel-by-kernel step replayed as a CUDA graph)";

/// The contexts a point is timed at: cache positions before the timed steps, a short prompt
/// and one of three quarters of the model's context. A point's time is the mean of the two: the
/// attention's cut of the cache into chunks (`min_chunk_keys`) only shows in a long context, and
/// a point timed only after a short prompt won by noise there and cost 28% after a 1,000-token
/// one (GPT-2 small, bf16, batch 1, H100).
fn contexts(cfg: &GPT2Config) -> [usize; 2] {
    [64, cfg.n_ctx * 3 / 4]
}

/// One batch's outcome.
pub(super) struct DecodeTuned {
    pub batch: usize,
    pub graph_ms: f64,
    /// The fastest megakernel point and its ms per step.
    pub best: Option<(Point, f64)>,
    pub tried: usize,
    pub refused: usize,
    pub seconds: f64,
    /// Read back from the tuning database, not measured in this run.
    pub from_db: bool,
}

/// Tunes the decode step of `cfg` in `dtype` for each batch of `batches` on GPU 0 and saves each
/// winner into that GPU's default tuning database. With `reuse`, a batch the database already
/// holds is read back instead (no backend is built when every batch is).
pub(super) fn tune_decode_steps(
    root: &Path,
    catalog: &Catalog,
    cfg: &GPT2Config,
    dtype: Dtype,
    batches: &[usize],
    seed: u64,
    reuse: bool,
) -> Result<Vec<DecodeTuned>> {
    let family = catalog.family(MEGAKERNEL_FAMILY)?.clone();
    let device = Gpu::new(0).context("opening GPU 0")?;
    let step_shape = |b: usize| decode_step_key(cfg, dtype, b).shape;
    let most_rows = most_rows(&family, &step_shape, op_dtype(dtype), &device.info.limits).max(1);
    // A batch no point holds runs on the graph engine (`GpuBackend::engine_for`): no engine to
    // choose, nothing to tune; said once, and the rest of the list is tuned.
    let (batches, handed_off): (Vec<usize>, Vec<usize>) = batches.iter().partition(|&&b| b <= most_rows);
    if !handed_off.is_empty() {
        let list: Vec<String> = handed_off.iter().map(ToString::to_string).collect();
        eprintln!(
            "decode step, batch {}: the megakernel holds at most {most_rows} sequences of this model in {dtype} on \
             this GPU (max_rows in specs/{MEGAKERNEL_FAMILY}.toml); these batches decode on the graph engine, \
             nothing to tune",
            list.join(", ")
        );
    }
    let mut out = if reuse {
        stored_decode_steps(&device, cfg, dtype, &batches)?
    } else {
        Vec::new()
    };
    let batches: Vec<usize> = batches
        .into_iter()
        .filter(|b| !out.iter().any(|r| r.batch == *b))
        .collect();
    if batches.is_empty() {
        return Ok(out);
    }
    let model = Arc::new(GPT2Model {
        config: cfg.clone(),
        weights: GPT2Weights::random(cfg, seed),
        source: "random weights (decode-step tuning)".into(),
    });
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let mut gpu = GpuBackend::with_root(root, model, max_batch, false, dtype).context("opening GPU 0")?;
    let header = gpu.tuning_db_header().clone();
    let db_path = default_path(&header);
    let contexts = contexts(cfg);
    for &b in &batches {
        let started = Instant::now();
        let bar = ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} decode step, batch {prefix}: {msg} ({elapsed})")
                .expect("a valid progress template"),
        );
        bar.set_prefix(b.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar.set_message("timing the graph engine");
        gpu.set_decode_engine(DecodeEngine::Graph)?;
        let graph_ms = gpu
            .time_greedy_decode(b, &contexts, STEPS, REPEATS)
            .with_context(|| format!("batch {b}: timing the graph engine"))?
            .wall_ms;

        gpu.set_decode_engine(DecodeEngine::Megakernel)?;
        let mut start: Point = family.default.clone();
        let shape = gpu.decode_step_key(b).shape;
        for (name, value) in fitted_default(&family, &shape, op_dtype(dtype), &gpu.gpu().info.limits) {
            start.insert(name, value);
        }
        let (mut timed, mut best_so_far) = (0, f64::INFINITY);
        let descent = coordinate_descent(&family.params, &start, &FIXED, |point| {
            gpu.set_megakernel_point(point.iter().map(|(k, v)| (k.clone(), *v)).collect());
            let ms = gpu
                .time_greedy_decode(b, &contexts, STEPS, REPEATS)
                .map_err(|e| format!("{e:#}"))?
                .wall_ms;
            timed += 1;
            best_so_far = best_so_far.min(ms);
            bar.set_message(format!(
                "{timed} points, best {best_so_far:.3} ms/step (graph {graph_ms:.3})"
            ));
            Ok(ms)
        });
        gpu.set_megakernel_point(Vec::new());
        bar.finish_and_clear();
        let refused = descent.trials.iter().filter(|t| t.outcome.is_err()).count();
        let candidates: Vec<Candidate> = descent
            .trials
            .iter()
            .map(|t| Candidate {
                family: MEGAKERNEL_FAMILY.to_string(),
                params: t.point.clone(),
                median_ms: t.outcome.as_ref().ok().copied(),
                spread_ms: None,
                error: None,
                rejected: t.outcome.as_ref().err().cloned(),
                resources: Vec::new(),
                step_ms: None,
            })
            .collect();
        if let Some((point, ms)) = &descent.best {
            let key = gpu.decode_step_key(b);
            let entry = Entry {
                family: MEGAKERNEL_FAMILY.to_string(),
                params: point.clone(),
                shape: key.shape.clone(),
                median_ms: *ms,
                spread_ms: 0.0,
                baseline_ms: Some(graph_ms),
                baseline: Some(PEER.to_string()),
                baseline_unavailable: None,
                variants_tried: descent.trials.len(),
                tuned_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                role: Some("decode_step".to_string()),
                flops: 0.0,
                bytes: 0.0,
                candidates,
            };
            let mut db = TuningDb::open(&db_path, header.clone())?;
            db.insert(&key, entry);
            db.save()
                .with_context(|| format!("saving the decode step of batch {b} to {}", db_path.display()))?;
        }
        out.push(DecodeTuned {
            batch: b,
            graph_ms,
            best: descent.best,
            tried: descent.trials.len(),
            refused,
            seconds: started.elapsed().as_secs_f64(),
            from_db: false,
        });
    }
    Ok(out)
}

/// The decode steps of `batches` that GPU 0's default tuning database holds, read back (the
/// database is found from the GPU and NVRTC, without building a backend).
fn stored_decode_steps(gpu: &Gpu, cfg: &GPT2Config, dtype: Dtype, batches: &[usize]) -> Result<Vec<DecodeTuned>> {
    let compiler = Compiler::new(&gpu.info.arch()).context("setting up NVRTC")?;
    let header = DbHeader::for_device(gpu, &compiler);
    let path = default_path(&header);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let db = TuningDb::open(&path, header)?;
    Ok(batches
        .iter()
        .filter_map(|&b| DecodeTuned::from_entry(b, db.get(&decode_step_key(cfg, dtype, b))?))
        .collect())
}

impl DecodeTuned {
    /// A batch's outcome as a previous run stored it (`None` without the graph engine's time).
    fn from_entry(batch: usize, entry: &Entry) -> Option<DecodeTuned> {
        Some(DecodeTuned {
            batch,
            graph_ms: entry.baseline_ms?,
            best: Some((entry.params.clone(), entry.median_ms)),
            tried: entry.variants_tried,
            refused: entry.candidates.iter().filter(|c| c.rejected.is_some()).count(),
            seconds: 0.0,
            from_db: true,
        })
    }

    /// The `decode_step` rows of `tune --json`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "batch": self.batch,
            "graph_ms_per_step": self.graph_ms,
            "megakernel_ms_per_step": self.best.as_ref().map(|b| b.1),
            "megakernel_point": self.best.as_ref().map(|b| b.0.clone()),
            "points_tried": self.tried,
            "points_refused": self.refused,
            "seconds": self.seconds,
            "from_db": self.from_db,
        })
    }
}

/// The table `tune --decode-step` prints: per batch, both engines' ms per step and the winner.
pub(super) fn decode_table(rows: &[DecodeTuned]) -> String {
    let mut s = String::from(
        "decode step (greedy, wall ms per step: the mean after a short and a long prompt)\nbatch  graph ms  megakernel ms  speed vs graph  engine      points  megakernel point\n",
    );
    for r in rows {
        let (mk, ratio, engine, label) = match &r.best {
            Some((point, ms)) => (
                format!("{ms:.3}"),
                format!("{:.2}x", r.graph_ms / ms),
                if *ms < r.graph_ms { "megakernel" } else { "graph" },
                point_text(point),
            ),
            None => ("-".into(), "-".into(), "graph", "no point ran".to_string()),
        };
        let when = if r.from_db {
            "from the database".to_string()
        } else {
            format!("{:.0} s", r.seconds)
        };
        s.push_str(&format!(
            "{:>5} {:>9.3} {:>14} {:>15}  {:<10} {:>3}/{:<3} {label} ({when})\n",
            r.batch,
            r.graph_ms,
            mk,
            ratio,
            engine,
            r.tried - r.refused,
            r.tried
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(slot_kib: i64) -> Point {
        [
            ("threads", 512),
            ("slot_kib", slot_kib),
            ("max_rows", 1),
            ("head_dim", 64),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    #[test]
    fn the_table_names_the_faster_engine_and_the_points_that_ran() {
        let rows = [
            DecodeTuned {
                batch: 1,
                graph_ms: 0.40,
                best: Some((point(48), 0.32)),
                tried: 20,
                refused: 3,
                seconds: 31.0,
                from_db: false,
            },
            DecodeTuned {
                batch: 8,
                graph_ms: 0.70,
                best: Some((point(32), 0.90)),
                tried: 12,
                refused: 0,
                seconds: 20.0,
                from_db: true,
            },
            DecodeTuned {
                batch: 4,
                graph_ms: 0.5,
                best: None,
                tried: 5,
                refused: 5,
                seconds: 2.0,
                from_db: false,
            },
        ];
        let t = decode_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[2].contains("1.25x") && lines[2].contains("megakernel") && lines[2].contains("17/20"),
            "{t}"
        );
        assert!(
            lines[2].contains("threads=512 slot_kib=48 max_rows=1") && !lines[2].contains("head_dim"),
            "{t}"
        );
        assert!(lines[3].contains("0.78x") && lines[3].contains(" graph "), "{t}");
        assert!(
            lines[2].contains("(31 s)") && lines[3].contains("(from the database)"),
            "{t}"
        );
        assert!(lines[4].contains("no point ran") && lines[4].contains("0/5"), "{t}");
        assert_eq!(rows[0].json()["megakernel_point"]["slot_kib"], 48);
    }
}
