//! The autotuner: for every workload, search the variants of every family of its op that
//! support the shape (see `search`: a first round from defaults, database seeds and samples,
//! then a climb of one-parameter steps, then successive halving), each compiled, screened from
//! its ptxas resources, verified against the f64 reference and timed on the real shape (see
//! `evaluate`), and record the winner, every candidate's fate and the vendor peer measured
//! beside it (cuBLASLt with its fused epilogue, cuBLAS + a split kernel for qkv) in the tuning
//! database.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::baseline::CublasBaseline;
use super::candidates::{Inputs, WorkloadSearch};
use super::climb;
use super::db::{Entry, TuningDb};
use super::evaluate::Evaluator;
pub use super::evaluate::Phases;
use super::registry::variant_kind;
use super::search;
use super::workloads::Workload;
use crate::codegen::Renderer;
use crate::gpu::{Compiler, Gpu};
use crate::ops::{self, Problem, Shape};
use crate::spec::{Catalog, Dtype, Variant};

/// Knobs of a tuning run.
#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// Wall-clock budget for the whole run (compiles included): the climb stops at 80% of it
    /// (the finals and the peers take the rest). The search usually ends well before, when a
    /// round stops paying.
    pub budget: Duration,
    pub seed: u64,
    /// Re-tune workloads the database already has.
    pub force: bool,
    /// Measure the vendor peer (cuBLASLt / cuBLAS, see `baseline`) beside matmuls.
    pub baseline: bool,
    /// Measure every valid variant of every family (no search, no budget): slow, the
    /// reference the search is checked against.
    pub exhaustive: bool,
}

/// One candidate's fate.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Tried {
    pub family: String,
    pub variant: String,
    /// Median time on the real shape; `None` when rejected.
    pub median_ms: Option<f64>,
    /// Why it was excluded (compile, launch or verification failure).
    pub rejected: Option<String>,
}

/// The outcome for one workload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TuneResult {
    pub role: String,
    pub op: String,
    pub dtype: Dtype,
    pub variant_kind: String,
    pub shape: Shape,
    pub winner: Option<Entry>,
    /// Taken from the database without measuring.
    pub from_db: bool,
    pub tried: Vec<Tried>,
    /// Floating-point operations and bytes moved by one call, for the throughput columns.
    pub flops: f64,
    pub bytes: f64,
}

/// What a tuning run returns: a result per workload, in the order given, and where the time
/// went.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TuneRun {
    pub results: Vec<TuneResult>,
    pub phases: Phases,
}

/// Progress callbacks, so the CLI can draw bars and tests can stay quiet.
pub trait Progress: Sync {
    fn stage(&self, _message: &str, _total: u64) {}
    fn advance(&self, _message: &str) {}
}

/// No progress output.
pub struct Quiet;
impl Progress for Quiet {}

/// Work of one call: 2·M·N·K for a matmul, 4·B·NH·T²·HS (halved when causal) for attention,
/// none for the memory-bound ops.
pub fn workload_flops(w: &Workload) -> f64 {
    let s = |k: &str| w.shape.get(k).copied().unwrap_or(0) as f64;
    match w.op {
        "matmul" => 2.0 * s("M") * s("N") * s("K"),
        "attention" => {
            let full = 4.0 * s("B") * s("NH") * s("T") * s("T") * s("HS");
            if w.mask == ops::Mask::Causal {
                full / 2.0
            } else {
                full
            }
        }
        _ => 0.0,
    }
}

/// Bytes one call must move at least: the embedding reads only B·T rows of the token table;
/// every other op reads its inputs and writes its outputs once.
pub fn workload_bytes(w: &Workload, problem: &Problem) -> f64 {
    let s = |k: &str| w.shape.get(k).copied().unwrap_or(0) as f64;
    match w.op {
        "encoder" => 4.0 * s("B") * s("T") * (3.0 * s("C") + 1.0),
        _ => super::time::problem_bytes(problem) as f64,
    }
}

/// The shape a candidate is verified on: the workload's own, with the row count capped so the
/// f64 CPU reference stays cheap (timing always uses the real shape).
pub fn verification_shape(w: &Workload) -> Shape {
    let mut s = w.shape.clone();
    let get = |s: &Shape, k: &str| s.get(k).copied().unwrap_or(1);
    match w.op {
        "matmul" => {
            let work = get(&s, "N") * get(&s, "K");
            let rows = (2_000_000_000 / work.max(1)).clamp(16, 512);
            if w.epilogue.after_product() == ops::Epilogue::Qkv {
                let t = get(&s, "T").min(rows).max(1);
                s.insert("T".into(), t);
                s.insert("M".into(), t);
            } else {
                let m = get(&s, "M").min(rows);
                s.insert("M".into(), m);
                s.insert("T".into(), m);
            }
        }
        "attention" => {
            s.insert("B".into(), 1);
            s.insert("NH".into(), get(&s, "NH").min(2));
        }
        "encoder" => {
            s.insert("B".into(), 1);
        }
        "attention_decode" => {
            // every (sequence, head) runs the same code: a few sequences check the kernel
            s.insert("B".into(), get(&s, "B").min(4));
        }
        "layernorm" | "softmax" => {
            s.insert("N".into(), get(&s, "N").min(512));
        }
        _ => {
            if let Some(n) = s.get_mut("N") {
                *n = (*n).min(1 << 20);
            }
        }
    }
    s
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Tunes `workloads`, saving each winner to `db` (a killed run keeps the workloads it
/// finished). Workloads already in `db` are reported from it unless `force`.
///
/// All workloads to tune advance together, round by round, so that each round's kernels
/// compile in one parallel batch (one variant often serves several shapes): the first round
/// ([`search::first_round`]: defaults, seeds from neighbouring shapes in `db`, a sample of each
/// family), then a climb of one-parameter steps from each workload's best points, and from the
/// best points of its sibling workloads (same op), until a round gains less than
/// [`search::MIN_GAIN`] or the budget is spent; then successive halving among each workload's
/// fastest. `options.exhaustive` measures every workload's whole pool instead, one workload
/// after the other, with no budget.
#[allow(clippy::too_many_arguments)]
pub fn tune(
    gpu: &Gpu,
    compiler: &Compiler,
    renderer: &Renderer,
    catalog: &Catalog,
    db: &mut TuningDb,
    workloads: &[Workload],
    options: &TuneOptions,
    progress: &dyn Progress,
) -> Result<TuneRun, String> {
    let started = Instant::now();
    let limits = gpu.info.limits;
    let mut eval = Evaluator::new(gpu, compiler, renderer);
    let todo: Vec<(usize, &Workload)> = workloads
        .iter()
        .enumerate()
        .filter(|(_, w)| options.force || db.get(&w.key()).is_none())
        .collect();

    // Inputs, references and the families' variants on the CPU, all in parallel; then uploads.
    let prepare_started = Instant::now();
    progress.stage("preparing inputs", todo.len() as u64);
    let todo_workloads: Vec<&Workload> = todo.iter().map(|(_, w)| *w).collect();
    let (inputs, pools) = rayon::join(
        || {
            todo.par_iter()
                .map(|(i, w)| {
                    let inputs = Inputs::new(w, options.seed ^ 0x5eed ^ *i as u64);
                    progress.advance(&w.role);
                    inputs
                })
                .collect::<Result<Vec<Inputs>, _>>()
        },
        || search::Pools::new(catalog, &todo_workloads, &limits),
    );
    let (inputs, pools) = (inputs?, pools?);
    let mut states: Vec<WorkloadSearch> = Vec::with_capacity(todo.len());
    for ((_, w), inputs) in todo.iter().zip(inputs) {
        states.push(WorkloadSearch::new(gpu, w, inputs, pools.pool(w, &limits))?);
    }
    let cublas = if options.baseline && todo.iter().any(|(_, w)| w.op == "matmul") {
        Some(CublasBaseline::new(gpu, compiler, renderer).map_err(|e| e.to_string())?)
    } else {
        None
    };
    eval.phases.prepare_s += prepare_started.elapsed().as_secs_f64();

    // Exhaustive: one workload at a time, each saved as soon as it is measured (a long run that
    // is stopped keeps what it finished). Search: all workloads advance together, round by
    // round (the first round, then the climb), and are finished at the end (a minute or two).
    let mut finished: Vec<Option<TuneResult>> = vec![None; states.len()];
    if options.exhaustive {
        for (s, slot) in states.iter_mut().zip(finished.iter_mut()) {
            progress.stage(&s.title(), s.pool.len() as u64);
            let pool = vec![s.pool.clone()];
            compile_and_measure(&mut eval, std::slice::from_mut(s), pool, progress)?;
            *slot = Some(finish(s, &mut eval, cublas.as_ref(), db, progress)?);
        }
    } else {
        let first: Vec<Vec<Variant>> = states
            .iter()
            .map(|s| search::first_round(&s.pool, &search::seeds_from_db(db, &s.key, &s.pool), options.seed))
            .collect();
        let climb_deadline = started + options.budget.mul_f64(0.8);
        climb::run_rounds(&mut states, first, &limits, |states, round, lists| {
            let label = match round {
                0 => "first round".to_string(),
                r => format!("climb {r}"),
            };
            let shapes = lists.iter().filter(|n| !n.is_empty()).count();
            let pairs: usize = lists.iter().map(Vec::len).sum();
            progress.stage(
                &format!("{label}: {pairs} candidates over {shapes} shapes"),
                pairs as u64,
            );
            compile_and_measure(&mut eval, states, lists, progress)?;
            Ok::<bool, String>(Instant::now() < climb_deadline)
        })?;
        for (s, slot) in states.iter_mut().zip(finished.iter_mut()) {
            *slot = Some(finish(s, &mut eval, cublas.as_ref(), db, progress)?);
        }
    }

    // In workload order, those taken from the database included.
    let mut finished = finished.into_iter();
    let results = workloads
        .iter()
        .enumerate()
        .map(|(index, w)| match todo.iter().any(|(i, _)| *i == index) {
            true => finished.next().flatten().expect("each tuned workload finished once"),
            false => result_for(w, db.get(&w.key()).cloned(), true, Vec::new(), 0.0),
        })
        .collect();
    Ok(TuneRun {
        results,
        phases: eval.phases,
    })
}

/// Compiles the variants of every workload's list in one batch and measures each on its
/// workload as soon as its compile lands (see [`Evaluator::compile_streaming`]).
fn compile_and_measure(
    eval: &mut Evaluator,
    states: &mut [WorkloadSearch],
    lists: Vec<Vec<Variant>>,
    progress: &dyn Progress,
) -> Result<(), String> {
    let mut waiting: HashMap<String, Vec<(usize, Variant)>> = HashMap::new();
    for (i, list) in lists.into_iter().enumerate() {
        for v in list {
            waiting.entry(v.kernel_name()).or_default().push((i, v));
        }
    }
    let batch: Vec<Variant> = waiting.values().flatten().map(|(_, v)| v.clone()).collect();
    eval.compile_streaming(&batch, |eval, name| {
        for (i, v) in waiting.remove(name).unwrap_or_default() {
            states[i].measure(eval, vec![v], true, progress)?;
        }
        Ok(())
    })
}

/// Finishes one workload: the pruned candidates after all if nothing else ran, the halving
/// rounds, the vendor peer (cuBLASLt with its fused epilogue; cuBLAS + split kernel for qkv,
/// checked on the verification rows of the real problem, then timed in turns with the
/// finalists: see [`WorkloadSearch::finals`]), the winner saved.
fn finish(
    s: &mut WorkloadSearch,
    eval: &mut Evaluator,
    cublas: Option<&CublasBaseline>,
    db: &mut TuningDb,
    progress: &dyn Progress,
) -> Result<TuneResult, String> {
    let w = s.workload;
    progress.stage(&format!("{} (finals)", s.title()), 1);
    s.measure_pruned_if_nothing_ran(eval, progress)?;
    // The peer is set up and checked first, then timed in turns with the finalists.
    let peer_started = Instant::now();
    let prepared = match (cublas, w.op) {
        (Some(c), "matmul") => {
            let rows = s.inputs.check_shape.get("M").copied().unwrap_or(1).max(1) as usize;
            Some(
                c.prepare_matmul(eval.gpu, &s.inputs.problem, w.dtype, rows)
                    .map_err(|e| e.to_string())?,
            )
        }
        _ => None,
    };
    eval.phases.peer_s += peer_started.elapsed().as_secs_f64();
    let ready = prepared.as_ref().and_then(|p| p.as_ref().ok());
    let finals = s.finals(eval, ready.map(|r| r.contestant(eval.gpu)))?;
    let peer = match (&prepared, finals.peer) {
        (Some(Ok(ready)), Some(t)) => Some(ready.timed(t)),
        (Some(Err(unavailable)), _) => Some(unavailable.clone()),
        _ => None,
    };
    let winner = finals.best.map(|(v, t)| Entry {
        family: v.family.name.clone(),
        params: v.params.clone(),
        shape: w.shape.clone(),
        median_ms: t.median_ms,
        spread_ms: t.spread_ms(),
        baseline_ms: peer.as_ref().and_then(|p| p.outcome.as_ref().ok().map(|t| t.median_ms)),
        baseline: peer.as_ref().map(|p| p.peer.to_string()),
        baseline_unavailable: peer.as_ref().and_then(|p| p.outcome.as_ref().err().cloned()),
        variants_tried: s.tried.len(),
        tuned_at: unix_now(),
        role: Some(w.role.clone()),
        flops: workload_flops(w),
        bytes: s.bytes,
        candidates: std::mem::take(&mut s.kept),
    });
    if let Some(e) = &winner {
        db.insert(&s.key, e.clone());
        db.save().map_err(|e| e.to_string())?;
    }
    Ok(result_for(w, winner, false, std::mem::take(&mut s.tried), s.bytes))
}

fn result_for(w: &Workload, winner: Option<Entry>, from_db: bool, tried: Vec<Tried>, bytes: f64) -> TuneResult {
    TuneResult {
        role: w.role.clone(),
        op: w.op.to_string(),
        dtype: w.dtype,
        variant_kind: variant_kind(w.epilogue, w.mask).to_string(),
        shape: w.shape.clone(),
        winner,
        from_db,
        tried,
        flops: workload_flops(w),
        bytes,
    }
}
