//! Every family of the ops other than matmul on the GPU (matmul: `tests/gpu_matmul.rs`): the
//! default and a seeded random sample of variants, every epilogue and mask, on each op's awkward
//! shapes, against the f64 CPU reference with NaN-poisoned outputs. Run with
//! `cargo test -- --include-ignored` on a machine with a CUDA GPU.

mod kernel_checks;

use kernel_checks::*;
use kernelforge::codegen::Renderer;
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::ops::{Epilogue, Mask, Shape};
use kernelforge::spec::{variant_with, Catalog, Dtype, Points};
use kernelforge::tune::verify::{verify, Shapes, Status};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_encoder() {
    check_op("encoder");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_encoder_vector_widths() {
    check_vector_widths("encoder_block", &[&[]]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_layernorm() {
    check_op("layernorm");
}

/// Every value of `family`'s `vector_width` (crossed with each `others` point), in every dtype
/// the family lists, the rest of the point at the default: check_op samples only a few points,
/// so a width (the 16-byte half path, its scalar tail) could go unchecked for a long time.
fn check_vector_widths(family: &str, others: &[&[(&str, i64)]]) {
    let catalog = catalog_of(&[]);
    let f = catalog
        .families
        .iter()
        .find(|f| f.name == family)
        .unwrap_or_else(|| panic!("no family {family}"));
    let widths = f.params.get("vector_width").expect("a vector_width param");
    assert!(widths.contains(&8), "{family}: no 16-byte half path (vector_width 8)");
    let mut points = Vec::new();
    for &width in widths {
        for other in others {
            let mut point = vec![("vector_width", width)];
            point.extend_from_slice(other);
            points.push(point);
        }
    }
    check_points(family, &points);
}

/// Each of `points` (params that differ from the default) of `family`, in every dtype it
/// lists: each must pass on some test shape and fail on none.
fn check_points(family: &str, points: &[Vec<(&str, i64)>]) {
    check_points_in(family, points, |_| true);
}

/// [`check_points`] in the family's dtypes `dtype_wanted` keeps.
fn check_points_in(family: &str, points: &[Vec<(&str, i64)>], dtype_wanted: impl Fn(Dtype) -> bool) {
    let catalog = catalog_of(&[]);
    let f = catalog
        .families
        .iter()
        .find(|f| f.name == family)
        .unwrap_or_else(|| panic!("no family {family}"))
        .clone();
    let mut wanted = Vec::new();
    let rows = run_variants(&catalog, |_, limits| {
        let mut variants = Vec::new();
        for point in points {
            let point: Vec<(String, i64)> = point.iter().map(|&(k, v)| (k.to_string(), v)).collect();
            for &dtype in f.dtypes.iter().filter(|&&d| dtype_wanted(d)) {
                let v = variant_with(&f, &point, dtype, Epilogue::None, Mask::None, limits)
                    .unwrap_or_else(|e| panic!("{family} {point:?}: {e}"));
                wanted.push(v.key());
                variants.push(v);
            }
        }
        variants
    });
    assert_no_failures(rows.iter());
    for key in wanted {
        assert!(
            rows.iter()
                .any(|r| r.family == family && r.variant == key && r.status == Status::Pass),
            "{family} {key}: passed on no test shape"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_layernorm_vector_widths() {
    check_vector_widths("layernorm_warp", &[&[("const_params", 0)], &[("const_params", 1)]]);
    check_vector_widths("layernorm_block", &[&[("const_params", 0)], &[("const_params", 1)]]);
    check_vector_widths(
        "layernorm_regs",
        &[&[("items", 2)], &[("block_size", 64), ("items", 4)]],
    );
    // The row cached in registers: lanes with no vector (C = 200), with one more (C = 1032),
    // rows that fill the cache exactly (C = 768 at 8 x 3).
    check_points(
        "layernorm_warp",
        &[
            vec![("vector_width", 8), ("cached_items", 3)],
            vec![("vector_width", 8), ("cached_items", 6), ("rows_per_block", 32)],
            vec![("vector_width", 4), ("cached_items", 7), ("rows_per_block", 1)],
        ],
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention() {
    check_op("attention");
}

/// The tensor-core attention families beyond the per-op sample: every head size they compile
/// and the edges of their tilings (one- and eight-warp blocks, two m-tiles per warp, 32- and
/// 128-key tiles, 3- and 4-stage rings), in every dtype they list (f16 and bf16 for
/// attention_flash_mma, f32 and tf32 for attention_flash_3xtf32), every mask, on awkward T (77:
/// not a multiple of any tile; 300 with a window of 37; 1024 for the f32 family) against the f64
/// reference with the dtype's bar.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_tensor_core_tilings() {
    let catalog = catalog_of(&[]);
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let renderer = Renderer::new(&catalog.templates_dir).expect("templates");
    let seed = seed();
    let points: &[(&str, &[(&str, i64)])] = &[
        ("attention_flash_mma", &[("head_dim", 32)]),
        ("attention_flash_mma", &[("head_dim", 128)]),
        (
            "attention_flash_mma",
            &[("head_dim", 128), ("block_q", 128), ("block_kv", 32), ("stages", 3)],
        ),
        ("attention_flash_mma", &[("block_q", 32), ("block_kv", 32)]),
        (
            "attention_flash_mma",
            &[("block_q", 128), ("block_kv", 128), ("stages", 3)],
        ),
        ("attention_flash_mma", &[("block_kv", 128), ("stages", 4)]),
        (
            "attention_flash_mma",
            &[("m_tiles", 2), ("block_kv", 32), ("stages", 3)],
        ),
        (
            "attention_flash_mma",
            &[("head_dim", 32), ("block_q", 32), ("m_tiles", 2), ("block_kv", 64)],
        ),
        (
            "attention_flash_3xtf32",
            &[("head_dim", 32), ("block_q", 32), ("block_kv", 32)],
        ),
        (
            "attention_flash_3xtf32",
            &[("block_q", 128), ("block_kv", 32), ("stages", 3)],
        ),
    ];
    let mut rows = Vec::new();
    let mut expected = 0;
    for &(name, point) in points {
        let family = catalog
            .families
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("{name} exists"));
        let over: Vec<(String, i64)> = point.iter().map(|&(k, v)| (k.to_string(), v)).collect();
        let hs = point.iter().find(|(k, _)| *k == "head_dim").map_or(64, |&(_, v)| v);
        let mut variants = Vec::new();
        for &dtype in &family.dtypes {
            for &mask in &family.masks {
                variants.push(
                    variant_with(family, &over, dtype, Epilogue::None, mask, &gpu.info.limits).expect("valid point"),
                );
            }
        }
        // f32 at a GPT-2 length too: the 3xTF32 error grows with the keys summed per row.
        let mut lengths = vec![(77, 20), (300, 37)];
        if name == "attention_flash_3xtf32" {
            lengths.push((1024, 300));
        }
        for (t, window) in lengths {
            let shape: Shape = [("B", 2), ("NH", 3), ("T", t), ("HS", hs), ("window", window)]
                .iter()
                .map(|&(k, v)| (k.to_string(), v))
                .collect();
            expected += variants.len();
            rows.extend(verify(
                &gpu,
                &compiler,
                &renderer,
                &variants,
                &Shapes::Given(shape),
                seed,
                |_| {},
            ));
        }
    }
    for r in &rows {
        eprintln!(
            "{:40} {:60} {:42} {:>10} {:?}",
            r.kernel,
            r.variant,
            r.shape,
            r.error.map(|e| format!("{e:.2e}")).unwrap_or_default(),
            r.status
        );
    }
    assert_eq!(rows.len(), expected);
    let failures: Vec<_> = rows.iter().filter(|r| r.status != Status::Pass).collect();
    assert!(
        failures.is_empty(),
        "{} of {} did not pass: {failures:#?}",
        failures.len(),
        rows.len()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_softmax() {
    check_op("softmax");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gelu() {
    check_op("gelu");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gelu_vector_widths() {
    check_vector_widths("gelu", &[&[]]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_residual() {
    check_op("residual");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_residual_vector_widths() {
    check_vector_widths("residual", &[&[]]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_decode() {
    check_op("attention_decode");
}

/// Every point of `attention_decode_groups` (split length x warps x rows a trip) with a trip's
/// loads at its top, and with them issued in the trip before (after or before its weighing) at
/// one warp and four, in every dtype, on every test shape: where a split ends inside a trip, a
/// warp has no rows, the step's own row falls in the first trip or the last, or the cache fits
/// one split (no combine) differs from point to point.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_decode_groups_every_point() {
    let mut points = Vec::new();
    for next_trip in [0, 1, 2] {
        let warps: &[i64] = if next_trip == 0 { &[1, 2, 4, 8] } else { &[1, 4] };
        for keys_per_split in [32, 64, 128, 256, 512, 1024] {
            for &warps in warps {
                for rows_at_once in [1, 2, 4, 8] {
                    points.push(vec![
                        ("keys_per_split", keys_per_split),
                        ("warps", warps),
                        ("rows_at_once", rows_at_once),
                        ("next_trip", next_trip),
                    ]);
                }
            }
        }
    }
    check_points("attention_decode_groups", &points);
}

/// Every point of `attention_decode_stream` at one block an SM (split length x warps x ring
/// slots x rows a turn) whose ring fits, and a few at more blocks, on every test shape: a block
/// that walks one item or many (its ring's slots reused, their barriers' phases flipping), a
/// split that ends inside a turn or holds the step's row alone, a cache of one split (no
/// combine). A ring sized by the dtype: the points whose f32 ring does not fit run in f16 and
/// bf16 only.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_decode_stream_every_point() {
    let max_smem = 227 * 1024; // H100 and H200, per block
    let ring = |split_rows: i64, stages: i64, elem_bytes: i64| stages * (2 * split_rows + 1) * 64 * elem_bytes + 128;
    let (mut everywhere, mut halves) = (Vec::new(), Vec::new());
    for split_rows in [32, 64, 128, 256] {
        for warps in [2, 4, 8] {
            for stages in [2, 3, 4, 6, 8] {
                if ring(split_rows, stages, 2) > max_smem {
                    continue;
                }
                for rows_at_once in [1, 2, 4] {
                    let point = vec![
                        ("split_rows", split_rows),
                        ("warps", warps),
                        ("stages", stages),
                        ("rows_at_once", rows_at_once),
                        ("blocks_per_sm", 1),
                    ];
                    if ring(split_rows, stages, 4) <= max_smem {
                        everywhere.push(point);
                    } else {
                        halves.push(point);
                    }
                }
            }
        }
    }
    for blocks_per_sm in [2, 3, 4] {
        everywhere.push(vec![
            ("split_rows", 32),
            ("stages", 2),
            ("blocks_per_sm", blocks_per_sm),
        ]);
    }
    halves.push(vec![("split_rows", 32), ("stages", 2), ("blocks_per_sm", 8)]);
    check_points("attention_decode_stream", &everywhere);
    check_points_in("attention_decode_stream", &halves, |d| d != Dtype::F32);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_kv_append() {
    check_op("kv_append");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_argmax() {
    check_op("argmax");
}

/// The harness itself must catch broken kernels: one that skips the last element (caught by
/// the NaN poison), one that is off by a little (caught by the tolerance), one that does not
/// compile (reported, not a crash).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_harness_catches_broken_kernels() {
    let dir = tempfile::tempdir().unwrap();
    let (specs, templates) = (dir.path().join("specs"), dir.path().join("templates"));
    std::fs::create_dir_all(&specs).unwrap();
    std::fs::create_dir_all(templates.join("t")).unwrap();
    let template = r#"extern "C" __global__ void {{ kernel_name }}_main(float* out, const float* a, const float* b, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
{% if bug == 0 %}    if (i < N - 1) out[i] = a[i] + b[i];   // forgets the last element
{% elif bug == 1 %}    if (i < N) out[i] = a[i] + b[i] + 1e-3f;  // slightly wrong
{% else %}    this does not compile
{% endif %}}
"#;
    std::fs::write(templates.join("t/bad.cu.tera"), template).unwrap();
    let spec = r#"[family]
name = "residual_broken"
op = "residual"
template = "t/bad.cu.tera"
dtypes = ["f32"]
[params]
bug = [0, 1, 2]
[[kernels]]
name = "main"
grid = ["ceil_div(N, 128)", "1", "1"]
block = ["128", "1", "1"]
[default]
bug = 0
"#;
    std::fs::write(specs.join("residual_broken.toml"), spec).unwrap();
    let catalog = Catalog::load(&specs, &templates).unwrap();
    let rows = run(&catalog, "residual", |_| Points::All);
    assert!(!rows.is_empty());
    for r in &rows {
        assert!(matches!(r.status, Status::Fail(_)), "a broken kernel passed: {r:?}");
    }
    assert!(rows
        .iter()
        .any(|r| r.variant.contains("bug=2") && format!("{:?}", r.status).contains("NVRTC")));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sample() {
    check_op("sample");
}

/// Every point of `sample_row` (block size x chunk x candidate list), in every dtype, on every
/// test shape: the paths (argmax, Gumbel, candidates, bisection) meet each point's sizes
/// differently, so a sample of points is not enough.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sample_every_point() {
    let mut points = Vec::new();
    for block_size in [256, 512, 1024] {
        for chunk in [1024, 2048, 4096] {
            for max_top_k in [64, 128, 256] {
                points.push(vec![
                    ("block_size", block_size),
                    ("chunk", chunk),
                    ("max_top_k", max_top_k),
                ]);
            }
        }
    }
    check_points("sample_row", &points);
}
