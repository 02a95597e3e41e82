//! What tuning the decode step (`kernelforge tune --decode-step`) needs from the backend
//! besides the megakernel's own (`megakernel.rs`: its database key, setting a point): the
//! engine the tuning database prefers for a batch, the matmuls a step runs and a point to run
//! for any kernel's key, and the time of greedy decode steps on the current engine (wall and GPU).

use anyhow::{Context, Result as AnyResult};

use super::GpuBackend;
use crate::model::engine::DecodeEngine;
use crate::model::generate::timed_greedy_decode;
use crate::stats::median;
use crate::tune::db::TuneKey;

/// A decode step's time in milliseconds, two ways.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTime {
    /// The wall time a user waits per token, host included: what chooses between engines,
    /// whose host paths differ.
    pub wall_ms: f64,
    /// From the step's first kernel to its last (CUDA events; the wall time where the engine
    /// records none): what chooses between kernels of one engine, whose host path is the same,
    /// without the host's jitter.
    pub gpu_ms: f64,
}

impl GpuBackend {
    /// The header of this GPU's tuning database (the default file, which this backend reads,
    /// is `tune::db::default_path` of it).
    pub fn tuning_db_header(&self) -> &crate::tune::db::DbHeader {
        &self.db_header
    }

    /// The engine the tuning database prefers for decode steps of `b` sequences: the megakernel
    /// when a tuned point of it beat the graph engine measured beside it, else the graph.
    pub fn tuned_decode_engine(&self, b: usize) -> DecodeEngine {
        let key = self.decode_step_key(b);
        let entry = self.registry.db.as_ref().and_then(|db| db.get(&key));
        match entry {
            Some(e) if e.baseline_ms.is_some_and(|graph| e.median_ms < graph) => DecodeEngine::Megakernel,
            _ => DecodeEngine::Graph,
        }
    }

    /// Run the kernel of the tuning-database key `key` (a decode step's attention bucket, one of
    /// its matmuls) at `point` (a family and every parameter of its point) from the next step
    /// on; `None`: the tuned winner or the default again.
    pub fn set_step_point(&mut self, key: &TuneKey, point: Option<(String, Vec<(String, i64)>)>) {
        let changed = match point {
            Some(p) => self.step_points.insert(key.text(), p.clone()).as_ref() != Some(&p),
            None => self.step_points.remove(&key.text()).is_some(),
        };
        if changed {
            // The kernel sets are selected again; a step's graph follows its kernels (nodes
            // switched in place, or the graph recorded again).
            self.discard_ahead();
            self.sets.clear();
            self.prepared = None;
        }
    }

    /// The matmuls a greedy decode step of `b` sequences runs, as (role, tuning-database key):
    /// qkv, attention output, fc, fc projection and the LM head, each with the layernorm before
    /// it folded in where the database says that pays.
    pub fn decode_step_matmuls(&mut self, b: usize) -> AnyResult<Vec<(&'static str, TuneKey)>> {
        let ks = self.kernels(b, 1, true, false)?;
        Ok([&ks.qkv, &ks.attn_proj, &ks.fc, &ks.fc_proj, &ks.lm_head]
            .into_iter()
            .map(|k| (k.role, TuneKey::clone(&k.key)))
            .collect())
    }

    /// Milliseconds per greedy decode step of `b` sequences on the current engine, averaged
    /// over `contexts` (cache positions before the timed steps): a quarter second of warm-up
    /// steps (compiles, graph recording, and the GPU raising its clocks, which it does only under
    /// sustained load), then for each context the median over `repeats` runs of a prefill of
    /// that many tokens and `steps` timed steps (fewer when the context is shorter). One warm-up
    /// serves every context.
    pub fn time_greedy_decode(
        &mut self,
        b: usize,
        contexts: &[usize],
        steps: usize,
        repeats: usize,
    ) -> AnyResult<StepTime> {
        let cfg = self.model.config.clone();
        let vocab = cfg.vocab_size as u32;
        // (prompt length, prompts, steps) of each context
        let runs: Vec<(usize, Vec<Vec<u32>>, usize)> = contexts
            .iter()
            .map(|&prompt| {
                let prompt = prompt.clamp(1, cfg.n_ctx.saturating_sub(1).max(1));
                let steps = steps.clamp(1, (cfg.n_ctx - prompt).max(1));
                let prompts = (0..b)
                    .map(|s| {
                        (0..prompt as u32)
                            .map(|i| (i * 37 + s as u32 * 101 + 11) % vocab)
                            .collect()
                    })
                    .collect();
                (prompt, prompts, steps)
            })
            .collect();
        let run =
            |this: &mut GpuBackend, (prompt, prompts, steps): &(usize, Vec<Vec<u32>>, usize)| -> AnyResult<StepTime> {
                this.take_decode_gpu_time(); // the prefill's and earlier steps' left out
                let (ms, _) = timed_greedy_decode(this, prompts, *steps)
                    .with_context(|| format!("{steps} decode steps after a {prompt}-token prompt"))?;
                let wall_ms = ms / *steps as f64;
                let (gpu_ms, timed) = this.take_decode_gpu_time();
                let gpu_ms = if timed > 0 { gpu_ms / timed as f64 } else { wall_ms };
                Ok(StepTime { wall_ms, gpu_ms })
            };
        let Some(first) = runs.first() else {
            anyhow::bail!("no context to time decode steps at");
        };
        let warm = std::time::Instant::now();
        while warm.elapsed().as_secs_f64() < 0.25 {
            run(self, first)?;
        }
        let (mut wall_ms, mut gpu_ms) = (0.0, 0.0);
        for context in &runs {
            let times = (0..repeats.max(1))
                .map(|_| run(self, context))
                .collect::<AnyResult<Vec<StepTime>>>()?;
            wall_ms += median(times.iter().map(|t| t.wall_ms).collect());
            gpu_ms += median(times.iter().map(|t| t.gpu_ms).collect());
        }
        let n = runs.len() as f64;
        Ok(StepTime {
            wall_ms: wall_ms / n,
            gpu_ms: gpu_ms / n,
        })
    }
}
