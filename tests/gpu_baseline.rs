//! The vendor peer on the GPU. cuBLASLt with its fused epilogue, in every dtype and for every
//! epilogue it fuses, and cuBLAS + the split kernel for QKV, compute the op's contract within
//! the dtype's bar on awkward shapes (fresh random inputs, the output poisoned with NaN before
//! each run); the honesty check passes, timing gives positive times, and `tune` records the
//! peer by name. Every case runs and every failure is listed before the test fails.

use std::path::Path;
use std::time::Duration;

use kernelforge::codegen::Renderer;
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::ops::matmul::Matmul;
use kernelforge::ops::{self, relative_l2_error, Epilogue, Mask, OpContract, Problem, Shape};
use kernelforge::spec::{Catalog, Dtype};
use kernelforge::tune::baseline::{peer_name, CublasBaseline};
use kernelforge::tune::db::{DbHeader, TuningDb};
use kernelforge::tune::time::TimingPlan;
use kernelforge::tune::tuner::{tune, Quiet, TuneOptions};
use kernelforge::tune::verify::tolerance;
use kernelforge::tune::workloads::Workload;
use rand::SeedableRng;

/// The epilogues cuBLASLt fuses.
const FUSED: [Epilogue; 4] = [
    Epilogue::None,
    Epilogue::Bias,
    Epilogue::BiasGelu,
    Epilogue::BiasResidual,
];
/// (M, N, K): odd sizes, a single row (the decode step), more rows than a tile.
const SHAPES: [(i64, i64, i64); 3] = [(37, 100, 72), (1, 2304, 768), (130, 3072, 768)];
/// (M, N, K, T, n_head) for the QKV split.
const QKV_SHAPES: [(i64, i64, i64, i64, i64); 3] =
    [(74, 2304, 768, 37, 12), (1, 2304, 768, 1, 12), (130, 108, 72, 65, 3)];

fn setup() -> (Catalog, Gpu, Compiler, Renderer) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
    let gpu = Gpu::new(0).unwrap();
    let compiler = Compiler::new(&gpu.info.arch()).unwrap();
    let renderer = Renderer::new(&catalog.templates_dir).unwrap();
    (catalog, gpu, compiler, renderer)
}

fn shape(pairs: &[(&str, i64)]) -> Shape {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// A fresh problem of `dtype`'s storage (inputs rounded on the host first, so the reference sees
/// exactly what the GPU reads).
fn problem(pairs: &[(&str, i64)], epilogue: Epilogue, dtype: Dtype, seed: u64) -> Problem {
    Matmul
        .problem(
            &shape(pairs),
            epilogue,
            Mask::None,
            &mut rand::rngs::StdRng::seed_from_u64(seed),
        )
        .unwrap()
        .stored_as(dtype.storage())
}

/// A dtype, an epilogue and a shape to check.
type Case = (Dtype, Epilogue, Vec<(&'static str, i64)>);

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for dtype in Dtype::ALL {
        for e in FUSED {
            for (m, n, k) in SHAPES {
                out.push((dtype, e, vec![("M", m), ("N", n), ("K", k)]));
            }
        }
        for (m, n, k, t, nh) in QKV_SHAPES {
            out.push((
                dtype,
                Epilogue::Qkv,
                vec![("M", m), ("N", n), ("K", k), ("T", t), ("n_head", nh)],
            ));
        }
    }
    out
}

/// Every dtype × every epilogue × the awkward shapes: the peer's whole output against the f64
/// reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_peer_matches_the_reference_in_every_dtype_and_epilogue() {
    let (_catalog, gpu, compiler, renderer) = setup();
    let peer = CublasBaseline::new(&gpu, &compiler, &renderer).unwrap();
    let mut failures = Vec::new();
    for (seed, (dtype, e, pairs)) in cases().into_iter().enumerate() {
        let p = problem(&pairs, e, dtype, 100 + seed as u64);
        let what = format!("{dtype} {e} {}", kernelforge::spec::shape_text(&p.shape));
        let want = &Matmul.reference(&p)[0].1;
        match peer.run_matmul(&gpu, &p, dtype) {
            Ok(got) => {
                let error = relative_l2_error(&got, want);
                eprintln!("{what}: {} relative L2 error {error:.3e}", peer_name(e));
                // NaN (a value never written) is infinite here and fails too.
                if error >= tolerance(dtype) || error.is_nan() {
                    failures.push(format!(
                        "{what}: error {error:.3e} over the bar {:.0e}",
                        tolerance(dtype)
                    ));
                }
            }
            Err(err) => failures.push(format!("{what}: {err}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The check on a head of the rows, the timing API, and `measure_matmul` (what `tune` records),
/// for every dtype and epilogue (the ln_ ones: the standardization pass, then the plain peer).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_peer_check_and_timing() {
    let (_catalog, gpu, compiler, renderer) = setup();
    let peer = CublasBaseline::new(&gpu, &compiler, &renderer).unwrap();
    let plan = TimingPlan {
        warmup: 1,
        min_runs: 3,
        max_runs: 3,
        target_ms: 0.0,
    };
    let mut failures = Vec::new();
    for dtype in Dtype::ALL {
        let standardized = [Epilogue::LnBias, Epilogue::LnBiasGelu, Epilogue::LnQkv];
        for e in FUSED.into_iter().chain([Epilogue::Qkv]).chain(standardized) {
            let pairs = if e.after_product() == Epilogue::Qkv {
                vec![("M", 260), ("N", 2304), ("K", 768), ("T", 130), ("n_head", 12)]
            } else {
                vec![("M", 130), ("N", 3072), ("K", 768)]
            };
            let p = problem(&pairs, e, dtype, 7);
            let what = format!("{dtype} {e}");
            // 64 of the rows (of the first sequence for qkv) against the reference.
            match peer.check_matmul(&gpu, &p, dtype, 64) {
                Ok(error) if error < tolerance(dtype) => {}
                Ok(error) => failures.push(format!("{what}: check passed with error {error:.3e}?")),
                Err(err) => failures.push(format!("{what}: check: {err}")),
            }
            match peer.time_matmul(&gpu, &p, dtype, &plan) {
                Ok(t) if t.median_ms > 0.0 && t.runs == 3 => {}
                Ok(t) => failures.push(format!("{what}: odd timing {t:?}")),
                Err(err) => failures.push(format!("{what}: time: {err}")),
            }
            match peer.measure_matmul(&gpu, &p, dtype, &plan, 64) {
                Ok(run) => {
                    eprintln!("{what}: {run:?}");
                    if run.peer != peer_name(e) {
                        failures.push(format!("{what}: peer named {}", run.peer));
                    }
                    match (&run.outcome, run.error) {
                        (Ok(t), Some(error)) if t.median_ms > 0.0 && error < tolerance(dtype) => {}
                        other => failures.push(format!("{what}: measure: {other:?}")),
                    }
                }
                Err(err) => failures.push(format!("{what}: measure: {err}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A problem stored in the wrong type for the dtype is refused with a clear error, not run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_peer_refuses_a_problem_in_the_wrong_storage() {
    let (_catalog, gpu, compiler, renderer) = setup();
    let peer = CublasBaseline::new(&gpu, &compiler, &renderer).unwrap();
    let p = problem(&[("M", 37), ("N", 100), ("K", 72)], Epilogue::Bias, Dtype::F32, 3);
    let e = peer.run_matmul(&gpu, &p, Dtype::Bf16).unwrap_err();
    assert!(!e.is_fatal());
    assert!(e.to_string().contains("matmul bf16 bias M=37 N=100 K=72"), "{e}");
}

/// `tune` records the peer by name beside its time, for a fused epilogue, for qkv and (on an
/// H100, where matmul_wgmma_tma runs) for a layernorm folded into the GEMM.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tune_records_the_peer() {
    let (catalog, gpu, compiler, renderer) = setup();
    let dir = tempfile::tempdir().unwrap();
    let header = DbHeader::for_device(&gpu, &compiler);
    let mut db = TuningDb::open(&dir.path().join("db.json"), header).unwrap();
    let mut workloads = Vec::new();
    for (e, dtype, pairs) in [
        (
            Epilogue::BiasGelu,
            Dtype::Bf16,
            vec![("M", 300), ("N", 384), ("K", 256)],
        ),
        (
            Epilogue::Qkv,
            Dtype::F32,
            vec![("M", 64), ("N", 192), ("K", 64), ("T", 32), ("n_head", 2)],
        ),
        (
            Epilogue::LnBiasGelu,
            Dtype::Bf16,
            vec![("M", 300), ("N", 384), ("K", 256)],
        ),
    ] {
        if e.standardizes_input() && gpu.info.compute_capability != (9, 0) {
            continue; // only matmul_wgmma_tma (sm_90a) folds the layernorm in
        }
        let mut s = shape(&pairs);
        ops::op_by_name("matmul")
            .unwrap()
            .complete_shape(&mut s, e, Mask::None)
            .unwrap();
        workloads.push(Workload {
            role: format!("matmul {e}"),
            op: "matmul",
            dtype,
            epilogue: e,
            mask: Mask::None,
            shape: s,
            calls: 1,
        });
    }
    let options = TuneOptions {
        budget: Duration::from_secs(20),
        seed: 1,
        force: false,
        baseline: true,
        exhaustive: false,
    };
    let results = tune(
        &gpu, &compiler, &renderer, &catalog, &mut db, &workloads, &options, &Quiet,
    )
    .unwrap()
    .results;
    for (r, w) in results.iter().zip(&workloads) {
        let winner = r.winner.as_ref().expect("a winner");
        eprintln!(
            "{}: {} {:.4} ms, peer {:?} {:?} ({:?})",
            r.role, winner.family, winner.median_ms, winner.baseline, winner.baseline_ms, winner.baseline_unavailable
        );
        assert_eq!(winner.baseline.as_deref(), Some(peer_name(w.epilogue)));
        assert!(
            winner.baseline_unavailable.is_none(),
            "{:?}",
            winner.baseline_unavailable
        );
        assert!(winner.baseline_ms.is_some_and(|b| b > 0.0));
    }
}
