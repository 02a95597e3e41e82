//! Which families run on which GPU, from the specs alone (`[family] arch`, `[family] min_arch`):
//! every op has a path in every dtype on every target from Turing (sm_75, the T4) to Blackwell
//! (sm_100, sm_120), or a refusal written down here and in the README; and the README's table of
//! families x targets is the catalog's.
//!
//! Where NVRTC is present, every family the catalog offers on a target compiles to that
//! target's CUBIN (ptxas checks every instruction; PTX alone would not).
//!
//! The paths per target read only the compute capability; the default points are checked
//! against the limits of the GPUs `--target` stands in for (`gpu::stand_in`: a T4's 64 KiB of
//! shared memory drops some points of a family, never the family).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use kernelforge::codegen::Renderer;
use kernelforge::gpu::compile::nvrtc_present;
use kernelforge::gpu::stand_in::{self, STAND_INS};
use kernelforge::gpu::Compiler;
use kernelforge::model::config::GPT2Config;
use kernelforge::model::gpu::{decode_step_key, fitted_default, MEGAKERNEL_FAMILY};
use kernelforge::ops::all_ops;
use kernelforge::spec::{expand, variant_with, Catalog, DeviceLimits, Dtype, Family, Points, Variant};

/// The targets of the table: name and compute capability.
const TARGETS: [(&str, (i32, i32)); 7] = [
    ("sm_75", (7, 5)),
    ("sm_80", (8, 0)),
    ("sm_86", (8, 6)),
    ("sm_89", (8, 9)),
    ("sm_90", (9, 0)),
    ("sm_100", (10, 0)),
    ("sm_120", (12, 0)),
];

/// (op, dtype, the first target with a path): the documented refusals. Below that target the
/// model refuses the dtype with the families' reasons ("needs compute capability 8.0 ...: --dtype
/// f32 runs everywhere"). tf32 exists only on Ampere's tensor cores and later, and so do the bf16
/// MMAs of every prefill matmul family; f16 runs everywhere (a T4's prefill attention in halves is
/// `attention_flash`, on the FMAs, its matmuls `matmul_wmma`).
const REFUSALS: [(&str, Dtype, &str); 3] = [
    ("attention", Dtype::Tf32, "sm_80"),
    ("matmul", Dtype::Tf32, "sm_80"),
    ("matmul", Dtype::Bf16, "sm_80"),
];

fn catalog() -> Catalog {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Catalog::load(&root.join("specs"), &root.join("templates")).unwrap_or_else(|e| panic!("{e}"))
}

fn limits(cc: (i32, i32)) -> DeviceLimits {
    DeviceLimits {
        compute_capability: cc,
        ..DeviceLimits::default()
    }
}

/// Whether the default point of `family` in `dtype` may run on compute capability `cc`, asked
/// the way verify, the tuner and the registry ask (`Variant::check_device`).
fn runs(family: &Arc<Family>, dtype: Dtype, cc: (i32, i32)) -> bool {
    expand(family, Points::Default, &limits(cc))
        .unwrap_or_else(|e| panic!("{}: {e}", family.name))
        .iter()
        .find(|v| v.dtype == dtype)
        .is_some_and(|v| v.check_device(&limits(cc)).is_ok())
}

#[test]
fn every_op_has_a_path_in_every_dtype_on_every_target_or_a_documented_refusal() {
    let catalog = catalog();
    let mut gaps = Vec::new();
    for op in all_ops() {
        // A specialist for a few rows (matmul_gemv: the decode step, M <= 16) is no path for a
        // prefill: an op's path must take every shape.
        let families: Vec<&Arc<Family>> = catalog
            .families
            .iter()
            .filter(|f| f.op.name() == op.name() && f.prefer_when.is_none())
            .collect();
        let mut dtypes: Vec<Dtype> = families.iter().flat_map(|f| f.dtypes.clone()).collect();
        dtypes.sort();
        dtypes.dedup();
        for dtype in dtypes {
            let first = TARGETS.iter().find(|(_, cc)| {
                families
                    .iter()
                    .any(|f| f.dtypes.contains(&dtype) && runs(f, dtype, *cc))
            });
            let later_all = first.is_some_and(|(name, _)| {
                let from = TARGETS.iter().position(|(n, _)| n == name).unwrap();
                TARGETS[from..].iter().all(|(_, cc)| {
                    families
                        .iter()
                        .any(|f| f.dtypes.contains(&dtype) && runs(f, dtype, *cc))
                })
            });
            assert!(
                later_all,
                "{} in {dtype}: a target after {first:?} has no family",
                op.name()
            );
            let first = first.map(|(name, _)| *name).unwrap_or("none");
            if first != TARGETS[0].0 {
                gaps.push((op.name(), dtype, first));
            }
        }
    }
    let mut documented: Vec<(&str, Dtype, &str)> = REFUSALS.to_vec();
    documented.sort();
    gaps.sort();
    assert_eq!(
        gaps, documented,
        "(op, dtype, first target with a family): the gaps changed"
    );
}

/// The README's table: a row a family, a column a target, each cell the dtypes that run there
/// (`all` for every dtype the family lists, `-` for none).
fn targets_table(catalog: &Catalog) -> String {
    let mut rows = BTreeMap::new();
    for f in &catalog.families {
        let cells: Vec<String> = TARGETS
            .iter()
            .map(|(_, cc)| {
                let ok: Vec<String> = f
                    .dtypes
                    .iter()
                    .filter(|d| runs(f, **d, *cc))
                    .map(|d| d.to_string())
                    .collect();
                if ok.len() == f.dtypes.len() {
                    "all".to_string()
                } else if ok.is_empty() {
                    "-".to_string()
                } else {
                    ok.join(", ")
                }
            })
            .collect();
        rows.insert(f.name.clone(), cells);
    }
    let mut text = format!(
        "| family | {} |\n| --- |{}\n",
        TARGETS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" | "),
        " --- |".repeat(TARGETS.len())
    );
    for (name, cells) in rows {
        text += &format!("| `{name}` | {} |\n", cells.join(" | "));
    }
    text
}

#[test]
fn the_readme_table_of_families_and_targets_is_the_catalogs() {
    let table = targets_table(&catalog());
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    assert!(
        readme.contains(&table),
        "README.md's families x targets table differs from the catalog; it should read:\n{table}"
    );
}

/// The variant of `family` in `dtype` a model would run on compute capability `cc`: the default
/// point (its first epilogue and mask), or for the decode megakernel the point fitted to the
/// GPU (no bulk copies before sm_90, no tensor cores before sm_80).
fn variant_for(family: &Arc<Family>, dtype: Dtype, cc: (i32, i32)) -> Variant {
    let limits = limits(cc);
    if family.name == MEGAKERNEL_FAMILY {
        let shape = decode_step_key(&GPT2Config::gpt2(), dtype, 8).shape;
        let point = fitted_default(family, &shape, dtype, &limits);
        return variant_with(family, &point, dtype, family.epilogues[0], family.masks[0], &limits)
            .unwrap_or_else(|e| panic!("{} {dtype} {point:?}: {e}", family.name));
    }
    expand(family, Points::Default, &limits)
        .unwrap_or_else(|e| panic!("{}: {e}", family.name))
        .into_iter()
        .find(|v| v.dtype == dtype)
        .expect("the family lists the dtype")
}

#[test]
fn every_family_compiles_for_every_target_the_catalog_offers_it_on() {
    if !nvrtc_present() {
        eprintln!("skipping: NVRTC is not on this machine (the GPU machine has it)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = catalog();
    let renderer = Renderer::new(&root.join("templates")).unwrap();
    let mut failures = Vec::new();
    let mut compiled = 0;
    for (name, cc) in TARGETS {
        let mut compiler = Compiler::new(name).unwrap();
        compiler.cache_dir = None; // a fresh compile: the cache would answer for an older NVRTC
        for family in &catalog.families {
            for &dtype in &family.dtypes {
                let variant = variant_for(family, dtype, cc);
                if variant.check_device(&limits(cc)).is_err() {
                    continue; // not offered there: the catalog says why
                }
                let source = renderer.render(&variant).unwrap();
                compiled += 1;
                if let Err(e) = compiler.for_family(family).compile(&source) {
                    let first = e
                        .to_string()
                        .lines()
                        .find(|l| l.contains("error"))
                        .unwrap_or_default()
                        .to_string();
                    failures.push(format!("{name} {} {dtype}: {first}", family.name));
                }
            }
        }
    }
    eprintln!("{compiled} variants compiled for {} targets", TARGETS.len());
    assert!(
        failures.is_empty(),
        "offered but not compiling:\n{}",
        failures.join("\n")
    );
}

/// Every family's default point on every GPU `--target` stands in for is one that GPU takes:
/// where the spec's `[default]` does not fit (its shared memory), the nearest point that does.
#[test]
fn every_default_point_fits_the_gpus_a_target_stands_in_for() {
    let catalog = catalog();
    for target in &STAND_INS {
        let limits = target.limits(&DeviceLimits::default());
        for family in &catalog.families {
            for v in expand(family, Points::Default, &limits).unwrap() {
                if v.check_device(&limits).is_err() {
                    continue;
                }
                let point: Vec<(String, i64)> = v.params.iter().map(|(k, x)| (k.clone(), *x)).collect();
                variant_with(family, &point, v.dtype, v.epilogue, v.mask, &limits)
                    .unwrap_or_else(|e| panic!("{} on {} ({}): {e}", family.name, target.arch, target.gpu));
            }
        }
    }
    // The H100's default is the spec's own; the T4 gets a tile that fits its 64 KiB.
    let wmma = catalog.families.iter().find(|f| f.name == "matmul_wmma").unwrap();
    let default_on = |limits: &DeviceLimits| expand(wmma, Points::Default, limits).unwrap().remove(0);
    let h100 = default_on(&DeviceLimits::default());
    assert_eq!(h100.params, wmma.default);
    let t4 = stand_in::parse("sm_75").unwrap().limits(&DeviceLimits::default());
    let on_t4 = default_on(&t4);
    assert!(on_t4.derived["smem_bytes"] <= 64 * 1024, "{:?}", on_t4.derived);
    assert_ne!(on_t4.params, wmma.default);
}
