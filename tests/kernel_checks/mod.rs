//! What the GPU kernel tests share: the seed, verifying variants on their op's test shapes or
//! on a given shape against the f64 reference, and failing with every failing row listed.
//! Each test binary uses a part of it.
#![allow(dead_code)]

use std::path::Path;

use kernelforge::codegen::Renderer;
use kernelforge::gpu::{Compiler, Gpu};
use kernelforge::ops::Shape;
use kernelforge::spec::{expand, Catalog, DeviceLimits, Points, Variant};
use kernelforge::tune::verify::{verify, Check, Shapes, Status};

/// Variants drawn per family besides the default.
pub const SAMPLE: usize = 4;

pub fn seed() -> u64 {
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

pub fn run(catalog: &Catalog, op: &str, points: impl Fn(u64) -> Points) -> Vec<Check> {
    run_variants(catalog, |seed, limits| {
        let mut variants = Vec::new();
        for f in catalog.for_op(op) {
            variants.extend(expand(f, points(seed), limits).expect("expand"));
        }
        assert!(!variants.is_empty(), "no family implements {op}");
        variants
    })
}

/// Verifies the variants `pick` chooses (given the seed and the device limits) on their op's
/// test shapes, and prints one line per check.
pub fn run_variants(catalog: &Catalog, pick: impl FnOnce(u64, &DeviceLimits) -> Vec<Variant>) -> Vec<Check> {
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    let compiler = Compiler::new(&gpu.info.arch()).expect("NVRTC");
    let renderer = Renderer::new(&catalog.templates_dir).expect("templates");
    let seed = seed();
    let variants = pick(seed, &gpu.info.limits);
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

/// The project's catalog, cut down to `families` when some are named (each must exist).
pub fn catalog_of(families: &[&str]) -> Catalog {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut catalog = Catalog::load(&root.join("specs"), &root.join("templates")).expect("specs");
    if !families.is_empty() {
        catalog.families.retain(|f| families.contains(&f.name.as_str()));
        assert_eq!(catalog.families.len(), families.len(), "{families:?} exist");
    }
    catalog
}

/// Verifies `variants` on one given shape, prints a line per check and fails on any failure.
pub fn verify_on_shape(
    gpu: &Gpu,
    compiler: &Compiler,
    renderer: &Renderer,
    variants: &[Variant],
    shape: &[(&str, i64)],
) -> Vec<Check> {
    let shape: Shape = shape.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let rows = verify(gpu, compiler, renderer, variants, &Shapes::Given(shape), seed(), |_| {});
    for r in &rows {
        eprintln!(
            "{:40} {:42} {:?} {:?} {}",
            r.kernel, r.shape, r.error, r.status, r.variant
        );
    }
    assert_no_failures(rows.iter());
    rows
}

/// Fails the test with every failing row listed.
pub fn assert_no_failures<'a>(rows: impl Iterator<Item = &'a Check> + Clone) {
    let failures: Vec<_> = rows.clone().filter(|r| matches!(r.status, Status::Fail(_))).collect();
    assert!(
        failures.is_empty(),
        "{} of {} checks failed: {failures:#?}",
        failures.len(),
        rows.count()
    );
}

pub fn check_op(op: &str) {
    let catalog = catalog_of(&[]);
    let rows = run(&catalog, op, |seed| Points::Sample { count: SAMPLE, seed });
    assert_no_failures(rows.iter());
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
