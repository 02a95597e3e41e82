//! The autotuner: for every workload, take the candidate variants of every family of its op
//! that support the shape (all of them when the budget allows, else a seeded sample plus the
//! neighbours of the best), verify each against the f64 reference, time the survivors on the
//! real shape, and record the winner (with its vendor peer measured beside it: cuBLASLt with its
//! fused epilogue, cuBLAS + a split kernel for qkv) in the tuning database.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use rand::SeedableRng;

use super::baseline::CublasBaseline;
use super::db::{Candidate, Entry, Resources, TuneKey, TuningDb};
use super::registry::variant_kind;
use super::time::{rotation_count, time_variant, Timing, TimingPlan};
use super::verify::{error_text, run_and_compare, tolerance, RunFailure};
use super::workloads::Workload;
use crate::codegen::{Renderer, Source};
use crate::gpu::{Compiled, Compiler, DeviceProblem, Gpu, LoadedVariant};
use crate::ops::{self, Problem, Shape};
use crate::spec::{expand, variant_with, Catalog, Dtype, Family, Points, Variant};

/// Knobs of a tuning run.
#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// Wall-clock budget for the whole run (compiles included).
    pub budget: Duration,
    pub seed: u64,
    /// Re-tune workloads the database already has.
    pub force: bool,
    /// Measure the vendor peer (cuBLASLt / cuBLAS, see `baseline`) beside matmuls.
    pub baseline: bool,
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
            if w.epilogue == ops::Epilogue::Qkv {
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

/// Variants that differ from `v` in exactly one parameter (valid ones only).
fn neighbours(v: &Variant, limits: &crate::spec::DeviceLimits) -> Vec<Variant> {
    let mut out = Vec::new();
    for (name, values) in &v.family.params {
        for value in values {
            if *value == v.params[name] {
                continue;
            }
            let overrides: Vec<_> = v
                .params
                .iter()
                .map(|(k, x)| (k.clone(), if k == name { *value } else { *x }))
                .collect();
            if let Ok(n) = variant_with(&v.family, &overrides, v.dtype, v.epilogue, v.mask, limits) {
                out.push(n);
            }
        }
    }
    out
}

struct Context<'a> {
    gpu: &'a Gpu,
    compiler: &'a Compiler,
    renderer: &'a Renderer,
    compiled: HashMap<String, Result<Compiled, String>>,
    loaded: HashMap<String, LoadedVariant>,
}

impl Context<'_> {
    /// Renders and compiles (in parallel) every variant not compiled yet.
    fn compile(&mut self, variants: &[Variant], progress: &dyn Progress) {
        let mut sources: Vec<(&Family, Source)> = Vec::new();
        for v in variants {
            let name = v.kernel_name();
            if self.compiled.contains_key(&name) || sources.iter().any(|(_, s)| s.kernel_name == name) {
                continue;
            }
            match self.renderer.render(v) {
                Ok(s) => sources.push((&v.family, s)),
                Err(e) => {
                    self.compiled.insert(name, Err(e.to_string()));
                }
            }
        }
        if sources.is_empty() {
            return;
        }
        progress.stage("compiling", sources.len() as u64);
        let jobs: Vec<_> = sources.iter().map(|(f, s)| (*f, s)).collect();
        let results = self.compiler.compile_all(&jobs, |s| progress.advance(&s.kernel_name));
        for ((_, s), r) in sources.iter().zip(results) {
            self.compiled
                .insert(s.kernel_name.clone(), r.map_err(|e| e.to_string()));
        }
    }

    fn load(&mut self, v: &Variant) -> Result<&LoadedVariant, String> {
        let name = v.kernel_name();
        if !self.loaded.contains_key(&name) {
            let compiled = self
                .compiled
                .get(&name)
                .ok_or("not compiled")?
                .as_ref()
                .map_err(|e| e.clone())?;
            let loaded = LoadedVariant::load(self.gpu, v, compiled).map_err(|e| e.to_string())?;
            self.loaded.insert(name.clone(), loaded);
        }
        Ok(&self.loaded[&name])
    }

    /// Runs `v` on the verification problem; `Ok` is its relative L2 error, `Err` says why it
    /// is excluded.
    fn verify(
        &mut self,
        v: &Variant,
        problem: &Problem,
        device: &mut DeviceProblem,
        reference: &[(usize, Vec<f64>)],
    ) -> Result<f64, String> {
        let gpu = self.gpu;
        let loaded = self.load(v)?;
        match run_and_compare(gpu, loaded, problem, device, reference) {
            Ok(err) if err < tolerance(v.dtype) => Ok(err),
            Ok(err) => Err(format!("wrong result: {}", error_text(v, err))),
            Err(RunFailure::Soft(why)) => Err(why),
            Err(RunFailure::Fault(why)) => Err(format!("kernel fault: {why}")),
        }
    }

    /// Registers, static shared memory and spills of `v`'s kernels, once it is loaded.
    fn resources(&self, v: &Variant) -> Vec<Resources> {
        self.loaded
            .get(&v.kernel_name())
            .and_then(|l| l.resources().ok())
            .map(|r| r.iter().map(Resources::from).collect())
            .unwrap_or_default()
    }

    fn time(
        &mut self,
        v: &Variant,
        problem: &Problem,
        copies: &mut [DeviceProblem],
        plan: &TimingPlan,
    ) -> Result<Timing, String> {
        let gpu = self.gpu;
        let elems = v
            .workspace_elems(&problem.shape, &gpu.info.limits)
            .map_err(|e| e.to_string())?;
        for c in copies.iter_mut() {
            c.ensure_workspace(gpu, elems).map_err(|e| e.to_string())?;
        }
        let loaded = self.load(v)?;
        let launches = loaded.plan(gpu, &problem.shape).map_err(|e| e.to_string())?;
        time_variant(gpu, loaded, problem, copies, &launches, plan).map_err(|e| e.to_string())
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Tunes `workloads`, saving each winner to `db` as soon as it is known (a killed run keeps
/// what it finished). Workloads already in `db` are reported from it unless `force`.
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
) -> Result<Vec<TuneResult>, String> {
    let started = Instant::now();
    let limits = gpu.info.limits;
    let mut ctx = Context {
        gpu,
        compiler,
        renderer,
        compiled: HashMap::new(),
        loaded: HashMap::new(),
    };
    let key_of = |w: &Workload| TuneKey {
        op: w.op.to_string(),
        dtype: w.dtype.to_string(),
        variant_kind: variant_kind(w.epilogue, w.mask).to_string(),
        shape: w.shape.clone(),
    };
    let result_of = |w: &Workload, winner: Option<Entry>, from_db: bool, tried: Vec<Tried>, bytes: f64| TuneResult {
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
    };

    // Candidates per workload still to tune.
    let todo: Vec<&Workload> = workloads
        .iter()
        .filter(|w| options.force || db.get(&key_of(w)).is_none())
        .collect();
    let mut candidates: BTreeMap<usize, Vec<Variant>> = BTreeMap::new();
    // Rough cost of one candidate (compile share + verify + time): sizes the sample.
    let per_candidate_s = 0.06;
    let cap = ((options.budget.as_secs_f64() * 0.6 / per_candidate_s) / todo.len().max(1) as f64).max(8.0) as usize;
    for (i, w) in todo.iter().enumerate() {
        let mut all = Vec::new();
        for f in catalog.for_op(w.op) {
            // Candidates compute in the workload's dtype: tf32 workloads get the tf32
            // variants, f32 workloads the f32 ones.
            if !f.dtypes.contains(&w.dtype) || !f.epilogues.contains(&w.epilogue) || !f.masks.contains(&w.mask) {
                continue;
            }
            let variants = expand(f, Points::All, &limits).map_err(|e| e.to_string())?;
            all.extend(variants.into_iter().filter(|v| {
                v.dtype == w.dtype
                    && v.epilogue == w.epilogue
                    && v.mask == w.mask
                    && v.check_shape(&w.shape, &limits).is_ok()
            }));
        }
        if all.len() > cap {
            // Keep every family's default, then a seeded sample of the rest.
            use rand::seq::SliceRandom;
            let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed ^ i as u64);
            let defaults: Vec<Variant> = all.iter().filter(|v| v.params == v.family.default).cloned().collect();
            let mut rest: Vec<Variant> = all.into_iter().filter(|v| v.params != v.family.default).collect();
            rest.shuffle(&mut rng);
            rest.truncate(cap.saturating_sub(defaults.len()));
            all = defaults.into_iter().chain(rest).collect();
        }
        candidates.insert(i, all);
    }
    let everything: Vec<Variant> = candidates.values().flatten().cloned().collect();
    ctx.compile(&everything, progress);

    let cublas = if options.baseline && todo.iter().any(|w| w.op == "matmul") {
        Some(CublasBaseline::new(gpu, compiler, renderer).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let quick = TimingPlan {
        warmup: 2,
        min_runs: 5,
        max_runs: 20,
        target_ms: 5.0,
    };
    let full = TimingPlan::default();

    let mut results = Vec::new();
    for w in workloads {
        let key = key_of(w);
        let Some(index) = todo.iter().position(|t| std::ptr::eq(*t, w)) else {
            let entry = db.get(&key).cloned();
            results.push(result_of(w, entry, true, Vec::new(), 0.0));
            continue;
        };
        let op = ops::op_by_name(w.op).ok_or_else(|| format!("unknown op {}", w.op))?;
        progress.stage(
            &format!("{} {}", w.role, crate::spec::shape_text(&w.shape)),
            candidates[&index].len() as u64,
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed ^ 0x5eed ^ index as u64);

        // Verify every candidate on fresh inputs against the f64 reference.
        let check_shape = verification_shape(w);
        let check = op
            .problem(&check_shape, w.epilogue, w.mask, &mut rng)
            .map_err(|e| e.to_string())?
            .stored_as(w.dtype.storage());
        let reference = op.reference(&check);
        let mut check_device = DeviceProblem::upload(gpu, &check).map_err(|e| e.to_string())?;
        let problem = op
            .problem(&w.shape, w.epilogue, w.mask, &mut rng)
            .map_err(|e| e.to_string())?
            .stored_as(w.dtype.storage());
        let bytes = workload_bytes(w, &problem);
        let mut copies = (0..rotation_count(&problem))
            .map(|_| DeviceProblem::upload(gpu, &problem))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;

        let mut tried: Vec<Tried> = Vec::new();
        // The same fates as `tried`, with params, error and resources, for the database.
        let mut candidates_kept: Vec<Candidate> = Vec::new();
        let mut timed: Vec<(Variant, Timing)> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut queue = candidates[&index].clone();
        let workload_deadline = started + options.budget.mul_f64((index + 1) as f64 / todo.len() as f64);
        let mut explored_neighbours = false;
        loop {
            for v in std::mem::take(&mut queue) {
                if !seen.insert(v.kernel_name()) {
                    continue;
                }
                progress.advance(&v.key());
                let outcome = ctx
                    .verify(&v, &check, &mut check_device, &reference)
                    .and_then(|err| ctx.time(&v, &problem, &mut copies, &quick).map(|t| (err, t)));
                let mut kept = Candidate {
                    family: v.family.name.clone(),
                    params: v.params.clone(),
                    median_ms: None,
                    spread_ms: None,
                    error: None,
                    rejected: None,
                    resources: ctx.resources(&v),
                };
                match outcome {
                    Ok((err, t)) => {
                        kept.median_ms = Some(t.median_ms);
                        kept.spread_ms = Some(t.spread_ms());
                        kept.error = Some(err);
                        candidates_kept.push(kept);
                        tried.push(Tried {
                            family: v.family.name.clone(),
                            variant: v.key(),
                            median_ms: Some(t.median_ms),
                            rejected: None,
                        });
                        timed.push((v, t));
                    }
                    Err(why) => {
                        if why.starts_with("kernel fault") {
                            return Err(format!(
                                "{}: {why} (the GPU context is unusable; fix the template)",
                                v.kernel_name()
                            ));
                        }
                        kept.rejected = Some(why.clone());
                        candidates_kept.push(kept);
                        tried.push(Tried {
                            family: v.family.name.clone(),
                            variant: v.key(),
                            median_ms: None,
                            rejected: Some(why),
                        });
                    }
                }
            }
            // Spend what is left of this workload's budget around the best points so far.
            if explored_neighbours || Instant::now() >= workload_deadline {
                break;
            }
            explored_neighbours = true;
            timed.sort_by(|a, b| a.1.median_ms.total_cmp(&b.1.median_ms));
            queue = timed
                .iter()
                .take(3)
                .flat_map(|(v, _)| neighbours(v, &limits))
                .filter(|v| v.check_shape(&w.shape, &limits).is_ok() && !seen.contains(&v.kernel_name()))
                .collect();
            if queue.is_empty() {
                break;
            }
            ctx.compile(&queue, progress);
        }

        // Re-time the best quarter (at least 3) with the full plan and pick the fastest.
        timed.sort_by(|a, b| a.1.median_ms.total_cmp(&b.1.median_ms));
        let finalists = timed.len().div_ceil(4).max(3).min(timed.len());
        let mut best: Option<(Variant, Timing)> = None;
        for (v, _) in timed.iter().take(finalists) {
            if let Ok(t) = ctx.time(v, &problem, &mut copies, &full) {
                if best.as_ref().is_none_or(|(_, b)| t.median_ms < b.median_ms) {
                    best = Some((v.clone(), t));
                }
            }
        }
        // The vendor peer (cuBLASLt with its fused epilogue; cuBLAS + split kernel for qkv),
        // checked on the verification row count of the real problem, then timed.
        let peer = match (&cublas, w.op) {
            (Some(c), "matmul") => {
                let rows = check_shape.get("M").copied().unwrap_or(1).max(1) as usize;
                Some(
                    c.measure_matmul(gpu, &problem, w.dtype, &full, rows)
                        .map_err(|e| e.to_string())?,
                )
            }
            _ => None,
        };
        let baseline_ms = peer.as_ref().and_then(|p| p.outcome.as_ref().ok().map(|t| t.median_ms));
        let baseline = peer.as_ref().map(|p| p.peer.to_string());
        let baseline_unavailable = peer.as_ref().and_then(|p| p.outcome.as_ref().err().cloned());
        let winner = best.map(|(v, t)| Entry {
            family: v.family.name.clone(),
            params: v.params.clone(),
            shape: w.shape.clone(),
            median_ms: t.median_ms,
            spread_ms: t.spread_ms(),
            baseline_ms,
            baseline,
            baseline_unavailable,
            variants_tried: tried.len(),
            tuned_at: unix_now(),
            role: Some(w.role.clone()),
            flops: workload_flops(w),
            bytes,
            candidates: candidates_kept,
        });
        if let Some(e) = &winner {
            db.insert(&key, e.clone());
            db.save().map_err(|e| e.to_string())?;
        }
        results.push(result_of(w, winner, false, tried, bytes));
    }
    Ok(results)
}
