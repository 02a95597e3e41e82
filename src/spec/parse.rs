//! Reading a spec file: the TOML layout (`Raw*`, exactly the fields a spec may have) and its
//! validation into a [`Family`], every error naming the file and the field.

use std::path::Path;

use indexmap::IndexMap;
use serde::Deserialize;

use super::*;
use crate::ops::{self, Epilogue, Mask};

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
    /// More points the tuner starts from besides the default (each the default with these
    /// params changed): the family's known-good shapes for other regimes.
    #[serde(default)]
    start: Vec<IndexMap<String, i64>>,
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
    /// The oldest GPU each dtype's kernels compile for: `{ all = "sm_80" }` for every dtype,
    /// `{ bf16 = "sm_80", tf32 = "sm_80" }` for some (a dtype not named has no minimum).
    #[serde(default)]
    min_arch: IndexMap<String, String>,
    // (`extends = "base"`, another spec of the same folder this one is laid over, is read and
    // removed before this layout: see `lay_over_base`.)
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
    when: Option<String>,
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

/// A spec with `[family] extends = "base"` is `base.toml` (same folder) with its own tables laid
/// over it: `[family]`, `[params]`, `[derived]` and `[default]` key by key (a key of both takes
/// this spec's value in the base's place, new keys go last); `[constraints]` `require` and
/// `shape` are the base's lists, then this spec's; `[[start]]`, `[[kernels]]`, `[workspace]` and
/// `[[constants]]` are this spec's where it has them, else the base's. `extends` itself is not
/// inherited, and a base may not extend another.
fn lay_over_base(mut base: toml::Table, spec: toml::Table) -> toml::Table {
    for (section, value) in spec {
        match (section.as_str(), base.get_mut(&section), value) {
            ("family" | "params" | "derived" | "default", Some(toml::Value::Table(into)), toml::Value::Table(over)) => {
                into.extend(
                    over.into_iter()
                        .filter(|(key, _)| !(section == "family" && key == "extends")),
                );
            }
            ("constraints", Some(toml::Value::Table(into)), toml::Value::Table(over)) => {
                for (list, items) in over {
                    match (into.get_mut(&list), items) {
                        (Some(toml::Value::Array(into)), toml::Value::Array(items)) => into.extend(items),
                        (_, items) => {
                            into.insert(list, items);
                        }
                    }
                }
            }
            (_, _, value) => {
                base.insert(section, value);
            }
        }
    }
    base
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

    /// Validates spec `text` as if read from `file` (a spec that `extends` another reads it
    /// from `file`'s folder).
    pub fn parse(text: &str, file: &Path, templates: &Path) -> Result<Family, SpecError> {
        let toml_err = |file: &Path, e: &dyn std::fmt::Display| SpecError::Toml {
            file: file.to_path_buf(),
            message: e.to_string().trim_end().replace('\n', " | "),
        };
        let field_err = |field: &str, message: String| SpecError::Field {
            file: file.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let table: toml::Table = toml::from_str(text).map_err(|e| toml_err(file, &e))?;
        let extends = |t: &toml::Table| t.get("family").and_then(|f| f.get("extends")).cloned();
        let base = extends(&table).map(|b| b.as_str().map(str::to_string).ok_or(b.type_str()));
        let raw: RawSpec = match base {
            // Straight from the text: its errors carry line numbers.
            None => toml::from_str(text).map_err(|e| toml_err(file, &e))?,
            Some(Err(kind)) => {
                return Err(field_err(
                    "family.extends",
                    format!("a {kind}: name a spec, e.g. \"matmul_wgmma_tma\""),
                ))
            }
            Some(Ok(base)) => {
                let base_file = file.with_file_name(format!("{base}.toml"));
                let base_text = std::fs::read_to_string(&base_file)
                    .map_err(|e| field_err("family.extends", format!("cannot read {} ({e})", base_file.display())))?;
                let base_table: toml::Table = toml::from_str(&base_text).map_err(|e| toml_err(&base_file, &e))?;
                if extends(&base_table).is_some() {
                    return Err(field_err(
                        "family.extends",
                        format!(
                            "{} extends another spec itself: extend the one it extends",
                            base_file.display()
                        ),
                    ));
                }
                toml::Value::Table(lay_over_base(base_table, table))
                    .try_into()
                    .map_err(|e| toml_err(file, &e))?
            }
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
        let mut min_compute = std::collections::BTreeMap::new();
        for (key, value) in &f.min_arch {
            let field = format!("family.min_arch.{key}");
            let target = ArchTarget::parse(value).map_err(|message| field_err(&field, message))?;
            if target.name.ends_with('a') {
                return Err(field_err(
                    &field,
                    format!(
                        "`{value}` is an exact target; a minimum is a plain sm_XY (exact targets go in family.arch)"
                    ),
                ));
            }
            let dtypes: Vec<Dtype> = if key == "all" {
                f.dtypes.clone()
            } else {
                match key.parse::<Dtype>() {
                    Ok(d) if f.dtypes.contains(&d) => vec![d],
                    _ => {
                        return Err(field_err(
                            &field,
                            format!("`{key}` is not `all` nor one of this family's dtypes ({:?})", f.dtypes),
                        ))
                    }
                }
            };
            for d in dtypes {
                min_compute.insert(d, target.compute_capability);
            }
        }
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
                when: k
                    .when
                    .as_ref()
                    .map(|w| parse(format!("kernels[{i}].when"), w))
                    .transpose()?,
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

        // A point's value for `name` (the default's, a start point's): a param, from its list.
        let check_value = |prefix: &str, name: &str, value: i64| -> Result<(), SpecError> {
            let field = format!("{prefix}.{name}");
            let values = raw
                .params
                .get(name)
                .ok_or_else(|| field_err(&field, format!("`{name}` is not a param of this family")))?;
            if values.contains(&value) {
                Ok(())
            } else {
                Err(field_err(
                    &field,
                    format!("{value} is not in params.{name} = {values:?}"),
                ))
            }
        };
        // The default point: every param, nothing else, each value from its list.
        for (name, value) in &raw.default {
            check_value("default", name, *value)?;
        }
        if let Some(missing) = raw.params.keys().find(|p| !raw.default.contains_key(*p)) {
            return Err(field_err("default", format!("no value for param `{missing}`")));
        }
        // The start points: the default with some params changed, each value from its list.
        let mut starts = Vec::with_capacity(raw.start.len());
        for (i, changes) in raw.start.iter().enumerate() {
            let mut point = raw.default.clone();
            for (name, value) in changes {
                check_value(&format!("start[{i}]"), name, *value)?;
                point.insert(name.clone(), *value);
            }
            starts.push(point);
        }

        let family = Family {
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
            min_compute,
            params: raw.params,
            derived,
            require,
            shape_constraints,
            kernels,
            workspace,
            constants,
            default: raw.default,
            starts,
            valid_count: Default::default(),
        };
        family.check_points(&DeviceLimits::default(), &test_shape)?;
        Ok(family)
    }
}
