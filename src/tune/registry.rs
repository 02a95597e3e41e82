//! The kernel registry: what the model asks for "the kernel for (op, epilogue or mask,
//! shape)". It answers with the tuned winner when the database has one (the exact shape, else
//! the nearest tuned row count), else the default point of the best-ranked family that
//! supports the shape (a family's default that cannot run the shape its `prefer_when` claims is
//! first moved to the nearest point that can, one parameter changed); and it compiles (through the cache) and loads each kernel
//! once.

use std::collections::HashMap;
use std::sync::Arc;

use crate::codegen::Renderer;
use crate::gpu::{Compiler, Gpu, LoadedVariant, RunError};
use crate::ops::{self, Epilogue, Mask, Shape};
use crate::spec::{expand, shape_text, variant_with, Catalog, DeviceLimits, Dtype, Points, Variant};
use crate::tune::db::{TuneKey, TuningDb};

/// Where a selected variant came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    /// Tuned on exactly this shape.
    Tuned,
    /// Tuned on the same shape with another row count.
    Nearest,
    /// Nothing tuned: the family default.
    Default,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("no kernel family implements op `{op}` for {shape} ({why})")]
    NoFamily { op: String, shape: String, why: String },
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("{0}")]
    Build(String),
}

/// A chosen variant.
#[derive(Debug, Clone)]
pub struct Selected {
    pub variant: Variant,
    pub choice: Choice,
}

/// Chooses, compiles and loads kernels for the model.
pub struct Registry {
    pub catalog: Catalog,
    pub db: Option<TuningDb>,
    renderer: Arc<Renderer>,
    compiler: Compiler,
    loaded: HashMap<String, Arc<LoadedVariant>>,
    /// Messages worth showing once (a tuned entry no longer valid for its spec, ...).
    pub notes: Vec<String>,
}

impl Registry {
    pub fn new(catalog: Catalog, db: Option<TuningDb>, compiler: Compiler) -> Result<Registry, RegistryError> {
        let renderer = Renderer::shared(&catalog.templates_dir).map_err(RegistryError::Build)?;
        Ok(Registry {
            catalog,
            db,
            renderer,
            compiler,
            loaded: HashMap::new(),
            notes: Vec::new(),
        })
    }

    /// The variant for (op, dtype, epilogue, mask, shape); `shape` must be complete (see
    /// [`ops::OpContract::complete_shape`]). Only variants of `dtype` are candidates: tuned
    /// entries are looked up under that dtype and the defaults come from families listing it.
    pub fn select(
        &mut self,
        op: &str,
        dtype: Dtype,
        epilogue: Epilogue,
        mask: Mask,
        shape: &Shape,
        limits: &DeviceLimits,
    ) -> Result<Selected, RegistryError> {
        let contract = ops::op_by_name(op).ok_or_else(|| RegistryError::NoFamily {
            op: op.to_string(),
            shape: shape_text(shape),
            why: "unknown op".into(),
        })?;
        if let Some(db) = &self.db {
            let key = TuneKey::of(op, dtype, epilogue, mask, shape.clone());
            if let Some(entry) = db.nearest(&key, contract.row_dims()) {
                let choice = if entry.shape == *shape {
                    Choice::Tuned
                } else {
                    Choice::Nearest
                };
                let overrides: Vec<_> = entry.params.iter().map(|(k, v)| (k.clone(), *v)).collect();
                let found = self
                    .catalog
                    .family(&entry.family)
                    .map_err(|e| e.to_string())
                    .and_then(|f| variant_with(f, &overrides, dtype, epilogue, mask, limits).map_err(|e| e.to_string()))
                    .and_then(|v| v.check_shape(shape, limits).map(|_| v));
                match found {
                    Ok(variant) => return Ok(Selected { variant, choice }),
                    Err(why) => self.notes.push(format!(
                        "ignoring the tuned {} for {}: {why}; using the default",
                        entry.family,
                        key.text()
                    )),
                }
            }
        }
        let mut defaults = Vec::new();
        for f in self
            .catalog
            .for_op(op)
            .filter(|f| f.dtypes.contains(&dtype) && f.epilogues.contains(&epilogue) && f.masks.contains(&mask))
        {
            let variant = expand(f, Points::Default, limits)
                .map_err(|e| RegistryError::Build(e.to_string()))?
                .into_iter()
                .find(|v| v.dtype == dtype && v.epilogue == epilogue && v.mask == mask)
                .expect("the family lists this dtype, epilogue and mask");
            let variant = match variant.check_shape(shape, limits) {
                Ok(()) => variant,
                Err(_) if f.prefer_when.is_some() => fitted_default(&variant, shape, limits).unwrap_or(variant),
                Err(_) => variant,
            };
            defaults.push(variant);
        }
        // Families whose `prefer_when` holds for this shape first, then by rank.
        defaults.sort_by_key(|v| (!v.preferred_for(shape, limits), v.family.rank, v.family.name.clone()));
        let mut reasons = Vec::new();
        for variant in defaults {
            let f = variant.family.clone();
            match variant.check_shape(shape, limits) {
                Ok(()) => {
                    return Ok(Selected {
                        variant,
                        choice: Choice::Default,
                    })
                }
                Err(why) => reasons.push(format!("{} {why}", f.name)),
            }
        }
        Err(RegistryError::NoFamily {
            op: op.to_string(),
            shape: shape_text(shape),
            why: if reasons.is_empty() {
                format!("none lists {dtype} with {}", variant_kind(epilogue, mask))
            } else {
                reasons.join("; ")
            },
        })
    }

    /// Compiles (through the on-disk cache) and loads a variant once.
    pub fn load(&mut self, gpu: &Gpu, variant: &Variant) -> Result<Arc<LoadedVariant>, RegistryError> {
        let name = variant.kernel_name();
        if let Some(k) = self.loaded.get(&name) {
            return Ok(k.clone());
        }
        let source = self
            .renderer
            .render(variant)
            .map_err(|e| RegistryError::Build(e.to_string()))?;
        let compiled = self
            .compiler
            .for_family(&variant.family)
            .compile(&source)
            .map_err(|e| RegistryError::Build(e.to_string()))?;
        let loaded = Arc::new(LoadedVariant::load(gpu, variant, &compiled)?);
        self.loaded.insert(name, loaded.clone());
        Ok(loaded)
    }
}

/// When a family's default cannot run `shape` (say `matmul_gemv` with `max_rows = 8` for 16
/// rows), the point nearest to it that can and that the family's `prefer_when` claims the shape
/// for: one parameter changed, to the closest value in the spec's order (the later value on a
/// tie, so sizes grow to fit). `None` when no such point exists (always for families without
/// `prefer_when`, whose defaults stay as they are).
fn fitted_default(default: &Variant, shape: &Shape, limits: &DeviceLimits) -> Option<Variant> {
    let family = &default.family;
    let mut tries: Vec<(usize, std::cmp::Reverse<usize>, String, i64)> = Vec::new();
    for (name, values) in &family.params {
        let at = values.iter().position(|v| *v == default.params[name])?;
        for (i, value) in values.iter().enumerate().filter(|(i, _)| *i != at) {
            tries.push((i.abs_diff(at), std::cmp::Reverse(i), name.clone(), *value));
        }
    }
    tries.sort();
    tries.into_iter().find_map(|(_, _, name, value)| {
        let overrides: Vec<(String, i64)> = default
            .params
            .iter()
            .map(|(k, v)| (k.clone(), if *k == name { value } else { *v }))
            .collect();
        variant_with(
            family,
            &overrides,
            default.dtype,
            default.epilogue,
            default.mask,
            limits,
        )
        .ok()
        .filter(|v| v.check_shape(shape, limits).is_ok() && v.preferred_for(shape, limits))
    })
}

/// The epilogue (matmul) or mask (attention) name used in tuning keys.
pub fn variant_kind(epilogue: Epilogue, mask: Mask) -> &'static str {
    if mask != Mask::None {
        mask.as_str()
    } else {
        epilogue.as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemv_default(dtype: Dtype) -> Variant {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
        let family = catalog.family("matmul_gemv").unwrap().clone();
        expand(&family, Points::Default, &DeviceLimits::default())
            .unwrap()
            .into_iter()
            .find(|v| v.dtype == dtype && v.epilogue == Epilogue::BiasResidual)
            .unwrap()
    }

    fn rows(m: i64) -> Shape {
        [("M", m), ("N", 768), ("K", 3072), ("T", m)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// A decode step of 16 sequences gets the small-M family grown to 16 rows, not a GEMM
    /// family built for thousands of rows; beyond what any point holds there is no fit.
    #[test]
    fn a_default_that_cannot_run_the_shape_is_grown_to_fit_it() {
        let limits = DeviceLimits::default();
        let default = gemv_default(Dtype::Bf16);
        assert_eq!(default.params["max_rows"], 8);
        assert!(default.check_shape(&rows(16), &limits).is_err());
        let fitted = fitted_default(&default, &rows(16), &limits).expect("a point with max_rows = 16");
        assert_eq!(fitted.params["max_rows"], 16);
        for (name, value) in &default.params {
            if name != "max_rows" {
                assert_eq!(fitted.params[name], *value, "only max_rows moved");
            }
        }
        let fitted = fitted_default(&default, &rows(12), &limits).unwrap();
        assert_eq!(fitted.params["max_rows"], 16, "the closest value that holds 12 rows");
        assert!(fitted_default(&default, &rows(17), &limits).is_none());
    }
}
