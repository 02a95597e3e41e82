//! Every family on the GPU: the default and a seeded random sample of variants, every epilogue
//! and mask, on each op's awkward shapes, against the f64 CPU reference with NaN-poisoned
//! outputs. Run with `cargo test -- --include-ignored` on a machine with a CUDA GPU.

use std::path::Path;

use kernelforge::codegen::Renderer;
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::spec::{expand, Catalog, Points};
use kernelforge::tune::verify::{verify, Check, Shapes, Status};

/// Variants drawn per family besides the default.
const SAMPLE: usize = 4;

fn seed() -> u64 {
    let seed = std::env::var("KERNELFORGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("seed {seed} (set KERNELFORGE_SEED to reproduce)");
    seed
}

fn run(catalog: &Catalog, op: &str, points: impl Fn(u64) -> Points) -> Vec<Check> {
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let renderer = Renderer::new(&catalog.templates_dir).expect("templates");
    let seed = seed();
    let mut variants = Vec::new();
    for f in catalog.for_op(op) {
        variants.extend(expand(f, points(seed), &gpu.info.limits).expect("expand"));
    }
    assert!(!variants.is_empty(), "no family implements {op}");
    let rows = verify(&gpu, &compiler, &renderer, &variants, &Shapes::TestShapes, seed, |_| {});
    for r in &rows {
        eprintln!(
            "{:40} {:42} {:>10} {:?}",
            r.kernel,
            r.shape,
            r.error.map(|e| format!("{e:.2e}")).unwrap_or_default(),
            r.status
        );
    }
    rows
}

fn check_op(op: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).expect("specs");
    let rows = run(&catalog, op, |seed| Points::Sample { count: SAMPLE, seed });
    let failures: Vec<_> = rows.iter().filter(|r| matches!(r.status, Status::Fail(_))).collect();
    assert!(
        failures.is_empty(),
        "{} of {} checks failed: {failures:#?}",
        failures.len(),
        rows.len()
    );
    // Every family must actually have run somewhere, in every dtype it lists.
    for f in catalog.for_op(op) {
        for dtype in &f.dtypes {
            let passed = rows
                .iter()
                .filter(|r| r.family == f.name && r.dtype == dtype.as_str() && r.status == Status::Pass)
                .count();
            assert!(passed > 0, "{} ({dtype}): no variant ran on any test shape", f.name);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_encoder() {
    check_op("encoder");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_layernorm() {
    check_op("layernorm");
}

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
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut catalog = Catalog::load(&root.join("specs"), &root.join("templates")).expect("specs");
    catalog.families.retain(|f| f.name == "matmul_wmma");
    assert_eq!(catalog.families.len(), 1, "matmul_wmma exists");
    let rows = run(&catalog, "matmul", |seed| Points::Sample { count: 8, seed });
    let failures: Vec<_> = rows.iter().filter(|r| matches!(r.status, Status::Fail(_))).collect();
    assert!(
        failures.is_empty(),
        "{} of {} failed: {failures:#?}",
        failures.len(),
        rows.len()
    );
    let passed: Vec<_> = rows.iter().filter(|r| r.status == Status::Pass).collect();
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

/// The Hopper wgmma family on its own (sm_90a: only on compute capability 9.0), with a larger
/// sample than the per-op test: every dtype it lists, every epilogue, on the awkward shapes its
/// `K % 8 == 0` constraint allows (M=37, N=100, K=72; QKV with HS=12, ...). On another GPU every
/// row must be a skip that names the target.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_wgmma() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut catalog = Catalog::load(&root.join("specs"), &root.join("templates")).expect("specs");
    catalog.families.retain(|f| f.name == "matmul_wgmma");
    assert_eq!(catalog.families.len(), 1, "matmul_wgmma exists");
    let family = catalog.families[0].clone();
    let rows = run(&catalog, "matmul", |seed| Points::Sample { count: 8, seed });
    if Gpu::new(0).expect("a CUDA GPU").info.compute_capability != (9, 0) {
        for r in &rows {
            assert!(
                matches!(&r.status, Status::Skip(why) if why.contains("sm_90a")),
                "{r:?}"
            );
        }
        return;
    }
    let failures: Vec<_> = rows.iter().filter(|r| matches!(r.status, Status::Fail(_))).collect();
    assert!(
        failures.is_empty(),
        "{} of {} failed: {failures:#?}",
        failures.len(),
        rows.len()
    );
    let passed: Vec<_> = rows.iter().filter(|r| r.status == Status::Pass).collect();
    for dtype in &family.dtypes {
        for kind in ["matmul_wgmma", "[bias]", "[bias_gelu]", "[bias_residual]", "[qkv]"] {
            assert!(
                passed
                    .iter()
                    .any(|r| r.dtype == dtype.as_str() && r.kernel.ends_with(kind)),
                "no {dtype} {kind} row passed"
            );
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
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention() {
    check_op("attention");
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
fn gpu_residual() {
    check_op("residual");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_decode() {
    check_op("attention_decode");
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
