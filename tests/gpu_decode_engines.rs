//! What every decode engine (launches, graph, megakernel) shares, on random models: steps that
//! choose their tokens on the device run one ahead and give the ids of steps run one at a time;
//! greedy ids of every engine equal the kernel-by-kernel path's over 256 steps; a batch the
//! megakernel cannot hold runs on the graph engine and says so; a graph step whose cache grows
//! into the next length bucket switches its attention kernel in place; and `tune --decode-step`
//! stores the faster engine, which `bench` then runs by default.
//!
//! GPU tests are `#[ignore = "needs a CUDA GPU"]`.

mod decode_support;

use decode_support::{backend, gpu_lock, model, tie_gap};
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::model::config::GPT2Config;
use kernelforge::model::generate::{Backend, Logits};
use kernelforge::model::gpu::GpuBackend;
use kernelforge::model::sampling::argmax;
use kernelforge::model::weights::GPT2Weights;
use kernelforge::model::DecodeEngine;
use kernelforge::spec::Dtype;
use kernelforge::tune::db::{default_path, DbHeader, Entry, TuneKey, TuningDb};
use kernelforge::tune::workloads::decode_attention_shape;

/// Greedy steps run one ahead on every engine (`model::gpu::run_ahead`): a chain of greedy
/// steps, broken now and then by feeding other tokens, up to the end of the context, gives
/// exactly the ids of the same steps run one at a time (each step's logits, argmax on the
/// host); every step the caller consumed counts once in the GPU time, none thrown away does;
/// and a prefill after a step left running ahead starts clean.
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_steps_run_ahead_equal_steps_run_one_at_a_time() {
    let _lock = gpu_lock();
    let tiny = model(2, 2, 128, 64, 300, 31);
    for (dtype, engine) in [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .flat_map(|dtype| DecodeEngine::ALL.map(|engine| (dtype, engine)))
    {
        let mut ahead = backend(&tiny, 2, dtype, engine);
        let mut one_at_a_time = backend(&tiny, 2, dtype, engine);
        let prompts: Vec<Vec<u32>> = vec![
            (0..9).map(|i| (i * 13 + 5) % 300).collect(),
            (0..9).map(|i| (i * 29 + 1) % 300).collect(),
        ];
        let first = one_at_a_time.prefill_last(&prompts).unwrap();
        ahead.prefill_last(&prompts).unwrap();
        ahead.take_decode_gpu_time();
        let mut feed: Vec<u32> = (0..2).map(|b| argmax(first.last(b)).unwrap()).collect();
        let mut calls = 0;
        for step in 9..64 {
            let got = ahead.decode_argmax(&feed).unwrap();
            calls += 1;
            let logits: Logits = one_at_a_time.decode(&feed).unwrap();
            let want: Vec<u32> = (0..2).map(|b| argmax(logits.last(b)).unwrap()).collect();
            assert_eq!(
                got, want,
                "{dtype:?} {engine:?} position {step}: ids of the chain against one step at a time"
            );
            // every seventh step the caller breaks the chain: the step run ahead is thrown away
            feed = if step % 7 == 0 {
                got.iter().map(|&t| (t + 1) % 300).collect()
            } else {
                got
            };
        }
        let err = ahead.decode_argmax(&feed).expect_err("the context is full");
        assert!(format!("{err}").contains("context"), "{err}");
        let (_, steps) = ahead.take_decode_gpu_time();
        assert_eq!(
            steps, calls,
            "{dtype:?} {engine:?}: GPU time of the steps consumed, not of those thrown away"
        );
        // a prefill right after a chained step (one ran ahead) starts clean
        let again = ahead.prefill_last(&prompts).unwrap();
        let feed: Vec<u32> = (0..2).map(|b| argmax(again.last(b)).unwrap()).collect();
        let got = ahead.decode_argmax(&feed).unwrap();
        let got = ahead.decode_argmax(&got).unwrap();
        let first = one_at_a_time.prefill_last(&prompts).unwrap();
        let mut want: Vec<u32> = (0..2).map(|b| argmax(first.last(b)).unwrap()).collect();
        for _ in 0..2 {
            let logits: Logits = one_at_a_time.decode(&want).unwrap();
            want = (0..2).map(|b| argmax(logits.last(b)).unwrap()).collect();
        }
        assert_eq!(got, want, "{dtype:?} {engine:?}: two chained steps after a new prefill");
    }
}

/// A batch no megakernel point holds hands off to the graph engine: the steps run (the same
/// logits as a backend asked for the graph engine), the engine reported is the graph, and a
/// note says why; a batch the point holds still runs on the megakernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_batch_larger_than_the_megakernel_holds_runs_on_the_graph_engine_and_says_so() {
    let _lock = gpu_lock();
    let tiny = model(2, 2, 128, 128, 300, 9);
    let prompts: Vec<Vec<u32>> = (0..9).map(|b| vec![b, 1, 2]).collect();
    let next: Vec<u32> = (0..9).collect();
    let run = |engine: DecodeEngine| {
        let mut g = backend(&tiny, 9, Dtype::F32, engine);
        g.prepare(9, 3).unwrap();
        g.prefill_last(&prompts).unwrap();
        let logits = g.decode(&next).unwrap();
        assert_eq!(Backend::decode_engine(&g), Some(DecodeEngine::Graph));
        (logits.data, g.notes())
    };
    let (handed_off, notes) = run(DecodeEngine::Megakernel);
    let (graph, _) = run(DecodeEngine::Graph);
    assert!(handed_off.iter().all(|x| x.is_finite()));
    assert_eq!(handed_off, graph, "the handoff runs the graph engine's kernels");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("batch 9") && n.contains("max_rows") && n.contains("graph engine")),
        "{notes:?}"
    );
    let mut g = backend(&tiny, 8, Dtype::F32, DecodeEngine::Megakernel);
    g.prepare(8, 3).unwrap();
    g.prefill_last(&prompts[..8]).unwrap();
    g.decode(&next[..8]).unwrap();
    assert_eq!(Backend::decode_engine(&g), Some(DecodeEngine::Megakernel));
    // In 16-bit storage the tensor cores take 16 rows on the megakernel, and 17 hand off.
    for (batch, engine) in [(16, DecodeEngine::Megakernel), (17, DecodeEngine::Graph)] {
        let prompts: Vec<Vec<u32>> = (0..batch).map(|b| vec![b, 1, 2]).collect();
        let next: Vec<u32> = (0..batch).collect();
        let mut g = backend(&tiny, batch as usize, Dtype::Bf16, DecodeEngine::Megakernel);
        g.prepare(batch as usize, 3).unwrap();
        g.prefill_last(&prompts).unwrap();
        let logits = g.decode(&next).unwrap();
        assert!(logits.data.iter().all(|x| x.is_finite()), "bf16 batch {batch}");
        assert_eq!(Backend::decode_engine(&g), Some(engine), "bf16 batch {batch}");
    }
}

/// Greedy ids of the graph engine (batch 1, 8, 16, 64 and 256: the decode attention of every cache
/// bucket, the batch handoff) and of the megakernel (1 and 8; 16 in bf16, on the tensor cores) equal the kernel-by-kernel path's
/// over 256 steps, computed on the device (`decode_argmax`). Teacher-forced with the reference's
/// ids, so one near-tie cannot end the comparison: a step may differ only where the reference's
/// top two logits are closer than the dtype's rounding (f32 1e-4 of the largest: the engines sum
/// in other orders; bf16 3e-2), and each such step is counted and printed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_ids_of_every_engine_equal_kernel_by_kernel_over_256_steps() {
    let _lock = gpu_lock();
    let (prompt_len, steps) = (16, 256);
    let tiny = model(2, 2, 128, prompt_len + steps + 8, 1000, 256);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let tie = if dtype == Dtype::F32 { 1e-4 } else { 3e-2 };
        // 16 rows: the megakernel on the tensor cores, bf16 only (f32 hands off past 8)
        let megakernel_rows = if dtype == Dtype::Bf16 { 16 } else { 8 };
        for batch in [1usize, 8, 16, 64, 256] {
            let mut reference = backend(&tiny, batch, dtype, DecodeEngine::Launches);
            let mut engines: Vec<(DecodeEngine, GpuBackend)> = [DecodeEngine::Graph, DecodeEngine::Megakernel]
                .into_iter()
                .filter(|&e| e != DecodeEngine::Megakernel || batch <= megakernel_rows)
                .map(|e| (e, backend(&tiny, batch, dtype, e)))
                .collect();
            let prompts: Vec<Vec<u32>> = (0..batch as u32)
                .map(|b| (0..prompt_len as u32).map(|i| (i * 53 + b * 97 + 5) % 1000).collect())
                .collect();
            let first = reference.prefill_last(&prompts).unwrap();
            for (_, g) in &mut engines {
                g.prefill_last(&prompts).unwrap();
            }
            let mut next: Vec<u32> = (0..batch).map(|b| argmax(first.last(b)).unwrap()).collect();
            let mut ties = vec![0usize; engines.len()];
            for step in 0..steps {
                let want: Logits = reference.decode(&next).unwrap();
                let want_ids: Vec<u32> = (0..batch).map(|b| argmax(want.last(b)).unwrap()).collect();
                for ((engine, g), ties) in engines.iter_mut().zip(&mut ties) {
                    let got = g.decode_argmax(&next).unwrap();
                    assert_eq!(Backend::decode_engine(g), Some(*engine), "{dtype} batch {batch}");
                    for b in 0..batch {
                        if got[b] != want_ids[b] {
                            let gap = tie_gap(want.last(b), want_ids[b], got[b]);
                            assert!(
                                gap <= tie,
                                "{engine:?} {dtype} batch {batch} step {step} sequence {b}: token {} instead of {} \
                                 (gap {gap:.2e} of the largest logit)",
                                got[b],
                                want_ids[b]
                            );
                            *ties += 1;
                        }
                    }
                }
                next = want_ids;
            }
            for ((engine, _), ties) in engines.iter().zip(&ties) {
                eprintln!("{engine:?} {dtype} batch {batch}: {steps} steps, {ties} near-tie disagreements");
            }
        }
    }
}

/// A graph step whose cache grows into the next length bucket switches its attention nodes to
/// that bucket's kernel in place (recording the graph again costs about a millisecond of the
/// host's time in the middle of a decode); a bucket whose kernel brings another number of
/// launches (a combine) records it once more. A 300-token model has buckets 128, 256 and 300;
/// a tuning database gives each its own decode attention, and the graph engine's logits equal
/// the kernel-by-kernel path's at every step across both boundaries.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_steps_switch_the_attention_kernel_of_each_cache_bucket_in_place() {
    graph_steps_equal_launches_with_decode_attention(
        [
            (
                128,
                "attention_decode_groups",
                &[("keys_per_split", 256), ("warps", 4), ("rows_at_once", 2)],
            ),
            (
                256,
                "attention_decode_groups",
                &[("keys_per_split", 512), ("warps", 2), ("rows_at_once", 4)],
            ),
            (300, "attention_decode", &[("splits", 4), ("block_size", 64)]),
        ],
        // recorded at the first step, and at 257 (a combine after the partial kernel); the
        // switch at 129 happened in place
        2,
    );
}

/// `attention_decode_stream` in the graph: its blocks copy the cache rows of their first items
/// before they wait for the QKV projection (a programmatic edge lets them start while it runs),
/// the query and the step's own key and value after. Its logits equal the kernel-by-kernel
/// path's (where each kernel starts after the one before has ended) at every step, in every
/// bucket: one split, a split of the step's row alone, several splits and their combine.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graph_steps_on_the_streaming_decode_attention_equal_kernel_by_kernel() {
    let stream = |split_rows, stages| {
        [
            ("split_rows", split_rows),
            ("warps", 4),
            ("stages", stages),
            ("rows_at_once", 2),
            ("blocks_per_sm", 1),
        ]
    };
    graph_steps_equal_launches_with_decode_attention(
        [
            (128, "attention_decode_stream", &stream(128, 2)),
            (256, "attention_decode_stream", &stream(64, 4)),
            (300, "attention_decode_stream", &stream(32, 3)),
        ],
        // recorded at the first step and at 129 (a combine after the partial kernel from there on)
        2,
    );
}

type Winner<'a> = (i64, &'static str, &'a [(&'static str, i64)]);

/// Greedy decode of a 300-token model (buckets 128, 256 and 300) over its whole context on the
/// graph engine and kernel by kernel, with a tuning database naming each bucket's decode
/// attention (`winners`): the logits agree at every step, and the graph engine recorded its
/// graph `recordings` times.
fn graph_steps_equal_launches_with_decode_attention(winners: [Winner; 3], recordings: usize) {
    let _lock = gpu_lock();
    let (batch, prompt_len, n_ctx) = (3usize, 16usize, 300usize);
    let tiny = model(2, 2, 128, n_ctx, 1000, 77);
    let cache = tempfile::tempdir().unwrap();
    let gpu = Gpu::new(0).unwrap();
    let header = DbHeader::for_device(&gpu, &Compiler::new(&gpu.info.arch()).unwrap());
    // The backends read the database from KERNELFORGE_CACHE when they open (the lock keeps the
    // other tests of this binary from opening one meanwhile).
    std::env::set_var("KERNELFORGE_CACHE", cache.path());
    let mut db = TuningDb::open(&default_path(&header), header).unwrap();
    for (len, family, params) in winners {
        let shape = decode_attention_shape(batch as i64, 2, 64, len);
        let key = TuneKey {
            op: "attention_decode".into(),
            dtype: "bf16".into(),
            variant_kind: "none".into(),
            shape: shape.clone(),
        };
        let params = [("head_dim", 64)]
            .iter()
            .chain(params)
            .map(|&(k, v)| (k.to_string(), v));
        db.insert(&key, Entry::timed(family, params.collect(), shape, 0.01));
    }
    db.save().unwrap();
    let mut reference = backend(&tiny, batch, Dtype::Bf16, DecodeEngine::Launches);
    let mut graph = backend(&tiny, batch, Dtype::Bf16, DecodeEngine::Graph);
    std::env::remove_var("KERNELFORGE_CACHE");

    let prompts: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| (0..prompt_len as u32).map(|i| (i * 31 + b * 7 + 3) % 1000).collect())
        .collect();
    let first = reference.prefill_last(&prompts).unwrap();
    graph.prefill_last(&prompts).unwrap();
    let mut next: Vec<u32> = (0..batch).map(|b| argmax(first.last(b)).unwrap()).collect();
    for position in prompt_len..n_ctx {
        let want: Logits = reference.decode(&next).unwrap();
        let got: Logits = graph.decode(&next).unwrap();
        for b in 0..batch {
            let (w, g) = (want.last(b), got.last(b));
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= 1e-5 * scale,
                "position {position} sequence {b}: the graph's logits differ from kernel-by-kernel's by {worst:.3e} \
                 (largest logit {scale:.3e})"
            );
        }
        next = (0..batch).map(|b| argmax(want.last(b)).unwrap()).collect();
    }
    assert_eq!(
        graph.graphs_recorded(),
        recordings,
        "graphs recorded over {} steps",
        n_ctx - prompt_len
    );
}

/// The kernelforge binary: `KERNELFORGE_BIN`, else the one cargo built beside this test, else a
/// `kernelforge` in this test binary's own folder (the GPU machine runs carried binaries, and
/// `device-pack` puts both in `.device/`, where cargo's path does not exist).
fn kernelforge_bin() -> std::path::PathBuf {
    if let Some(bin) = std::env::var_os("KERNELFORGE_BIN") {
        return bin.into();
    }
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kernelforge"));
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("kernelforge")))
        .filter(|beside| beside.exists())
        .unwrap_or(built)
}

fn run_json(cache: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let bin = kernelforge_bin();
    let out = std::process::Command::new(&bin)
        .args(args)
        .env("KERNELFORGE_CACHE", cache)
        .output()
        .unwrap_or_else(|e| panic!("running {} (set KERNELFORGE_BIN): {e}", bin.display()));
    assert!(
        out.status.success(),
        "kernelforge {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "kernelforge {args:?}: not JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// `tune --decode-step` chooses decode attention and the step's matmuls among their near ties by
/// whole steps, times the graph engine and megakernel points on the model's shape, stores the
/// fastest point with the graph's time beside it, and `bench` then runs the faster engine by
/// default (and the one asked for when asked).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tune_decode_step_stores_the_winner_and_bench_runs_the_faster_engine_by_default() {
    let _gpu = gpu_lock();
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    let config = GPT2Config::new(2, 2, 128, 128, 1000).unwrap();
    kernelforge::model::write_hf_folder(&model_dir, &config, &GPT2Weights::random(&config, 5)).unwrap();
    let model = model_dir.to_str().unwrap();
    let tune_args = [
        "tune",
        "--model",
        model,
        "--batch",
        "1",
        "--seq",
        "32",
        "--budget",
        "30",
        "--decode-step",
        "--json",
    ];
    // The kernels first, then a near tie planted in decode attention's entry and in the fc
    // projection's (a second verified point within 1% of the winner alone), so that
    // `--decode-step` must time both of each in the step.
    let kernels_only: Vec<&str> = tune_args.iter().copied().filter(|a| *a != "--decode-step").collect();
    run_json(cache.path(), &kernels_only);
    let db_file = std::fs::read_dir(cache.path().join("tuning"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .expect("the tuning database");
    let read_db =
        || -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(&db_file).unwrap()).unwrap() };
    let key_of = |db: &serde_json::Value, prefix: &str| {
        db["entries"]
            .as_object()
            .unwrap()
            .keys()
            .find(|k| k.starts_with(prefix))
            .unwrap_or_else(|| panic!("no entry {prefix}..."))
            .clone()
    };
    let attention_prefix = "attention_decode|f32|none|B=1 ";
    // the fc projection of a decode step of one sequence: 512 -> 128, one row
    let matmul_prefix = "matmul|f32|bias_residual|K=512 M=1 N=128 T=1 ";
    let mut db = read_db();
    let mut planted = Vec::new();
    for prefix in [attention_prefix, matmul_prefix] {
        let key = key_of(&db, prefix);
        let entry = &mut db["entries"][&key];
        let alone = (entry["family"].clone(), entry["params"].clone());
        let winner_ms = entry["median_ms"].as_f64().unwrap();
        let tie = entry["candidates"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|c| {
                c["rejected"].is_null()
                    && c["median_ms"].is_f64()
                    && (c["family"].clone(), c["params"].clone()) != alone
            })
            .unwrap_or_else(|| panic!("a second verified candidate in {key}"));
        tie["median_ms"] = serde_json::json!(winner_ms * 1.01);
        planted.push((key, alone, winner_ms));
    }
    std::fs::write(&db_file, serde_json::to_string_pretty(&db).unwrap()).unwrap();

    let tuned = run_json(cache.path(), &tune_args);
    let db = read_db();
    for ((key, alone, winner_ms), rows) in planted.iter().zip(["decode_attention", "decode_matmul"]) {
        let row = tuned[rows]
            .as_array()
            .unwrap_or_else(|| panic!("no {rows} rows: {tuned}"))
            .iter()
            .find(|r| r["key"] == key.as_str())
            .unwrap_or_else(|| panic!("no {rows} row of {key}: {tuned}"));
        assert_eq!(row["from_db"], false, "{row}");
        assert!(row["points_timed"].as_u64().unwrap() >= 2, "{row}");
        let entry = &db["entries"][key];
        let timed: Vec<&serde_json::Value> = entry["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["step_ms"].is_f64())
            .collect();
        assert_eq!(timed.len() as u64, row["points_timed"].as_u64().unwrap(), "{entry}");
        let step_ms = |c: &serde_json::Value| c["step_ms"].as_f64().unwrap();
        let fastest = timed.iter().min_by(|a, b| step_ms(a).total_cmp(&step_ms(b))).unwrap();
        let winner_alone = timed
            .iter()
            .find(|c| (&c["family"], &c["params"]) == (&alone.0, &alone.1))
            .expect("the winner alone was timed in the step");
        // The fastest replaces the winner alone only when more than 0.5% faster in the step,
        // and then brings its own time alone; a kept winner keeps its entry's time.
        let switched = step_ms(fastest) < step_ms(winner_alone) * 0.995;
        let chosen = if switched { fastest } else { winner_alone };
        assert_eq!(
            (&entry["family"], &entry["params"]),
            (&chosen["family"], &chosen["params"]),
            "{key}: the entry's winner is the step's choice"
        );
        assert_eq!(row["chosen"]["ms_per_step"], chosen["step_ms"]);
        let median_alone = if switched {
            chosen["median_ms"].as_f64().unwrap()
        } else {
            *winner_ms
        };
        assert_eq!(entry["median_ms"].as_f64().unwrap(), median_alone, "{entry}");
    }

    let row = &tuned["decode_step"][0];
    let graph = row["graph_ms_per_step"].as_f64().unwrap();
    let mega = row["megakernel_ms_per_step"].as_f64().expect("a megakernel point ran");
    assert!(graph > 0.0 && mega > 0.0, "{row}");
    assert!(
        row["points_tried"].as_u64().unwrap() >= 8,
        "the search moved every parameter: {row}"
    );

    let db = read_db();
    let (key, entry) = db["entries"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.starts_with("decode_step|f32|none|"))
        .expect("a decode_step entry");
    assert!(key.contains("B=1") && key.contains("L=2"), "{key}");
    assert_eq!(entry["median_ms"].as_f64().unwrap(), mega);
    assert_eq!(entry["baseline_ms"].as_f64().unwrap(), graph);
    assert!(entry["candidates"].as_array().unwrap().len() >= 8);

    // Again on the tuned database: every kernel and the decode step are read back, not
    // measured (the time is printed: issue 48 asks for at most 2 s).
    let started = std::time::Instant::now();
    let again = run_json(cache.path(), &tune_args);
    eprintln!(
        "tune --decode-step on the tuned database: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(again["decode_attention"][0]["from_db"], true, "{again}");
    let matmuls = again["decode_matmul"].as_array().expect("matmul rows read back");
    assert!(matmuls.iter().all(|r| r["from_db"] == true), "{again}");
    // Read back, each row still says which matmul of the step it is (from its shape).
    assert!(matmuls.iter().any(|r| r["role"] == "fc_proj"), "{again}");
    assert!(matmuls.iter().all(|r| r["role"] != "matmul"), "{again}");
    let row = &again["decode_step"][0];
    assert_eq!(row["from_db"], true, "{row}");
    assert_eq!(row["megakernel_ms_per_step"].as_f64().unwrap(), mega);
    assert_eq!(row["graph_ms_per_step"].as_f64().unwrap(), graph);

    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench", "--model", model, "--device", "cuda", "--batch", "1", "--seq", "16",
        ];
        args.extend_from_slice(&["--generate", "8", "--repeats", "1", "--json"]);
        args.extend_from_slice(extra);
        run_json(cache.path(), &args)
    };
    let expected = if mega < graph { "megakernel" } else { "graph" };
    assert_eq!(
        bench(&[])["decode"]["engine"],
        expected,
        "graph {graph} ms, megakernel {mega} ms"
    );
    assert_eq!(bench(&["--decode-engine", "graph"])["decode"]["engine"], "graph");
    assert_eq!(
        bench(&["--decode-engine", "megakernel"])["decode"]["engine"],
        "megakernel"
    );
}
