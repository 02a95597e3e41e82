//! The tuner end to end on the GPU, on small shapes: winners are verified, stored, read back
//! without measuring, and drive the registry.

use std::path::Path;
use std::time::Duration;

use kernelforge::codegen::Renderer;
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::ops::{self, Epilogue, Mask, Shape};
use kernelforge::spec::{Catalog, Dtype};
use kernelforge::tune::db::{DbHeader, TuningDb};
use kernelforge::tune::registry::{Choice, Registry};
use kernelforge::tune::tuner::{tune, Quiet, TuneOptions};
use kernelforge::tune::workloads::Workload;

fn workload(op: &str, epilogue: Epilogue, mask: Mask, pairs: &[(&str, i64)]) -> Workload {
    let contract = ops::op_by_name(op).unwrap();
    let mut shape: Shape = pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    contract.complete_shape(&mut shape, epilogue, mask).unwrap();
    Workload {
        role: op.to_string(),
        op: contract.name(),
        dtype: Dtype::F32,
        epilogue,
        mask,
        shape,
        calls: 1,
    }
}

/// The project's catalog, the GPU, NVRTC and the template renderer.
fn setup() -> (Catalog, Gpu, Compiler, Renderer) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
    let gpu = Gpu::new(0).unwrap();
    let compiler = Compiler::new(&gpu.info.arch()).unwrap();
    let renderer = Renderer::new(&catalog.templates_dir).unwrap();
    (catalog, gpu, compiler, renderer)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tune_store_reuse_and_registry() {
    let (catalog, gpu, compiler, renderer) = setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.json");
    let header = DbHeader::for_device(&gpu, &compiler);
    std::fs::write(&path, "not json at all").unwrap();
    let mut db = TuningDb::open(&path, header.clone()).unwrap();
    assert!(db
        .warning
        .as_deref()
        .unwrap_or("")
        .contains("not a valid tuning database"));
    // A matmul with its epilogue, a layernorm and an attention.
    let workloads: Vec<Workload> = small_workloads().into_iter().take(3).collect();
    let options = TuneOptions {
        budget: Duration::from_secs(40),
        seed: 3,
        force: false,
        baseline: true,
        exhaustive: false,
    };
    let t0 = std::time::Instant::now();
    let results = tune(
        &gpu, &compiler, &renderer, &catalog, &mut db, &workloads, &options, &Quiet,
    )
    .unwrap()
    .results;
    eprintln!("cold: {:.1} s", t0.elapsed().as_secs_f64());
    for r in &results {
        let w = r.winner.as_ref().expect("a winner");
        eprintln!(
            "{} {} -> {} {:?} {:.4} ms (peer {:?}), {} tried",
            r.role,
            r.variant_kind,
            w.family,
            w.params,
            w.median_ms,
            w.baseline_ms,
            r.tried.len()
        );
        assert!(!r.from_db);
        assert!(r.tried.iter().any(|t| t.median_ms.is_some()));
        assert!(w.median_ms > 0.0 && w.spread_ms >= 0.0);
    }
    // The matmul carries its vendor peer: a time, or the reason it has none (a peer that fails
    // the check against the reference is reported, not timed; tests/gpu_baseline.rs checks the
    // peers' accuracy itself).
    let first = results[0].winner.as_ref().unwrap();
    assert!(first.baseline.is_some(), "matmul carries its peer");
    assert!(
        first.baseline_ms.is_some() || first.baseline_unavailable.is_some(),
        "{first:?}"
    );

    // Warm: everything comes from the database, fast.
    let mut again = TuningDb::open(&path, header).unwrap();
    assert_eq!(again.len(), 3);
    let t1 = std::time::Instant::now();
    let warm = tune(
        &gpu, &compiler, &renderer, &catalog, &mut again, &workloads, &options, &Quiet,
    )
    .unwrap();
    assert!(warm.results.iter().all(|r| r.from_db));
    assert_eq!(
        warm.phases.compiled + warm.phases.cached,
        0,
        "nothing compiled when warm"
    );
    assert!(t1.elapsed() < Duration::from_secs(5));

    // The registry now answers with the tuned winners, and the nearest row count for others.
    let mut registry = Registry::new(catalog, Some(again), compiler).unwrap();
    let s = registry
        .select(
            "matmul",
            Dtype::F32,
            Epilogue::BiasGelu,
            Mask::None,
            &workloads[0].shape,
            &gpu.info.limits,
        )
        .unwrap();
    assert_eq!(s.choice, Choice::Tuned);
    assert_eq!(s.variant.family.name, results[0].winner.as_ref().unwrap().family);
    let mut other = workloads[0].shape.clone();
    other.insert("M".into(), 280);
    other.insert("T".into(), 280);
    let s = registry
        .select(
            "matmul",
            Dtype::F32,
            Epilogue::BiasGelu,
            Mask::None,
            &other,
            &gpu.info.limits,
        )
        .unwrap();
    assert_eq!(s.choice, Choice::Nearest);
    let s = registry
        .select(
            "matmul",
            Dtype::F32,
            Epilogue::Bias,
            Mask::None,
            &workloads[0].shape,
            &gpu.info.limits,
        )
        .unwrap();
    assert_eq!(s.choice, Choice::Default);
    // The best-ranked family that runs here: the 3xTF32 one on sm_90a, else the SIMT register tiles.
    let default_family = if gpu.info.compute_capability == (9, 0) {
        "matmul_wgmma_tma_3xtf32"
    } else {
        "matmul_regtile"
    };
    assert_eq!(s.variant.family.name, default_family);
    // A decode-step shape prefers the small-M family (its spec's prefer_when) over the ranks.
    let mut decode = workloads[0].shape.clone();
    decode.insert("M".into(), 1);
    decode.insert("T".into(), 1);
    let s = registry
        .select(
            "matmul",
            Dtype::F32,
            Epilogue::Bias,
            Mask::None,
            &decode,
            &gpu.info.limits,
        )
        .unwrap();
    assert_eq!(
        (s.choice, s.variant.family.name.as_str()),
        (Choice::Default, "matmul_gemv")
    );
}

/// tf32 end to end: the candidates are the tf32 variants, the winner is stored under the tf32
/// key with its peer (cuBLASLt, TF32 compute) beside it, and the registry answers per dtype.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tune_tf32_is_keyed_by_dtype() {
    let (catalog, gpu, compiler, renderer) = setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.json");
    let header = DbHeader::for_device(&gpu, &compiler);
    let mut db = TuningDb::open(&path, header.clone()).unwrap();
    let mut w = workload(
        "matmul",
        Epilogue::BiasGelu,
        Mask::None,
        &[("M", 300), ("N", 384), ("K", 256)],
    );
    w.dtype = Dtype::Tf32;
    let options = TuneOptions {
        budget: Duration::from_secs(15),
        seed: 5,
        force: false,
        baseline: true,
        exhaustive: false,
    };
    let results = tune(
        &gpu,
        &compiler,
        &renderer,
        &catalog,
        &mut db,
        std::slice::from_ref(&w),
        &options,
        &Quiet,
    )
    .unwrap()
    .results;
    let r = &results[0];
    assert_eq!(r.dtype, Dtype::Tf32);
    let winner = r.winner.as_ref().expect("a winner");
    // A tensor-core family (the wgmma ones only exist on compute capability 9.0).
    assert!(
        ["matmul_wmma", "matmul_wgmma", "matmul_wgmma_tma"].contains(&winner.family.as_str()),
        "{}",
        winner.family
    );
    assert_eq!(winner.baseline.as_deref(), Some("cuBLASLt bias+gelu (fused)"));
    assert!(winner.baseline_ms.is_some() || winner.baseline_unavailable.is_some());
    assert!(r.tried.iter().all(|t| t.variant.starts_with("dtype=tf32")));
    let mut registry = Registry::new(catalog, Some(TuningDb::open(&path, header).unwrap()), compiler).unwrap();
    let s = registry
        .select(
            "matmul",
            Dtype::Tf32,
            Epilogue::BiasGelu,
            Mask::None,
            &w.shape,
            &gpu.info.limits,
        )
        .unwrap();
    assert_eq!(
        (s.choice, s.variant.family.name.as_str()),
        (Choice::Tuned, winner.family.as_str())
    );
    assert_eq!(s.variant.dtype, Dtype::Tf32);
    // The same shape in f32 is not tuned and never gets a tf32 kernel.
    let s = registry
        .select(
            "matmul",
            Dtype::F32,
            Epilogue::BiasGelu,
            Mask::None,
            &w.shape,
            &gpu.info.limits,
        )
        .unwrap();
    assert_eq!(s.choice, Choice::Default);
    assert_eq!(s.variant.dtype, Dtype::F32);
}

/// Timing measures GPU time, not launch cost: a call whose host side takes 15 µs but whose GPU
/// work is a tiny copy times far below 15 µs (the hold queued before it covers the host's
/// share), and a call that keeps the GPU busy for 100 µs times at about 100 µs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_timing_counts_gpu_time_not_launch_cost() {
    use kernelforge::tune::time::{time_with, TimingPlan};
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    let mut buffer = gpu.stream.alloc_zeros::<f32>(256).unwrap();
    let plan = TimingPlan {
        warmup: 3,
        min_runs: 20,
        max_runs: 20,
        target_ms: 0.0,
    };
    let slow_host = time_with(&gpu, 1, &plan, |_| {
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_micros(15) {}
        gpu.stream.memset_zeros(&mut buffer).unwrap();
        Ok(())
    })
    .unwrap();
    eprintln!(
        "15 µs of host work + a 1 KB memset: {:.1} µs",
        slow_host.median_ms * 1e3
    );
    assert!(slow_host.median_ms < 0.010, "{slow_host:?}");
    let busy_gpu = time_with(&gpu, 1, &plan, |_| Ok(gpu.hold(100_000)?)).unwrap();
    eprintln!("a 100 µs GPU hold: {:.1} µs", busy_gpu.median_ms * 1e3);
    assert!((0.095..0.150).contains(&busy_gpu.median_ms), "{busy_gpu:?}");
}

/// Contestants timed in turns each get their own timing: holds of 40, 120 and 80 µs come back
/// in that order at about those times, each from `rounds` x the plan's runs, and every call of
/// a contestant goes to its own copies in rotation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_time_in_turns_keeps_each_contestant_apart() {
    use kernelforge::tune::time::{time_in_turns, Contestant, TimingPlan};
    use std::cell::RefCell;
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    let plan = TimingPlan {
        warmup: 1,
        min_runs: 6,
        max_runs: 6,
        target_ms: 0.0,
    };
    let holds_us = [40u64, 120, 80];
    let calls: Vec<RefCell<Vec<usize>>> = holds_us.iter().map(|_| RefCell::new(Vec::new())).collect();
    let mut contestants: Vec<Contestant> = holds_us
        .iter()
        .zip(&calls)
        .map(|(&us, seen)| {
            let gpu = &gpu;
            Contestant {
                copies: 3,
                enqueue: Box::new(move |i| {
                    seen.borrow_mut().push(i);
                    Ok(gpu.hold(us * 1000)?)
                }),
            }
        })
        .collect();
    let times = time_in_turns(&gpu, &plan, 4, &mut contestants).unwrap();
    drop(contestants);
    assert_eq!(times.len(), holds_us.len());
    for ((t, us), seen) in times.iter().zip(holds_us).zip(&calls) {
        eprintln!(
            "a {us} µs hold in turns: {:.1} µs over {} runs",
            t.median_ms * 1e3,
            t.runs
        );
        assert_eq!(t.runs, 4 * 6, "{t:?}");
        let expected = us as f64 * 1e-3;
        assert!(
            (expected * 0.95..expected * 1.4).contains(&t.median_ms),
            "{us} µs: {t:?}"
        );
        let seen = seen.borrow();
        assert_eq!(seen.len(), 4 * (1 + 6), "warm-up and runs of every round");
        assert!(
            seen.iter().all(|&i| i < 3),
            "copy indices stay below the copies: {seen:?}"
        );
    }
}

/// Counts what the tuner reports, per device (what the one progress display draws).
#[derive(Default)]
struct Counted {
    stages: std::sync::atomic::AtomicUsize,
}

impl kernelforge::tune::tuner::Progress for Counted {
    fn stage(&self, _message: &str, _total: u64) {
        self.stages.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Small workloads of four kinds (a matmul with its epilogue, a layernorm, an attention, ...).
fn small_workloads() -> Vec<Workload> {
    vec![
        workload(
            "matmul",
            Epilogue::BiasGelu,
            Mask::None,
            &[("M", 300), ("N", 384), ("K", 256)],
        ),
        workload("layernorm", Epilogue::None, Mask::None, &[("N", 300), ("C", 768)]),
        workload(
            "attention",
            Epilogue::None,
            Mask::Causal,
            &[("B", 1), ("NH", 2), ("T", 200), ("HS", 64)],
        ),
        workload(
            "matmul",
            Epilogue::Bias,
            Mask::None,
            &[("M", 64), ("N", 256), ("K", 128)],
        ),
    ]
}

fn spread_options(force: bool) -> TuneOptions {
    TuneOptions {
        budget: Duration::from_secs(40),
        seed: 5,
        force,
        baseline: true,
        exhaustive: false,
    }
}

/// Spreads `workloads` over `ordinals` (one kind) into the database at `path`, cold, then warm;
/// checks every workload is tuned exactly once, in order, saved, and read back from the
/// database the second time.
fn spread_cold_then_warm(catalog: &Catalog, ordinals: &[usize], path: &Path, workloads: &[Workload]) {
    use kernelforge::tune::spread::spread_tune;
    let bars: Vec<Counted> = ordinals.iter().map(|_| Counted::default()).collect();
    let progress: Vec<&dyn kernelforge::tune::tuner::Progress> = bars.iter().map(|b| b as _).collect();
    let t0 = std::time::Instant::now();
    let kinds = spread_tune(
        catalog,
        ordinals,
        Some(path),
        workloads,
        &spread_options(false),
        &progress,
    )
    .unwrap_or_else(|e| panic!("spread over {ordinals:?}: {e}"));
    eprintln!("spread over {ordinals:?}, cold: {:.1} s", t0.elapsed().as_secs_f64());
    assert_eq!(kinds.len(), 1, "one kind");
    let kind = &kinds[0];
    assert_eq!(kind.results.len(), workloads.len());
    for (w, r) in workloads.iter().zip(&kind.results) {
        eprintln!(
            "{} {:?} on {:?}: {:?}",
            w.role,
            w.shape,
            r.device,
            r.result.winner.as_ref().map(|e| &e.family)
        );
        assert_eq!((&r.result.role, &r.result.shape), (&w.role, &w.shape), "input order");
        assert!(!r.result.from_db && r.result.winner.is_some());
        assert!(r.device.is_some_and(|d| ordinals.contains(&d)));
    }
    assert_eq!(kind.work.len(), ordinals.len());
    assert_eq!(
        kind.work.iter().map(|w| w.tuned).sum::<usize>(),
        workloads.len(),
        "each once"
    );
    for (slot, w) in kind.work.iter().enumerate() {
        eprintln!(
            "cuda:{} tuned {} in {:.1} s (budget {:.1} s)",
            w.device.ordinal,
            w.tuned,
            w.busy.as_secs_f64(),
            w.budget.as_secs_f64()
        );
        assert!(
            w.tuned > 0,
            "every device gets a share of {} workloads",
            workloads.len()
        );
        assert!(
            bars[slot].stages.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "its bar moved"
        );
    }
    // Both devices' winners are in the one file.
    let db = TuningDb::read_only(path).unwrap();
    assert_eq!(
        db.len(),
        workloads.len(),
        "{:?}",
        db.entries().map(|(k, _)| k).collect::<Vec<_>>()
    );

    let t1 = std::time::Instant::now();
    let warm = spread_tune(catalog, ordinals, Some(path), workloads, &spread_options(false), &[]).unwrap();
    assert!(warm[0].results.iter().all(|r| r.result.from_db && r.device.is_none()));
    assert!(warm[0].work.iter().all(|w| w.tuned == 0));
    assert!(t1.elapsed() < Duration::from_secs(10));
}

/// The spread on one GPU listed twice (`--devices` refuses repeats; the library takes any
/// list): two threads, two contexts on GPU 0, one database. With two GPUs of one kind, the
/// same over GPUs 0 and 1; with fewer, it says so and skips that part.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_spread_tunes_every_workload_once_in_order() {
    use kernelforge::gpu::{device_count, identify};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
    let workloads = small_workloads();
    let dir = tempfile::tempdir().unwrap();
    spread_cold_then_warm(&catalog, &[0, 0], &dir.path().join("same.json"), &workloads);

    let count = device_count().unwrap();
    if count < 2 {
        eprintln!("SKIPPED the two-GPU spread: this machine has {count} GPU(s), it needs 2");
        return;
    }
    let (a, b) = (identify(0).unwrap(), identify(1).unwrap());
    if (&a.name, a.compute_capability) != (&b.name, b.compute_capability) {
        // Two kinds: one --db cannot hold both, and the error says so.
        let e = kernelforge::tune::spread::spread_tune(
            &catalog,
            &[0, 1],
            Some(&dir.path().join("two.json")),
            &workloads,
            &spread_options(false),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("kinds") && e.contains("drop --db"), "{e}");
        eprintln!(
            "SKIPPED the two-GPU spread: GPUs 0 and 1 are of different kinds ({} / {})",
            a.name, b.name
        );
        return;
    }
    spread_cold_then_warm(&catalog, &[0, 1], &dir.path().join("two.json"), &workloads);
}

/// A GPU index the machine does not have is named in the error, with how many there are.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_spread_names_a_missing_device() {
    use kernelforge::tune::spread::SpreadPlan;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
    let count = kernelforge::gpu::device_count().unwrap();
    let e = SpreadPlan::new(&catalog, &[0, count], None, &small_workloads(), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("no GPU {count}")) && e.contains(&format!("has {count}")),
        "{e}"
    );
}
