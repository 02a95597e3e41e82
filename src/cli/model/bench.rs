//! `kernelforge bench`: forward and decode throughput on random tokens, and the per-kernel
//! time table of both.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;

use super::{load, make_gpu_backend, Device, ModelArgs};
use crate::model::cpu::CpuBackend;
use crate::model::generate::Backend;
use crate::model::gpu::{GpuBackend, ProfileRow};

/// `kernelforge bench`: forward and generation throughput, and where the time goes.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Tokens per sequence of the timed forward pass (random ids).
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Decode steps to time, after a prefill of --seq tokens (fewer if the steps would not fit
    /// the context); 0: forward only.
    #[arg(long, default_value_t = 32)]
    pub generate: usize,
    /// Timed forward passes (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Time the decode steps kernel by kernel instead of replaying each step as a CUDA graph
    /// (to see what the graphs save).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Deterministic pseudo-random token ids in `0..vocab` (the bench input).
fn bench_tokens(batch: usize, seq: usize, vocab: usize) -> Vec<Vec<u32>> {
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

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn profile_table(rows: &[ProfileRow]) -> String {
    let mut table = vec![vec![
        "role".to_string(),
        "kernel".to_string(),
        "calls".to_string(),
        "total ms".to_string(),
        "avg ms".to_string(),
        "%".to_string(),
    ]];
    for r in rows {
        table.push(vec![
            r.role.clone(),
            r.kernel.clone(),
            r.calls.to_string(),
            format!("{:.3}", r.total_ms),
            format!("{:.4}", r.avg_ms),
            format!("{:.1}", r.percent),
        ]);
    }
    crate::cli::kernels::render_table(&table)
}

/// `kernelforge bench`: a warm-up, then the median of `--repeats` forward passes over
/// `--batch` × `--seq` random tokens (LM head on every position; on the GPU the logits stay on
/// the device), then `--generate` greedy decode steps after a prefill (each step's tokens
/// chosen by `decode_argmax`, on the GPU like greedy generation), then one profiled forward and
/// decode run for the per-kernel table (GPU only).
pub fn run_bench(args: &BenchArgs) -> Result<()> {
    let device = args.target.device()?;
    if args.batch == 0 || args.seq == 0 {
        bail!("--batch and --seq must be at least 1");
    }
    let model = load(&args.target.model)?;
    let cfg = model.config.clone();
    if args.seq > cfg.n_ctx {
        bail!(
            "--seq {} is longer than the model's context ({} tokens)",
            args.seq,
            cfg.n_ctx
        );
    }
    let steps = args.generate.min(cfg.n_ctx - 1);
    // The decode steps follow a prefill of up to --seq tokens that leaves room for them.
    let decode_prefill = args.seq.min(cfg.n_ctx - steps);
    let mut notes = Vec::new();
    if steps < args.generate {
        notes.push(format!(
            "--generate {} cut to {steps}: the context holds {} tokens",
            args.generate, cfg.n_ctx
        ));
    }
    if decode_prefill < args.seq && steps > 0 {
        notes.push(format!(
            "the decode steps follow a prefill of {decode_prefill} tokens (not {}) so that {steps} more fit the context ({})",
            args.seq, cfg.n_ctx
        ));
    }
    let tokens = bench_tokens(args.batch, args.seq, cfg.vocab_size);
    let decode_tokens: Vec<Vec<u32>> = tokens.iter().map(|t| t[..decode_prefill].to_vec()).collect();
    let repeats = args.repeats.max(1);
    let opts = args.target.backend_options(args.batch);
    let mut gpu = match device {
        Device::Cuda => Some(make_gpu_backend(model.clone(), &opts)?),
        Device::Cpu => None,
    };
    if let Some(g) = gpu.as_mut() {
        g.set_decode_engine(if args.no_cuda_graphs {
            crate::model::DecodeEngine::Launches
        } else {
            crate::model::DecodeEngine::Graph
        })?;
    }
    let mut cpu = CpuBackend::new(model.clone());
    let decode_ok = match &gpu {
        Some(g) => match g.decode_unavailable() {
            Some(why) => {
                notes.push(format!("decode not timed: {why}"));
                false
            }
            None => true,
        },
        None => true,
    };
    let steps = if decode_ok { steps } else { 0 };

    // One forward pass: on the GPU without copying the logits back.
    let forward = |gpu: &mut Option<GpuBackend>, cpu: &mut CpuBackend| -> Result<()> {
        match gpu {
            Some(g) => g.forward_on_device(&tokens)?,
            None => {
                cpu.prefill(&tokens)?;
            }
        }
        Ok(())
    };
    // A prefill, then `steps` greedy decode steps; returns the decode wall time in ms.
    let decode_run = |gpu: &mut Option<GpuBackend>, cpu: &mut CpuBackend, steps: usize| -> Result<f64> {
        let backend: &mut dyn Backend = match gpu {
            Some(g) => g,
            None => cpu,
        };
        let logits = backend.prefill_last(&decode_tokens)?;
        let mut next: Vec<u32> = (0..args.batch)
            .map(|b| crate::model::sampling::argmax(logits.last(b)))
            .collect::<Result<_, _>>()?;
        let t0 = Instant::now();
        for _ in 0..steps {
            next = backend.decode_argmax(&next)?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };

    // Warm-up: compiles and loads every kernel, touches every buffer.
    let t0 = Instant::now();
    forward(&mut gpu, &mut cpu)?;
    if steps > 0 {
        decode_run(&mut gpu, &mut cpu, steps.min(2))?;
    }
    let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;

    let mut runs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        forward(&mut gpu, &mut cpu)?;
        runs.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let forward_ms = median(&mut runs.clone());
    let forward_tps = (args.batch * args.seq) as f64 / (forward_ms / 1e3);
    if let Some(g) = gpu.as_mut() {
        g.take_decode_gpu_time(); // forget the warm-up's steps
    }
    let decode_ms = if steps > 0 {
        decode_run(&mut gpu, &mut cpu, steps)?
    } else {
        0.0
    };
    // GPU time of a decode step (first kernel to last): the rest of ms_per_step is the host's.
    let decode_gpu_ms_per_step = gpu.as_mut().and_then(|g| {
        let (ms, n) = g.take_decode_gpu_time();
        (n > 0).then(|| ms / n as f64)
    });
    let decode_tps = if steps > 0 {
        (args.batch * steps) as f64 / (decode_ms / 1e3)
    } else {
        0.0
    };

    // Per-kernel profile (GPU): one forward, then the decode steps.
    let (mut prof_forward, mut prof_decode) = (Vec::new(), Vec::new());
    if let Some(g) = gpu.as_mut() {
        g.set_profiling(true);
        g.forward_on_device(&tokens)?;
        prof_forward = g.take_profile()?;
        if steps > 0 {
            let logits = g.prefill_last(&decode_tokens)?;
            g.take_profile()?; // the prefill is not part of the decode profile
            let mut next: Vec<u32> = (0..args.batch)
                .map(|b| crate::model::sampling::argmax(logits.last(b)))
                .collect::<Result<_, _>>()?;
            for _ in 0..steps {
                next = g.decode_argmax(&next)?;
            }
            prof_decode = g.take_profile()?;
        }
        g.set_profiling(false);
    }

    let decode_graphs = gpu.as_ref().is_some_and(|g| g.decode_graphs());
    let (device_name, tuned, choices, backend_notes) = match &gpu {
        Some(g) => (
            format!(
                "{} ({})",
                g.gpu().info.name,
                if g.unfused() { "unfused" } else { "fused" }
            ),
            Some(g.tuned_kernels()),
            g.kernel_choices(),
            g.notes(),
        ),
        None => ("cpu".to_string(), None, Vec::new(), Vec::new()),
    };
    notes.extend(backend_notes);
    let mut out = std::io::stdout().lock();
    if args.json {
        let j = json!({
            "device": device.as_str(),
            "device_name": device_name,
            "unfused": args.target.unfused,
            "model": args.target.model,
            "config": cfg,
            "batch": args.batch,
            "seq": args.seq,
            "warmup_ms": warmup_ms,
            "forward": {
                "median_ms": forward_ms,
                "runs_ms": runs,
                "tokens": args.batch * args.seq,
                "tokens_per_s": forward_tps,
            },
            "decode": {
                "steps": steps,
                "prefill_tokens": decode_prefill,
                "total_ms": decode_ms,
                "ms_per_step": if steps > 0 { decode_ms / steps as f64 } else { 0.0 },
                "tokens_per_s": decode_tps,
                "cuda_graphs": decode_graphs,
                "gpu_ms_per_step": decode_gpu_ms_per_step,
            },
            "tuned_kernels": tuned.map(|(t, n)| json!({ "tuned": t, "total": n })),
            "kernels": choices
                .iter()
                .map(|(role, kernel, choice, shape)| json!({ "role": role, "kernel": kernel, "choice": choice, "shape": shape }))
                .collect::<Vec<_>>(),
            "profile": { "forward": prof_forward, "decode": prof_decode },
            "notes": notes,
        });
        writeln!(out, "{j}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{device_name}: {} (L={}, NH={}, C={}), batch {} x seq {}",
        args.target.model, cfg.n_layer, cfg.n_head, cfg.n_embd, args.batch, args.seq
    )?;
    writeln!(out, "warm-up (compile + first runs): {warmup_ms:.1} ms")?;
    writeln!(
        out,
        "forward: median {forward_ms:.2} ms of {repeats} ({forward_tps:.0} tokens/s)"
    )?;
    if steps > 0 {
        writeln!(
            out,
            "decode: {steps} steps after a {decode_prefill}-token prefill in {decode_ms:.1} ms ({:.3} ms/step{}, {decode_tps:.1} tokens/s{})",
            decode_ms / steps as f64,
            decode_gpu_ms_per_step.map_or(String::new(), |g| format!(" of which {g:.3} ms on the GPU")),
            if decode_graphs { ", CUDA graphs" } else { "" }
        )?;
    }
    if let Some((t, n)) = tuned {
        writeln!(out, "kernels: {t}/{n} tuned")?;
    }
    if !prof_forward.is_empty() {
        writeln!(out, "\nforward pass, per kernel:\n{}", profile_table(&prof_forward))?;
    }
    if !prof_decode.is_empty() {
        writeln!(
            out,
            "\n{steps} decode steps, per kernel:\n{}",
            profile_table(&prof_decode)
        )?;
    }
    drop(out);
    for n in notes {
        eprintln!("note: {n}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::weights::{write_llmc, GPT2Weights, LlmcVersion};
    use crate::spec::Dtype;

    fn cpu_target(model: &str) -> ModelArgs {
        ModelArgs {
            model: model.to_string(),
            device: Some(Device::Cpu),
            unfused: false,
            dtype: Dtype::F32,
            root: None,
        }
    }

    #[test]
    fn bench_runs_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(1, 2, 32, 16, 100).unwrap();
        let bin = dir.path().join("m.bin");
        write_llmc(&bin, &cfg, &GPT2Weights::random(&cfg, 3), LlmcVersion::F32).unwrap();
        let args = BenchArgs {
            target: cpu_target(&bin.display().to_string()),
            batch: 2,
            seq: 12,
            generate: 8, // 12 + 8 > 16: the decode prefill shrinks to 8 tokens
            repeats: 2,
            no_cuda_graphs: false,
            json: true,
        };
        run_bench(&args).unwrap();
        run_bench(&BenchArgs {
            json: false,
            ..args.clone()
        })
        .unwrap();
        let too_long = BenchArgs { seq: 17, ..args };
        assert!(run_bench(&too_long).unwrap_err().to_string().contains("context"));
    }
}
