//! Tuned (or default) GEMMs with their fused epilogues, in f32, tf32 and bf16, against the vendor
//! peer of the same epilogue and dtype (`tune::baseline`): cuBLASLt with its own fused epilogue
//! (bias+GELU; bias+residual as beta = 1 with C = the residual), and cuBLAS + a separate split
//! kernel for the QKV split, which cuBLASLt cannot fuse. GPT-2 124M projection shapes and the LM
//! head at M = 1024 and 8192. The peer is checked once against the f64 reference (first 256 rows)
//! before it is timed; a peer that fails is reported and left out.
//! Times are CUDA-event medians fed to criterion through `iter_custom`.
//! Without a GPU the bench prints a note and measures nothing.
//!
//! `KERNELFORGE_GEMM_FILTER=TEXT` keeps only the shapes whose name contains TEXT (set up nothing
//! else: the peer's checks of the LM head take seconds). `KERNELFORGE_GEMM_SHAPES=K,N,EPILOGUE;...`
//! replaces GPT-2 124M's (K, N, epilogue) list, e.g. `1600,50304,none` for GPT-2 1.5B's LM head.
//! `KERNELFORGE_GEMM_PROFILE=1` runs, for each kept shape, our kernel (two warm-ups and a timed
//! run) and then the peer twice inside one profiler range, instead of criterion: `ncu
//! --profile-from-start off` then sees exactly those launches, not the peer's checks or its
//! choice among cuBLASLt's algorithms.
//! On the GPU machine, with the tuned database in place (the LM head tuned at T = 1024, n_head =
//! 12, the keys this bench asks for):
//!
//! ```text
//! KERNELFORGE_GEMM_FILTER=gemm_bf16_none/M8192 KERNELFORGE_GEMM_PROFILE=1 \
//!   ncu --profile-from-start off -k regex:'matmul_wgmma_tma|nvjet' --section SpeedOfLight GEMM_BENCH --bench
//! ```

use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kernelforge::gpu::{Compiler, DeviceProblem, Gpu};
use kernelforge::ops::{self, Epilogue, Mask, Shape};
use kernelforge::spec::{Catalog, Dtype};
use kernelforge::tune::baseline::{peer_name, CublasBaseline};
use kernelforge::tune::db::{default_path, DbHeader, TuningDb};
use kernelforge::tune::registry::Registry;
use kernelforge::tune::time::{time_variant, TimingPlan};
use rand::SeedableRng;

fn plan(iters: u64) -> TimingPlan {
    TimingPlan {
        warmup: 2,
        min_runs: iters as usize,
        max_runs: iters as usize,
        target_ms: 0.0,
    }
}

fn gemm(c: &mut Criterion) {
    let Ok(gpu) = Gpu::new(0) else {
        eprintln!("no CUDA GPU: skipping the GEMM benchmarks");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).expect("specs");
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let header = DbHeader::for_device(&gpu, &compiler);
    let path = default_path(&header);
    let db = path
        .exists()
        .then(|| TuningDb::open(&path, header).expect("tuning database"));
    let renderer = kernelforge::codegen::Renderer::new(&catalog.templates_dir).expect("templates");
    let cublas = CublasBaseline::new(&gpu, &compiler, &renderer).expect("cuBLAS");
    let mut registry = Registry::new(catalog, db, compiler).expect("registry");
    let op = ops::op_by_name("matmul").expect("matmul op");
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let filter = std::env::var("KERNELFORGE_GEMM_FILTER").unwrap_or_default();
    let profile = std::env::var_os("KERNELFORGE_GEMM_PROFILE").is_some();
    let shapes = match std::env::var("KERNELFORGE_GEMM_SHAPES") {
        Ok(list) => parse_shapes(&list).unwrap_or_else(|e| panic!("KERNELFORGE_GEMM_SHAPES={list:?}: {e}")),
        Err(_) => vec![
            (768i64, 2304i64, Epilogue::Qkv),
            (768, 768, Epilogue::BiasResidual),
            (768, 3072, Epilogue::BiasGelu),
            (3072, 768, Epilogue::BiasResidual),
            (768, 50304, Epilogue::None), // the LM head (tied wte, padded vocabulary)
        ],
    };
    for dtype in [Dtype::F32, Dtype::Tf32, Dtype::Bf16] {
        for m in [1024i64, 8192] {
            for &(k, n, epilogue) in &shapes {
                let name = format!("gemm_{dtype}_{}/M{m}_N{n}_K{k}", epilogue.as_str());
                if !name.contains(&filter) {
                    continue;
                }
                let mut shape: Shape = [("M", m), ("N", n), ("K", k), ("T", 1024.min(m)), ("n_head", 12)]
                    .iter()
                    .map(|(a, b)| (a.to_string(), *b))
                    .collect();
                op.complete_shape(&mut shape, epilogue, Mask::None).expect("shape");
                let problem = op
                    .problem(&shape, epilogue, Mask::None, &mut rng)
                    .expect("problem")
                    .stored_as(dtype.storage());
                let selected = match registry.select("matmul", dtype, epilogue, Mask::None, &shape, &gpu.info.limits) {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("{name}: no kernelforge variant ({e}); skipped");
                        continue;
                    }
                };
                let loaded = registry.load(&gpu, &selected.variant).expect("load");
                let launches = loaded.plan(&gpu, &shape).expect("plan");
                let mut device = DeviceProblem::upload(&gpu, &problem).expect("upload");
                let ws = selected
                    .variant
                    .workspace_elems(&shape, &gpu.info.limits)
                    .expect("workspace");
                device.ensure_workspace(&gpu, ws).expect("workspace");
                let copies = [device];
                if profile {
                    // The peer's set-up (its choice among cuBLASLt's algorithms) and its check
                    // against the reference, before the range.
                    let ready = match cublas.prepare_matmul(&gpu, &problem, dtype, 256) {
                        Ok(Ok(ready)) => Some(ready),
                        Ok(Err(run)) => {
                            eprintln!("{name}: peer left out: {}", run.outcome.err().unwrap_or_default());
                            None
                        }
                        Err(e) => panic!("{name}: {e}"),
                    };
                    let range = cudarc::driver::Profiler::new().expect("cuProfilerStart");
                    let ours = time_variant(&gpu, &loaded, &problem, &copies, &launches, &plan(1)).expect("time");
                    if let Some(ready) = &ready {
                        let mut contestant = ready.contestant(&gpu);
                        for _ in 0..2 {
                            (contestant.enqueue)(0).expect("peer");
                        }
                        gpu.synchronize().expect("peer");
                    }
                    drop(range);
                    eprintln!(
                        "{name}: kernelforge {:.4} ms, then the peer twice (profiled)",
                        ours.median_ms
                    );
                    continue;
                }
                // The peer must be right before its time means anything.
                let peer = match cublas.check_matmul(&gpu, &problem, dtype, 256) {
                    Ok(_) => true,
                    Err(e) if e.is_fatal() => panic!("{name}: {e}"),
                    Err(e) => {
                        eprintln!("{name}: peer left out: {e}");
                        false
                    }
                };
                let mut group = c.benchmark_group(name);
                group
                    .sample_size(10)
                    .warm_up_time(Duration::from_secs(1))
                    .measurement_time(Duration::from_secs(2));
                group.bench_function(
                    format!("kernelforge ({:?} {})", selected.choice, selected.variant.family.name),
                    |b| {
                        b.iter_custom(|iters| {
                            let t =
                                time_variant(&gpu, &loaded, &problem, &copies, &launches, &plan(iters)).expect("time");
                            Duration::from_secs_f64(t.median_ms * 1e-3 * iters as f64)
                        })
                    },
                );
                if peer {
                    group.bench_function(peer_name(epilogue), |b| {
                        b.iter_custom(|iters| {
                            let t = cublas.time_matmul(&gpu, &problem, dtype, &plan(iters)).expect("peer");
                            Duration::from_secs_f64(t.median_ms * 1e-3 * iters as f64)
                        })
                    });
                }
                group.finish();
            }
        }
    }
}

/// `K,N,EPILOGUE;...` as (K, N, epilogue) triples.
fn parse_shapes(list: &str) -> Result<Vec<(i64, i64, Epilogue)>, String> {
    list.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            let fields: Vec<&str> = item.split(',').map(str::trim).collect();
            let [k, n, epilogue] = fields[..] else {
                return Err(format!("{item:?} is not K,N,EPILOGUE"));
            };
            let number = |s: &str| s.parse::<i64>().map_err(|e| format!("{s:?} in {item:?}: {e}"));
            let epilogue = epilogue.parse::<Epilogue>().map_err(|e| e.to_string())?;
            Ok((number(k)?, number(n)?, epilogue))
        })
        .collect()
}

criterion_group!(benches, gemm);
criterion_main!(benches);
