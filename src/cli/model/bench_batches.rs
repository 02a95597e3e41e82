//! `kernelforge bench --batch 1,8,32,...`: decode timed at every batch of a list in one process
//! (the model loaded and the backend built once, for the largest batch), printed as one table:
//! batch, engine, tokens/s, GPU ms a step, the floor (the larger of the memory bound and the
//! compute bound) with the bound that sets it, and the share of the floor reached; with
//! `--json` one object with a `batches` array. The forward pass runs at the first batch only.
//! This file measures; `bench_batches_report.rs` renders the table and the JSON.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};

use super::bench::BenchArgs;
use super::bench_batches_report::progress_words;
use super::bench_decode::{ComputePeak, FloorReport};
use super::bench_setup::{bench_tokens, set_up, BackendFacts, BenchSetup, ForwardTiming};
use crate::model::engine::DecodeEngine;
use crate::model::gpu::MegakernelSummary;

/// The timed decode steps of one batch.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct DecodeTiming {
    pub(super) total_ms: f64,
    pub(super) ms_per_step: f64,
    pub(super) tokens_per_s: f64,
    pub(super) gpu_ms_per_step: Option<f64>,
}

/// What one batch of the list measured.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct BatchRun {
    pub(super) batch: usize,
    /// Each GPU's slice of the batch (`[batch]` on the CPU; empty when it did not run).
    pub(super) slices: Vec<usize>,
    /// The engine it ran on (`None`: the CPU).
    pub(super) engine: Option<DecodeEngine>,
    pub(super) cuda_graphs: bool,
    /// `Err`: why this batch did not run (the other batches still do).
    pub(super) timing: Result<DecodeTiming, String>,
    pub(super) megakernel: Option<MegakernelSummary>,
    pub(super) floor: Option<FloorReport>,
}

/// Everything a `--batch` list measured, for the table or the JSON object.
pub(super) struct BatchesReport {
    pub(super) run: BenchSetup,
    pub(super) first: usize,
    /// The first forward pass (compiles, first runs); `None` with the forward pass left out.
    pub(super) warmup_ms: Option<f64>,
    /// The timed forward passes at the first batch (`None`: too large for the kernels' index).
    pub(super) forward: Option<ForwardTiming>,
    pub(super) batches: Vec<BatchRun>,
    pub(super) copy_gb_per_s: Option<f64>,
    pub(super) peak: Option<ComputePeak>,
    pub(super) facts: BackendFacts,
    pub(super) notes: Vec<String>,
}

/// `bench` with a `--batch` list: the forward pass at the first batch, then at each batch a
/// warm-up and the timed decode steps (a line on stderr per batch), then the copy bandwidth and
/// the compute peak, once, and the table (or the JSON object).
pub(super) fn run_bench_batches(args: &BenchArgs) -> Result<()> {
    let report = measure_batches(args)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", report.json(args))?;
    } else {
        write!(out, "{}", report.text(args))?;
    }
    drop(out);
    if !args.json {
        for n in &report.notes {
            eprintln!("note: {n}");
        }
    }
    Ok(())
}

fn measure_batches(args: &BenchArgs) -> Result<BatchesReport> {
    if args.timeline.is_some() {
        bail!(
            "--timeline draws one batch's megakernel step, and --batch {} lists several; give one --batch with --timeline",
            args.batch
        );
    }
    if args.generate == 0 {
        bail!(
            "--batch {} times decode at each batch, and --generate 0 runs no decode step; pass --generate N with N >= 1",
            args.batch
        );
    }
    let mut run = set_up(args)?;
    let first = args.batch.first();
    let tokens = bench_tokens(first, args.seq, run.cfg.vocab_size);
    let repeats = args.repeats.max(1);
    // The forward pass at the first batch, unless it is too large for the kernels' index.
    let mut warmup_ms = None;
    let forward = if run.forward_fits(first, args.seq, args.generate)? {
        let t0 = Instant::now();
        run.forward(&tokens)?;
        warmup_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
        Some(run.time_forward(&tokens, repeats)?)
    } else {
        None
    };

    let count = args.batch.sizes().len();
    let mut batches = Vec::with_capacity(count);
    for (i, &batch) in args.batch.sizes().iter().enumerate() {
        let done = decode_batch(&mut run, args, batch)?;
        eprintln!("bench: batch {batch} ({} of {count}): {}", i + 1, progress_words(&done));
        batches.push(done);
    }
    let (copy_gb_per_s, peak) = if run.steps > 0 {
        (run.copy_bandwidth(), run.compute_peak(args.target.dtype))
    } else {
        (None, None)
    };
    for b in &mut batches {
        if let Ok(t) = &b.timing {
            let slice = b.slices.first().copied().unwrap_or(b.batch);
            b.floor = Some(run.floor(
                args,
                slice,
                copy_gb_per_s,
                peak.as_ref(),
                t.ms_per_step,
                t.gpu_ms_per_step,
            ));
        }
    }
    let facts = run.facts()?;
    let mut notes = std::mem::take(&mut run.notes);
    notes.extend(facts.notes.iter().cloned());
    Ok(BatchesReport {
        run,
        first,
        warmup_ms,
        forward,
        batches,
        copy_gb_per_s,
        peak,
        facts,
        notes,
    })
}

/// Puts every replica on the engine `batch` runs on: the one asked for, else (fused) the one the
/// tuning database prefers for this batch, as a run of this batch alone would choose.
fn set_engine_for(run: &mut BenchSetup, args: &BenchArgs, batch: usize) -> Result<Option<DecodeEngine>> {
    let Some(g) = run.gpu.as_mut() else {
        return Ok(None);
    };
    let engine = match run.engine {
        Some(asked) => asked,
        None if args.target.unfused => return Ok(Some(g.primary().decode_engine())),
        None => g.primary().tuned_decode_engine(batch),
    };
    for set in g.for_each(move |r| r.set_decode_engine(engine))? {
        set?;
    }
    Ok(Some(engine))
}

/// One batch: its engine, a warm-up (kernels compiled, the graph recorded), then the timed
/// steps. A batch the engine refuses, or whose steps fail, keeps the reason in `timing`.
fn decode_batch(run: &mut BenchSetup, args: &BenchArgs, batch: usize) -> Result<BatchRun> {
    let (steps, prefill, vocab) = (run.steps, run.decode_prefill, run.cfg.vocab_size);
    let timed = |run: &mut BenchSetup| -> Result<(Option<DecodeEngine>, DecodeTiming)> {
        let engine = set_engine_for(run, args, batch)?;
        if steps == 0 {
            bail!("no decode step is timed (see the notes)");
        }
        let prompts: Vec<Vec<u32>> = bench_tokens(batch, args.seq, vocab)
            .into_iter()
            .map(|t| t[..prefill].to_vec())
            .collect();
        run.decode(&prompts, steps.min(2))?; // warm-up
        run.take_gpu_ms_per_step()?;
        let (total_ms, _) = run.decode(&prompts, steps)?;
        let timing = DecodeTiming {
            total_ms,
            ms_per_step: total_ms / steps as f64,
            tokens_per_s: (batch * steps) as f64 / (total_ms / 1e3),
            gpu_ms_per_step: run.take_gpu_ms_per_step()?,
        };
        // the engine the steps ran on: a batch the megakernel cannot hold runs on the graph's
        let slice = run.slices(batch).first().copied().unwrap_or(batch);
        let ran = run.gpu.as_ref().map(|g| g.primary().engine_for(slice));
        Ok((ran.or(engine), timing))
    };
    let (engine, timing) = match timed(run) {
        Ok((engine, timing)) => (engine, Ok(timing)),
        Err(e) => (
            run.gpu.as_ref().map(|g| g.primary().decode_engine()),
            Err(format!("{e:#}")),
        ),
    };
    let megakernel = run
        .gpu
        .as_ref()
        .filter(|_| timing.is_ok() && engine == Some(DecodeEngine::Megakernel))
        .and_then(|g| g.primary().megakernel_summary());
    Ok(BatchRun {
        batch,
        // A batch that did not run may not have been sliced: no slices rather than stale ones.
        slices: if timing.is_ok() { run.slices(batch) } else { Vec::new() },
        engine,
        cuda_graphs: run.gpu.as_ref().is_some_and(|g| g.primary().decode_graphs()),
        timing,
        megakernel,
        floor: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::batch_list::BatchList;
    use super::super::tests::cpu_target;
    use super::super::EngineArgs;
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::weights::{write_llmc, GPT2Weights, LlmcVersion};

    /// A list on the CPU runs end to end (model loaded once), text and JSON; a list with
    /// --timeline or --generate 0 is refused before any work.
    #[test]
    fn a_batch_list_runs_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(1, 2, 32, 16, 100).unwrap();
        let bin = dir.path().join("m.bin");
        write_llmc(&bin, &cfg, &GPT2Weights::random(&cfg, 3), LlmcVersion::F32).unwrap();
        let args = BenchArgs {
            target: cpu_target(&bin.display().to_string()),
            engine: EngineArgs::default(),
            batch: BatchList::parse("1,3,2").unwrap(),
            seq: 8,
            generate: 4,
            sampling: Default::default(),
            repeats: 1,
            no_cuda_graphs: false,
            timeline: None,
            json: true,
        };
        super::super::run_bench(&args).unwrap();
        super::super::run_bench(&BenchArgs {
            json: false,
            ..args.clone()
        })
        .unwrap();
        let e = super::super::run_bench(&BenchArgs {
            timeline: Some(dir.path().join("t.svg")),
            ..args.clone()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("--batch 1,3,2") && e.contains("give one --batch"), "{e}");
        let e = super::super::run_bench(&BenchArgs { generate: 0, ..args })
            .unwrap_err()
            .to_string();
        assert!(e.contains("--generate 0") && e.contains("--generate N"), "{e}");
    }

    /// On a GPU: a list runs on the graph engine with both floors measured; the megakernel
    /// runs the batches it holds and shows the others as n/a with the reason; a list whose
    /// largest batch cannot fit is refused before anything runs, naming the largest that can.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_batch_list_runs_on_the_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(2, 2, 128, 128, 1000).unwrap();
        let bin = dir.path().join("m.bin");
        write_llmc(&bin, &cfg, &GPT2Weights::random(&cfg, 5), LlmcVersion::F32).unwrap();
        let args = |batch: &str, engine| BenchArgs {
            target: super::super::ModelArgs {
                device: Some(super::super::Device::Cuda),
                ..cpu_target(&bin.display().to_string())
            },
            engine: EngineArgs {
                decode_engine: Some(engine),
            },
            batch: BatchList::parse(batch).unwrap(),
            seq: 16,
            generate: 4,
            sampling: Default::default(),
            repeats: 1,
            no_cuda_graphs: false,
            timeline: None,
            json: false,
        };
        let graph = args("1,2,16", DecodeEngine::Graph);
        let report = measure_batches(&graph).unwrap();
        assert!(
            report.copy_gb_per_s.is_some() && report.peak.is_some(),
            "{:?}",
            report.notes
        );
        assert_eq!(
            report.batches.iter().map(|b| b.batch).collect::<Vec<_>>(),
            vec![1, 2, 16]
        );
        for b in &report.batches {
            let t = b.timing.as_ref().unwrap();
            assert!(t.tokens_per_s > 0.0 && t.gpu_ms_per_step.is_some(), "{b:?}");
            assert_eq!(b.engine, Some(DecodeEngine::Graph));
            assert!(b.floor.as_ref().and_then(FloorReport::bound).is_some(), "{b:?}");
        }
        let text = report.text(&graph);
        eprintln!("{text}");
        assert!(
            text.contains("batches 1,2,16 x seq 16") && text.contains("% of floor"),
            "{text}"
        );
        let j = report.json(&graph);
        assert_eq!(j["batches"].as_array().unwrap().len(), 3);
        assert!(
            j["batches"][2]["floor_bound"].is_string() && j["compute_peak"]["tflops"].is_number(),
            "{j}"
        );

        let mega = args("1,16", DecodeEngine::Megakernel);
        let report = measure_batches(&mega).unwrap();
        let text = report.text(&mega);
        eprintln!("{text}");
        assert!(report.batches[0].timing.is_ok(), "{text}");
        if let Err(why) = &report.batches[1].timing {
            assert!(
                !why.is_empty() && text.contains("batch 16: n/a on the megakernel engine: "),
                "{text}"
            );
        }

        let e = measure_batches(&args("1,1000000", DecodeEngine::Graph))
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.starts_with("--batch 1,1000000: cuda:0 (") && e.contains("the largest batch that fits is "),
            "{e}"
        );
    }
}
