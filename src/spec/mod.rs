//! Kernel family specs: parse `specs/*.toml`, validate them with errors that name the file and
//! the field, and expand a family's parameter space into concrete [`Variant`]s.
//!
//! A spec says *what* to search (params), *what is valid* (derived values + constraints),
//! *how to launch* (grid/block/shared memory per kernel, as expressions over params, derived
//! values, the problem shape and the device limits) and *where to start* (the default point).
//!
//! `parse` reads a spec file into a [`Family`] (`family` holds what a family computes from a
//! point), `space` finds its valid points, `variant` expands a family into [`Variant`]s and
//! evaluates their launches, `catalog` loads a project's families, `target` holds the device
//! side ([`ArchTarget`], [`DeviceLimits`]) and `expr` the expression language. This file keeps
//! what all of them share: [`Dtype`] and [`SpecError`].

mod catalog;
pub mod expr;
mod family;
mod parse;
mod space;
mod target;
mod variant;

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;

use crate::ops::{self};
pub use catalog::Catalog;
pub use expr::{Expr, ExprError};
pub use family::{ConstantSpec, Family, KernelSpec, TensorMapLaunch, TensorMapSpec, Vars};
use target::DEVICE_VARS;
pub use target::{ArchTarget, DeviceLimits};
pub use variant::{expand, shape_text, variant_with, Launch, Points, Variant};

/// Storage/compute precision of a variant:
/// - `f32`: f32 storage, FP32 FMA, the reference path (relative L2 error < 1e-5);
/// - `tf32`: f32 storage, tensor-core math on inputs rounded to TF32 (10-bit mantissa), f32
///   accumulation (relative L2 error < 1e-3);
/// - `f16` / `bf16`: every floating-point tensor stored as 2-byte IEEE half / bfloat16, math in
///   f32 (tensor cores with f32 accumulation for the matmuls; relative L2 error < 1e-2).
///
/// Only families that list a dtype in `family.dtypes` have variants of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    #[default]
    F32,
    Tf32,
    F16,
    Bf16,
}

impl Dtype {
    /// Every dtype, in the order `--help` lists them.
    pub const ALL: [Dtype; 4] = [Dtype::F32, Dtype::Tf32, Dtype::F16, Dtype::Bf16];

    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Tf32 => "tf32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// How the variant's floating-point tensors are stored in memory.
    pub fn storage(self) -> ops::Storage {
        match self {
            Dtype::F32 | Dtype::Tf32 => ops::Storage::F32,
            Dtype::F16 => ops::Storage::F16,
            Dtype::Bf16 => ops::Storage::Bf16,
        }
    }

    /// `f32, tf32`: dtype names for messages.
    pub fn list(dtypes: &[Dtype]) -> String {
        dtypes.iter().map(|d| d.as_str()).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a dtype name was not understood.
#[derive(Debug, thiserror::Error)]
#[error("unknown dtype `{0}` (known: {known})", known = Dtype::list(&Dtype::ALL))]
pub struct UnknownDtype(pub String);

impl std::str::FromStr for Dtype {
    type Err = UnknownDtype;
    fn from_str(text: &str) -> Result<Dtype, UnknownDtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.as_str() == text.trim())
            .ok_or_else(|| UnknownDtype(text.to_string()))
    }
}

/// Largest parameter space a family may declare (a guard against typos like `[1, 2, ..., 4096]`).
pub const MAX_SPACE: usize = 1 << 20;

/// A spec that cannot be used. Every message names the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{file}: cannot read: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    #[error("{file}: {message}")]
    Toml { file: PathBuf, message: String },
    #[error("{file}: {field}: {message}")]
    Field {
        file: PathBuf,
        field: String,
        message: String,
    },
    #[error("{file}: {field}: {source}")]
    Expr {
        file: PathBuf,
        field: String,
        source: ExprError,
    },
    #[error("no spec files (*.toml) in {0}")]
    NoSpecs(PathBuf),
    #[error("no kernel family named `{name}` (known: {known})")]
    UnknownFamily { name: String, known: String },
}
