//! Renders variants through the tera templates into CUDA C++ source, and writes the
//! `generated/` folder people read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::spec::{expand, Catalog, DeviceLimits, Points, SpecError, Variant};

/// Rendering failed; the message names the spec and template.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("templates in {dir}: {message}")]
    Load { dir: PathBuf, message: String },
    #[error("{spec}: family.template: templates/{template} failed to render `{variant}`: {message}")]
    Render {
        spec: PathBuf,
        template: String,
        variant: String,
        message: String,
    },
    #[error(
        "{spec}: templates/{template} declares {kernel}{mismatch}: the template's parameters must \
         be the op's (templates/README.md), in order, then any tensor maps; a --root folder from \
         another version of kernelforge has templates of another contract"
    )]
    Parameters {
        spec: PathBuf,
        template: String,
        kernel: String,
        /// `(its parameters), but the <op> op passes (the op's)`.
        mismatch: String,
    },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// Rendered CUDA source of one variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Kernel-name prefix; the functions are `<kernel_name>_<kernel>`.
    pub kernel_name: String,
    pub code: String,
}

/// Tera's error and its causes on one line (tera nests the useful part in `source()`).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}

/// The template environment of a project's `templates/` folder.
pub struct Renderer {
    tera: tera::Tera,
}

impl Renderer {
    /// Parses every `*.tera` under `templates_dir` (a syntax error names the file).
    pub fn new(templates_dir: &Path) -> Result<Renderer, CodegenError> {
        let glob = format!("{}/**/*.tera", templates_dir.display());
        let mut tera = tera::Tera::new(&glob).map_err(|e| CodegenError::Load {
            dir: templates_dir.to_path_buf(),
            message: error_chain(&e),
        })?;
        tera.autoescape_on(vec![]);
        Ok(Renderer { tera })
    }

    /// The templates under `templates_dir` parsed once for the whole process (every GPU
    /// backend's registry shares them), so that a command can start the parse on a thread of its
    /// own early ([`Renderer::warm`]) and the backend finds it done. A caller that arrives while
    /// another thread parses waits for that parse. The error is the parse's, as text.
    pub fn shared(templates_dir: &Path) -> Result<Arc<Renderer>, String> {
        type Cell = Arc<OnceLock<Result<Arc<Renderer>, String>>>;
        static PARSED: Mutex<BTreeMap<PathBuf, Cell>> = Mutex::new(BTreeMap::new());
        let cell: Cell = {
            let mut parsed = PARSED.lock().unwrap_or_else(|e| e.into_inner());
            parsed.entry(templates_dir.to_path_buf()).or_default().clone()
        };
        cell.get_or_init(|| Renderer::new(templates_dir).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
    }

    /// Starts [`Renderer::shared`] for `templates_dir` on a thread of its own (its result is
    /// kept for the caller that needs it; an error is reported there).
    pub fn warm(templates_dir: &Path) {
        let dir = templates_dir.to_path_buf();
        std::thread::spawn(move || {
            let _ = Renderer::shared(&dir);
        });
    }

    /// Renders a template that is not a family (the baselines' helper kernels) with `vars`.
    pub fn render_template(&self, template: &str, vars: &[(&str, &str)]) -> Result<String, CodegenError> {
        let mut ctx = tera::Context::new();
        for (k, v) in vars {
            ctx.insert(*k, v);
        }
        self.tera.render(template, &ctx).map_err(|e| CodegenError::Render {
            spec: PathBuf::from("(no spec)"),
            template: template.to_string(),
            variant: format!("{vars:?}"),
            message: error_chain(&e),
        })
    }

    /// Renders one variant. The source starts with a header naming the spec, template and point.
    pub fn render(&self, variant: &Variant) -> Result<Source, CodegenError> {
        let family = &variant.family;
        let kernel_name = variant.kernel_name();
        let mut ctx = tera::Context::new();
        ctx.insert("kernel_name", &kernel_name);
        ctx.insert("family", &family.name);
        ctx.insert("op", family.op.name());
        ctx.insert("dtype", &variant.dtype.to_string());
        ctx.insert("epilogue", variant.epilogue.as_str());
        ctx.insert("mask", variant.mask.as_str());
        for (k, v) in variant.params.iter().chain(variant.derived.iter()) {
            ctx.insert(k.as_str(), v);
        }
        ctx.insert("params", &variant.params);
        let body = self
            .tera
            .render(&family.template, &ctx)
            .map_err(|e| CodegenError::Render {
                spec: family.file.clone(),
                template: family.template.clone(),
                variant: variant.key(),
                message: error_chain(&e),
            })?;
        let spec_file = family
            .file
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let header = format!(
            "// Generated by kernelforge from specs/{spec_file} and templates/{template}.\n\
             // Do not edit: change the spec or the template, then run `kernelforge gen`.\n\
             // {description}\n\
             // Variant: {key}\n\
             // Derived: {derived}\n\n",
            template = family.template,
            description = family.description,
            key = variant.key(),
            derived = variant
                .derived
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
        );
        let want: Vec<&str> = crate::ops::arg_names(family.op).collect();
        for kernel in &family.kernels {
            let function = format!("{kernel_name}_{}", kernel.name);
            // A kernel with a `when` may be left out of this variant's source.
            let Some(params) = parameter_names(&body, &function) else {
                continue;
            };
            // The op's arguments, in order, then TMA descriptors (`[[kernels.tensor_maps]]`).
            let maps = params.get(want.len()..).unwrap_or_default();
            if params.get(..want.len()) != Some(&want[..]) || !maps.iter().all(|m| m.ends_with("_map")) {
                return Err(CodegenError::Parameters {
                    spec: family.file.clone(),
                    template: family.template.clone(),
                    kernel: function,
                    mismatch: format!(
                        "({}), but the {} op passes ({})",
                        params.join(", "),
                        family.op.name(),
                        want.join(", ")
                    ),
                });
            }
        }
        Ok(Source {
            kernel_name,
            code: format!("{header}{}\n", collapse_blank_lines(body.trim())),
        })
    }
}

/// The last word of a declaration (`const float* __restrict__ inp` -> `inp`).
fn last_word(declaration: &str) -> &str {
    declaration
        .trim()
        .rsplit(|c: char| c.is_whitespace() || c == '*' || c == '&')
        .next()
        .unwrap_or_default()
}

/// The parameter names of the `__global__` function `function` in `code`, or `None` when the
/// code defines no such kernel.
fn parameter_names<'a>(code: &'a str, function: &str) -> Option<Vec<&'a str>> {
    let at = code.match_indices(&format!("{function}(")).find(|&(at, _)| {
        let before = &code[..at];
        // the definition: `__global__` since the last statement, not a call
        before.rfind("__global__").is_some_and(|g| !before[g..].contains(';'))
    })?;
    let list = &code[at.0 + function.len() + 1..];
    let list = &list[..list.find(')')?];
    Some(list.split(',').map(last_word).filter(|p| !p.is_empty()).collect())
}

/// Template control lines leave runs of empty lines behind; keep at most one.
fn collapse_blank_lines(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut blank_run = 0;
    for line in text.lines() {
        let line = line.trim_end();
        blank_run = if line.is_empty() { blank_run + 1 } else { 0 };
        if blank_run <= 1 {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.trim_end().to_string()
}

/// One file `gen` writes: its path relative to the output folder and its contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedFile {
    pub path: PathBuf,
    pub code: String,
}

/// Renders what `kernelforge gen` writes: for every family, the default point for each dtype ×
/// epilogue × mask as `<family>/<epilogue-or-mask>.cu` (or `<family>/default.cu`); with
/// [`Points::All`], every valid point as `<family>/<kernel_name>.cu`.
pub fn render_catalog(
    catalog: &Catalog,
    points: Points,
    limits: &DeviceLimits,
) -> Result<Vec<GeneratedFile>, CodegenError> {
    let renderer = Renderer::new(&catalog.templates_dir)?;
    let mut files = Vec::new();
    for family in &catalog.families {
        for variant in expand(family, points, limits)? {
            let source = renderer.render(&variant)?;
            let stem = match points {
                Points::All | Points::Sample { .. } => source.kernel_name.clone(),
                Points::Default => {
                    let mut parts = Vec::new();
                    if family.dtypes.len() > 1 {
                        parts.push(variant.dtype.to_string());
                    }
                    if variant.epilogue != crate::ops::Epilogue::None {
                        parts.push(variant.epilogue.as_str().to_string());
                    }
                    if variant.mask != crate::ops::Mask::None {
                        parts.push(variant.mask.as_str().to_string());
                    }
                    if parts.is_empty() {
                        "default".to_string()
                    } else {
                        parts.join("_")
                    }
                }
            };
            files.push(GeneratedFile {
                path: PathBuf::from(&family.name).join(format!("{stem}.cu")),
                code: source.code,
            });
        }
    }
    Ok(files)
}

/// Writes `files` under `out` (each atomically: temp file + rename). When `prune` is set,
/// `*.cu` files under `out` that are not in `files` are removed, so the folder mirrors the specs.
/// Returns (written or changed, unchanged, removed) counts.
pub fn write_files(out: &Path, files: &[GeneratedFile], prune: bool) -> Result<(usize, usize, usize), CodegenError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CodegenError::Io { path, source }
    };
    let (mut written, mut unchanged, mut removed) = (0, 0, 0);
    for file in files {
        let path = out.join(&file.path);
        if std::fs::read_to_string(&path).ok().as_deref() == Some(file.code.as_str()) {
            unchanged += 1;
            continue;
        }
        let dir = path.parent().unwrap_or(out);
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let tmp = path.with_extension("cu.tmp");
        std::fs::write(&tmp, &file.code).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        written += 1;
    }
    if prune {
        let keep: BTreeSet<PathBuf> = files.iter().map(|f| out.join(&f.path)).collect();
        for path in cuda_files(out) {
            if !keep.contains(&path) {
                std::fs::remove_file(&path).map_err(io(&path))?;
                removed += 1;
                if let Some(dir) = path.parent() {
                    let _ = std::fs::remove_dir(dir); // only succeeds once the folder is empty
                }
            }
        }
    }
    Ok((written, unchanged, removed))
}

/// Every `*.cu` file one level of folders below `dir`, sorted.
pub fn cuda_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for family in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        for file in std::fs::read_dir(family.path()).into_iter().flatten().flatten() {
            let p = file.path();
            if p.extension().is_some_and(|x| x == "cu") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernels_parameters_are_read_from_its_definition() {
        let code = "__device__ void helper() { k_main(a, b); }\n\
                    extern \"C\" __global__ void __launch_bounds__(256, 2)\n\
                    k_main(storage_t* out, const storage_t* __restrict__ inp, int N,\n\
                           const __grid_constant__ TensorMap inp_map) {}\n";
        assert_eq!(
            parameter_names(code, "k_main"),
            Some(vec!["out", "inp", "N", "inp_map"])
        );
        assert_eq!(parameter_names(code, "k_other"), None, "not defined in this variant");
        assert_eq!(parameter_names("__global__ void k_main() {}", "k_main"), Some(vec![]));
    }

    #[test]
    fn blank_line_runs_collapse_to_one() {
        assert_eq!(collapse_blank_lines("a  \n\n\n\nb\n\nc\n\n"), "a\n\nb\n\nc");
        assert_eq!(collapse_blank_lines("x"), "x");
    }

    /// One parse a folder for the whole process: a warm start and every later caller (from
    /// other threads too) share it; another folder gets its own; a folder whose templates do not
    /// parse gives the same error to every caller.
    #[test]
    fn templates_are_parsed_once_a_folder_and_shared() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::create_dir_all(&a).unwrap();
        std::fs::write(a.join("t.cu.tera"), "// {{ x }}\n").unwrap();
        Renderer::warm(&a);
        let first = Renderer::shared(&a).unwrap();
        let others: Vec<Arc<Renderer>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4).map(|_| s.spawn(|| Renderer::shared(&a).unwrap())).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(others.iter().all(|r| Arc::ptr_eq(r, &first)));
        assert_eq!(
            first.render_template("t.cu.tera", &[("x", "7")]).unwrap().trim(),
            "// 7"
        );
        let b = dir.path().join("b");
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("t.cu.tera"), "// {{ x \n").unwrap();
        let e = Renderer::shared(&b).err().unwrap();
        assert!(e.contains("t.cu.tera"), "{e}");
        assert_eq!(Renderer::shared(&b).err().unwrap(), e);
    }
}
