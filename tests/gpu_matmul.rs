//! The matmul families on the GPU: the per-op sample, and for the tensor-core families the
//! edges of their tilings, their dtypes and epilogues (the TMA family's residual by TMA, split-K
//! clusters, qkv heads) against the f64 reference with NaN-poisoned outputs. Run with
//! `cargo test -- --include-ignored` on a machine with a CUDA GPU.

mod kernel_checks;

use kernel_checks::*;
use kernelforge::codegen::Renderer;
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::ops::{Epilogue, Mask};
use kernelforge::spec::{expand, variant_with, Points};
use kernelforge::tune::verify::{verify, Shapes, Status};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul() {
    check_op("matmul");
}

/// The TF32 tensor-core family on its own, with a larger sample than the per-op test: every
/// epilogue on the awkward shapes its `K % 4 == 0` constraint allows (M=37, N=100, K=72, ...),
/// judged with the tf32 bar (relative L2 < 1e-3).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wmma_tf32() {
    let catalog = catalog_of(&["matmul_wmma"]);
    let rows = run(&catalog, "matmul", |seed| Points::Sample { count: 8, seed });
    assert_no_failures(rows.iter());
    // The family also lists f16/bf16 (gpu_matmul_half checks those): judge the tf32 rows here.
    let passed: Vec<_> = rows
        .iter()
        .filter(|r| r.status == Status::Pass && r.dtype == "tf32")
        .collect();
    for kind in ["[bias]", "[bias_gelu]", "[bias_residual]", "[qkv]"] {
        assert!(passed.iter().any(|r| r.kernel.ends_with(kind)), "no {kind} row passed");
    }
    assert!(passed
        .iter()
        .any(|r| r.shape.contains("M=37") && r.shape.contains("N=100")));
    for r in &passed {
        assert_eq!(r.tolerance, 1e-3, "tf32 variants use the tf32 bar: {r:?}");
        assert!(r.variant.starts_with("dtype=tf32"), "{r:?}");
    }
}

/// The Hopper wgmma families on their own (sm_90a: only on compute capability 9.0), with a
/// larger sample than the per-op test: every dtype they list, every epilogue, on the awkward
/// shapes their `K % 8 == 0` constraint allows (M=37, N=100, K=72; QKV with HS=12, ...). On
/// another GPU every row must be a skip that names the target. Then the persistent TMA family on
/// a shape with more tiles than blocks (M=4099, N=1000, K=264: at least two tiles per block even
/// for its largest tiles on 132 SMs), where the ring runs across tile boundaries and clusters
/// get an odd number of tile rows, and on partial tiles its staged epilogue must clip.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma() {
    let families = ["matmul_wgmma", "matmul_wgmma_tma"];
    let catalog = catalog_of(&families);
    let rows = run(&catalog, "matmul", |seed| Points::Sample { count: 8, seed });
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    if gpu.info.compute_capability != (9, 0) {
        for r in &rows {
            assert!(
                matches!(&r.status, Status::Skip(why) if why.contains("sm_90a")),
                "{r:?}"
            );
        }
        return;
    }
    assert_no_failures(rows.iter());
    let passed: Vec<_> = rows.iter().filter(|r| r.status == Status::Pass).collect();
    for family in &catalog.families {
        for dtype in &family.dtypes {
            for kind in ["", "[bias]", "[bias_gelu]", "[bias_residual]", "[qkv]"] {
                // The TMA family's qkv runs these test shapes only at points without the staged
                // epilogue (its stores need heads of 64 columns) or the stats pass: about one in
                // four, so eight sampled points miss them all one run in ten.
                // gpu_matmul_wgmma_tma_qkv_heads checks it on such heads in every dtype.
                if family.name == "matmul_wgmma_tma" && kind == "[qkv]" {
                    continue;
                }
                let kernel = format!("{}{kind}", family.name);
                assert!(
                    passed.iter().any(|r| r.dtype == dtype.as_str() && r.kernel == kernel),
                    "no {dtype} {kernel} row passed"
                );
            }
        }
    }
    assert!(passed
        .iter()
        .any(|r| r.shape.contains("M=37") && r.shape.contains("N=100")));
    for r in &passed {
        assert_eq!(
            r.tolerance,
            kernelforge::tune::verify::tolerance(r.dtype.parse().unwrap()),
            "{r:?}"
        );
    }

    // Several tiles per block: the persistent loop, the ring across tiles, ping-pong turns.
    let tma = catalog.family("matmul_wgmma_tma").expect("the TMA family");
    let mut variants = expand(tma, Points::Sample { count: 6, seed: seed() }, &gpu.info.limits).expect("expand");
    variants.retain(|v| v.epilogue == Epilogue::None || v.epilogue == Epilogue::BiasResidual);
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let renderer = Renderer::new(&catalog.templates_dir).expect("templates");
    // Then partial tiles in both directions with N % 8 == 0, where the staged epilogue's TMA
    // stores (which need it) clip the edges: 333 rows, 264 = 2 x 128 + 8 columns.
    for (m, n, k) in [(4099, 1000, 264), (333, 264, 136)] {
        let rows = verify_on_shape(&gpu, &compiler, &renderer, &variants, &[("M", m), ("N", n), ("K", k)]);
        assert!(
            rows.iter().filter(|r| r.status == Status::Pass).count() >= 2 * 2,
            "both dtypes, both epilogues, the default at least: {rows:#?}"
        );
    }
}

/// Verifies `family` (matmul_wgmma_tma or its 3xTF32 sibling) at the given points (params over
/// the default; the staged epilogue always), in every dtype and each of `epilogues`, on
/// `shapes` (M, N, K, T, n_head): every variant must pass on every shape.
fn verify_tma_points(family: &str, points: &[&[(&str, i64)]], epilogues: &[Epilogue], shapes: &[[i64; 5]]) {
    let catalog = catalog_of(&[family]);
    let family = &catalog.families[0];
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    if gpu.info.compute_capability != (9, 0) {
        eprintln!("skipped: {} needs sm_90a", family.name);
        return;
    }
    let mut variants = Vec::new();
    for dtype in &family.dtypes {
        for epilogue in epilogues {
            for point in points {
                let overrides: Vec<(String, i64)> = point
                    .iter()
                    .chain(&[("staged_epilogue", 1)])
                    .map(|(k, v)| (k.to_string(), *v))
                    .collect();
                variants.push(
                    variant_with(family, &overrides, *dtype, *epilogue, Mask::None, &gpu.info.limits)
                        .unwrap_or_else(|e| panic!("{dtype} {epilogue:?} {point:?}: {e}")),
                );
            }
        }
    }
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let renderer = Renderer::new(&catalog.templates_dir).expect("templates");
    for &[m, n, k, t, n_head] in shapes {
        let shape = [("M", m), ("N", n), ("K", k), ("T", t), ("n_head", n_head)];
        let rows = verify_on_shape(&gpu, &compiler, &renderer, &variants, &shape);
        assert_eq!(
            rows.iter().filter(|r| r.status == Status::Pass).count(),
            variants.len(),
            "every variant passes on M={m} N={n} K={k}: {rows:#?}"
        );
    }
}

/// matmul_wgmma_tma's bias+residual with the staged epilogue, where the residual comes by TMA
/// into the staging buffers ahead of the epilogue: the points that exercise each way the loads
/// are scheduled (a tile of one chunk; of several, so the epilogue loads chunks 2..; ping-pong;
/// two m64 tiles; column-split consumers; 64-byte chunks; a 2-CTA cluster; five chunks of a
/// 160-wide tile), in every dtype, on shapes with several tiles per block and partial tiles both
/// ways.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_residual_by_tma() {
    verify_tma_points(
        "matmul_wgmma_tma",
        &[
            &[],
            &[("pingpong", 1)],
            &[("mma_n", 96), ("m_tiles", 2), ("cluster_m", 2)],
            &[("split_n", 1), ("mma_n", 128)],
            &[("consumers", 1), ("mma_n", 64)],
            &[("mma_n", 256), ("pingpong", 1), ("raster_m", 1)],
            &[("mma_n", 160), ("stages", 5)],
        ],
        &[Epilogue::BiasResidual],
        &[[4099, 1000, 264, 4099, 1], [333, 264, 136, 333, 1], [8, 72, 64, 8, 1]],
    );
}

/// matmul_wgmma_tma with grouped stores (ping-pong only): a whole m64 row of a consumer's tile
/// staged before one fence, one barrier and its TMA stores, the two groups' buffers alternating.
/// The points cover groups of one chunk (64 wide), two (128), three (96 in 32-column chunks) and
/// five (160, the fc point, with B multicast), one and two m64 tiles, both tile orders, in every
/// dtype (tf32 groups half a row) and the epilogues that may group, on shapes with several tiles
/// per block (the buffers alternate across tiles) and partial tiles both ways (a whole group past
/// N, groups cut by N). Sized for compute-sanitizer (memcheck, racecheck, synccheck).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_grouped_stores() {
    let pingpong = [("grouped_stores", 1), ("pingpong", 1)];
    verify_tma_points(
        "matmul_wgmma_tma",
        &[
            &[pingpong[0], pingpong[1], ("mma_n", 64)],
            &[
                pingpong[0],
                pingpong[1],
                ("mma_n", 128),
                ("m_tiles", 2),
                ("raster_m", 1),
            ],
            &[pingpong[0], pingpong[1], ("mma_n", 96), ("m_tiles", 2)],
            &[
                pingpong[0],
                pingpong[1],
                ("mma_n", 160),
                ("m_tiles", 2),
                ("cluster_m", 2),
            ],
        ],
        &[Epilogue::None, Epilogue::Bias, Epilogue::BiasGelu],
        &[[2000, 1400, 64, 2000, 1], [333, 264, 136, 333, 1], [8, 72, 64, 8, 1]],
    );
}

/// Shapes (M, N, K, T, n_head) with many output tiles per block (a split-K cluster hands its ring
/// back and forth), a few, and one; K slices of unequal length; heads 64 wide: qkv stores by TMA
/// (T % 64 == 0) on the first and the last, copies chunk by chunk on the second.
const MANY_FEW_AND_ONE_TILE: [[i64; 5]; 3] = [
    [4096, 1536, 264, 1024, 8],
    [333, 384, 520, 111, 2],
    [64, 384, 256, 64, 2],
];

/// matmul_wgmma_tma with split-K clusters: 2 and 4 CTAs per tile adding their partial sums
/// through distributed shared memory, each storing the chunks it owns, for every epilogue kind
/// (the residual's TMA loads follow the owned chunks), on shapes where a cluster walks many
/// tiles (the ring is handed back and forth), a few, and one; K slices of unequal length.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_split_k() {
    verify_tma_points(
        "matmul_wgmma_tma",
        &[
            &[("split_k", 2)],
            &[("split_k", 4)],
            &[("split_k", 2), ("mma_n", 96), ("m_tiles", 2)],
            &[("split_k", 4), ("split_n", 1), ("mma_n", 128)],
        ],
        &[
            Epilogue::None,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
            Epilogue::Qkv,
        ],
        &MANY_FEW_AND_ONE_TILE,
    );
}

/// matmul_wgmma_tma's qkv epilogue with the staged epilogue: with T % 64 == 0 each chunk (one
/// head, 64 positions) goes out as one TMA store into the [3, B, n_head, T, HS] tensors; with
/// other T the threads copy it; on GPT-2's shape and on small ones, one tile or many.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_qkv_heads() {
    verify_tma_points(
        "matmul_wgmma_tma",
        &[
            &[],
            &[("pingpong", 1)],
            &[("mma_n", 96), ("m_tiles", 2), ("cluster_m", 2)],
            &[("consumers", 1), ("mma_n", 64)],
            &[("split_n", 1), ("mma_n", 128)],
            &[("consumers", 1), ("mma_n", 160)],
        ],
        &[Epilogue::Qkv],
        &[
            [2048, 2304, 768, 1024, 12],
            [300, 384, 136, 100, 2],
            [128, 1152, 64, 64, 6],
        ],
    );
}

/// matmul_wgmma_tma with the layernorm folded in (ln_bias, ln_bias_gelu, ln_qkv): each consumer
/// thread sums its rows from the stages as they pass and standardizes its accumulators before
/// the epilogue. The points change who holds which rows: two consumers splitting a tile's rows
/// (default), each its own tile (ping-pong; with two m64 tiles and a 2-CTA multicast cluster: the
/// fc point), splitting its columns (both sum the same rows), one consumer of 64 rows with
/// 128-wide K stages, one of 192 rows. Shapes: GPT-2's qkv, K not a multiple of the K stage (the
/// zero-filled end of a row), partial tiles both ways, T % 64 != 0 (qkv copied out by threads).
/// The rows are shifted by random offsets (ops/matmul.rs), so a dropped mean fails.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_layernorm_folded() {
    verify_tma_points(
        "matmul_wgmma_tma",
        &[
            &[],
            &[("pingpong", 1)],
            &[("mma_n", 160), ("m_tiles", 2), ("pingpong", 1), ("cluster_m", 2)],
            &[("split_n", 1), ("mma_n", 128)],
            &[("consumers", 1), ("mma_n", 64), ("panels", 2)],
            &[("consumers", 1), ("mma_n", 96), ("m_tiles", 3)],
        ],
        &[Epilogue::LnBias, Epilogue::LnBiasGelu, Epilogue::LnQkv],
        &[
            [2048, 2304, 768, 1024, 12],
            [300, 384, 136, 100, 2],
            [130, 1152, 72, 65, 6],
        ],
    );
}

/// The same ln_ epilogues with each row's statistics from a pass of their own (`stats_pass = 1`:
/// kernel `row_stats` writes every row's rstd and -mean * rstd to the workspace, and the
/// consumers read their rows' pair when a tile starts): the points and shapes above, so that every
/// way of holding rows reads the right pairs (rows past M included); at K = 136 and 72 a row is
/// fewer 16-byte pieces than the pass's warp has lanes. The rows' random offsets (ops/matmul.rs)
/// make a dropped or misplaced mean fail. Sized for compute-sanitizer (memcheck, racecheck,
/// synccheck).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_layernorm_stats_pass() {
    verify_tma_points(
        "matmul_wgmma_tma",
        &[
            &[("stats_pass", 1)],
            &[("stats_pass", 1), ("pingpong", 1)],
            &[
                ("stats_pass", 1),
                ("mma_n", 160),
                ("m_tiles", 2),
                ("pingpong", 1),
                ("cluster_m", 2),
            ],
            &[("stats_pass", 1), ("split_n", 1), ("mma_n", 128)],
            &[("stats_pass", 1), ("consumers", 1), ("mma_n", 96), ("m_tiles", 3)],
        ],
        &[Epilogue::LnBias, Epilogue::LnBiasGelu, Epilogue::LnQkv],
        &[
            [512, 2304, 768, 256, 12],
            [300, 384, 136, 100, 2],
            [130, 1152, 72, 65, 6],
        ],
    );
}

/// matmul_wgmma_tma_3xtf32: f32 at f32 accuracy (the f32 bar, relative L2 < 1e-5) from three
/// TF32 MMAs per product, the low parts written by the producer warpgroup's idle warps into a
/// ring of their own. Every epilogue, at the points that change how that ring is walked: the
/// default; a shallower low ring; two m64 tiles with a 2-CTA multicast cluster (each CTA splits
/// its own copy of B); split-K (the ring then holds the partial sums between tiles); consumers
/// sharing a tile by columns; one consumer.
/// Shapes with many tiles per block, partial tiles both ways, and one tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_3xtf32() {
    verify_tma_points(
        "matmul_wgmma_tma_3xtf32",
        &[
            &[],
            &[("low_stages", 2)],
            &[
                ("mma_n", 96),
                ("m_tiles", 2),
                ("cluster_m", 2),
                ("stages", 2),
                ("low_stages", 2),
            ],
            &[("split_k", 2), ("mma_n", 64), ("split_n", 1), ("stages", 4)],
            &[("split_n", 1), ("mma_n", 96), ("stages", 2)],
            &[("consumers", 1), ("mma_n", 64), ("stages", 4)],
        ],
        &[
            Epilogue::None,
            Epilogue::Bias,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
            Epilogue::Qkv,
        ],
        &MANY_FEW_AND_ONE_TILE,
    );
}

/// matmul_wgmma_tma_3xtf32, small enough for compute-sanitizer (memcheck, racecheck,
/// synccheck): the default, consumers sharing columns, a multicast cluster and split-K, with
/// the two epilogues that read or write the most (bias+residual by TMA, qkv heads), on two
/// small shapes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma_tma_3xtf32_small() {
    verify_tma_points(
        "matmul_wgmma_tma_3xtf32",
        &[
            &[],
            &[("split_n", 1), ("mma_n", 96), ("stages", 2)],
            &[
                ("mma_n", 96),
                ("m_tiles", 2),
                ("cluster_m", 2),
                ("stages", 2),
                ("low_stages", 2),
            ],
            &[("split_k", 2), ("mma_n", 64), ("split_n", 1), ("stages", 4)],
        ],
        &[Epilogue::BiasResidual, Epilogue::Qkv],
        &[[333, 384, 136, 111, 2], [256, 384, 256, 64, 2]],
    );
}

/// matmul_mma alone, small: its default and one sampled point, every epilogue, both dtypes, on
/// the awkward shapes. Sized for compute-sanitizer (memcheck, racecheck) runs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_mma_small() {
    let catalog = catalog_of(&["matmul_mma"]);
    let rows = run(&catalog, "matmul", |seed| Points::Sample { count: 1, seed });
    assert_no_failures(rows.iter());
    assert!(rows.iter().filter(|r| r.status == Status::Pass).count() >= 2 * 5 * 3);
}

/// The half-storage matmuls on their own (f16 and bf16; matmul_mma, matmul_wmma, matmul_gemv),
/// with a larger sample than the per-op test: every epilogue on the awkward shapes their
/// `K % 8 == 0` (gemv: `K % 4`) constraint allows, judged with the half bar (relative L2 <
/// 1e-2); then gemv's 8-byte path on a K that is 4 mod 8 (rows only 8-byte aligned).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_half() {
    let families = ["matmul_mma", "matmul_wmma", "matmul_gemv"];
    let catalog = catalog_of(&families);
    let rows = run(&catalog, "matmul", |seed| Points::Sample { count: 6, seed });
    let half: Vec<_> = rows.iter().filter(|r| r.dtype == "f16" || r.dtype == "bf16").collect();
    assert_no_failures(half.iter().copied());
    for family in families {
        for dtype in ["f16", "bf16"] {
            let passed: Vec<_> = half
                .iter()
                .filter(|r| r.family == family && r.dtype == dtype && r.status == Status::Pass)
                .collect();
            // The `none` epilogue's rows carry no [epilogue] suffix.
            assert!(
                passed.iter().any(|r| !r.kernel.contains('[')),
                "{family} {dtype}: no [none] row passed"
            );
            for kind in ["[bias]", "[bias_gelu]", "[bias_residual]", "[qkv]"] {
                assert!(
                    passed.iter().any(|r| r.kernel.ends_with(kind)),
                    "{family} {dtype}: no {kind} row passed"
                );
            }
            if family != "matmul_gemv" {
                // A partial tile in both M and N, with K = 72 (a partial K tile too).
                assert!(
                    passed
                        .iter()
                        .any(|r| r.shape.contains("M=37") && r.shape.contains("N=100")),
                    "{family} {dtype}: the awkward shape did not run"
                );
            }
            for r in &passed {
                assert_eq!(r.tolerance, 1e-2, "half variants use the half bar: {r:?}");
                assert!(r.error.is_some_and(|e| e > 0.0), "a real, rounded result: {r:?}");
            }
        }
    }

    // gemv with K % 8 == 4: the 8-byte (load4) path of the half variants.
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let renderer = Renderer::new(&catalog.templates_dir).expect("templates");
    let gemv = catalog.family("matmul_gemv").expect("gemv");
    let variants = expand(gemv, Points::Default, &gpu.info.limits).expect("expand");
    // T and n_head for qkv (N = 3 * n_head * HS with HS = 16); the other epilogues ignore them.
    let shape: kernelforge::ops::Shape = [("M", 3), ("N", 96), ("K", 36), ("T", 3), ("n_head", 2)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let rows = verify(
        &gpu,
        &compiler,
        &renderer,
        &variants,
        &Shapes::Given(shape),
        seed(),
        |_| {},
    );
    for r in &rows {
        eprintln!("{:40} {:42} {:?} {:?}", r.kernel, r.shape, r.error, r.status);
    }
    for dtype in ["f16", "bf16"] {
        let ok: Vec<_> = rows
            .iter()
            .filter(|r| r.dtype == dtype && r.status == Status::Pass)
            .collect();
        assert_eq!(ok.len(), 5, "{dtype}: every epilogue of gemv at K=36: {rows:#?}");
    }
}
