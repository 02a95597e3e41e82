//! Kernel family specs: parse `specs/*.toml`, validate them with errors that name the file and
//! the field, and expand a family's parameter space into concrete [`Variant`]s.
//!
//! A spec says *what* to search (params), *what is valid* (derived values + constraints),
//! *how to launch* (grid/block/shared memory per kernel, as expressions over params, derived
//! values, the problem shape and the device limits) and *where to start* (the default point).

pub mod expr;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use indexmap::IndexMap;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::ops::{self, Epilogue, Mask, OpContract, Shape};
pub use expr::{Expr, ExprError};

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

/// An exact compile target from `[family] arch`, e.g. `sm_90a`.
///
/// Architecture-specific targets (the `a` suffix) unlock instructions that exist on exactly one
/// compute capability (Hopper's `wgmma` and `setmaxnreg` need `sm_90a`) and are neither forward
/// nor backward compatible, so a family that names one is compiled for exactly that target and
/// offered only on devices of exactly that compute capability: elsewhere `verify` skips it with
/// the reason, and the tuner and the registry never pick it. A plain `sm_XY` is allowed too and
/// is treated the same way (compiled for it, run only on X.Y).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchTarget {
    /// What NVRTC gets as `--gpu-architecture`: `sm_90a`.
    pub name: String,
    /// The only compute capability it runs on: (9, 0).
    pub compute_capability: (i32, i32),
}

impl ArchTarget {
    /// Parses `sm_<major><minor>` with an optional `a` suffix (`sm_90a`, `sm_100a`, `sm_80`).
    pub fn parse(text: &str) -> Result<ArchTarget, String> {
        let bad = || {
            format!(
                "`{text}` is not a GPU target: write sm_<major><minor>, optionally with the \
                 architecture-specific suffix `a` (e.g. sm_90a for Hopper's wgmma)"
            )
        };
        let digits = text.strip_prefix("sm_").ok_or_else(bad)?;
        let digits = digits.strip_suffix('a').unwrap_or(digits);
        if !(2..=3).contains(&digits.len()) || !digits.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        let major: i32 = major.parse().map_err(|_| bad())?;
        let minor: i32 = minor.parse().map_err(|_| bad())?;
        if major < 5 {
            return Err(bad());
        }
        Ok(ArchTarget {
            name: text.to_string(),
            compute_capability: (major, minor),
        })
    }

    /// `Err` says why a device of compute capability `cc` cannot run code built for this target.
    pub fn check_device(&self, cc: (i32, i32)) -> Result<(), String> {
        if cc == self.compute_capability {
            Ok(())
        } else {
            Err(format!(
                "built for {} only (compute capability {}.{}); this GPU is {}.{}",
                self.name, self.compute_capability.0, self.compute_capability.1, cc.0, cc.1
            ))
        }
    }
}

/// What the device allows; expressions see these as `max_threads`, `max_smem_static`,
/// `max_smem_dynamic`, `num_sms` and `warp_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct DeviceLimits {
    pub max_threads: i64,
    pub max_smem_static: i64,
    pub max_smem_dynamic: i64,
    pub num_sms: i64,
    pub warp_size: i64,
    /// Compute capability (major, minor). Not an expression variable: it decides which
    /// families with an exact `[family] arch` target may run at all.
    #[serde(default = "hopper")]
    pub compute_capability: (i32, i32),
}

fn hopper() -> (i32, i32) {
    (9, 0)
}

impl Default for DeviceLimits {
    /// The limits used without a GPU (`gen`, CPU tests): those of an H100.
    fn default() -> Self {
        DeviceLimits {
            max_threads: 1024,
            max_smem_static: 48 * 1024,
            max_smem_dynamic: 227 * 1024,
            num_sms: 132,
            warp_size: 32,
            compute_capability: hopper(),
        }
    }
}

impl DeviceLimits {
    fn vars(&self) -> [(&'static str, i64); 5] {
        [
            ("max_threads", self.max_threads),
            ("max_smem_static", self.max_smem_static),
            ("max_smem_dynamic", self.max_smem_dynamic),
            ("num_sms", self.num_sms),
            ("warp_size", self.warp_size),
        ]
    }
}

const DEVICE_VARS: [&str; 5] = [
    "max_threads",
    "max_smem_static",
    "max_smem_dynamic",
    "num_sms",
    "warp_size",
];

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    family: RawFamily,
    #[serde(default)]
    params: IndexMap<String, Vec<i64>>,
    #[serde(default)]
    derived: IndexMap<String, String>,
    #[serde(default)]
    constraints: RawConstraints,
    #[serde(default)]
    kernels: Vec<RawKernel>,
    workspace: Option<RawWorkspace>,
    #[serde(default)]
    constants: Vec<RawConstant>,
    #[serde(default)]
    default: IndexMap<String, i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFamily {
    name: String,
    op: String,
    template: String,
    #[serde(default)]
    description: String,
    /// Lower is preferred when nothing is tuned: the registry falls back to the default point
    /// of the best-ranked family that supports the shape.
    #[serde(default = "default_rank")]
    rank: i64,
    /// A shape condition under which this family goes before every other (whatever the
    /// ranks) when nothing is tuned, e.g. `M <= 8` for a family built for the decode step.
    prefer_when: Option<String>,
    dtypes: Vec<Dtype>,
    #[serde(default)]
    epilogues: Vec<Epilogue>,
    #[serde(default)]
    masks: Vec<Mask>,
    /// An exact compile target such as `sm_90a` (see [`ArchTarget`]).
    arch: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConstraints {
    #[serde(default)]
    require: Vec<String>,
    #[serde(default)]
    shape: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKernel {
    name: String,
    grid: [String; 3],
    block: [String; 3],
    #[serde(default = "zero")]
    smem: String,
    #[serde(default)]
    tensor_maps: Vec<RawTensorMap>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensorMap {
    arg: String,
    rows: String,
    cols: String,
    box_rows: String,
    box_bytes: String,
    #[serde(default = "zero")]
    swizzle: String,
    when: Option<String>,
}

fn default_rank() -> i64 {
    100
}

fn zero() -> String {
    "0".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkspace {
    elems: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConstant {
    symbol: String,
    tensor: String,
    when: Option<String>,
}

/// One `__global__` function of a family and its launch geometry.
#[derive(Debug, Clone)]
pub struct KernelSpec {
    /// Suffix: the function is `<kernel_name>_<name>`.
    pub name: String,
    pub grid: [Expr; 3],
    pub block: [Expr; 3],
    pub smem: Expr,
    /// TMA descriptors passed after the op's arguments, in this order.
    pub tensor_maps: Vec<TensorMapSpec>,
}

/// `[[kernels.tensor_maps]]`: a TMA tensor map (`CUtensorMap`) the kernel takes as an extra
/// `const __grid_constant__` parameter after the op's arguments. It describes one op tensor as
/// a row-major `rows x cols` matrix of the variant's storage type and the box (tile) one TMA
/// copy moves: `box_rows` rows of `box_bytes` bytes, stored in shared memory with the given
/// swizzle. Built on the host at every launch from the argument's device pointer.
#[derive(Debug, Clone)]
pub struct TensorMapSpec {
    /// The op argument the map describes, and its position in the op's signature.
    pub arg: String,
    pub arg_index: usize,
    pub rows: Expr,
    pub cols: Expr,
    pub box_rows: Expr,
    pub box_bytes: Expr,
    /// Shared-memory swizzle span in bytes: 0 (none), 32, 64 or 128.
    pub swizzle: Expr,
    /// Only variants for which this holds take the map (the template declares the parameter
    /// under the same condition).
    pub when: Option<Expr>,
}

/// A tensor map to build for one launch (see [`TensorMapSpec`]), all sizes evaluated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMapLaunch {
    /// The op argument (its name and position) that holds the tensor's device pointer.
    pub arg: String,
    pub arg_index: usize,
    pub storage: ops::Storage,
    pub rows: u64,
    pub cols: u64,
    pub box_rows: u32,
    /// Elements of the contiguous dimension per box (`box_bytes / element size`).
    pub box_cols: u32,
    pub swizzle: u32,
}

/// A `__constant__` symbol filled from an op tensor before launch.
#[derive(Debug, Clone)]
pub struct ConstantSpec {
    pub symbol: String,
    pub tensor: String,
    pub when: Option<Expr>,
}

/// A validated kernel family.
#[derive(Debug)]
pub struct Family {
    pub name: String,
    pub op: &'static dyn OpContract,
    /// Template path relative to the templates folder.
    pub template: String,
    pub description: String,
    /// Fallback preference among the op's families (lower first).
    pub rank: i64,
    /// Shapes for which this family is preferred over the ranks.
    pub prefer_when: Option<Expr>,
    /// The spec file it came from.
    pub file: PathBuf,
    pub dtypes: Vec<Dtype>,
    pub epilogues: Vec<Epilogue>,
    pub masks: Vec<Mask>,
    /// `[family] arch`: the exact target the family is compiled for, and so the only devices
    /// it runs on; `None` compiles for whatever GPU is present.
    pub arch: Option<ArchTarget>,
    pub params: IndexMap<String, Vec<i64>>,
    pub derived: IndexMap<String, Expr>,
    pub require: Vec<Expr>,
    pub shape_constraints: Vec<Expr>,
    pub kernels: Vec<KernelSpec>,
    pub workspace: Option<Expr>,
    pub constants: Vec<ConstantSpec>,
    pub default: IndexMap<String, i64>,
    /// Valid points under the default (H100) limits, counted when the spec was checked (the
    /// report shows it without enumerating the space again).
    pub valid_points: usize,
}

/// Parameter values and derived values of one point, each in spec order.
type Point = (IndexMap<String, i64>, IndexMap<String, i64>);

/// Variable scope for one evaluation: params, derived values, shape, device limits.
#[derive(Debug, Clone, Default)]
pub struct Vars(BTreeMap<String, i64>);

impl Vars {
    fn set(&mut self, name: &str, value: i64) {
        self.0.insert(name.to_string(), value);
    }
}

impl expr::Scope for Vars {
    fn get(&self, name: &str) -> Option<i64> {
        self.0.get(name).copied()
    }
    fn names(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
}

/// One point of a family: concrete parameter values plus the dtype and epilogue/mask.
#[derive(Debug, Clone)]
pub struct Variant {
    pub family: Arc<Family>,
    pub dtype: Dtype,
    pub epilogue: Epilogue,
    pub mask: Mask,
    /// Parameter values, in spec order.
    pub params: IndexMap<String, i64>,
    /// Derived values, in spec order.
    pub derived: IndexMap<String, i64>,
}

/// How to launch one kernel of a variant on one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The `__global__` function name.
    pub function: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem_bytes: u32,
    /// TMA descriptors to build and pass after the op's arguments.
    pub tensor_maps: Vec<TensorMapLaunch>,
}

impl Family {
    /// Loads and validates one spec; `templates` is the templates folder (checked for the
    /// template file).
    pub fn load(file: &Path, templates: &Path) -> Result<Family, SpecError> {
        let text = std::fs::read_to_string(file).map_err(|source| SpecError::Io {
            file: file.to_path_buf(),
            source,
        })?;
        Family::parse(&text, file, templates)
    }

    /// Validates spec `text` as if read from `file`.
    pub fn parse(text: &str, file: &Path, templates: &Path) -> Result<Family, SpecError> {
        let raw: RawSpec = toml::from_str(text).map_err(|e| SpecError::Toml {
            file: file.to_path_buf(),
            message: e.to_string().trim_end().replace('\n', " | "),
        })?;
        let field_err = |field: &str, message: String| SpecError::Field {
            file: file.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let parse = |field: String, text: &str| {
            Expr::parse(text).map_err(|source| SpecError::Expr {
                file: file.to_path_buf(),
                field,
                source,
            })
        };

        let f = &raw.family;
        let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        if f.name != stem {
            return Err(field_err(
                "family.name",
                format!("`{}` must match the file name `{stem}.toml`", f.name),
            ));
        }
        let op = ops::op_by_name(&f.op).ok_or_else(|| {
            field_err(
                "family.op",
                format!("unknown op `{}` (known: {})", f.op, ops::op_names().join(", ")),
            )
        })?;
        if !templates.join(&f.template).is_file() {
            return Err(field_err(
                "family.template",
                format!("{} does not exist", templates.join(&f.template).display()),
            ));
        }
        if f.dtypes.is_empty() {
            return Err(field_err(
                "family.dtypes",
                format!("empty list: name at least one dtype ({})", Dtype::list(&Dtype::ALL)),
            ));
        }
        let epilogues = if f.epilogues.is_empty() {
            vec![Epilogue::None]
        } else {
            f.epilogues.clone()
        };
        for e in &epilogues {
            if !op.epilogues().contains(e) {
                return Err(field_err(
                    "family.epilogues",
                    format!(
                        "op `{}` has no epilogue `{}` (it supports: {})",
                        op.name(),
                        e.as_str(),
                        op.epilogues().iter().map(|e| e.as_str()).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        let arch = f
            .arch
            .as_deref()
            .map(|text| ArchTarget::parse(text).map_err(|message| field_err("family.arch", message)))
            .transpose()?;
        let masks = if f.masks.is_empty() {
            vec![Mask::None]
        } else {
            f.masks.clone()
        };
        for m in &masks {
            if !op.masks().contains(m) {
                return Err(field_err(
                    "family.masks",
                    format!(
                        "op `{}` has no mask `{}` (it supports: {})",
                        op.name(),
                        m.as_str(),
                        op.masks().iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }

        // Names must not shadow each other, the device limits or the op's shape variables.
        let test_shape = op
            .test_shapes(epilogues[0], masks[0])
            .into_iter()
            .next()
            .unwrap_or_default();
        let reserved = |name: &str| DEVICE_VARS.contains(&name) || test_shape.contains_key(name);
        let mut space: usize = 1;
        for (name, values) in &raw.params {
            let field = format!("params.{name}");
            if values.is_empty() {
                return Err(field_err(&field, "empty list: give at least one value".into()));
            }
            if reserved(name) {
                return Err(field_err(
                    &field,
                    format!("`{name}` is a device limit or shape variable; rename the param"),
                ));
            }
            let mut sorted = values.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != values.len() {
                return Err(field_err(&field, "a value is listed twice".into()));
            }
            space = space.saturating_mul(values.len());
        }
        if space > MAX_SPACE {
            return Err(field_err(
                "params",
                format!("the space has {space} points, more than {MAX_SPACE}"),
            ));
        }
        let mut derived = IndexMap::new();
        for (name, text) in &raw.derived {
            let field = format!("derived.{name}");
            if raw.params.contains_key(name) || reserved(name) {
                return Err(field_err(
                    &field,
                    format!("`{name}` is already a param, device limit or shape variable"),
                ));
            }
            derived.insert(name.clone(), parse(field, text)?);
        }
        let require = raw
            .constraints
            .require
            .iter()
            .enumerate()
            .map(|(i, t)| parse(format!("constraints.require[{i}]"), t))
            .collect::<Result<Vec<_>, _>>()?;
        let shape_constraints = raw
            .constraints
            .shape
            .iter()
            .enumerate()
            .map(|(i, t)| parse(format!("constraints.shape[{i}]"), t))
            .collect::<Result<Vec<_>, _>>()?;
        if raw.kernels.is_empty() {
            return Err(field_err(
                "kernels",
                "no [[kernels]] entry: every family launches at least one kernel".into(),
            ));
        }
        let mut kernels = Vec::new();
        for (i, k) in raw.kernels.iter().enumerate() {
            if k.name.is_empty() || !k.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(field_err(
                    &format!("kernels[{i}].name"),
                    format!("`{}` is not a C identifier", k.name),
                ));
            }
            let three = |what: &str, exprs: &[String; 3]| -> Result<[Expr; 3], SpecError> {
                Ok([
                    parse(format!("kernels[{i}].{what}[0]"), &exprs[0])?,
                    parse(format!("kernels[{i}].{what}[1]"), &exprs[1])?,
                    parse(format!("kernels[{i}].{what}[2]"), &exprs[2])?,
                ])
            };
            let tensor_maps = k
                .tensor_maps
                .iter()
                .enumerate()
                .map(|(j, m)| {
                    let field = |what: &str| format!("kernels[{i}].tensor_maps[{j}].{what}");
                    let arg_index = ops::tensor_arg_index(op, &m.arg).ok_or_else(|| {
                        field_err(
                            &field("arg"),
                            format!(
                                "`{}` is not a tensor argument of op `{}` (`{}`)",
                                m.arg,
                                op.name(),
                                op.signature()
                            ),
                        )
                    })?;
                    Ok(TensorMapSpec {
                        arg: m.arg.clone(),
                        arg_index,
                        rows: parse(field("rows"), &m.rows)?,
                        cols: parse(field("cols"), &m.cols)?,
                        box_rows: parse(field("box_rows"), &m.box_rows)?,
                        box_bytes: parse(field("box_bytes"), &m.box_bytes)?,
                        swizzle: parse(field("swizzle"), &m.swizzle)?,
                        when: m.when.as_ref().map(|w| parse(field("when"), w)).transpose()?,
                    })
                })
                .collect::<Result<Vec<_>, SpecError>>()?;
            kernels.push(KernelSpec {
                name: k.name.clone(),
                grid: three("grid", &k.grid)?,
                block: three("block", &k.block)?,
                smem: parse(format!("kernels[{i}].smem"), &k.smem)?,
                tensor_maps,
            });
        }
        let workspace = raw
            .workspace
            .as_ref()
            .map(|w| parse("workspace.elems".into(), &w.elems))
            .transpose()?;
        let constants = raw
            .constants
            .iter()
            .enumerate()
            .map(|(i, c)| {
                Ok(ConstantSpec {
                    symbol: c.symbol.clone(),
                    tensor: c.tensor.clone(),
                    when: c
                        .when
                        .as_ref()
                        .map(|w| parse(format!("constants[{i}].when"), w))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>, SpecError>>()?;

        // The default point: every param, nothing else, each value from its list.
        for (name, value) in &raw.default {
            let values = raw.params.get(name).ok_or_else(|| {
                field_err(
                    &format!("default.{name}"),
                    format!("`{name}` is not a param of this family"),
                )
            })?;
            if !values.contains(value) {
                return Err(field_err(
                    &format!("default.{name}"),
                    format!("{value} is not in params.{name} = {values:?}"),
                ));
            }
        }
        if let Some(missing) = raw.params.keys().find(|p| !raw.default.contains_key(*p)) {
            return Err(field_err("default", format!("no value for param `{missing}`")));
        }

        let mut family = Family {
            name: f.name.clone(),
            op,
            template: f.template.clone(),
            description: f.description.clone(),
            rank: f.rank,
            prefer_when: f
                .prefer_when
                .as_deref()
                .map(|t| parse("family.prefer_when".into(), t))
                .transpose()?,
            file: file.to_path_buf(),
            dtypes: f.dtypes.clone(),
            epilogues,
            masks,
            arch,
            params: raw.params,
            derived,
            require,
            shape_constraints,
            kernels,
            workspace,
            constants,
            default: raw.default,
            valid_points: 0,
        };
        family.valid_points = family.check_points(&DeviceLimits::default(), &test_shape)?;
        Ok(family)
    }

    /// Whether an optional `when` condition holds in `vars` (true without one); `field` names
    /// it in the error.
    fn when_holds(&self, when: Option<&Expr>, vars: &Vars, field: impl FnOnce() -> String) -> Result<bool, SpecError> {
        match when {
            Some(w) => w.holds(vars).map_err(|e| self.expr_error(field(), e)),
            None => Ok(true),
        }
    }

    fn field_error(&self, field: impl Into<String>, message: String) -> SpecError {
        SpecError::Field {
            file: self.file.clone(),
            field: field.into(),
            message,
        }
    }

    fn expr_error(&self, field: impl Into<String>, source: ExprError) -> SpecError {
        SpecError::Expr {
            file: self.file.clone(),
            field: field.into(),
            source,
        }
    }

    /// Checks that the default point is valid, that some point is, and that the shape-time
    /// expressions only use known variables (evaluated at the default on the op's first test shape).
    /// Returns the number of valid points.
    fn check_points(&self, limits: &DeviceLimits, shape: &Shape) -> Result<usize, SpecError> {
        let points = self.points(limits)?;
        if points.is_empty() {
            let total: usize = self.params.values().map(|v| v.len()).product();
            let mut worst = String::new();
            for c in &self.require {
                if self.count_rejected(c, limits)? == total {
                    worst = format!(" (`{c}` rejects all of them)");
                    break;
                }
            }
            return Err(self.field_error(
                "constraints.require",
                format!("no point of the {total}-point space satisfies every constraint{worst}"),
            ));
        }
        let (default_params, default_derived) = self.evaluate_point(&self.default, limits)?;
        if let Some(failed) = self.failed_constraint(&default_params, &default_derived, limits)? {
            return Err(self.field_error("default", format!("the default point violates `{failed}`")));
        }
        // Evaluate every shape-time expression once so that typos surface at load time.
        let vars = self.scope(&default_params, &default_derived, shape, limits);
        let mut all: Vec<(String, &Expr)> = Vec::new();
        for (i, c) in self.shape_constraints.iter().enumerate() {
            all.push((format!("constraints.shape[{i}]"), c));
        }
        for (i, k) in self.kernels.iter().enumerate() {
            for d in 0..3 {
                all.push((format!("kernels[{i}].grid[{d}]"), &k.grid[d]));
                all.push((format!("kernels[{i}].block[{d}]"), &k.block[d]));
            }
            all.push((format!("kernels[{i}].smem"), &k.smem));
            for (j, m) in k.tensor_maps.iter().enumerate() {
                let field = |what: &str| format!("kernels[{i}].tensor_maps[{j}].{what}");
                all.push((field("rows"), &m.rows));
                all.push((field("cols"), &m.cols));
                all.push((field("box_rows"), &m.box_rows));
                all.push((field("box_bytes"), &m.box_bytes));
                all.push((field("swizzle"), &m.swizzle));
                if let Some(w) = &m.when {
                    all.push((field("when"), w));
                }
            }
        }
        if let Some(w) = &self.workspace {
            all.push(("workspace.elems".into(), w));
        }
        if let Some(p) = &self.prefer_when {
            all.push(("family.prefer_when".into(), p));
        }
        for (i, c) in self.constants.iter().enumerate() {
            if let Some(w) = &c.when {
                all.push((format!("constants[{i}].when"), w));
            }
        }
        for (field, e) in all {
            match e.eval(&vars) {
                Err(err @ ExprError::UnknownVariable { .. }) | Err(err @ ExprError::Parse { .. }) => {
                    return Err(self.expr_error(field, err))
                }
                _ => {}
            }
        }
        Ok(points.len())
    }

    fn count_rejected(&self, constraint: &Expr, limits: &DeviceLimits) -> Result<usize, SpecError> {
        let mut rejected = 0;
        for point in self.all_points() {
            let (params, derived) = self.evaluate_point(&point, limits)?;
            let vars = self.point_scope(&params, &derived, limits);
            if !constraint
                .holds(&vars)
                .map_err(|e| self.expr_error("constraints.require", e))?
            {
                rejected += 1;
            }
        }
        Ok(rejected)
    }

    /// Every point of the parameter space, valid or not, in a fixed order.
    fn all_points(&self) -> Vec<IndexMap<String, i64>> {
        let mut points = vec![IndexMap::new()];
        for (name, values) in &self.params {
            points = points
                .into_iter()
                .flat_map(|p| {
                    values.iter().map(move |v| {
                        let mut q = p.clone();
                        q.insert(name.clone(), *v);
                        q
                    })
                })
                .collect();
        }
        points
    }

    fn point_scope(
        &self,
        params: &IndexMap<String, i64>,
        derived: &IndexMap<String, i64>,
        limits: &DeviceLimits,
    ) -> Vars {
        let mut vars = Vars::default();
        for (k, v) in limits.vars() {
            vars.set(k, v);
        }
        for (k, v) in params.iter().chain(derived.iter()) {
            vars.set(k, *v);
        }
        vars
    }

    fn scope(
        &self,
        params: &IndexMap<String, i64>,
        derived: &IndexMap<String, i64>,
        shape: &Shape,
        limits: &DeviceLimits,
    ) -> Vars {
        let mut vars = self.point_scope(params, derived, limits);
        for (k, v) in shape {
            vars.set(k, *v);
        }
        vars
    }

    /// Evaluates the derived values of one point.
    fn evaluate_point(&self, point: &IndexMap<String, i64>, limits: &DeviceLimits) -> Result<Point, SpecError> {
        let mut derived = IndexMap::new();
        for (name, e) in &self.derived {
            let vars = self.point_scope(point, &derived, limits);
            let value = e
                .eval(&vars)
                .map_err(|err| self.expr_error(format!("derived.{name}"), err))?;
            derived.insert(name.clone(), value);
        }
        Ok((point.clone(), derived))
    }

    /// The first `require` constraint the point violates, if any.
    fn failed_constraint(
        &self,
        params: &IndexMap<String, i64>,
        derived: &IndexMap<String, i64>,
        limits: &DeviceLimits,
    ) -> Result<Option<&Expr>, SpecError> {
        let vars = self.point_scope(params, derived, limits);
        for (i, c) in self.require.iter().enumerate() {
            if !c
                .holds(&vars)
                .map_err(|e| self.expr_error(format!("constraints.require[{i}]"), e))?
            {
                return Ok(Some(c));
            }
        }
        Ok(None)
    }

    /// Valid points (params + derived) under `limits`.
    fn points(&self, limits: &DeviceLimits) -> Result<Vec<Point>, SpecError> {
        let mut out = Vec::new();
        for point in self.all_points() {
            let (params, derived) = self.evaluate_point(&point, limits)?;
            if self.failed_constraint(&params, &derived, limits)?.is_none() {
                out.push((params, derived));
            }
        }
        Ok(out)
    }

    /// Number of valid parameter points (not counting dtypes, epilogues, masks).
    pub fn point_count(&self, limits: &DeviceLimits) -> Result<usize, SpecError> {
        Ok(self.points(limits)?.len())
    }
}

/// The families of a project, loaded from its `specs/` and checked against its `templates/`.
#[derive(Debug, Clone)]
pub struct Catalog {
    pub families: Vec<Arc<Family>>,
    pub specs_dir: PathBuf,
    pub templates_dir: PathBuf,
}

impl Catalog {
    /// Loads every `*.toml` in `specs_dir`, sorted by name.
    pub fn load(specs_dir: &Path, templates_dir: &Path) -> Result<Catalog, SpecError> {
        let entries = std::fs::read_dir(specs_dir).map_err(|source| SpecError::Io {
            file: specs_dir.to_path_buf(),
            source,
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(SpecError::NoSpecs(specs_dir.to_path_buf()));
        }
        // In parallel: checking a family expands its whole space (tens of thousands of points
        // for the tensor-core GEMMs), which every command pays at start-up.
        let families = {
            use rayon::prelude::*;
            files
                .par_iter()
                .map(|f| Family::load(f, templates_dir).map(Arc::new))
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(Catalog {
            families,
            specs_dir: specs_dir.to_path_buf(),
            templates_dir: templates_dir.to_path_buf(),
        })
    }

    /// Loads a single spec file (for `gen --spec`).
    pub fn load_one(file: &Path, templates_dir: &Path) -> Result<Catalog, SpecError> {
        Ok(Catalog {
            families: vec![Arc::new(Family::load(file, templates_dir)?)],
            specs_dir: file.parent().unwrap_or(Path::new(".")).to_path_buf(),
            templates_dir: templates_dir.to_path_buf(),
        })
    }

    pub fn family(&self, name: &str) -> Result<&Arc<Family>, SpecError> {
        self.families
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| SpecError::UnknownFamily {
                name: name.to_string(),
                known: self
                    .families
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Families implementing `op`.
    pub fn for_op<'a>(&'a self, op: &'a str) -> impl Iterator<Item = &'a Arc<Family>> + 'a {
        self.families.iter().filter(move |f| f.op.name() == op)
    }

    /// Whether some family implements `op` in `dtype`.
    pub fn has_dtype(&self, op: &str, dtype: Dtype) -> bool {
        self.for_op(op).any(|f| f.dtypes.contains(&dtype))
    }
}

/// Which variants of a family to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Points {
    /// Only the default point.
    Default,
    /// Every valid point.
    All,
    /// The default point plus up to `count` other valid points drawn with `seed`.
    Sample { count: usize, seed: u64 },
}

/// Expands `family` into variants: each selected point × dtype × epilogue × mask.
pub fn expand(family: &Arc<Family>, points: Points, limits: &DeviceLimits) -> Result<Vec<Variant>, SpecError> {
    let selected = match points {
        Points::Default => vec![family.evaluate_point(&family.default, limits)?],
        Points::All => family.points(limits)?,
        Points::Sample { count, seed } => {
            use rand::seq::IndexedRandom;
            let default = family.evaluate_point(&family.default, limits)?;
            let others: Vec<_> = family
                .points(limits)?
                .into_iter()
                .filter(|(p, _)| *p != default.0)
                .collect();
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let mut picked: Vec<_> = others.choose_multiple(&mut rng, count).cloned().collect();
            picked.insert(0, default);
            picked
        }
    };
    let mut out = Vec::new();
    for (params, derived) in selected {
        for dtype in &family.dtypes {
            for epilogue in &family.epilogues {
                for mask in &family.masks {
                    out.push(Variant {
                        family: family.clone(),
                        dtype: *dtype,
                        epilogue: *epilogue,
                        mask: *mask,
                        params: params.clone(),
                        derived: derived.clone(),
                    });
                }
            }
        }
    }
    Ok(out)
}

/// The default variant of `family` with some params overridden (`--param k=v`), validated.
pub fn variant_with(
    family: &Arc<Family>,
    overrides: &[(String, i64)],
    dtype: Dtype,
    epilogue: Epilogue,
    mask: Mask,
    limits: &DeviceLimits,
) -> Result<Variant, SpecError> {
    let mut point = family.default.clone();
    for (name, value) in overrides {
        let values = family.params.get(name).ok_or_else(|| {
            family.field_error(
                "params",
                format!(
                    "no param `{name}` (params: {})",
                    family.params.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
        if !values.contains(value) {
            return Err(family.field_error(format!("params.{name}"), format!("{value} is not one of {values:?}")));
        }
        point.insert(name.clone(), *value);
    }
    let (params, derived) = family.evaluate_point(&point, limits)?;
    if let Some(failed) = family.failed_constraint(&params, &derived, limits)? {
        return Err(family.field_error("constraints.require", format!("this point violates `{failed}`")));
    }
    let pick = |what: &str, ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(family.field_error(format!("family.{what}"), format!("the family has no such {what} entry")))
        }
    };
    if !family.dtypes.contains(&dtype) {
        return Err(family.field_error(
            "family.dtypes",
            format!(
                "the family has no {dtype} variants (it lists: {})",
                Dtype::list(&family.dtypes)
            ),
        ));
    }
    pick("epilogues", family.epilogues.contains(&epilogue))?;
    pick("masks", family.masks.contains(&mask))?;
    Ok(Variant {
        family: family.clone(),
        dtype,
        epilogue,
        mask,
        params,
        derived,
    })
}

impl Variant {
    /// Canonical text of the point: `dtype=f32 epilogue=bias block_m=64 ...`.
    pub fn key(&self) -> String {
        let mut parts = vec![format!("dtype={}", self.dtype)];
        if self.epilogue != Epilogue::None {
            parts.push(format!("epilogue={}", self.epilogue.as_str()));
        }
        if self.mask != Mask::None {
            parts.push(format!("mask={}", self.mask.as_str()));
        }
        parts.extend(self.params.iter().map(|(k, v)| format!("{k}={v}")));
        parts.join(" ")
    }

    /// Deterministic kernel-name prefix: family, epilogue or mask, 8 hex digits of the key's hash.
    pub fn kernel_name(&self) -> String {
        let digest = Sha256::digest(format!("{}:{}", self.family.name, self.key()).as_bytes());
        let hash: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
        let mut name = self.family.name.clone();
        if self.epilogue != Epilogue::None {
            name = format!("{name}_{}", self.epilogue.as_str());
        }
        if self.mask != Mask::None {
            name = format!("{name}_{}", self.mask.as_str());
        }
        format!("{name}_{hash}")
    }

    fn vars(&self, shape: &Shape, limits: &DeviceLimits) -> Vars {
        self.family.scope(&self.params, &self.derived, shape, limits)
    }

    /// Whether the variant can run on the device `limits` describes at all: a family with an
    /// exact `[family] arch` target runs only on that compute capability.
    pub fn check_device(&self, limits: &DeviceLimits) -> Result<(), String> {
        match &self.family.arch {
            Some(target) => target.check_device(limits.compute_capability),
            None => Ok(()),
        }
    }

    /// Whether the variant can run `shape` on this device (its `[family] arch`, see
    /// [`Variant::check_device`], then its `constraints.shape`); `Err` names what failed. Every
    /// path that picks a variant to run (verify, the tuner, the registry, the model) asks this.
    pub fn check_shape(&self, shape: &Shape, limits: &DeviceLimits) -> Result<(), String> {
        self.check_device(limits)?;
        let vars = self.vars(shape, limits);
        for c in &self.family.shape_constraints {
            match c.holds(&vars) {
                Ok(true) => {}
                Ok(false) => return Err(format!("needs `{c}`")),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    /// Launch geometry of every kernel for `shape`.
    pub fn launches(&self, shape: &Shape, limits: &DeviceLimits) -> Result<Vec<Launch>, SpecError> {
        let vars = self.vars(shape, limits);
        let prefix = self.kernel_name();
        self.family
            .kernels
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let dim = |what: &str, d: usize, e: &Expr| -> Result<u32, SpecError> {
                    let field = format!("kernels[{i}].{what}[{d}]");
                    let v = e
                        .eval(&vars)
                        .map_err(|err| self.family.expr_error(field.clone(), err))?;
                    u32::try_from(v).ok().filter(|v| *v > 0).ok_or_else(|| {
                        self.family
                            .field_error(field, format!("`{e}` gives {v} for {}", shape_text(shape)))
                    })
                };
                let smem = k
                    .smem
                    .eval(&vars)
                    .map_err(|e| self.family.expr_error(format!("kernels[{i}].smem"), e))?;
                let mut tensor_maps = Vec::new();
                for (j, m) in k.tensor_maps.iter().enumerate() {
                    let field = format!("kernels[{i}].tensor_maps[{j}]");
                    if self
                        .family
                        .when_holds(m.when.as_ref(), &vars, || format!("{field}.when"))?
                    {
                        tensor_maps.push(self.tensor_map_launch(m, &vars, shape, &field)?);
                    }
                }
                Ok(Launch {
                    function: format!("{prefix}_{}", k.name),
                    grid: [
                        dim("grid", 0, &k.grid[0])?,
                        dim("grid", 1, &k.grid[1])?,
                        dim("grid", 2, &k.grid[2])?,
                    ],
                    block: [
                        dim("block", 0, &k.block[0])?,
                        dim("block", 1, &k.block[1])?,
                        dim("block", 2, &k.block[2])?,
                    ],
                    smem_bytes: u32::try_from(smem).map_err(|_| {
                        self.family
                            .field_error(format!("kernels[{i}].smem"), format!("`{}` gives {smem}", k.smem))
                    })?,
                    tensor_maps,
                })
            })
            .collect()
    }

    /// Evaluates one `[[kernels.tensor_maps]]` entry for `shape`, checking the box against
    /// what TMA accepts (at most 256 elements per box dimension, the contiguous box extent
    /// within the swizzle span, whole elements).
    fn tensor_map_launch(
        &self,
        m: &TensorMapSpec,
        vars: &Vars,
        shape: &Shape,
        field: &str,
    ) -> Result<TensorMapLaunch, SpecError> {
        let eval = |what: &str, e: &Expr| {
            e.eval(vars)
                .map_err(|err| self.family.expr_error(format!("{field}.{what}"), err))
        };
        let bad = |what: &str, message: String| self.family.field_error(format!("{field}.{what}"), message);
        let storage = self.dtype.storage();
        let element = storage.bytes() as i64;
        let (rows, cols) = (eval("rows", &m.rows)?, eval("cols", &m.cols)?);
        let (box_rows, box_bytes) = (eval("box_rows", &m.box_rows)?, eval("box_bytes", &m.box_bytes)?);
        let swizzle = eval("swizzle", &m.swizzle)?;
        if ![0, 32, 64, 128].contains(&swizzle) {
            return Err(bad(
                "swizzle",
                format!(
                    "`{}` gives {swizzle} bytes; TMA swizzles 0 (none), 32, 64 or 128 bytes",
                    m.swizzle
                ),
            ));
        }
        if rows < 1 || cols < 1 {
            return Err(bad(
                "rows",
                format!(
                    "`{}` x `{}` gives {rows} x {cols} for {}",
                    m.rows,
                    m.cols,
                    shape_text(shape)
                ),
            ));
        }
        if !(1..=256).contains(&box_rows) {
            return Err(bad(
                "box_rows",
                format!("`{}` gives {box_rows}; TMA boxes hold 1 to 256 rows", m.box_rows),
            ));
        }
        let box_cols = box_bytes / element;
        if box_bytes % element != 0 || !(1..=256).contains(&box_cols) || (swizzle > 0 && box_bytes > swizzle) {
            return Err(bad(
                "box_bytes",
                format!(
                    "`{}` gives {box_bytes} bytes of {element}-byte elements; a box row holds 1 to 256 whole \
                     elements{}",
                    m.box_bytes,
                    if swizzle > 0 {
                        format!(" within the {swizzle}-byte swizzle")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        Ok(TensorMapLaunch {
            arg: m.arg.clone(),
            arg_index: m.arg_index,
            storage,
            rows: rows as u64,
            cols: cols as u64,
            box_rows: box_rows as u32,
            box_cols: box_cols as u32,
            swizzle: swizzle as u32,
        })
    }

    /// f32 elements of scratch the kernels need for `shape` (0 without a `[workspace]`).
    pub fn workspace_elems(&self, shape: &Shape, limits: &DeviceLimits) -> Result<usize, SpecError> {
        let Some(e) = &self.family.workspace else { return Ok(0) };
        let v = e
            .eval(&self.vars(shape, limits))
            .map_err(|err| self.family.expr_error("workspace.elems", err))?;
        usize::try_from(v).map_err(|_| self.family.field_error("workspace.elems", format!("`{e}` gives {v}")))
    }

    /// Whether the family's `prefer_when` holds for `shape` (false without one).
    pub fn preferred_for(&self, shape: &Shape, limits: &DeviceLimits) -> bool {
        self.family
            .prefer_when
            .as_ref()
            .is_some_and(|p| p.holds(&self.vars(shape, limits)).unwrap_or(false))
    }

    /// `__constant__` symbols to fill before launch: (symbol, op tensor name).
    pub fn constants(&self) -> Result<Vec<(&str, &str)>, SpecError> {
        let vars = self
            .family
            .point_scope(&self.params, &self.derived, &DeviceLimits::default());
        let mut out = Vec::new();
        for (i, c) in self.family.constants.iter().enumerate() {
            if self
                .family
                .when_holds(c.when.as_ref(), &vars, || format!("constants[{i}].when"))?
            {
                out.push((c.symbol.as_str(), c.tensor.as_str()));
            }
        }
        Ok(out)
    }
}

/// `M=37 N=100 K=72`.
pub fn shape_text(shape: &Shape) -> String {
    shape
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}
