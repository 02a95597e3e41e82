//! `kernelforge bench --batch 1,8,32,...`: decode timed at every batch of a list in one process
//! (the model loaded and the backend built once, for the largest batch), printed as one table:
//! batch, engine, tokens/s, GPU ms a step, the floor (the larger of the memory bound and the
//! compute bound) with the bound that sets it, and the share of the floor reached; with
//! `--json` one object with a `batches` array. The forward pass runs at the first batch only.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::bench::{draw_words, BenchArgs};
use super::bench_decode::{grouped, ComputePeak, FloorReport};
use super::bench_setup::{bench_tokens, set_up, BackendFacts, BenchSetup};
use crate::model::engine::DecodeEngine;
use crate::model::generate::Draw;
use crate::model::gpu::MegakernelSummary;

/// The timed decode steps of one batch.
#[derive(Clone, Debug, PartialEq)]
struct DecodeTiming {
    total_ms: f64,
    ms_per_step: f64,
    tokens_per_s: f64,
    gpu_ms_per_step: Option<f64>,
}

/// What one batch of the list measured.
#[derive(Clone, Debug, PartialEq)]
struct BatchRun {
    batch: usize,
    /// Each GPU's slice of the batch (`[batch]` on the CPU; empty when it did not run).
    slices: Vec<usize>,
    /// The engine it ran on (`None`: the CPU).
    engine: Option<DecodeEngine>,
    cuda_graphs: bool,
    /// `Err`: why this batch did not run (the other batches still do).
    timing: Result<DecodeTiming, String>,
    megakernel: Option<MegakernelSummary>,
    floor: Option<FloorReport>,
}

/// Everything a `--batch` list measured, for the table or the JSON object.
struct BatchesReport {
    run: BenchSetup,
    first: usize,
    warmup_ms: f64,
    /// The timed forward passes (ms), their median and its tokens/s.
    forward_runs: Vec<f64>,
    forward_ms: f64,
    forward_tps: f64,
    batches: Vec<BatchRun>,
    copy_gb_per_s: Option<f64>,
    peak: Option<ComputePeak>,
    facts: BackendFacts,
    notes: Vec<String>,
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
    let t0 = Instant::now();
    run.forward(&tokens)?; // warm-up
    let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (forward_runs, forward_ms) = run.time_forward(&tokens, repeats)?;
    let forward_tps = (first * args.seq) as f64 / (forward_ms / 1e3);

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
        forward_runs,
        forward_ms,
        forward_tps,
        batches,
        copy_gb_per_s,
        peak,
        facts,
        notes,
    })
}

impl BatchesReport {
    /// `bench --batch LIST --json`: the one-batch document's header and forward pass (at the
    /// first batch), a `batches` array in place of its `decode` object, the copy bandwidth and
    /// compute peak the floors were divided by; no profile or timeline.
    fn json(&self, args: &BenchArgs) -> Value {
        let (run, facts) = (&self.run, &self.facts);
        json!({
            "device": run.device.as_str(),
            "device_name": facts.device_name,
            "devices": facts.devices,
            "unfused": args.target.unfused,
            "dtype": args.target.dtype,
            "model": args.target.model,
            "config": run.cfg,
            "batch": self.first,
            "seq": args.seq,
            "warmup_ms": self.warmup_ms,
            "forward": {
                "median_ms": self.forward_ms,
                "runs_ms": self.forward_runs,
                "tokens": self.first * args.seq,
                "tokens_per_s": self.forward_tps,
            },
            "copy_gb_per_s": self.copy_gb_per_s,
            "compute_peak": ComputePeak::json(self.peak.as_ref()),
            "batches": self
                .batches
                .iter()
                .map(|b| batch_json(b, &run.draw, run.decode_prefill, run.steps))
                .collect::<Vec<_>>(),
            "tuned_kernels": facts.tuned.map(|(t, n)| json!({ "tuned": t, "total": n })),
            "kernels": facts.kernels_json(),
            "notes": self.notes,
        })
    }

    /// The header lines, the table, the floor legend and the kernels line.
    fn text(&self, args: &BenchArgs) -> String {
        let (run, facts, cfg) = (&self.run, &self.facts, &self.run.cfg);
        let (steps, prefill, first) = (run.steps, run.decode_prefill, self.first);
        let mut text = format!(
            "{}: {} (L={}, NH={}, C={}), {}, batches {} x seq {}\n",
            facts.device_name,
            args.target.model,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            args.target.dtype,
            args.batch,
            args.seq
        );
        if facts.devices.len() > 1 {
            let on: Vec<String> = facts.devices.iter().map(|d| format!("cuda:{d}")).collect();
            text += &format!(
                "each batch sliced across {} (the floor is cuda:{}'s slice)\n",
                on.join(", "),
                facts.devices[0]
            );
        }
        text += &format!("warm-up (compile + first forward pass): {:.1} ms\n", self.warmup_ms);
        text += &format!(
            "forward (batch {first} only): median {:.2} ms of {} ({:.0} tokens/s)\n",
            self.forward_ms,
            self.forward_runs.len(),
            self.forward_tps
        );
        text += &format!(
            "decode: {steps} steps after a {prefill}-token prefill at each batch{}\n",
            draw_words(&run.draw)
        );
        text += &batches_table(&self.batches);
        if let Some(legend) = floor_legend(prefill + steps / 2, self.copy_gb_per_s, self.peak.as_ref()) {
            text += &format!("{legend}\n");
        }
        if let Some((t, n)) = facts.tuned {
            text += &format!("kernels: {t}/{n} tuned\n");
        }
        text
    }
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

/// The engine as the table names it (`cpu` on the CPU).
fn engine_cell(b: &BatchRun) -> String {
    match b.engine {
        Some(DecodeEngine::Graph) if !b.cuda_graphs => "graph (as launches)".to_string(),
        Some(e) => e.to_string(),
        None => "cpu".to_string(),
    }
}

/// `13,671 tokens/s, 0.385 ms GPU a step, graph engine` (or why the batch did not run): the
/// progress line of a batch.
fn progress_words(b: &BatchRun) -> String {
    let engine = engine_cell(b);
    match &b.timing {
        Ok(t) => format!(
            "{} tokens/s, {}{engine} engine",
            grouped(t.tokens_per_s, 0),
            t.gpu_ms_per_step
                .map_or(String::new(), |g| format!("{g:.3} ms GPU a step, "))
        ),
        Err(why) => format!("n/a on the {engine} engine: {why}"),
    }
}

/// The floor of a batch and the share of it its steps reached: the floor over the GPU time of
/// a step, or over the wall time (marked) when the GPU time is not known.
fn floor_cells(b: &BatchRun) -> [String; 3] {
    let dash = || "-".to_string();
    let (Ok(t), Some((bound, floor_ms))) = (&b.timing, b.floor.as_ref().and_then(FloorReport::bound)) else {
        return [dash(), dash(), dash()];
    };
    let share = match t.gpu_ms_per_step {
        Some(gpu) if gpu > 0.0 => format!("{:.0}%", 100.0 * floor_ms / gpu),
        _ if t.ms_per_step > 0.0 => format!("{:.0}% (wall)", 100.0 * floor_ms / t.ms_per_step),
        _ => dash(),
    };
    [format!("{floor_ms:.3}"), bound.as_str().to_string(), share]
}

/// The table of a `--batch` list: a row per batch, then a line per batch that did not run.
fn batches_table(batches: &[BatchRun]) -> String {
    let header = [
        "batch",
        "engine",
        "tokens/s",
        "GPU ms a step",
        "floor ms",
        "bound",
        "% of floor",
    ];
    let mut rows = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    let mut refused = Vec::new();
    for b in batches {
        let mut row = vec![b.batch.to_string(), engine_cell(b)];
        match &b.timing {
            Ok(t) => {
                row.push(grouped(t.tokens_per_s, 0));
                row.push(t.gpu_ms_per_step.map_or("-".to_string(), |g| format!("{g:.3}")));
            }
            Err(why) => {
                row.extend(["n/a".to_string(), "n/a".to_string()]);
                refused.push(format!(
                    "batch {}: n/a on the {} engine: {why}\n",
                    b.batch,
                    engine_cell(b)
                ));
            }
        }
        row.extend(floor_cells(b));
        rows.push(row);
    }
    let mut text = crate::cli::kernels::render_table(&rows);
    text.extend(refused);
    text
}

/// What the floor columns mean, with the figures they were divided by (`None` when neither was
/// measured: the CPU).
fn floor_legend(cache_len: usize, copy_gb_per_s: Option<f64>, peak: Option<&ComputePeak>) -> Option<String> {
    if copy_gb_per_s.is_none() && peak.is_none() {
        return None;
    }
    let memory = match copy_gb_per_s {
        Some(bw) => format!("{} GB/s", grouped(bw, 0)),
        None => "not measured".to_string(),
    };
    let compute = match peak {
        Some(p) => format!("{}, {:.1} TFLOP/s", p.source, p.flops_per_s / 1e12),
        None => "not measured".to_string(),
    };
    Some(format!(
        "floor: the larger of the memory bound (the weights and the KV cache at {cache_len} cached tokens, the mean \
         of the timed steps, over the copy bandwidth: {memory}) and the compute bound (the step's FLOPs over {compute}), \
         both measured in this run; % of floor: the floor over the GPU time of a step"
    ))
}

/// A batch's entry of the `batches` array: the `decode` object of a one-batch run (nulls for the
/// timings of a batch that did not run) with `batch`, `batch_slices` and `error`.
fn batch_json(b: &BatchRun, draw: &Draw, prefill: usize, steps: usize) -> Value {
    let t = b.timing.as_ref().ok();
    let mut entry = json!({
        "batch": b.batch,
        "batch_slices": b.slices,
        "error": b.timing.as_ref().err(),
        "steps": if t.is_some() { steps } else { 0 },
        "prefill_tokens": prefill,
        "total_ms": t.map(|t| t.total_ms),
        "ms_per_step": t.map(|t| t.ms_per_step),
        "tokens_per_s": t.map(|t| t.tokens_per_s),
        "engine": b.engine,
        "cuda_graphs": b.cuda_graphs,
        "gpu_ms_per_step": t.and_then(|t| t.gpu_ms_per_step),
        "sampling": draw.params,
        "seed": draw.seed,
    });
    if let Some(map) = entry.as_object_mut() {
        map.extend(FloorReport::json_fields(b.floor.as_ref()));
        if let Some(m) = &b.megakernel {
            map.insert("megakernel".to_string(), json!(m));
        }
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::super::batch_list::BatchList;
    use super::super::bench_decode::FloorBound;
    use super::super::tests::cpu_target;
    use super::super::EngineArgs;
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::floor::{decode_step_bytes, decode_step_flops};
    use crate::model::weights::{write_llmc, GPT2Weights, LlmcVersion};

    fn timing(tokens_per_s: f64, ms_per_step: f64, gpu: Option<f64>) -> Result<DecodeTiming, String> {
        Ok(DecodeTiming {
            total_ms: 32.0 * ms_per_step,
            ms_per_step,
            tokens_per_s,
            gpu_ms_per_step: gpu,
        })
    }

    /// Three batches of 124M bf16 on a GPU (memory-bound, compute-bound, refused) and one on
    /// the CPU (no floor), as the table prints them.
    #[test]
    fn the_table_has_a_row_per_batch_and_says_why_one_did_not_run() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let floor = |batch: usize, cache: usize, ms: f64, gpu: Option<f64>| {
            FloorReport::new(decode_step_bytes(&cfg, 2, batch, cache), Some(4000.0), ms, gpu)
                .with_compute(decode_step_flops(&cfg, batch, cache), Some(100e12))
        };
        let gpu_run = |batch, engine, timing, floor| BatchRun {
            batch,
            slices: vec![batch],
            engine: Some(engine),
            cuda_graphs: engine == DecodeEngine::Graph,
            timing,
            megakernel: None,
            floor,
        };
        let fast = floor(1, 144, 0.3, Some(0.25));
        assert_eq!(fast.bound().unwrap().0, FloorBound::Memory);
        let wide = floor(256, 0, 2.0, None);
        assert_eq!(wide.bound().unwrap().0, FloorBound::Compute);
        let batches = vec![
            gpu_run(
                1,
                DecodeEngine::Megakernel,
                timing(3333.3, 0.3, Some(0.25)),
                Some(fast.clone()),
            ),
            gpu_run(
                256,
                DecodeEngine::Graph,
                timing(128_000.0, 2.0, None),
                Some(wide.clone()),
            ),
            gpu_run(
                32,
                DecodeEngine::Megakernel,
                Err("no point of decode_megakernel holds 32 rows".into()),
                None,
            ),
        ];
        let table = batches_table(&batches);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 6, "{table}");
        assert_eq!(
            lines[0],
            "batch  engine      tokens/s  GPU ms a step  floor ms  bound    % of floor"
        );
        assert!(lines[1].starts_with("-----  ----------  --------"), "{table}");
        // Batch 1: 252.7 MB / 4,000 GB/s = 0.063 ms of 0.25 ms on the GPU.
        let memory_ms = fast.floor_ms.unwrap();
        assert_eq!(
            lines[2],
            format!(
                "1      megakernel  3,333     0.250          {memory_ms:.3}     memory   {:.0}%",
                100.0 * memory_ms / 0.25
            )
        );
        // Batch 256: 63.3 GFLOP / 100 TFLOP/s = 0.633 ms; no GPU time, so against the wall's 2 ms.
        let compute_ms = wide.compute_floor_ms.unwrap();
        assert_eq!(
            lines[3],
            format!("256    graph       128,000   -              {compute_ms:.3}     compute  32% (wall)")
        );
        assert_eq!(
            lines[4],
            "32     megakernel  n/a       n/a            -         -        -"
        );
        assert_eq!(
            lines[5],
            "batch 32: n/a on the megakernel engine: no point of decode_megakernel holds 32 rows"
        );
        // The CPU: no engine, no GPU time, no floor.
        let cpu = BatchRun {
            batch: 2,
            slices: vec![2],
            engine: None,
            cuda_graphs: false,
            timing: timing(50.0, 40.0, None),
            megakernel: None,
            floor: Some(FloorReport::new(decode_step_bytes(&cfg, 4, 2, 10), None, 40.0, None)),
        };
        let table = batches_table(&[cpu]);
        assert_eq!(
            table.lines().nth(2).unwrap(),
            "2      cpu     50        -              -         -      -"
        );
        assert_eq!(
            progress_words(&batches[0]),
            "3,333 tokens/s, 0.250 ms GPU a step, megakernel engine"
        );
        assert_eq!(
            progress_words(&batches[2]),
            "n/a on the megakernel engine: no point of decode_megakernel holds 32 rows"
        );
        // The legend names both figures; on the CPU there is none.
        let peak = ComputePeak {
            flops_per_s: 800.06e12,
            source: "cuBLAS BF16 on 8192x8192x8192".into(),
        };
        let legend = floor_legend(144, Some(4250.4), Some(&peak)).unwrap();
        assert!(legend.contains("at 144 cached tokens"), "{legend}");
        assert!(legend.contains("over the copy bandwidth: 4,250 GB/s"), "{legend}");
        assert!(
            legend.contains("over cuBLAS BF16 on 8192x8192x8192, 800.1 TFLOP/s"),
            "{legend}"
        );
        assert!(floor_legend(144, None, None).is_none());
        assert!(floor_legend(144, Some(4000.0), None)
            .unwrap()
            .contains("FLOPs over not measured"));
    }

    #[test]
    fn each_batch_entry_is_the_decode_object_with_its_batch_bound_and_error() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let floor = FloorReport::new(decode_step_bytes(&cfg, 2, 8, 144), Some(4000.0), 0.4, Some(0.35))
            .with_compute(decode_step_flops(&cfg, 8, 144), Some(800e12));
        let ran = BatchRun {
            batch: 8,
            slices: vec![8],
            engine: Some(DecodeEngine::Graph),
            cuda_graphs: true,
            timing: timing(20_000.0, 0.4, Some(0.35)),
            megakernel: None,
            floor: Some(floor),
        };
        let j = batch_json(&ran, &Draw::greedy(), 128, 32);
        for key in [
            "batch",
            "batch_slices",
            "error",
            "steps",
            "prefill_tokens",
            "total_ms",
            "ms_per_step",
            "tokens_per_s",
            "engine",
            "cuda_graphs",
            "gpu_ms_per_step",
            "sampling",
            "seed",
            "floor_bytes",
            "weights_bytes",
            "kv_bytes",
            "copy_gb_per_s",
            "floor_ms",
            "floor_share",
            "floor_share_gpu",
            "floor_bound",
            "compute_floor_ms",
        ] {
            assert!(j.get(key).is_some(), "{key} missing from {j}");
        }
        assert_eq!((j["batch"].as_u64(), j["steps"].as_u64()), (Some(8), Some(32)));
        assert_eq!(
            (j["engine"].as_str(), j["floor_bound"].as_str()),
            (Some("graph"), Some("memory"))
        );
        assert!(j["error"].is_null());
        let refused = BatchRun {
            batch: 32,
            engine: Some(DecodeEngine::Megakernel),
            timing: Err("too many rows".into()),
            floor: None,
            ..ran
        };
        let j = batch_json(&refused, &Draw::greedy(), 128, 32);
        assert_eq!(j["error"], "too many rows");
        assert_eq!(j["steps"], 0);
        assert!(j["tokens_per_s"].is_null() && j["floor_bound"].is_null() && j["compute_floor_ms"].is_null());
    }

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
