//! A validated kernel family and what it can compute from a point: derived values,
//! constraints, the variable scope of its expressions, and its valid points.

use std::collections::BTreeMap;
use std::path::PathBuf;

use indexmap::IndexMap;

use super::*;
use crate::ops::{self, Epilogue, Mask, OpContract, Shape};

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
    /// Launched only for the variants and shapes where this holds (the template defines the
    /// function under the same condition); without one, always.
    pub when: Option<Expr>,
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
    /// `[family] min_arch`: the oldest compute capability each dtype's kernels compile for (a
    /// dtype not in it has no minimum): `cp.async`, `mma.sync` m16n8k16 and bf16/tf32 tensor
    /// cores need 8.0.
    pub min_compute: std::collections::BTreeMap<Dtype, (i32, i32)>,
    pub params: IndexMap<String, Vec<i64>>,
    pub derived: IndexMap<String, Expr>,
    pub require: Vec<Expr>,
    pub shape_constraints: Vec<Expr>,
    pub kernels: Vec<KernelSpec>,
    pub workspace: Option<Expr>,
    pub constants: Vec<ConstantSpec>,
    pub default: IndexMap<String, i64>,
    /// Full points the tuner's first round takes besides the default (`[[start]]` in the spec:
    /// each the default with some params changed), checked valid like the default.
    pub starts: Vec<IndexMap<String, i64>>,
    /// Valid points under the default (H100) limits, counted once when first asked
    /// ([`Family::valid_points`]): walking a space costs up to ~0.2 s (`decode_megakernel`'s
    /// 72,000 points), which loading the catalog, at the start of every command, need not pay.
    pub(super) valid_count: std::sync::OnceLock<usize>,
}

/// Parameter values and derived values of one point, each in spec order.
pub(super) type Point = (IndexMap<String, i64>, IndexMap<String, i64>);

/// Variable scope for one evaluation: params, derived values, shape, device limits.
#[derive(Debug, Clone, Default)]
pub struct Vars(BTreeMap<String, i64>);

impl Vars {
    pub(super) fn set(&mut self, name: &str, value: i64) {
        match self.0.get_mut(name) {
            Some(slot) => *slot = value,
            None => {
                self.0.insert(name.to_string(), value);
            }
        }
    }

    pub(super) fn unset(&mut self, name: &str) {
        self.0.remove(name);
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

impl Family {
    /// Whether an optional `when` condition holds in `vars` (true without one); `field` names
    /// it in the error.
    pub(super) fn when_holds(
        &self,
        when: Option<&Expr>,
        vars: &Vars,
        field: impl FnOnce() -> String,
    ) -> Result<bool, SpecError> {
        match when {
            Some(w) => w.holds(vars).map_err(|e| self.expr_error(field(), e)),
            None => Ok(true),
        }
    }

    pub(super) fn field_error(&self, field: impl Into<String>, message: String) -> SpecError {
        SpecError::Field {
            file: self.file.clone(),
            field: field.into(),
            message,
        }
    }

    pub(super) fn expr_error(&self, field: impl Into<String>, source: ExprError) -> SpecError {
        SpecError::Expr {
            file: self.file.clone(),
            field: field.into(),
            source,
        }
    }

    /// Checks that the default point is valid (so some point is), and that the shape-time
    /// expressions only use known variables (evaluated at the default on the op's first test
    /// shape). The space is walked only when the default is not valid, to tell an empty space
    /// (every point rejected, and by which constraint) from a bad default.
    pub(super) fn check_points(&self, limits: &DeviceLimits, shape: &Shape) -> Result<(), SpecError> {
        // The default and the start points must be valid points of the space.
        let valid = |field: String, what: &str, point: &IndexMap<String, i64>| -> Result<Point, SpecError> {
            let (params, derived) = self.evaluate_point(point, limits)?;
            match self.failed_constraint(&params, &derived, limits)? {
                Some(failed) => Err(self.field_error(field, format!("{what} violates `{failed}`"))),
                None => Ok((params, derived)),
            }
        };
        let default = valid("default".into(), "the default point", &self.default);
        if default.is_err() && self.points(limits)?.is_empty() {
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
        let (default_params, default_derived) = default?;
        for (i, start) in self.starts.iter().enumerate() {
            valid(format!("start[{i}]"), "the point", start)?;
        }
        // Evaluate every shape-time expression once so that typos surface at load time.
        let widest = self.dtypes.iter().map(|d| d.storage().bytes()).max().unwrap_or(4);
        let vars = self.scope(
            &default_params,
            &default_derived,
            self.epilogues[0],
            widest,
            shape,
            limits,
        );
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
            if let Some(w) = &k.when {
                all.push((format!("kernels[{i}].when"), w));
            }
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
        Ok(())
    }

    /// Valid points under the default limits (counted on the first call; see `valid_count`).
    pub fn valid_points(&self) -> Result<usize, SpecError> {
        if let Some(&n) = self.valid_count.get() {
            return Ok(n);
        }
        let n = self.point_count(&DeviceLimits::default())?;
        Ok(*self.valid_count.get_or_init(|| n))
    }

    pub(super) fn count_rejected(&self, constraint: &Expr, limits: &DeviceLimits) -> Result<usize, SpecError> {
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
    pub(super) fn all_points(&self) -> Vec<IndexMap<String, i64>> {
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

    pub(super) fn point_scope(
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

    /// The launch-time scope: the point's, `elem_bytes` (bytes of one stored element of the
    /// variant's dtype: a point is dtype-free, so shared memory sized by the dtype is checked in
    /// `constraints.shape`), the shape's variables (a shape may set `elem_bytes` itself) and the
    /// epilogue's.
    pub(super) fn scope(
        &self,
        params: &IndexMap<String, i64>,
        derived: &IndexMap<String, i64>,
        epilogue: Epilogue,
        elem_bytes: usize,
        shape: &Shape,
        limits: &DeviceLimits,
    ) -> Vars {
        let mut vars = self.point_scope(params, derived, limits);
        vars.set("elem_bytes", elem_bytes as i64);
        for (k, v) in shape {
            vars.set(k, *v);
        }
        // What the epilogue reads and writes beyond a plain matrix: a kernel may take a tensor
        // map of the residual only when there is one, views qkv's output as per-head rows, and
        // an ln_ epilogue's kernel holds whole rows of the input.
        vars.set("epilogue_residual", i64::from(epilogue == Epilogue::BiasResidual));
        vars.set("epilogue_qkv", i64::from(epilogue.after_product() == Epilogue::Qkv));
        vars.set("epilogue_ln", i64::from(epilogue.standardizes_input()));
        vars
    }

    /// Evaluates the derived values of one point.
    pub(super) fn evaluate_point(
        &self,
        point: &IndexMap<String, i64>,
        limits: &DeviceLimits,
    ) -> Result<Point, SpecError> {
        self.evaluate_in_scope(point, limits).map(|(point, _)| point)
    }

    /// The derived values of one point, and the point's scope (limits, params, derived). One
    /// scope for the whole point, each derived value added as it is computed (a derived value
    /// may use the ones before it). The walk over a family's space (`space.rs`) keeps one scope
    /// for the whole walk instead, and comes here only for points it could not evaluate itself.
    pub(super) fn evaluate_in_scope(
        &self,
        point: &IndexMap<String, i64>,
        limits: &DeviceLimits,
    ) -> Result<(Point, Vars), SpecError> {
        let mut derived = IndexMap::new();
        let mut vars = self.point_scope(point, &derived, limits);
        for (name, e) in &self.derived {
            let value = e
                .eval(&vars)
                .map_err(|err| self.expr_error(format!("derived.{name}"), err))?;
            vars.set(name, value);
            derived.insert(name.clone(), value);
        }
        Ok(((point.clone(), derived), vars))
    }

    /// The point `[default]` stands for under `limits`: the spec's own where the device takes
    /// it, else the valid point that differs from it in the fewest parameters (the first in the
    /// space's order among equals). A T4's 64 KiB of shared memory cannot hold matmul_wmma's
    /// default 128 x 128 tile in 3 stages; it gets the nearest tile that fits. Where no point
    /// is valid, the spec's own, for the caller's checks to refuse with their reasons.
    pub(super) fn default_point(&self, limits: &DeviceLimits) -> Result<Point, SpecError> {
        let default = self.evaluate_point(&self.default, limits)?;
        if self.failed_constraint(&default.0, &default.1, limits)?.is_none() {
            return Ok(default);
        }
        let differences = |point: &IndexMap<String, i64>| {
            point
                .iter()
                .filter(|&(name, value)| self.default.get(name) != Some(value))
                .count()
        };
        let nearest = self
            .points(limits)?
            .into_iter()
            .min_by_key(|(point, _)| differences(point));
        Ok(nearest.unwrap_or(default))
    }

    /// The first `require` constraint the point violates, if any.
    pub(super) fn failed_constraint(
        &self,
        params: &IndexMap<String, i64>,
        derived: &IndexMap<String, i64>,
        limits: &DeviceLimits,
    ) -> Result<Option<&Expr>, SpecError> {
        self.failed_in_scope(&self.point_scope(params, derived, limits))
    }

    pub(super) fn failed_in_scope(&self, vars: &Vars) -> Result<Option<&Expr>, SpecError> {
        for (i, c) in self.require.iter().enumerate() {
            if !c
                .holds(vars)
                .map_err(|e| self.expr_error(format!("constraints.require[{i}]"), e))?
            {
                return Ok(Some(c));
            }
        }
        Ok(None)
    }

    /// Number of valid parameter points (not counting dtypes, epilogues, masks).
    pub fn point_count(&self, limits: &DeviceLimits) -> Result<usize, SpecError> {
        Ok(self.points(limits)?.len())
    }
}
