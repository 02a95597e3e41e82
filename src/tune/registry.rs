//! The kernel registry: what the model asks for "the kernel for (op, epilogue or mask,
//! shape)". It answers with the tuned winner when the database has one (the exact shape, else
//! the nearest tuned row count), else the default point of the best-ranked family that
//! supports the shape; and it compiles (through the cache) and loads each kernel once.

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
    renderer: Renderer,
    compiler: Compiler,
    loaded: HashMap<String, Arc<LoadedVariant>>,
    /// Messages worth showing once (a tuned entry no longer valid for its spec, ...).
    pub notes: Vec<String>,
}

impl Registry {
    pub fn new(catalog: Catalog, db: Option<TuningDb>, compiler: Compiler) -> Result<Registry, RegistryError> {
        let renderer = Renderer::new(&catalog.templates_dir).map_err(|e| RegistryError::Build(e.to_string()))?;
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
            let key = TuneKey {
                op: op.to_string(),
                dtype: dtype.to_string(),
                variant_kind: variant_kind(epilogue, mask).to_string(),
                shape: shape.clone(),
            };
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

/// The epilogue (matmul) or mask (attention) name used in tuning keys.
pub fn variant_kind(epilogue: Epilogue, mask: Mask) -> &'static str {
    if mask != Mask::None {
        mask.as_str()
    } else {
        epilogue.as_str()
    }
}
