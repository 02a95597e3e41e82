//! The project's own specs and templates: they load, expand, render, and `generated/` is in sync.

use std::collections::BTreeSet;
use std::path::Path;

use kernelforge::codegen::{cuda_files, render_catalog, Renderer};
use kernelforge::spec::{expand, variant_with, Catalog, DeviceLimits, Dtype, Points, Variant};

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
        let plain: Vec<_> = f.epilogues.iter().filter(|e| !e.standardizes_input()).collect();
        assert_eq!(plain.len(), 5, "{}", f.name);
        // The ln_ epilogues (a layernorm folded in) are matmul_wgmma_tma's alone.
        let folded = f.epilogues.iter().filter(|e| e.standardizes_input()).count();
        assert_eq!(folded, if f.name == "matmul_wgmma_tma" { 3 } else { 0 }, "{}", f.name);
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
                .max_by_key(|s| s.values().fold(1i64, |a, &v| a.saturating_mul(v)))
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

/// Every kernel a variant launches is defined in its source (a kernel with a `when` at least
/// where it runs on the op's test shapes).
#[test]
fn every_variant_renders_and_defines_its_kernels() {
    let c = catalog();
    let renderer = Renderer::new(&c.templates_dir).unwrap();
    let limits = DeviceLimits::default();
    // Whether `v` launches its family's kernel `i` on one of the op's test shapes.
    let launches_kernel = |v: &Variant, i: usize| {
        v.family
            .op
            .test_shapes(v.epilogue, v.mask)
            .iter()
            .any(|s| v.launches(s, &limits).is_ok_and(|l| l.iter().any(|l| l.kernel == i)))
    };
    let mut conditional_runs = 0;
    for f in &c.families {
        // every point would be slow for the biggest spaces; a seeded sample plus the default
        let mut variants = expand(f, Points::Sample { count: 12, seed: 7 }, &limits).unwrap();
        // ... and for the conditional kernels, the points where they run
        for (i, k) in f.kernels.iter().enumerate() {
            if k.when.is_some() {
                let runs: Vec<_> = expand(f, Points::All, &limits)
                    .unwrap()
                    .into_iter()
                    .filter(|v| launches_kernel(v, i))
                    .take(4)
                    .collect();
                conditional_runs += runs.len();
                variants.extend(runs);
            }
        }
        for v in variants {
            let source = renderer.render(&v).unwrap_or_else(|e| panic!("{e}"));
            for (i, k) in f.kernels.iter().enumerate() {
                let runs = k.when.is_none() || launches_kernel(&v, i);
                let signature = format!("{}_{}(", source.kernel_name, k.name);
                assert!(
                    !runs || source.code.contains(&signature),
                    "{}: no `{signature}` in\n{}",
                    v.key(),
                    source.code
                );
            }
            assert!(source.code.contains("extern \"C\" __global__"), "{}", v.key());
            if let Some(kernel) = kernel_not_waiting_first(&source.code) {
                panic!(
                    "{}: `{kernel}` does not start with `{{{{ launch::wait_for_previous_kernel() }}}}` \
                     (a CUDA graph may launch it while the kernel before it still runs)",
                    v.key()
                );
            }
        }
    }
    assert!(
        conditional_runs > 0,
        "no point of the catalog launches a conditional kernel"
    );
}

/// The first `__global__` function of `code` whose body does not begin with the wait for the
/// previous kernel (`templates/common/launch.cu.tera`), by its signature's first line. Before
/// the wait a kernel may call one `prefetch_*` function (fetches of what no kernel writes, into
/// L2 or the CTA's own shared memory), and nothing else.
fn kernel_not_waiting_first(code: &str) -> Option<String> {
    let mut rest = code;
    while let Some(at) = rest.find("__global__") {
        let kernel = &rest[at..];
        let body = kernel.find("{\n").map(|b| &kernel[b + 2..]).unwrap_or("");
        // Its first statements, comments left out: the guard, then the wait, or one prefetch
        // call and then the wait.
        let head: Vec<&str> = body
            .trim_start()
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("//"))
            .take(3)
            .collect();
        let guard = |l: &&str| *l == "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900";
        let wait = |l: &&str| l.contains("griddepcontrol.wait;");
        let prefetch = |l: &&str| l.starts_with("prefetch_") && l.ends_with(");");
        let waits_first = match head.as_slice() {
            [g, w, ..] if guard(g) && wait(w) => true,
            [g, p, w] => guard(g) && prefetch(p) && wait(w),
            _ => false,
        };
        if !waits_first {
            // The line with the kernel's name: the first past the launch bounds.
            let name = kernel.lines().find(|l| !l.contains("__launch_bounds__")).unwrap_or("");
            return Some(name.trim().to_string());
        }
        rest = &kernel["__global__".len()..];
    }
    None
}

/// The check above on hand-written kernels: the wait first, one prefetch before it, and the
/// two ways to get it wrong (a load before the wait, no wait).
#[test]
fn the_wait_check_tells_kernels_apart() {
    let kernel = |before: &str| {
        format!(
            "extern \"C\" __global__ void __launch_bounds__(64)\nk(float* x) {{\n\
             #if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n{before}\
             asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");\n#endif\n    x[0] = 1.0f;\n}}\n"
        )
    };
    assert_eq!(kernel_not_waiting_first(&kernel("")), None);
    assert_eq!(
        kernel_not_waiting_first(&kernel("    // why\n    prefetch_rows(x, 4);\n")),
        None
    );
    assert_eq!(
        kernel_not_waiting_first(&kernel("    const float y = x[1];\n")).as_deref(),
        Some("k(float* x) {")
    );
    let no_wait = "extern \"C\" __global__ void k(float* x) {\n    x[0] = 1.0f;\n}\n";
    assert!(kernel_not_waiting_first(no_wait).is_some());
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

/// Untuned, an op's families are tried by rank: two families of one op and dtype never share a
/// rank, so no default falls to the families' names.
#[test]
fn ranks_order_each_ops_families_in_each_dtype_without_ties() {
    let catalog = catalog();
    let mut seen: std::collections::BTreeMap<(String, String, i64), String> = Default::default();
    for f in &catalog.families {
        for dtype in &f.dtypes {
            let key = (f.op.name().to_string(), dtype.to_string(), f.rank);
            if let Some(other) = seen.insert(key.clone(), f.name.clone()) {
                panic!("{} and {other} share rank {} for {} in {}", f.name, key.2, key.0, key.1);
            }
        }
    }
}

/// `elem_bytes` in the launch-time scope: attention_decode_stream's ring of shared memory is
/// sized by the variant's dtype (a point is dtype-free), so the same point asks half the bytes
/// in 16-bit storage, a ring that fits only in halves is refused for f32 by its shape
/// constraint, and the family is offered only where batch x heads is at most three per SM.
#[test]
fn the_streaming_decode_attention_sizes_its_ring_by_the_dtype() {
    let c = catalog();
    let f = c.family("attention_decode_stream").unwrap();
    let limits = DeviceLimits::default();
    let point = |split_rows: i64, stages: i64| {
        vec![
            ("split_rows".to_string(), split_rows),
            ("stages".to_string(), stages),
            ("blocks_per_sm".to_string(), 1),
        ]
    };
    let shape = |b: i64, nh: i64| -> kernelforge::ops::Shape {
        [("B", b), ("NH", nh), ("T", 300), ("HS", 64), ("max_T", 307)]
            .into_iter()
            .map(|(n, x)| (n.to_string(), x))
            .collect()
    };
    let variant = |point: &[(String, i64)], dtype| {
        variant_with(
            f,
            point,
            dtype,
            kernelforge::ops::Epilogue::None,
            kernelforge::ops::Mask::None,
            &limits,
        )
        .unwrap()
    };
    // 3 slots of 128 keys, 128 values and the query, 64 elements a row, then the barriers
    for (dtype, bytes) in [(Dtype::Bf16, 2), (Dtype::F32, 4)] {
        let v = variant(&point(128, 3), dtype);
        let partial = &v.launches(&shape(2, 2), &limits).unwrap()[0];
        assert_eq!(partial.smem_bytes as i64, 3 * 257 * 64 * bytes + 128, "{dtype}");
        assert!(v.check_shape(&shape(2, 2), &limits).is_ok(), "{dtype}");
    }
    // Two slots of 256-row splits: 131 KB in bf16, 263 KB in f32 (more than a block may have).
    assert!(variant(&point(256, 2), Dtype::Bf16)
        .check_shape(&shape(2, 2), &limits)
        .is_ok());
    let why = variant(&point(256, 2), Dtype::F32)
        .check_shape(&shape(2, 2), &limits)
        .unwrap_err();
    assert!(why.contains("elem_bytes"), "{why}");
    // 32 x 12 heads on 132 SMs is offered, 64 x 12 is not.
    assert!(variant(&point(64, 2), Dtype::Bf16)
        .check_shape(&shape(32, 12), &limits)
        .is_ok());
    let why = variant(&point(64, 2), Dtype::Bf16)
        .check_shape(&shape(64, 12), &limits)
        .unwrap_err();
    assert!(why.contains("B * NH <= 3 * num_sms"), "{why}");
}
