//! The project's own specs and templates: they load, expand, render, and `generated/` is in sync.

use std::collections::BTreeSet;
use std::path::Path;

use kernelforge::codegen::{cuda_files, render_catalog, Renderer};
use kernelforge::spec::{expand, variant_with, Catalog, DeviceLimits, Dtype, Points};

fn catalog() -> Catalog {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Catalog::load(&root.join("specs"), &root.join("templates")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_family_of_the_design_exists() {
    let c = catalog();
    let names: BTreeSet<_> = c.families.iter().map(|f| f.name.as_str()).collect();
    for want in [
        "encoder_block",
        "encoder_gridstride",
        "layernorm_warp",
        "layernorm_block",
        "layernorm_regs",
        "matmul_naive",
        "matmul_tiled",
        "matmul_regtile",
        "matmul_splitk",
        "matmul_warptile",
        "matmul_gemv",
        "matmul_simt",
        "matmul_wmma",
        "matmul_wgmma",
        "matmul_mma",
        "attention_naive",
        "attention_flash",
        "attention_flash_mma",
        "attention_flash_3xtf32",
        "softmax_row",
        "gelu",
        "residual",
        "attention_decode",
        "kv_append",
        "argmax_row",
    ] {
        assert!(names.contains(want), "missing family {want}; have {names:?}");
    }
}

#[test]
fn every_matmul_family_has_every_epilogue_and_attention_every_mask() {
    let c = catalog();
    for f in c.for_op("matmul") {
        assert_eq!(f.epilogues.len(), 5, "{}", f.name);
    }
    for f in c.for_op("attention") {
        assert_eq!(f.masks.len(), 3, "{}", f.name);
    }
}

/// The size of every search space and the default launch of every family, reviewed as a
/// snapshot: a change to a spec shows up here.
#[test]
fn catalog_summary() {
    let c = catalog();
    let limits = DeviceLimits::default();
    let mut lines = Vec::new();
    for f in &c.families {
        let points = f.point_count(&limits).unwrap();
        let variants = expand(f, Points::All, &limits).unwrap().len();
        let default = expand(f, Points::Default, &limits).unwrap().remove(0);
        // the largest test shape, so the grid sizes say something
        let shape =
            f.op.test_shapes(default.epilogue, default.mask)
                .into_iter()
                .max_by_key(|s| s.values().product::<i64>())
                .unwrap();
        let launches = default.launches(&shape, &limits).unwrap();
        let geometry: Vec<String> = launches
            .iter()
            .map(|l| {
                format!(
                    "{}: grid {:?} block {:?} smem {}",
                    l.function.rsplit('_').next().unwrap(),
                    l.grid,
                    l.block,
                    l.smem_bytes
                )
            })
            .collect();
        lines.push(format!(
            "{} (op {}): {points} points, {variants} variants; default {} on {}: {}",
            f.name,
            f.op.name(),
            default.key(),
            kernelforge::spec::shape_text(&shape),
            geometry.join("; ")
        ));
    }
    insta::assert_snapshot!(lines.join("\n"));
}

#[test]
fn kernel_names_are_deterministic_and_distinct() {
    let c = catalog();
    let limits = DeviceLimits::default();
    let mut seen = BTreeSet::new();
    for f in &c.families {
        for v in expand(f, Points::All, &limits).unwrap() {
            let name = v.kernel_name();
            assert_eq!(name, v.clone().kernel_name());
            assert!(name.starts_with(&f.name), "{name}");
            assert!(seen.insert(name.clone()), "two variants share the kernel name {name}");
        }
    }
}

#[test]
fn every_variant_renders_and_defines_its_kernels() {
    let c = catalog();
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    for f in &c.families {
        // every point would be slow for the biggest spaces; a seeded sample plus the default
        for v in expand(f, Points::Sample { count: 12, seed: 7 }, &DeviceLimits::default()).unwrap() {
            let source = renderer.render(&v).unwrap_or_else(|e| panic!("{e}"));
            for k in &f.kernels {
                let signature = format!("{}_{}(", source.kernel_name, k.name);
                assert!(
                    source.code.contains(&signature),
                    "{}: no `{signature}` in\n{}",
                    v.key(),
                    source.code
                );
            }
            assert!(source.code.contains("extern \"C\" __global__"), "{}", v.key());
        }
    }
}

#[test]
fn generated_folder_matches_specs_and_templates() {
    let c = catalog();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = root.join("generated");
    let files = render_catalog(&c, Points::Default, &DeviceLimits::default()).unwrap();
    for f in &files {
        let on_disk = std::fs::read_to_string(out.join(&f.path)).unwrap_or_default();
        assert!(
            on_disk == f.code,
            "generated/{} is stale: run `kernelforge gen`",
            f.path.display()
        );
    }
    let expected: BTreeSet<_> = files.iter().map(|f| out.join(&f.path)).collect();
    for extra in cuda_files(&out) {
        assert!(
            expected.contains(&extra),
            "{} is not rendered by any spec: run `kernelforge gen`",
            extra.display()
        );
    }
}

/// The WMMA family: tf32, f16 and bf16 (one fragment-shape param, 32 bytes of K for every dtype),
/// a variant of another dtype refused with a message that says which dtypes exist; each dtype
/// renders its own fragment type.
#[test]
fn wmma_family_is_tensor_core_only() {
    let c = catalog();
    let f = c.family("matmul_wmma").unwrap();
    assert_eq!(f.dtypes, vec![Dtype::Tf32, Dtype::F16, Dtype::Bf16]);
    let limits = DeviceLimits::default();
    let all = expand(f, Points::All, &limits).unwrap();
    assert!(all.len() > 5 * 20, "a real search space: {}", all.len());
    assert!(all.iter().all(|v| v.dtype != Dtype::F32));
    assert!(all
        .iter()
        .all(|v| (v.params["frag_m"], v.params["frag_n"], v.params["frag_k"]) == (16, 16, 8)));
    for v in &all {
        let warp = (v.derived["warp_m"], v.derived["warp_n"]);
        assert!(warp.0 % 16 == 0 && warp.1 % 16 == 0, "{}", v.key());
        assert!(v.derived["smem_bytes"] <= limits.max_smem_dynamic, "{}", v.key());
        assert_eq!(v.params["block_k"] % 16, 0, "whole k16 half fragments: {}", v.key());
    }
    let stages: BTreeSet<i64> = all.iter().map(|v| v.params["stages"]).collect();
    assert_eq!(stages, [2, 3, 4].into_iter().collect());
    let e = variant_with(
        f,
        &[],
        Dtype::F32,
        kernelforge::ops::Epilogue::None,
        kernelforge::ops::Mask::None,
        &limits,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("matmul_wmma.toml") && e.contains("no f32 variants") && e.contains("tf32, f16, bf16"),
        "{e}"
    );
    // No other matmul family does tf32 but the Hopper ones (tf32 needs tensor cores).
    for f in c
        .for_op("matmul")
        .filter(|f| !["matmul_wmma", "matmul_wgmma", "matmul_wgmma_tma"].contains(&f.name.as_str()))
    {
        assert!(!f.dtypes.contains(&Dtype::Tf32), "{}", f.name);
    }
    // The rendered defaults: TF32 fragments with the conversion, 16-bit fragments without it,
    // the cp.async pipeline and the storage-typed epilogue in both.
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    let render = |dtype: Dtype| {
        let v = variant_with(
            f,
            &[],
            dtype,
            kernelforge::ops::Epilogue::None,
            kernelforge::ops::Mask::None,
            &limits,
        )
        .unwrap();
        renderer.render(&v).unwrap().code
    };
    let tf32 = render(Dtype::Tf32);
    for want in [
        "#include <mma.h>",
        "precision::tf32",
        "__float_to_tf32",
        "cp.async.cg.shared.global",
        "cp.async.wait_group",
        "store_output(",
        "typedef float storage_t;",
    ] {
        assert!(tf32.contains(want), "tf32: missing {want}");
    }
    for (dtype, ty) in [(Dtype::F16, "__half"), (Dtype::Bf16, "__nv_bfloat16")] {
        let code = render(dtype);
        assert!(
            code.contains(&format!("16, 16, FRAG_K, {ty}, wmma::row_major")),
            "{dtype}"
        );
        assert!(code.contains("#define FRAG_K 16"), "{dtype}");
        assert!(
            !code.contains("__float_to_tf32(a"),
            "{dtype}: no TF32 rounding of halves"
        );
        assert!(code.contains(&format!("typedef {ty} storage_t;")), "{dtype}");
    }
}

/// The mma.sync family: f16/bf16 only, K % 8 for its 16-byte rows, every point's shared
/// memory within the device limit and its warp tile whole m16 x n16 steps; the default renders
/// the raw instructions (ldmatrix, mma.sync m16n8k16 in its dtype, cp.async) and the swizzle.
#[test]
fn mma_family_is_half_only_with_raw_instructions() {
    let c = catalog();
    let f = c.family("matmul_mma").unwrap();
    assert_eq!(f.dtypes, vec![Dtype::F16, Dtype::Bf16]);
    assert_eq!(f.epilogues.len(), 5);
    let limits = DeviceLimits::default();
    let all = expand(f, Points::All, &limits).unwrap();
    assert!(all.len() > 5 * 2 * 50, "a real search space: {}", all.len());
    for v in &all {
        assert!(v.derived["smem_bytes"] <= limits.max_smem_dynamic, "{}", v.key());
        assert_eq!(v.derived["warp_m"] % 16, 0, "{}", v.key());
        assert_eq!(v.derived["warp_n"] % 16, 0, "{}", v.key());
        assert!(v.derived["c_bytes"] <= v.derived["smem_bytes"], "{}", v.key());
    }
    let swizzles: BTreeSet<i64> = all.iter().map(|v| v.params["swizzle"]).collect();
    assert_eq!(swizzles, [0, 1].into_iter().collect());
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    for (dtype, name) in [(Dtype::F16, "f16"), (Dtype::Bf16, "bf16")] {
        let v = variant_with(
            f,
            &[],
            dtype,
            kernelforge::ops::Epilogue::BiasGelu,
            kernelforge::ops::Mask::None,
            &limits,
        )
        .unwrap();
        let code = renderer.render(&v).unwrap().code;
        for want in [
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
            "mma.sync.aligned.m16n8k16.row.col.f32.",
            &format!("#define MMA_INPUT_TYPE \"{name}\""),
            "cp.async.cg.shared.global",
            "int swz(int row) { return (row / ROWS_PER_LINE) % CHUNKS_PER_ROW; }",
            "store_output8(",
            "gelu_precise(",
        ] {
            assert!(code.contains(want), "{name}: missing {want}");
        }
        // The shape constraint: 16-byte rows of halves.
        let shape = |k: i64| {
            [("M", 64), ("N", 64), ("K", k), ("T", 64), ("n_head", 1)]
                .into_iter()
                .map(|(n, x)| (n.to_string(), x))
                .collect()
        };
        assert!(v.check_shape(&shape(72), &limits).is_ok());
        assert!(v.check_shape(&shape(36), &limits).is_err());
    }
}

/// The decode step's matmul in every storage dtype.
#[test]
fn gemv_family_has_half_storage() {
    let c = catalog();
    let f = c.family("matmul_gemv").unwrap();
    assert_eq!(f.dtypes, vec![Dtype::F32, Dtype::F16, Dtype::Bf16]);
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    let limits = DeviceLimits::default();
    let v = variant_with(
        f,
        &[],
        Dtype::Bf16,
        kernelforge::ops::Epilogue::Qkv,
        kernelforge::ops::Mask::None,
        &limits,
    )
    .unwrap();
    let code = renderer.render(&v).unwrap().code;
    for want in [
        "typedef __nv_bfloat16 storage_t;",
        "accumulate<8>",
        "load8(",
        "storage_t* out",
    ] {
        assert!(code.contains(want), "missing {want}");
    }
}

#[test]
fn dtype_names_parse_and_print() {
    for d in Dtype::ALL {
        assert_eq!(d.to_string().parse::<Dtype>().unwrap(), d);
    }
    assert_eq!("tf32".parse::<Dtype>().unwrap(), Dtype::Tf32);
    let e = "bf17".parse::<Dtype>().unwrap_err().to_string();
    assert!(e.contains("bf17") && e.contains("f32, tf32"), "{e}");
    assert_eq!(kernelforge::tune::verify::tolerance(Dtype::Tf32), 1e-3);
    assert_eq!(kernelforge::tune::verify::tolerance(Dtype::F32), 1e-5);
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
        "mbarrier.arrive.release.cluster.shared::cluster.b64",
        "mbarrier.try_wait.parity.acquire.cluster",
    ] {
        assert!(code.contains(want), "split-K: missing {want}");
    }
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
        code.contains("split_stages(smem_base, low_ring"),
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
