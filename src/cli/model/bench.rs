//! `kernelforge bench`: forward and decode throughput on random tokens, the decode step's
//! memory floor and the share of it reached, the per-kernel time table of both, and with the
//! megakernel a blocks × time picture of one decode step. A `--batch` list times decode at each
//! batch in the same process instead (`bench_batches.rs`); what both share is `bench_setup.rs`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use super::batch_list::{BatchList, BATCH_HELP};
use super::bench_decode::{timeline_step, write_atomically, ComputePeak, FloorReport};
use super::bench_setup::{bench_tokens, set_up, ForwardTiming};
use super::sampling::SamplingArgs;
use super::{EngineArgs, ModelArgs};
use crate::model::engine::DecodeEngine;
use crate::model::generate::{Backend, Draw};
use crate::model::gpu::ProfileRow;
use crate::model::timeline_stats::{summarize, summary_table};
use crate::model::timeline_svg::render_timeline_svg;

/// `kernelforge bench`: forward and generation throughput, and where the time goes.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "1", value_name = "B[,B...]", value_parser = BatchList::parse, help = BATCH_HELP)]
    pub batch: BatchList,
    /// Tokens per sequence of the timed forward pass (random ids); with a --batch list the
    /// forward pass runs at the list's first batch only. A pass whose logits (batch x seq x
    /// the padded vocabulary, per GPU) would pass the kernels' 32-bit index is left out with a
    /// note; the decode steps after it still run.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Decode steps to time, after a prefill of --seq tokens (fewer if the steps would not fit
    /// the context); 0: forward only.
    #[arg(long, default_value_t = 32)]
    pub generate: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Timed forward passes (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Deprecated: the same as --decode-engine launches.
    #[arg(long, hide = true, conflicts_with = "decode_engine")]
    pub no_cuda_graphs: bool,
    /// With --decode-engine megakernel: after the timed steps, run one more (drawing its tokens
    /// as they did: greedy, or with the sampling flags) with every task stamped and draw it to
    /// this SVG file (a row per block, time across, tasks coloured by op, the time a task waited
    /// for its inputs hatched).
    #[arg(long, value_name = "FILE.svg")]
    pub timeline: Option<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
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
/// the device), then `--generate` decode steps after a prefill (each step's tokens chosen
/// on the GPU as generation chooses them: the argmax, or drawn with the sampling flags) on the
/// chosen decode engine,
/// then (GPU) one more step for `--timeline`, one profiled forward and decode run for the
/// per-kernel table, and the copy bandwidth the decode floor is divided by (and with `--json`
/// the compute peak its FLOPs are). A `--batch` list runs [`super::bench_batches`] instead.
pub fn run_bench(args: &BenchArgs) -> Result<()> {
    if args.batch.is_list() {
        return super::bench_batches::run_bench_batches(args);
    }
    let batch = args.batch.first();
    let mut run = set_up(args)?;
    let (cfg, steps, decode_prefill) = (run.cfg.clone(), run.steps, run.decode_prefill);
    let tokens = bench_tokens(batch, args.seq, cfg.vocab_size);
    let decode_tokens: Vec<Vec<u32>> = tokens.iter().map(|t| t[..decode_prefill].to_vec()).collect();
    let repeats = args.repeats.max(1);

    let forward_fits = run.forward_fits(batch, args.seq, steps)?;

    // Warm-up: compiles and loads every kernel, touches every buffer.
    let t0 = Instant::now();
    if forward_fits {
        run.forward(&tokens)?;
    }
    if steps > 0 {
        run.decode(&decode_tokens, steps.min(2))?;
    }
    let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;

    let forward = if forward_fits {
        Some(run.time_forward(&tokens, repeats)?)
    } else {
        None
    };
    run.take_gpu_ms_per_step()?; // forget the warm-up's steps
    let (decode_ms, last_tokens) = if steps > 0 {
        run.decode(&decode_tokens, steps)?
    } else {
        (0.0, Vec::new())
    };
    // GPU time of a decode step (first kernel to last): the rest of ms_per_step is the host's.
    let decode_gpu_ms_per_step = run.take_gpu_ms_per_step()?;
    let ms_per_step = if steps > 0 { decode_ms / steps as f64 } else { 0.0 };
    let decode_tps = if steps > 0 {
        (batch * steps) as f64 / (decode_ms / 1e3)
    } else {
        0.0
    };
    // One more step with the megakernel's task stamps on, drawing as the timed steps drew (the
    // token after the prefill and the timed steps' ones).
    let timeline = match (&args.timeline, run.gpu.as_mut()) {
        (Some(path), Some(g)) if steps > 0 => {
            let position = decode_prefill + steps + 1;
            Some((path, timeline_step(g.primary_mut(), &last_tokens, &run.draw, position)?))
        }
        _ => None,
    };

    // Per-kernel profile (GPU; the first GPU's slice): one forward, then the decode steps.
    let (mut prof_forward, mut prof_decode) = (Vec::new(), Vec::new());
    if let Some(g) = run.gpu.as_mut() {
        let draw = &run.draw;
        g.primary_mut().set_profiling(true);
        if forward.is_some() {
            g.forward_on_device(&tokens)?;
            prof_forward = g.primary_mut().take_profile()?;
        }
        if steps > 0 {
            let logits = g.prefill_last(&decode_tokens)?;
            g.primary_mut().take_profile()?; // the prefill is not part of the decode profile
            let mut position = decode_prefill;
            let mut next: Vec<u32> = (0..batch)
                .map(|b| draw.on_host(logits.last(b), b, position))
                .collect::<Result<_, _>>()?;
            for _ in 0..steps {
                position += 1;
                next = g.decode_draw(&next, draw, position)?;
            }
            prof_decode = g.primary_mut().take_profile()?;
        }
        g.primary_mut().set_profiling(false);
    }
    // The batch slice of each GPU, and the first GPU's (the largest: the floor and the
    // profile are the first GPU's).
    let slices = run.slices(batch);
    let first_slice = slices.first().copied().unwrap_or(batch);

    // The floor: the bytes a step reads at the average cache length of the timed steps, over
    // the copy bandwidth of this GPU (and with --json its FLOPs over the compute peak).
    let (floor, peak) = if steps > 0 {
        let copy = run.copy_bandwidth();
        let peak = if args.json {
            run.compute_peak(args.target.dtype)
        } else {
            None
        };
        let floor = run.floor(
            args,
            first_slice,
            copy,
            peak.as_ref(),
            ms_per_step,
            decode_gpu_ms_per_step,
        );
        (Some(floor), peak)
    } else {
        (None, None)
    };

    let decode_graphs = run.gpu.as_ref().is_some_and(|g| g.primary().decode_graphs());
    // the engine the steps ran on (a batch the megakernel cannot hold runs on the graph engine)
    let engine = run.gpu.as_ref().map(|g| g.primary().engine_for(first_slice));
    // The point the megakernel ran (after the timed steps it is the one set up last).
    let megakernel = run
        .gpu
        .as_ref()
        .filter(|_| steps > 0 && engine == Some(DecodeEngine::Megakernel))
        .and_then(|g| g.primary().megakernel_summary());
    let dtype = args.target.dtype;
    let timeline_svg = match &timeline {
        Some((path, tl)) => {
            let gpu_ms = decode_gpu_ms_per_step.map_or(String::new(), |g| format!(", {g:.3} ms GPU"));
            let title = format!(
                "{} {dtype}, batch {batch}: a megakernel decode step at {} cached tokens (timed steps: {ms_per_step:.3} ms wall{gpu_ms})",
                args.target.model,
                decode_prefill + steps
            );
            write_atomically(path, &render_timeline_svg(tl, &title))?;
            Some(path.display().to_string())
        }
        None => None,
    };
    let facts = run.facts()?;
    let mut notes = std::mem::take(&mut run.notes);
    notes.extend(facts.notes.iter().cloned());
    let (device_name, devices, tuned) = (&facts.device_name, &facts.devices, facts.tuned);
    let draw = &run.draw;
    let mut out = std::io::stdout().lock();
    if args.json {
        let mut decode = json!({
            "steps": steps,
            "prefill_tokens": decode_prefill,
            "total_ms": decode_ms,
            "ms_per_step": ms_per_step,
            "tokens_per_s": decode_tps,
            "engine": engine,
            "cuda_graphs": decode_graphs,
            "gpu_ms_per_step": decode_gpu_ms_per_step,
            "sampling": draw.params,
            "seed": draw.seed,
        });
        if let Some(d) = decode.as_object_mut() {
            d.extend(FloorReport::json_fields(floor.as_ref()));
            if let Some(m) = &megakernel {
                d.insert("megakernel".to_string(), json!(m));
            }
        }
        let j = json!({
            "device": run.device.as_str(),
            "device_name": device_name,
            "devices": devices,
            "batch_slices": slices,
            "unfused": args.target.unfused,
            "dtype": dtype,
            "model": args.target.model,
            "config": cfg,
            "batch": batch,
            "seq": args.seq,
            "warmup_ms": warmup_ms,
            "forward": ForwardTiming::json(forward.as_ref()),
            "decode": decode,
            "compute_peak": ComputePeak::json(peak.as_ref()),
            "timeline_svg": timeline_svg,
            "timeline_ops": timeline.as_ref().map(|(_, tl)| summarize(tl)),
            "tuned_kernels": tuned.map(|(t, n)| json!({ "tuned": t, "total": n })),
            "kernels": facts.kernels_json(),
            "profile": { "forward": prof_forward, "decode": prof_decode },
            "notes": notes,
        });
        writeln!(out, "{j}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{device_name}: {} (L={}, NH={}, C={}), {dtype}, batch {batch} x seq {}",
        args.target.model, cfg.n_layer, cfg.n_head, cfg.n_embd, args.seq
    )?;
    if devices.len() > 1 {
        let on: Vec<String> = devices.iter().map(|d| format!("cuda:{d}")).collect();
        let cut: Vec<String> = slices.iter().map(usize::to_string).collect();
        writeln!(
            out,
            "batch sliced across {}: {} sequences (the floor and the per-kernel tables are cuda:{}'s)",
            on.join(", "),
            cut.join(" + "),
            devices[0]
        )?;
    }
    writeln!(out, "warm-up (compile + first runs): {warmup_ms:.1} ms")?;
    match &forward {
        Some(f) => writeln!(
            out,
            "forward: median {:.2} ms of {repeats} ({:.0} tokens/s)",
            f.median_ms, f.tokens_per_s
        )?,
        None => writeln!(out, "forward: not timed (see the note below)")?,
    }
    if steps > 0 {
        let how = format!("{}{}", engine_words(engine, decode_graphs), draw_words(draw));
        writeln!(
            out,
            "decode: {steps} steps after a {decode_prefill}-token prefill in {decode_ms:.1} ms ({ms_per_step:.3} ms/step{}, {decode_tps:.1} tokens/s{how})",
            decode_gpu_ms_per_step.map_or(String::new(), |g| format!(" of which {g:.3} ms on the GPU")),
        )?;
    }
    if let Some(m) = &megakernel {
        writeln!(out, "megakernel: {}", m.line())?;
    }
    if let (Some(f), true) = (&floor, run.gpu.is_some()) {
        writeln!(out, "{}", f.line())?;
    }
    if let (Some(path), Some((_, tl))) = (&timeline_svg, &timeline) {
        writeln!(
            out,
            "timeline: {path} ({} tasks on {} blocks)",
            tl.tasks.len(),
            tl.blocks
        )?;
        write!(out, "{}", summary_table(&summarize(tl)))?;
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

/// `, graph engine` (or how the graph engine ran) for the decode line.
pub(super) fn engine_words(engine: Option<DecodeEngine>, decode_graphs: bool) -> String {
    match engine {
        Some(DecodeEngine::Graph) if !decode_graphs => {
            ", graph engine run as launches (KERNELFORGE_SYNC_EACH)".to_string()
        }
        Some(e) => format!(", {e} engine"),
        None => String::new(),
    }
}

/// `, greedy` or `, sampled: temperature T top-k K top-p P` for the decode line.
pub(super) fn draw_words(draw: &Draw) -> String {
    if draw.params.is_greedy() {
        ", greedy".to_string()
    } else {
        let p = &draw.params;
        format!(
            ", sampled: temperature {} top-k {} top-p {}",
            p.temperature, p.top_k, p.top_p
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::cpu_target;
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::weights::{write_llmc, GPT2Weights, LlmcVersion};

    #[test]
    fn bench_runs_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(1, 2, 32, 16, 100).unwrap();
        let bin = dir.path().join("m.bin");
        write_llmc(&bin, &cfg, &GPT2Weights::random(&cfg, 3), LlmcVersion::F32).unwrap();
        let args = BenchArgs {
            target: cpu_target(&bin.display().to_string()),
            engine: EngineArgs::default(),
            batch: BatchList::parse("2").unwrap(),
            seq: 12,
            generate: 8, // 12 + 8 > 16: the decode prefill shrinks to 8 tokens
            sampling: SamplingArgs {
                top_k: Some(5),
                ..Default::default()
            },
            repeats: 2,
            no_cuda_graphs: false,
            timeline: None,
            json: true,
        };
        run_bench(&args).unwrap();
        run_bench(&BenchArgs {
            json: false,
            ..args.clone()
        })
        .unwrap();
        // The deprecated --no-cuda-graphs is ignored on the CPU (with a note).
        run_bench(&BenchArgs {
            no_cuda_graphs: true,
            ..args.clone()
        })
        .unwrap();
        let too_long = BenchArgs {
            seq: 17,
            ..args.clone()
        };
        assert!(run_bench(&too_long).unwrap_err().to_string().contains("context"));
        // An engine or a timeline on the CPU: refused before any work, naming the fix.
        let engine = BenchArgs {
            engine: EngineArgs {
                decode_engine: Some(DecodeEngine::Megakernel),
            },
            ..args.clone()
        };
        let e = run_bench(&engine).unwrap_err().to_string();
        assert!(
            e.contains("--decode-engine megakernel") && e.contains("--device cuda"),
            "{e}"
        );
        let timeline = BenchArgs {
            timeline: Some(dir.path().join("t.svg")),
            ..args
        };
        let e = run_bench(&timeline).unwrap_err().to_string();
        assert!(e.contains("--timeline needs --decode-engine megakernel"), "{e}");
        assert!(!dir.path().join("t.svg").exists());
    }
}
