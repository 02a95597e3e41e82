//! The Hopper (sm_90a) matmul families' specs and templates: what every valid point keeps within
//! the SM's bounds, and what their rendered sources issue (wgmma, TMA, mbarriers, clusters, the
//! 3xTF32 split).

use std::path::Path;

use kernelforge::codegen::Renderer;
use kernelforge::spec::{expand, variant_with, Catalog, DeviceLimits, Dtype, Points};

fn catalog() -> Catalog {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Catalog::load(&root.join("specs"), &root.join("templates")).unwrap_or_else(|e| panic!("{e}"))
}

/// The Hopper family: compiled for exactly sm_90a, its rendered source issues wgmma from
/// 128-byte-swizzle descriptors behind the proxy fence, and every valid point keeps its
/// accumulators and shared-memory ring within bounds.
#[test]
fn wgmma_family_targets_sm_90a() {
    let c = catalog();
    let f = c.family("matmul_wgmma").unwrap();
    let target = f.arch.as_ref().expect("[family] arch");
    assert_eq!((target.name.as_str(), target.compute_capability), ("sm_90a", (9, 0)));
    let limits = DeviceLimits::default();
    let all = expand(f, Points::All, &limits).unwrap();
    for v in &all {
        assert!(v.derived["m_tiles"] * v.derived["acc_regs"] <= 128, "{}", v.key());
        assert!(v.derived["smem_bytes"] <= limits.max_smem_dynamic, "{}", v.key());
        assert!(v.derived["prefetch"] >= 1, "{}", v.key());
    }
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    let v = expand(f, Points::Default, &limits).unwrap().remove(0);
    let code = renderer.render(&v).unwrap().code;
    for want in [
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16",
        "wgmma.fence.sync.aligned",
        "wgmma.commit_group.sync.aligned",
        "wgmma.wait_group.sync.aligned",
        "fence.proxy.async.shared::cta",
        "cp.async.cg.shared.global",
        "swizzle_128b << 62",
    ] {
        assert!(code.contains(want), "missing {want}");
    }
}

/// The TMA family: sm_90a only; every valid point keeps the consumers' accumulators inside the
/// registers setmaxnreg gives them, the ring and staging inside shared memory, whole TMA boxes
/// and atom-aligned multicast slices; its launches carry the tensor maps the template declares;
/// the rendered sources use TMA, mbarriers, clusters and the tf32 rounding where they should.
#[test]
fn tma_family_targets_sm_90a_and_plans_its_tensor_maps() {
    let c = catalog();
    let f = c.family("matmul_wgmma_tma").unwrap();
    assert_eq!(f.arch.as_ref().expect("[family] arch").name, "sm_90a");
    let limits = DeviceLimits::default();
    let all = expand(f, Points::All, &limits).unwrap();
    assert!(all.len() > 1000, "{}", all.len());
    for v in &all {
        let d = &v.derived;
        assert!(
            v.params["m_tiles"] * d["acc_regs"] + 48 <= d["consumer_regs"],
            "{}",
            v.key()
        );
        assert!(d["smem_bytes"] <= limits.max_smem_dynamic, "{}", v.key());
        assert!(d["block_m"] <= 256 && d["block_n"] <= 256, "{}", v.key());
        assert_eq!((d["block_n"] / v.params["cluster_m"]) % 8, 0, "{}", v.key());
        if v.params["split_k"] > 1 {
            // the partial sums of a tile fit in the ring; no multicast or ping-pong beside split-K
            assert!(
                v.params["stages"] * d["stage_bytes"] >= d["block_m"] * d["block_n"] * 4,
                "{}",
                v.key()
            );
            assert_eq!((v.params["cluster_m"], v.params["pingpong"]), (1, 0), "{}", v.key());
        }
    }
    assert!(all.iter().any(|v| v.params["split_k"] == 4));
    let shape: kernelforge::ops::Shape = [("M", 1000), ("N", 2304), ("K", 768), ("T", 1000), ("n_head", 1)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    let variant_of = |dtype: Dtype, epilogue: kernelforge::ops::Epilogue, params: &[(&str, i64)]| {
        let params: Vec<(String, i64)> = params.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        variant_with(f, &params, dtype, epilogue, kernelforge::ops::Mask::None, &limits).unwrap()
    };
    let variant = |dtype: Dtype, params: &[(&str, i64)]| variant_of(dtype, kernelforge::ops::Epilogue::Bias, params);
    // Default (staged epilogue): inp, weight and out maps, boxes of 128 bytes; persistent grid.
    let v = variant(Dtype::Bf16, &[]);
    let launch = v.launches(&shape, &limits).unwrap().remove(0);
    let maps: Vec<_> = launch
        .tensor_maps
        .iter()
        .map(|m| (m.arg.as_str(), m.box_rows, m.box_cols))
        .collect();
    assert_eq!(maps, [("inp", 128, 64), ("weight", 192, 64), ("out", 64, 64)]);
    assert_eq!(launch.grid, [96, 1, 1], "8 x 12 tiles, fewer than 132 SMs");
    let code = renderer.render(&v).unwrap().code;
    for want in [
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group",
        "mbarrier.arrive.expect_tx",
        "const __grid_constant__ TensorMap out_map",
        "setmaxnreg.inc.sync.aligned.u32 232",
    ] {
        assert!(code.contains(want), "default: missing {want}");
    }
    assert!(!code.contains("__cluster_dims__") && !code.contains("cvt.rna.tf32"));
    // Clusters of two: B slices of half the tile, multicast, whole clusters in the grid.
    let v = variant(Dtype::F16, &[("cluster_m", 2), ("staged_epilogue", 0)]);
    let launch = v.launches(&shape, &limits).unwrap().remove(0);
    let maps: Vec<_> = launch
        .tensor_maps
        .iter()
        .map(|m| (m.arg.as_str(), m.box_rows))
        .collect();
    assert_eq!(maps, [("inp", 128), ("weight", 96)]);
    assert_eq!(launch.grid, [96, 1, 1]);
    let code = renderer.render(&v).unwrap().code;
    for want in [
        "__cluster_dims__(CLUSTER_SIZE, 1, 1)",
        ".multicast::cluster",
        "mapa.shared::cluster",
        "barrier.cluster.wait",
    ] {
        assert!(code.contains(want), "cluster: missing {want}");
    }
    // Split-K: 4 CTAs per tile (whole clusters, K cut in 4 slices of 3 K tiles each) exchanging
    // partial sums through distributed shared memory; bias+residual's residual map rides along.
    let v = variant_of(Dtype::Bf16, kernelforge::ops::Epilogue::BiasResidual, &[("split_k", 4)]);
    let launch = v.launches(&shape, &limits).unwrap().remove(0);
    let maps: Vec<_> = launch.tensor_maps.iter().map(|m| m.arg.as_str()).collect();
    assert_eq!(maps, ["inp", "weight", "out", "residual"]);
    assert_eq!(
        launch.grid,
        [4 * 33, 1, 1],
        "33 clusters of 4 CTAs for 96 tiles, not 132 single CTAs"
    );
    let code = renderer.render(&v).unwrap().code;
    for want in [
        "__cluster_dims__(CLUSTER_SIZE, 1, 1)",
        "#define SPLIT_K 4",
        "ld.shared::cluster.v4.f32",
        // the exchange's two turns a tile at the cluster barrier, which racecheck follows
        "barrier.cluster.arrive.release;",
        "barrier.cluster.wait.acquire;",
        "exchange_turns();",
        "close_exchange(local);",
    ] {
        assert!(code.contains(want), "split-K: missing {want}");
    }
    // not mbarriers between CTAs, which it does not
    assert!(
        !code.contains("mbarrier.arrive.release.cluster"),
        "split-K: a cross-CTA mbarrier arrival is back"
    );
    let short_k: kernelforge::ops::Shape = [("M", 64), ("N", 64), ("K", 192), ("T", 64), ("n_head", 1)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let why = v.check_shape(&short_k, &limits).unwrap_err();
    assert!(why.contains("split_k"), "3 K tiles cannot feed 4 slices: {why}");
    let params: Vec<(String, i64)> = [("split_k", 2), ("cluster_m", 2)]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    let err = variant_with(
        f,
        &params,
        Dtype::Bf16,
        kernelforge::ops::Epilogue::None,
        kernelforge::ops::Mask::None,
        &limits,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("split_k == 1 ||"), "{err}");
    // qkv: out seen as the [3 B n_head T, HS] matrix of its heads, so that a chunk of one head
    // and 64 positions is one box; heads that are not a multiple of 64 wide are refused.
    let v = variant_of(Dtype::Bf16, kernelforge::ops::Epilogue::Qkv, &[]);
    let gpt2: kernelforge::ops::Shape = [("M", 2048), ("N", 2304), ("K", 768), ("T", 1024), ("n_head", 12)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let launch = v.launches(&gpt2, &limits).unwrap().remove(0);
    let out = launch.tensor_maps.iter().find(|m| m.arg == "out").unwrap();
    assert_eq!(
        (out.rows, out.cols, out.box_rows, out.box_cols),
        (2048 * 36, 64, 64, 64)
    );
    let mut narrow_heads = gpt2.clone();
    narrow_heads.insert("n_head".into(), 8);
    let why = v.check_shape(&narrow_heads, &limits).unwrap_err();
    assert!(why.contains("epilogue_qkv"), "96-wide heads: {why}");
    // tf32: f32 boxes of 32 elements; both operands straight from shared memory (the tensor
    // cores truncate them), no rounding in registers nor a pass over shared memory.
    let v = variant(Dtype::Tf32, &[]);
    assert_eq!(v.launches(&shape, &limits).unwrap()[0].tensor_maps[0].box_cols, 32);
    let code = renderer.render(&v).unwrap().code;
    assert!(
        code.contains("wgmma.mma_async.sync.aligned.m64n192k8.f32.tf32.tf32"),
        "tf32 wgmma"
    );
    assert!(
        code.contains("wgmma_m64(acc[i], desc_a + a_offset, desc_b + b_offset)"),
        "A from shared memory"
    );
    for unwanted in [
        "wgmma_m64_rs(acc[i]",
        "ldmatrix.sync",
        "round_tf32_in_place(",
        "desc_a_low",
    ] {
        assert!(!code.contains(unwanted), "tf32: {unwanted}");
    }
}

/// The 3xTF32 sibling of the TMA family: f32 only, the same template; each product is three
/// TF32 MMAs (the low parts first) reading the stage and the low ring, which the producer
/// warpgroup's idle warps fill; both rings and the staging fit in shared memory; a K longer
/// than an accumulator can sum at f32 accuracy is refused with the constraint named, and
/// split-K brings it back.
#[test]
fn tma_3xtf32_family_splits_every_operand() {
    let c = catalog();
    let f = c.family("matmul_wgmma_tma_3xtf32").unwrap();
    assert_eq!(f.dtypes, vec![Dtype::F32]);
    assert_eq!(f.arch.as_ref().expect("[family] arch").name, "sm_90a");
    let limits = DeviceLimits::default();
    let all = expand(f, Points::All, &limits).unwrap();
    assert!(all.len() > 100, "{}", all.len());
    for v in &all {
        let d = &v.derived;
        let rings = (v.params["stages"] + v.params["low_stages"]) * d["stage_bytes"];
        assert!(
            rings < d["smem_bytes"] && d["smem_bytes"] <= limits.max_smem_dynamic,
            "{}",
            v.key()
        );
    }
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    let v = variant_with(
        f,
        &[],
        Dtype::F32,
        kernelforge::ops::Epilogue::BiasGelu,
        kernelforge::ops::Mask::None,
        &limits,
    )
    .unwrap();
    let code = renderer.render(&v).unwrap().code;
    let mmas = [
        "wgmma_m64(acc[i], desc_a_low + a_offset, desc_b + b_offset)",
        "wgmma_m64(acc[i], desc_a + a_offset, desc_b_low + b_offset)",
        "wgmma_m64(acc[i], desc_a + a_offset, desc_b + b_offset)",
    ];
    let at: Vec<usize> = mmas
        .iter()
        .map(|m| code.find(m).unwrap_or_else(|| panic!("{m}")))
        .collect();
    assert!(at[0] < at[1] && at[1] < at[2], "the small terms first");
    assert!(code.contains("m64n128k8.f32.tf32.tf32"), "TF32 instructions");
    assert!(
        code.contains("split_stages(ring.stages, ring.low_ring"),
        "the producer's warps split"
    );
    assert!(code.contains("0xFFFFE000u"), "low(x) = x - trunc(x)");
    let shape = |k: i64| -> kernelforge::ops::Shape {
        [("M", 1024), ("N", 768), ("K", k), ("T", 1024), ("n_head", 12)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    };
    v.check_shape(&shape(3072), &limits).unwrap();
    let why = v.check_shape(&shape(6400), &limits).unwrap_err();
    assert!(why.contains("ceil_div(K, split_k) <= 4096"), "{why}");
    let split = variant_with(
        f,
        &[
            ("split_k".to_string(), 2),
            ("mma_n".to_string(), 96),
            ("stages".to_string(), 4),
        ],
        Dtype::F32,
        kernelforge::ops::Epilogue::BiasResidual,
        kernelforge::ops::Mask::None,
        &limits,
    )
    .unwrap();
    split.check_shape(&shape(6400), &limits).unwrap();
}
