//! One workload under tuning: its inputs (a verification problem with its f64 reference, the
//! real problem uploaded in enough copies to defeat the L2), and the fate of every candidate
//! measured on it so far (timed, rejected, or pruned from its resources), down to the winner
//! picked by successive halving.

use std::collections::HashSet;

use rand::SeedableRng;

use super::climb::{unseen_by_name, ClimbState, Climber};
use super::db::{Candidate, TuneKey};
use super::evaluate::Evaluator;
use super::search;
use super::time::{rotation_count, Contestant, Timing};
use super::tuner::{verification_shape, workload_bytes, Progress, Tried};
use super::workloads::Workload;
use crate::gpu::{DeviceProblem, Gpu};
use crate::ops::{self, Problem, Shape};
use crate::spec::Variant;

/// Host side of a workload's inputs: built on the CPU (in parallel across workloads) before
/// anything touches the GPU.
pub struct Inputs {
    pub check_shape: Shape,
    pub check: Problem,
    pub reference: Vec<(usize, Vec<f64>)>,
    pub problem: Problem,
}

impl Inputs {
    /// Fresh random inputs for `w`, drawn from `seed`.
    pub fn new(w: &Workload, seed: u64) -> Result<Inputs, String> {
        let op = ops::op_by_name(w.op).ok_or_else(|| format!("unknown op {}", w.op))?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let check_shape = verification_shape(w);
        let check = op
            .problem(&check_shape, w.epilogue, w.mask, &mut rng)
            .map_err(|e| e.to_string())?
            .stored_as(w.dtype.storage());
        let reference = op.reference(&check);
        let problem = op
            .problem(&w.shape, w.epilogue, w.mask, &mut rng)
            .map_err(|e| e.to_string())?
            .stored_as(w.dtype.storage());
        Ok(Inputs {
            check_shape,
            check,
            reference,
            problem,
        })
    }
}

/// A workload's search in progress.
pub struct WorkloadSearch<'w> {
    pub workload: &'w Workload,
    pub key: TuneKey,
    pub inputs: Inputs,
    pub bytes: f64,
    /// Every valid variant (see `search::Pools`).
    pub pool: Vec<Variant>,
    check_device: DeviceProblem,
    copies: Vec<DeviceProblem>,
    seen: HashSet<String>,
    pub tried: Vec<Tried>,
    /// The same fates as `tried`, with params, error and resources, for the database.
    pub kept: Vec<Candidate>,
    /// Timed candidates with their screen time.
    pub timed: Vec<(Variant, Timing)>,
    pruned: Vec<Variant>,
    climb: ClimbState,
}

/// What [`WorkloadSearch::finals`] found: the fastest finalist, and the peer's time from the
/// same turns (when a peer ran).
pub struct Finals {
    pub best: Option<(Variant, Timing)>,
    pub peer: Option<Timing>,
}

impl<'w> WorkloadSearch<'w> {
    /// Uploads the inputs; nothing is measured yet.
    pub fn new(gpu: &Gpu, workload: &'w Workload, inputs: Inputs, pool: Vec<Variant>) -> Result<Self, String> {
        let upload = |p: &Problem| DeviceProblem::upload(gpu, p).map_err(|e| e.to_string());
        let copies = (0..rotation_count(&inputs.problem))
            .map(|_| upload(&inputs.problem))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(WorkloadSearch {
            key: workload.key(),
            bytes: workload_bytes(workload, &inputs.problem),
            check_device: upload(&inputs.check)?,
            workload,
            inputs,
            pool,
            copies,
            seen: HashSet::new(),
            tried: Vec::new(),
            kept: Vec::new(),
            timed: Vec::new(),
            pruned: Vec::new(),
            climb: ClimbState::default(),
        })
    }

    /// `attn.qkv M=1024 N=2304 ...`, for progress lines.
    pub fn title(&self) -> String {
        format!(
            "{} {}",
            self.workload.role,
            crate::spec::shape_text(&self.workload.shape)
        )
    }

    /// Screens (unless `screen` is off), verifies and screen-times each variant not seen yet;
    /// they must be compiled already (see [`Evaluator::compile_streaming`]). A kernel fault ends the run
    /// (the context is lost).
    pub fn measure(
        &mut self,
        eval: &mut Evaluator,
        variants: Vec<Variant>,
        screen: bool,
        progress: &dyn Progress,
    ) -> Result<(), String> {
        // Pruned candidates come back (with `screen` off) after they were seen.
        let fresh: Vec<Variant> = if screen {
            variants
                .into_iter()
                .filter(|v| self.seen.insert(v.kernel_name()))
                .collect()
        } else {
            variants
        };
        for v in fresh {
            progress.advance(&v.key());
            if screen {
                if let Err(why) = eval.screen(&v, &self.inputs.problem.shape) {
                    if why.starts_with("pruned") {
                        self.pruned.push(v.clone());
                    }
                    self.record(eval, &v, Err(why));
                    continue;
                }
            }
            let outcome = eval
                .verify(&v, &self.inputs.check, &mut self.check_device, &self.inputs.reference)
                .and_then(|err| {
                    eval.time(&v, &self.inputs.problem, &mut self.copies, &search::SCREEN)
                        .map(|t| (err, t))
                });
            if let Err(why) = &outcome {
                if why.starts_with("kernel fault") {
                    return Err(format!(
                        "{}: {why} (the GPU context is unusable; fix the template)",
                        v.kernel_name()
                    ));
                }
            }
            self.record(eval, &v, outcome);
        }
        Ok(())
    }

    /// Measures the pruned candidates after all when nothing else ran.
    pub fn measure_pruned_if_nothing_ran(
        &mut self,
        eval: &mut Evaluator,
        progress: &dyn Progress,
    ) -> Result<(), String> {
        if !self.timed.is_empty() || self.pruned.is_empty() {
            return Ok(());
        }
        let pruned = std::mem::take(&mut self.pruned);
        self.measure(eval, pruned, false, progress)
    }

    fn record(&mut self, eval: &Evaluator, v: &Variant, outcome: Result<(f64, Timing), String>) {
        let mut kept = Candidate {
            family: v.family.name.clone(),
            params: v.params.clone(),
            median_ms: None,
            spread_ms: None,
            error: None,
            rejected: None,
            resources: eval.resources(v),
            step_ms: None,
        };
        let mut tried = Tried {
            family: v.family.name.clone(),
            variant: v.key(),
            median_ms: None,
            rejected: None,
        };
        match outcome {
            Ok((err, t)) => {
                kept.median_ms = Some(t.median_ms);
                kept.spread_ms = Some(t.spread_ms());
                kept.error = Some(err);
                tried.median_ms = Some(t.median_ms);
                self.timed.push((v.clone(), t));
            }
            Err(why) => {
                kept.rejected = Some(why.clone());
                tried.rejected = Some(why);
            }
        }
        // A pruned candidate measured after all replaces its earlier record.
        self.kept.retain(|c| !c.is_point(&kept.family, &kept.params));
        self.tried
            .retain(|t| !(t.family == tried.family && t.variant == tried.variant));
        self.kept.push(kept);
        self.tried.push(tried);
    }

    /// Successive halving (see [`search::HALVING`]): the best candidates by screen time are
    /// timed again, then the best of those and `peer` (the vendor's kernel, if any) in turns.
    pub fn finals(&mut self, eval: &mut Evaluator, peer: Option<Contestant<'_>>) -> Result<Finals, String> {
        let by_time =
            |field: &mut Vec<(Variant, Timing)>| field.sort_by(|a, b| a.1.median_ms.total_cmp(&b.1.median_ms));
        let mut field = self.timed.clone();
        by_time(&mut field);
        field.truncate(search::HALVING_KEEP);
        let mut field: Vec<(Variant, Timing)> = field
            .into_iter()
            .filter_map(|(v, _)| {
                eval.time(&v, &self.inputs.problem, &mut self.copies, &search::HALVING)
                    .ok()
                    .map(|t| (v, t))
            })
            .collect();
        by_time(&mut field);
        field.truncate(search::FINAL_KEEP);
        let finalists: Vec<Variant> = field.into_iter().map(|(v, _)| v).collect();
        let (times, peer_time) = eval.time_in_turns(
            &finalists,
            &self.inputs.problem,
            &mut self.copies,
            &search::FINAL,
            search::FINAL_ROUNDS,
            peer,
        )?;
        let best = finalists
            .into_iter()
            .zip(times)
            .min_by(|a, b| a.1.median_ms.total_cmp(&b.1.median_ms));
        Ok(Finals { best, peer: peer_time })
    }
}

impl Climber for WorkloadSearch<'_> {
    fn op(&self) -> &str {
        &self.key.op
    }
    fn shape(&self) -> &Shape {
        &self.workload.shape
    }
    fn pool(&self) -> &[Variant] {
        &self.pool
    }
    fn timed(&self) -> Vec<(&Variant, f64)> {
        self.timed.iter().map(|(v, t)| (v, t.median_ms)).collect()
    }
    fn unseen(&self, variants: Vec<Variant>) -> Vec<Variant> {
        unseen_by_name(&self.seen, variants)
    }
    fn climb(&mut self) -> &mut ClimbState {
        &mut self.climb
    }
}
