//! What a `kernelforge bench` run of one batch and of a `--batch` list share: settling the run
//! before any timed work (flags, model, the draw, how many decode steps after how long a
//! prefill, the memory check, the backend sized for the largest batch), the timed forward pass
//! and decode run, and the figures measured once a run (copy bandwidth, compute peak).

use anyhow::{bail, Result};
use serde_json::json;

use super::bench::BenchArgs;
use super::bench_decode::{check_timeline_request, ComputePeak, FloorReport};
use super::fits::{check_batch_fits, CpuTokens, OpeningGpus};
use super::{decode_engine_for, load, make_gpu_backend, BackendOptions, Device};
use crate::model::config::GPT2Config;
use crate::model::cpu::CpuBackend;
use crate::model::engine::DecodeEngine;
use crate::model::floor::{decode_step_bytes, decode_step_flops};
use crate::model::generate::{timed_decode, Backend, Draw};
use crate::model::replicas::Replicas;
use crate::model::sampling::SamplingParams;
use crate::tune::registry::Choice;

/// Deterministic pseudo-random token ids in `0..vocab` (the bench input).
pub(super) fn bench_tokens(batch: usize, seq: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..batch)
        .map(|_| {
            (0..seq)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 33) % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// Why a forward pass over `batch` x `seq` tokens on `gpus` GPUs cannot run, naming the batch
/// and the sequence length that would: its logits (a row for every position of a GPU's slice,
/// `vocab` wide) must stay within the kernels' 32-bit element index. The decode steps are not
/// bound by it: their prefill takes the last position's logits only.
pub(super) fn forward_too_large(batch: usize, seq: usize, gpus: usize, vocab: usize) -> Option<String> {
    let (gpus, limit) = (gpus.max(1), i32::MAX as usize);
    let slice = batch.div_ceil(gpus);
    let elements = slice * seq * vocab;
    if elements <= limit {
        return None;
    }
    let batch_fits = gpus * (limit / (seq * vocab));
    let seq_fits = limit / (slice * vocab);
    let on = if gpus > 1 {
        format!(" on each of {gpus} GPUs")
    } else {
        String::new()
    };
    Some(format!(
        "the forward pass of --batch {batch} x --seq {seq} would hold {:.1} G logits ({slice} x {seq} positions x {vocab}{on}), \
         more than its kernels' 32-bit index reaches; it runs at --batch {batch_fits} or less at this --seq, or --seq {seq_fits} or less at this --batch",
        elements as f64 / 1e9
    ))
}

/// The timed forward pass: every run's wall ms, their median, the tokens of one pass and
/// the tokens a second at the median.
pub(super) struct ForwardTiming {
    pub runs_ms: Vec<f64>,
    pub median_ms: f64,
    pub tokens: usize,
    pub tokens_per_s: f64,
}

impl ForwardTiming {
    /// The `forward` object of `bench --json` (`null` when the pass was not timed).
    pub fn json(timing: Option<&ForwardTiming>) -> serde_json::Value {
        timing.map_or(serde_json::Value::Null, |f| {
            json!({
                "median_ms": f.median_ms,
                "runs_ms": f.runs_ms,
                "tokens": f.tokens,
                "tokens_per_s": f.tokens_per_s,
            })
        })
    }
}

/// What a bench run settles before any timed work: the model, how tokens are drawn, how many
/// decode steps follow how long a prefill, and the backend (on the GPU, sized for the largest
/// batch asked for).
pub(super) struct BenchSetup {
    pub device: Device,
    /// The decode engine asked for (`None`: each batch's tuned engine, else the graph).
    pub engine: Option<DecodeEngine>,
    pub cfg: GPT2Config,
    pub draw: Draw,
    /// Decode steps to time (0: none, with `--generate 0` or when decode is unavailable).
    pub steps: usize,
    /// Tokens of the prefill the decode steps follow.
    pub decode_prefill: usize,
    pub notes: Vec<String>,
    pub gpu: Option<Replicas>,
    pub cpu: CpuBackend,
}

/// Checks the flags, loads the model, refuses a batch that does not fit (before anything is
/// allocated) and builds the backend for the largest batch of `--batch`.
pub(super) fn set_up(args: &BenchArgs) -> Result<BenchSetup> {
    let device = args.target.device()?;
    if args.seq == 0 {
        bail!("--seq must be at least 1");
    }
    let mut notes = Vec::new();
    let asked = match (args.engine.decode_engine, args.no_cuda_graphs) {
        (None, true) => {
            notes.push("--no-cuda-graphs is deprecated: use --decode-engine launches".to_string());
            (device == Device::Cuda).then_some(DecodeEngine::Launches)
        }
        (asked, _) => asked,
    };
    let engine = decode_engine_for(device, asked)?;
    if let Some(path) = &args.timeline {
        check_timeline_request(path, engine, args.generate)?;
        if let Some(devices) = args.target.devices.as_ref().filter(|d| d.is_several()) {
            bail!("--timeline draws one GPU's megakernel step; drop --devices {devices} (or give one GPU) to draw it");
        }
    }
    args.sampling.draw(SamplingParams::greedy(), usize::MAX)?;
    let opening_gpus = OpeningGpus::start(device, &args.target.backend_options(args.batch.largest()));
    let model = load(&args.target.model)?;
    let cfg = model.config.clone();
    let (draw, note) = args.sampling.draw(SamplingParams::greedy(), cfg.vocab_size)?;
    notes.extend(note);
    if args.seq > cfg.n_ctx {
        bail!(
            "--seq {} is longer than the model's context ({} tokens)",
            args.seq,
            cfg.n_ctx
        );
    }
    // --timeline runs one step more than the timed ones: the context must hold it too.
    let extra = usize::from(args.timeline.is_some());
    let steps = args.generate.min((cfg.n_ctx - 1).saturating_sub(extra));
    if extra == 1 && steps == 0 {
        bail!(
            "--timeline: the model's context ({} tokens) leaves no room for a decode step",
            cfg.n_ctx
        );
    }
    // The decode steps follow a prefill of up to --seq tokens that leaves room for them.
    let decode_prefill = args.seq.min(cfg.n_ctx - steps - extra);
    if steps < args.generate {
        notes.push(format!(
            "--generate {} cut to {steps}: the context holds {} tokens",
            args.generate, cfg.n_ctx
        ));
    }
    if decode_prefill < args.seq && steps > 0 {
        notes.push(format!(
            "the decode steps follow a prefill of {decode_prefill} tokens (not {}) so that {} more fit the context ({})",
            args.seq,
            steps + extra,
            cfg.n_ctx
        ));
    }
    let opts = BackendOptions {
        decode_engine: engine,
        ..args.target.backend_options(args.batch.largest())
    };
    // The CPU caches the forward pass's tokens, then the prefill's and the steps'; the forward
    // pass has a logits row for every token.
    let cpu_tokens = CpuTokens {
        cached: args.seq.max(decode_prefill + steps + extra),
        step: args.seq,
        logits: args.seq,
    };
    let checked = check_batch_fits(
        &format!("--batch {}", args.batch),
        device,
        &cfg,
        &opts,
        cpu_tokens,
        opening_gpus,
    )?;
    let gpu = match device {
        Device::Cuda => Some(make_gpu_backend(model.clone(), &opts)?),
        Device::Cpu => None,
    };
    drop(checked); // the contexts the check opened, kept until the backend holds them
    let decode_ok = match &gpu {
        Some(g) => match g.primary().decode_unavailable() {
            Some(why) if args.timeline.is_some() => bail!("--timeline: decode steps are unavailable: {why}"),
            Some(why) => {
                notes.push(format!("decode not timed: {why}"));
                false
            }
            None => true,
        },
        None => true,
    };
    Ok(BenchSetup {
        device,
        engine,
        cfg,
        draw,
        steps: if decode_ok { steps } else { 0 },
        decode_prefill,
        notes,
        gpu,
        cpu: CpuBackend::new(model),
    })
}

impl BenchSetup {
    /// One forward pass over `tokens`: on the GPU without copying the logits back.
    pub fn forward(&mut self, tokens: &[Vec<u32>]) -> Result<()> {
        match &mut self.gpu {
            Some(g) => g.forward_on_device(tokens)?,
            None => {
                self.cpu.prefill(tokens)?;
            }
        }
        Ok(())
    }

    /// `repeats` (at least one) timed forward passes over `tokens`: each one's wall ms, their
    /// median and the tokens a second at it.
    pub fn time_forward(&mut self, tokens: &[Vec<u32>], repeats: usize) -> Result<ForwardTiming> {
        let mut runs_ms = Vec::with_capacity(repeats);
        for _ in 0..repeats.max(1) {
            let t = std::time::Instant::now();
            self.forward(tokens)?;
            runs_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let median_ms = crate::stats::median(runs_ms.clone());
        let tokens = tokens.iter().map(Vec::len).sum::<usize>();
        Ok(ForwardTiming {
            runs_ms,
            median_ms,
            tokens,
            tokens_per_s: tokens as f64 / (median_ms / 1e3),
        })
    }

    /// Whether the forward pass over `batch` x `seq` tokens is timed. One too large for the
    /// kernels' index on the GPU ([`forward_too_large`]) is left out with a note when `steps`
    /// decode steps follow (their prefill takes the last position's logits only), and refused,
    /// naming what would run, when none do.
    pub fn forward_fits(&mut self, batch: usize, seq: usize, steps: usize) -> Result<bool> {
        let Some(gpu) = self.gpu.as_ref() else {
            return Ok(true);
        };
        match forward_too_large(batch, seq, gpu.devices().len(), self.cfg.padded_vocab_size) {
            None => Ok(true),
            Some(why) if steps == 0 => bail!("{why}"),
            Some(why) => {
                self.notes.push(format!("forward not timed: {why}"));
                Ok(false)
            }
        }
    }

    /// A prefill of `prompts`, then `steps` decode steps each drawing its tokens as asked
    /// (greedy unless a sampling flag is given); the decode wall time in ms and the tokens the
    /// last step chose.
    pub fn decode(&mut self, prompts: &[Vec<u32>], steps: usize) -> Result<(f64, Vec<u32>)> {
        let backend: &mut dyn Backend = match &mut self.gpu {
            Some(g) => g,
            None => &mut self.cpu,
        };
        Ok(timed_decode(backend, prompts, steps, &self.draw)?)
    }

    /// GPU time of a decode step since the last call (first kernel to last), when the backend
    /// measures it; the rest of a step's wall time is the host's.
    pub fn take_gpu_ms_per_step(&mut self) -> Result<Option<f64>> {
        Ok(match self.gpu.as_mut() {
            Some(g) => {
                let (ms, n) = g.take_decode_gpu_time()?;
                (n > 0).then(|| ms / n as f64)
            }
            None => None,
        })
    }

    /// The sequences of each GPU's slice of the last prefill (`[batch]` on the CPU).
    pub fn slices(&self, batch: usize) -> Vec<usize> {
        self.gpu
            .as_ref()
            .map_or_else(|| vec![batch], |g| g.slices().iter().map(|r| r.len()).collect())
    }

    /// The copy bandwidth (GB/s) the memory bound is divided by, measured now on the first GPU
    /// (`None` on the CPU, or with a note when it could not be measured).
    pub fn copy_bandwidth(&mut self) -> Option<f64> {
        let g = self.gpu.as_ref()?;
        let measured =
            crate::gpu::bandwidth::copy_bandwidth(g.primary().gpu(), crate::gpu::bandwidth::DEFAULT_COPY_BYTES, 10);
        measured
            .map_err(|e| self.notes.push(format!("copy bandwidth not measured: {e}")))
            .ok()
            .map(|c| c.gb_per_s)
    }

    /// The compute peak for `--dtype`, measured now on the first GPU (`None` on the CPU, or with
    /// a note when it could not be measured).
    pub fn compute_peak(&mut self, dtype: crate::spec::Dtype) -> Option<ComputePeak> {
        let g = self.gpu.as_ref()?;
        ComputePeak::measure(g.primary().gpu(), dtype)
            .map_err(|e| self.notes.push(format!("compute peak not measured: {e:#}")))
            .ok()
    }

    /// The floor of a step of `slice` sequences (the first GPU's) at the mean cache length of
    /// the timed steps, over `copy_gb_per_s` and, when given, `peak`.
    pub fn floor(
        &self,
        args: &BenchArgs,
        slice: usize,
        copy_gb_per_s: Option<f64>,
        peak: Option<&ComputePeak>,
        ms_per_step: f64,
        gpu_ms_per_step: Option<f64>,
    ) -> FloorReport {
        let cache_len = self.decode_prefill + self.steps / 2;
        let bytes = decode_step_bytes(&self.cfg, args.target.dtype.storage().bytes(), slice, cache_len);
        let report = FloorReport::new(bytes, copy_gb_per_s, ms_per_step, gpu_ms_per_step);
        match peak {
            Some(p) => report.with_compute(decode_step_flops(&self.cfg, slice, cache_len), Some(p.flops_per_s)),
            None => report,
        }
    }

    /// What the report says about the backend: its name, GPUs, tuned kernels, the kernels it
    /// chose and its notes.
    pub fn facts(&mut self) -> Result<BackendFacts> {
        Ok(match self.gpu.as_mut() {
            Some(g) => {
                let p = g.primary();
                let several = match g.devices().len() {
                    1 => String::new(),
                    n => format!(" x{n}"),
                };
                BackendFacts {
                    device_name: format!(
                        "{}{several} ({})",
                        p.gpu().info.name,
                        if p.unfused() { "unfused" } else { "fused" }
                    ),
                    devices: g.devices().to_vec(),
                    tuned: Some(p.tuned_kernels()),
                    choices: p.kernel_choices(),
                    notes: g.notes()?,
                }
            }
            None => BackendFacts {
                device_name: "cpu".to_string(),
                devices: Vec::new(),
                tuned: None,
                choices: Vec::new(),
                notes: Vec::new(),
            },
        })
    }
}

/// See [`BenchSetup::facts`].
pub(super) struct BackendFacts {
    pub device_name: String,
    pub devices: Vec<usize>,
    pub tuned: Option<(usize, usize)>,
    pub choices: Vec<(String, String, Choice, String)>,
    pub notes: Vec<String>,
}

impl BackendFacts {
    /// The `kernels` array of `bench --json`.
    pub fn kernels_json(&self) -> Vec<serde_json::Value> {
        self.choices
            .iter()
            .map(|(role, kernel, choice, shape)| json!({ "role": role, "kernel": kernel, "choice": choice, "shape": shape }))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::forward_too_large;

    #[test]
    fn a_forward_pass_past_the_32_bit_index_names_the_batch_and_the_seq_that_fit() {
        // GPT-2's padded vocabulary: 768 x 50,304 x 55 positions fit, 56 do not.
        assert_eq!(forward_too_large(55, 768, 1, 50304), None);
        let why = forward_too_large(256, 768, 1, 50304).unwrap();
        assert!(why.contains("--batch 256 x --seq 768"), "{why}");
        assert!(why.contains("9.9 G logits (256 x 768 positions x 50304)"), "{why}");
        assert!(
            why.contains("--batch 55 or less") && why.contains("--seq 166 or less"),
            "{why}"
        );
        // Two GPUs hold half the batch each: twice the batch fits, and the slice decides the seq.
        let why = forward_too_large(256, 768, 2, 50304).unwrap();
        assert!(why.contains("128 x 768 positions x 50304 on each of 2 GPUs"), "{why}");
        assert!(
            why.contains("--batch 110 or less") && why.contains("--seq 333 or less"),
            "{why}"
        );
        assert_eq!(forward_too_large(16, 1024, 1, 50304), None);
    }
}
