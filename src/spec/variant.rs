//! Concrete points of a family: [`Variant`]s, how a family's space expands into them, and
//! what a variant says about one shape (its launches, workspace, constants).

use std::sync::Arc;

use indexmap::IndexMap;
use sha2::{Digest, Sha256};

use super::*;
use crate::ops::{Epilogue, Mask, Shape};

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
    /// The kernel's position in the family's `[[kernels]]` (and in the loaded functions).
    pub kernel: usize,
    /// The `__global__` function name.
    pub function: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub smem_bytes: u32,
    /// TMA descriptors to build and pass after the op's arguments.
    pub tensor_maps: Vec<TensorMapLaunch>,
}

/// Which variants of a family to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Points {
    /// Only the default point (where the device cannot take the spec's `[default]`, the valid
    /// point nearest to it: see `Family::default_point`).
    Default,
    /// Every valid point.
    All,
    /// The default point plus up to `count` other valid points drawn with `seed`.
    Sample { count: usize, seed: u64 },
}

/// Expands `family` into variants: each selected point × dtype × epilogue × mask.
pub fn expand(family: &Arc<Family>, points: Points, limits: &DeviceLimits) -> Result<Vec<Variant>, SpecError> {
    let selected = match points {
        Points::Default => vec![family.default_point(limits)?],
        Points::All => family.points(limits)?,
        Points::Sample { count, seed } => {
            use rand::seq::IndexedRandom;
            let default = family.default_point(limits)?;
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

    /// Deterministic kernel-name prefix: family, epilogue or mask, 16 hex digits of the key's
    /// hash. 64 bits, because a family has up to ~10^5 variants: at 32 bits two of them shared
    /// a name as soon as `decode_megakernel` gained a parameter (68,400 variants, a birthday
    /// collision), and the name is what the tuner de-duplicates candidates by.
    pub fn kernel_name(&self) -> String {
        let digest = Sha256::digest(format!("{}:{}", self.family.name, self.key()).as_bytes());
        let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        let mut name = self.family.name.clone();
        if self.epilogue != Epilogue::None {
            name = format!("{name}_{}", self.epilogue.as_str());
        }
        if self.mask != Mask::None {
            name = format!("{name}_{}", self.mask.as_str());
        }
        format!("{name}_{hash}")
    }

    pub(super) fn vars(&self, shape: &Shape, limits: &DeviceLimits) -> Vars {
        self.family.scope(
            &self.params,
            &self.derived,
            self.epilogue,
            self.dtype.storage().bytes(),
            shape,
            limits,
        )
    }

    /// Whether the variant can run on the device `limits` describes at all: a family with an
    /// exact `[family] arch` target runs only on that compute capability, and one with a
    /// `[family] min_arch` for this dtype only from that one on.
    pub fn check_device(&self, limits: &DeviceLimits) -> Result<(), String> {
        if let Some(target) = &self.family.arch {
            target.check_device(limits.compute_capability)?;
        }
        let have = limits.compute_capability;
        match self.family.min_compute.get(&self.dtype) {
            Some(&need) if have < need => Err(format!(
                "needs compute capability {}.{} (sm_{}{}) or newer for {} (`min_arch` in {}); this GPU is {}.{}{}",
                need.0,
                need.1,
                need.0,
                need.1,
                self.dtype,
                self.family.file.display(),
                have.0,
                have.1,
                if self.dtype == Dtype::F32 {
                    ""
                } else {
                    ": --dtype f32 runs everywhere"
                }
            )),
            _ => Ok(()),
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

    /// Launch geometry of every kernel for `shape`, in spec order, leaving out those whose
    /// `when` does not hold.
    pub fn launches(&self, shape: &Shape, limits: &DeviceLimits) -> Result<Vec<Launch>, SpecError> {
        let vars = self.vars(shape, limits);
        let prefix = self.kernel_name();
        let mut runs = Vec::new();
        for (i, k) in self.family.kernels.iter().enumerate() {
            if self
                .family
                .when_holds(k.when.as_ref(), &vars, || format!("kernels[{i}].when"))?
            {
                runs.push((i, k));
            }
        }
        runs.into_iter()
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
                    kernel: i,
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
