//! How `bench --batch 1,8,32,...` shows what `bench_batches.rs` measured: the table (batch,
//! engine, tokens/s, GPU ms a step, the floor, its bound and the share reached, then a line per
//! batch that did not run, and the floor's legend), the JSON object with its `batches` array, and
//! the progress line of each batch.

use serde_json::{json, Value};

use super::bench::{draw_words, BenchArgs};
use super::bench_batches::{BatchRun, BatchesReport};
use super::bench_decode::{grouped, ComputePeak, FloorReport};
use super::bench_setup::ForwardTiming;
use crate::model::engine::DecodeEngine;
use crate::model::generate::Draw;

impl BatchesReport {
    /// `bench --batch LIST --json`: the one-batch document's header and forward pass (at the
    /// first batch), a `batches` array in place of its `decode` object, the copy bandwidth and
    /// compute peak the floors were divided by; no profile or timeline.
    pub(super) fn json(&self, args: &BenchArgs) -> Value {
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
            "forward": ForwardTiming::json(self.forward.as_ref()),
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
    pub(super) fn text(&self, args: &BenchArgs) -> String {
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
        if let Some(ms) = self.warmup_ms {
            text += &format!("warm-up (compile + first forward pass): {ms:.1} ms\n");
        }
        text += &match &self.forward {
            Some(f) => format!(
                "forward (batch {first} only): median {:.2} ms of {} ({:.0} tokens/s)\n",
                f.median_ms,
                f.runs_ms.len(),
                f.tokens_per_s
            ),
            None => "forward: not timed (see the note below)\n".to_string(),
        };
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
pub(super) fn progress_words(b: &BatchRun) -> String {
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
    use super::super::bench_batches::DecodeTiming;
    use super::super::bench_decode::FloorBound;
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::floor::{decode_step_bytes, decode_step_flops};

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
}
