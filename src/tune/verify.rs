//! Verification: every variant runs on fresh random inputs with NaN-poisoned outputs and is
//! compared with the op's f64 CPU reference by relative L2 error.

use std::collections::{BTreeMap, HashMap};

use rand::SeedableRng;

use crate::codegen::Renderer;
use crate::gpu::{Compiled, Compiler, DeviceProblem, Gpu, LoadedVariant};
use crate::ops::{self, Epilogue, Mask, Problem, Shape, Storage};
use crate::spec::{shape_text, Dtype, Variant};

/// Largest relative L2 error a dtype may show against the f64 reference (DESIGN.md).
pub fn tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 1e-5,
        // Inputs rounded to a 10-bit mantissa before the tensor-core products (f32 sums).
        Dtype::Tf32 => 1e-3,
        // Inputs and outputs stored with an 11-bit (f16) or 8-bit (bf16) significand.
        Dtype::F16 | Dtype::Bf16 => 1e-2,
    }
}

/// What a failing error means: a relative L2 error, or (exact ops) a count of wrong elements.
pub fn error_text(variant: &Variant, error: f64) -> String {
    if variant.family.op.exact() {
        format!("{error} elements differ from the reference")
    } else {
        format!("relative L2 error {error:.3e}")
    }
}

/// Outcome of one variant on one shape.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "status", content = "reason", rename_all = "snake_case")]
pub enum Status {
    Pass,
    /// Wrong result, or failed to compile, load or launch.
    Fail(String),
    /// The variant does not support the shape (its `constraints.shape`).
    Skip(String),
}

/// One row of the verification table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    pub family: String,
    pub kernel: String,
    pub variant: String,
    pub op: String,
    pub dtype: String,
    pub shape: String,
    /// Largest relative L2 error over the outputs (None when it did not run).
    pub error: Option<f64>,
    pub tolerance: f64,
    #[serde(flatten)]
    pub status: Status,
}

/// Which shapes to check.
#[derive(Debug, Clone)]
pub enum Shapes {
    /// Each op's awkward test shapes.
    TestShapes,
    /// One shape for every variant (completed per epilogue/mask by the op).
    Given(Shape),
}

/// Verifies `variants` on `shapes`; never stops early except on a GPU fault (which poisons the
/// context, so later rows would be meaningless: they are reported as failures).
/// `progress` is called after each row.
pub fn verify(
    gpu: &Gpu,
    compiler: &Compiler,
    renderer: &Renderer,
    variants: &[Variant],
    shapes: &Shapes,
    seed: u64,
    mut progress: impl FnMut(&Check),
) -> Vec<Check> {
    let mut rows = Vec::new();
    // Render and compile up front, in parallel, every variant this device can run (a family
    // built for another exact `[family] arch` is skipped below with the reason), each for its
    // family's target.
    let sources: Vec<_> = variants.iter().map(|v| renderer.render(v)).collect();
    let to_compile: Vec<_> = variants
        .iter()
        .zip(&sources)
        .filter(|(v, _)| v.check_device(&gpu.info.limits).is_ok())
        .filter_map(|(v, s)| s.as_ref().ok().map(|s| (&*v.family, s)))
        .collect();
    let compiled: HashMap<String, Result<Compiled, String>> = to_compile
        .iter()
        .zip(compiler.compile_all(&to_compile, |_| {}))
        .map(|((_, s), result)| (s.kernel_name.clone(), result.map_err(|e| e.to_string())))
        .collect();

    // Group variants by the problem they need so every group shares inputs and reference.
    // Half-storage variants need their own problem (inputs rounded, tensors stored as halves).
    let mut groups: BTreeMap<(&'static str, Storage, Epilogue, Mask), Vec<usize>> = BTreeMap::new();
    for (i, v) in variants.iter().enumerate() {
        groups
            .entry((v.family.op.name(), v.dtype.storage(), v.epilogue, v.mask))
            .or_default()
            .push(i);
    }
    let mut loaded: HashMap<String, LoadedVariant> = HashMap::new();
    let mut faulted: Option<String> = None;
    for ((op_name, storage, epilogue, mask), members) in groups {
        let op = ops::op_by_name(op_name).expect("families name known ops");
        if let Some(why) = op.checked_end_to_end() {
            for &i in &members {
                let shape = op.test_shapes(epilogue, mask).into_iter().next().unwrap_or_default();
                let row = row_for(&variants[i], &shape, None, Status::Skip(why.to_string()));
                progress(&row);
                rows.push(row);
            }
            continue;
        }
        let shape_list = match shapes {
            Shapes::TestShapes => op.test_shapes(epilogue, mask),
            Shapes::Given(shape) => {
                let mut s = shape.clone();
                match op.complete_shape(&mut s, epilogue, mask) {
                    Ok(()) => vec![s],
                    Err(e) => {
                        for &i in &members {
                            let row = row_for(&variants[i], shape, None, Status::Skip(e.to_string()));
                            progress(&row);
                            rows.push(row);
                        }
                        continue;
                    }
                }
            }
        };
        for (shape_index, shape) in shape_list.iter().enumerate() {
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                seed ^ ((shape_index as u64) << 32) ^ epilogue as u64 ^ ((mask as u64) << 8),
            );
            let problem = op
                .problem(shape, epilogue, mask, &mut rng)
                .map(|p| p.stored_as(storage));
            let (problem, reference) = match problem {
                Ok(p) => {
                    let r = op.reference(&p);
                    (p, r)
                }
                Err(e) => {
                    for &i in &members {
                        let row = row_for(
                            &variants[i],
                            shape,
                            None,
                            Status::Fail(format!("cannot build the problem: {e}")),
                        );
                        progress(&row);
                        rows.push(row);
                    }
                    continue;
                }
            };
            let mut device = match DeviceProblem::upload(gpu, &problem) {
                Ok(d) => Some(d),
                Err(e) => {
                    faulted.get_or_insert(e.to_string());
                    None
                }
            };
            for &i in &members {
                let variant = &variants[i];
                let status_error = if let Some(fault) = &faulted {
                    (
                        Status::Fail(format!("not run: an earlier kernel faulted the GPU context ({fault})")),
                        None,
                    )
                } else if let Err(why) = variant.check_shape(shape, &gpu.info.limits) {
                    (Status::Skip(why), None)
                } else {
                    match run_one(
                        gpu,
                        variant,
                        &sources[i],
                        &compiled,
                        &mut loaded,
                        &problem,
                        device.as_mut().expect("uploaded"),
                        &reference,
                    ) {
                        Ok(error) if error < tolerance(variant.dtype) => (Status::Pass, Some(error)),
                        Ok(error) => (Status::Fail(error_text(variant, error)), Some(error)),
                        Err(RunFailure::Soft(message)) => (Status::Fail(message), None),
                        Err(RunFailure::Fault(message)) => {
                            faulted = Some(message.clone());
                            (Status::Fail(message), None)
                        }
                    }
                };
                let row = row_for(variant, shape, status_error.1, status_error.0);
                progress(&row);
                rows.push(row);
            }
        }
    }
    rows
}

/// Why a variant did not produce a result.
#[derive(Debug)]
pub(crate) enum RunFailure {
    /// This variant is broken; others can still run.
    Soft(String),
    /// The GPU context is unusable from now on.
    Fault(String),
}

#[allow(clippy::too_many_arguments)]
fn run_one(
    gpu: &Gpu,
    variant: &Variant,
    source: &Result<crate::codegen::Source, crate::codegen::CodegenError>,
    compiled: &HashMap<String, Result<Compiled, String>>,
    loaded: &mut HashMap<String, LoadedVariant>,
    problem: &Problem,
    device: &mut DeviceProblem,
    reference: &[(usize, Vec<f64>)],
) -> Result<f64, RunFailure> {
    let soft = |e: &dyn std::fmt::Display| RunFailure::Soft(e.to_string());
    let source = source.as_ref().map_err(|e| soft(e))?;
    let name = &source.kernel_name;
    if !loaded.contains_key(name) {
        let cubin = compiled
            .get(name)
            .expect("compiled every rendered source")
            .as_ref()
            .map_err(|e| soft(e))?;
        loaded.insert(
            name.clone(),
            LoadedVariant::load(gpu, variant, cubin).map_err(|e| soft(&e))?,
        );
    }
    run_and_compare(gpu, &loaded[name], problem, device, reference)
}

/// Runs a loaded variant once on `problem` (its workspace sized, `__constant__` data filled,
/// outputs poisoned with NaN first) and returns the largest relative L2 error of its outputs
/// against `reference`.
pub(crate) fn run_and_compare(
    gpu: &Gpu,
    loaded: &LoadedVariant,
    problem: &Problem,
    device: &mut DeviceProblem,
    reference: &[(usize, Vec<f64>)],
) -> Result<f64, RunFailure> {
    let soft = |e: &dyn std::fmt::Display| RunFailure::Soft(e.to_string());
    let launches = loaded.plan(gpu, &problem.shape).map_err(|e| soft(&e))?;
    let elems = loaded
        .variant
        .workspace_elems(&problem.shape, &gpu.info.limits)
        .map_err(|e| soft(&e))?;
    device.ensure_workspace(gpu, elems).map_err(|e| soft(&e))?;
    loaded.fill_constants(gpu, problem).map_err(|e| soft(&e))?;
    device.poison_outputs(gpu, problem).map_err(|e| soft(&e))?;
    loaded
        .launch(gpu, problem, device, &launches)
        .map_err(|e| RunFailure::Fault(e.to_string()))?;
    gpu.synchronize().map_err(|e| RunFailure::Fault(e.to_string()))?;
    let mut worst = 0.0f64;
    for (index, want) in reference {
        let got = device
            .download(gpu, *index)
            .map_err(|e| RunFailure::Fault(e.to_string()))?;
        let error = if loaded.variant.family.op.exact() {
            ops::mismatch_count(&got, want)
        } else {
            ops::relative_l2_error(&got, want)
        };
        worst = worst.max(error);
    }
    Ok(worst)
}

fn row_for(variant: &Variant, shape: &Shape, error: Option<f64>, status: Status) -> Check {
    let mut kernel = variant.family.name.clone();
    if variant.epilogue != Epilogue::None {
        kernel = format!("{kernel}[{}]", variant.epilogue.as_str());
    }
    if variant.mask != Mask::None {
        kernel = format!("{kernel}[{}]", variant.mask.as_str());
    }
    Check {
        family: variant.family.name.clone(),
        kernel,
        variant: variant.key(),
        op: variant.family.op.name().to_string(),
        dtype: variant.dtype.to_string(),
        shape: shape_text(shape),
        error,
        tolerance: tolerance(variant.dtype),
        status,
    }
}
