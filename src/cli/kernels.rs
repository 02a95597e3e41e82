//! `gen`, `inspect` and `verify`: the kernel-generator commands.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::codegen::{render_catalog, write_files, Renderer};
use crate::gpu::cubin::code_sizes;
use crate::gpu::{Compiler, Gpu, LoadedVariant};
use crate::ops::{self, Epilogue, Mask};
use crate::spec::{expand, variant_with, ArchTarget, Catalog, DeviceLimits, Dtype, Points};
use crate::tune::verify::{self, Check, Shapes, Status};

/// Render kernel families to CUDA source files for reading.
///
/// By default every family's default point, once per epilogue or mask, as
/// generated/<family>/<epilogue-or-mask>.cu; with --all every valid point as
/// <family>/<kernel_name>.cu. Stale .cu files in the output folder are removed unless --spec
/// picks one family.
#[derive(Debug, Args)]
pub struct GenArgs {
    /// Output folder (default: generated/ in the project folder, the one --root names, so that
    /// rendering another project's specs never writes into this folder's generated/).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Render only this spec file.
    #[arg(long, value_name = "FILE")]
    pub spec: Option<PathBuf>,
    /// Render every valid point, not only the defaults.
    #[arg(long)]
    pub all: bool,
    /// Write nothing; fail if the output folder differs from what would be written.
    #[arg(long)]
    pub check: bool,
}

/// Print one variant's CUDA source, and optionally its PTX and resource use.
///
/// Example: kernelforge inspect matmul_regtile --epilogue bias_gelu --param block_m=64 --resources
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// Kernel family (the spec's file name without .toml).
    pub family: String,
    /// Override a parameter of the default point (repeatable): --param block_m=64.
    #[arg(long = "param", value_name = "NAME=VALUE", value_parser = parse_param)]
    pub params: Vec<(String, i64)>,
    /// Epilogue (matmul families): none, bias, bias_gelu, bias_residual, qkv. Default: the first listed.
    #[arg(long, value_parser = parse_epilogue)]
    pub epilogue: Option<Epilogue>,
    /// Mask (attention families): causal, full, window. Default: the first listed.
    #[arg(long, value_parser = parse_mask)]
    pub mask: Option<Mask>,
    /// Dtype: f32, tf32, f16 or bf16 (among the family's `dtypes`). Default: the first listed.
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<Dtype>,
    /// Also print the PTX (needs NVRTC, not a GPU).
    #[arg(long)]
    pub ptx: bool,
    /// Also print registers, shared memory and local (spill) bytes per kernel (needs a GPU).
    #[arg(long)]
    pub resources: bool,
    /// Also print each kernel's machine code size (its section of the CUBIN; needs NVRTC, and a
    /// GPU unless --arch is given). A persistent kernel larger than the SM's instruction caches
    /// fetches its code from L2 as it switches between kinds of task.
    #[arg(long)]
    pub code_size: bool,
    /// Compile for this architecture (e.g. sm_90) instead of the GPU's own. A family with an
    /// exact `[family] arch` (sm_90a) is compiled for that target, and refused for another
    /// compute capability.
    #[arg(long, value_name = "sm_XY")]
    pub arch: Option<String>,
    /// Do not print the source.
    #[arg(long)]
    pub no_source: bool,
}

/// Run kernel variants on the GPU against the f64 CPU reference and print a pass/fail table.
///
/// Inputs are fresh random numbers (seeded; the seed is printed), outputs are poisoned with NaN
/// before every run, and the relative L2 error must stay under 1e-5 (f32), 1e-3 (tf32) or 1e-2
/// (f16, bf16). Exit status 1 if any variant fails.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Only families of this op (encoder, layernorm, matmul, attention, attention_decode, kv_append,
    /// softmax, gelu, residual, argmax).
    #[arg(long)]
    pub op: Option<String>,
    /// Only this family.
    #[arg(long)]
    pub family: Option<String>,
    /// Only variants of this dtype: f32, tf32, f16 or bf16 (default: every dtype each family lists).
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<Dtype>,
    /// One shape instead of the op's awkward test shapes: positional (37,100,72 for M,N,K) or
    /// named (M=37,N=100,K=72,T=37,n_head=1). Needs --op or --family.
    #[arg(long, value_name = "SHAPE")]
    pub shape: Option<String>,
    /// Every valid variant, not only the defaults.
    #[arg(long, conflicts_with = "sample")]
    pub all_variants: bool,
    /// The default plus N randomly drawn variants of each family.
    #[arg(long, value_name = "N")]
    pub sample: Option<usize>,
    /// Seed for inputs and sampling (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print JSON rows instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_param(text: &str) -> Result<(String, i64), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}`: write NAME=VALUE, e.g. block_m=64"))?;
    let value = value
        .trim()
        .parse()
        .map_err(|_| format!("`{text}`: `{value}` is not an integer"))?;
    Ok((name.trim().to_string(), value))
}

pub(crate) fn parse_epilogue(text: &str) -> Result<Epilogue, String> {
    text.parse::<Epilogue>().map_err(|e| e.to_string())
}

pub(crate) fn parse_dtype(text: &str) -> Result<Dtype, String> {
    text.parse::<Dtype>().map_err(|e| e.to_string())
}

pub(crate) fn parse_mask(text: &str) -> Result<Mask, String> {
    [Mask::Causal, Mask::Full, Mask::Window]
        .into_iter()
        .find(|m| m.as_str() == text)
        .ok_or_else(|| format!("unknown mask `{text}` (causal, full, window)"))
}

fn catalog(root: &Path) -> Result<Catalog> {
    Ok(Catalog::load(&root.join("specs"), &root.join("templates"))?)
}

pub fn gen(root: &Path, args: GenArgs) -> Result<()> {
    let templates = root.join("templates");
    let catalog = match &args.spec {
        Some(file) => Catalog::load_one(file, &templates)?,
        None => catalog(root)?,
    };
    let points = if args.all { Points::All } else { Points::Default };
    let files = render_catalog(&catalog, points, &DeviceLimits::default())?;
    let out = args.out.clone().unwrap_or_else(|| root.join("generated"));
    if args.check {
        let mut stale = Vec::new();
        for f in &files {
            if std::fs::read_to_string(out.join(&f.path)).ok().as_deref() != Some(f.code.as_str()) {
                stale.push(f.path.display().to_string());
            }
        }
        let expected: std::collections::BTreeSet<_> = files.iter().map(|f| out.join(&f.path)).collect();
        if args.spec.is_none() {
            for extra in crate::codegen::cuda_files(&out) {
                if !expected.contains(&extra) {
                    stale.push(format!("{} (no spec renders it)", extra.display()));
                }
            }
        }
        if !stale.is_empty() {
            bail!(
                "{} is out of date with specs/ and templates/: {}; run `kernelforge gen`",
                out.display(),
                stale.join(", ")
            );
        }
        println!("{}: {} files match the specs and templates", out.display(), files.len());
        return Ok(());
    }
    let (written, unchanged, removed) = write_files(&out, &files, args.spec.is_none())?;
    println!(
        "{}: {} families, {} files ({written} written, {unchanged} unchanged, {removed} stale removed)",
        out.display(),
        catalog.families.len(),
        files.len()
    );
    Ok(())
}

/// `kernelforge inspect`: one variant's source, and on request its PTX, resources and code size.
pub fn inspect(root: &Path, args: InspectArgs) -> Result<()> {
    let catalog = catalog(root)?;
    let family = catalog.family(&args.family)?;
    let compiles = args.ptx || args.code_size;
    let gpu = if args.resources || (compiles && args.arch.is_none()) {
        Some(Gpu::new(0).context("--resources (and --ptx or --code-size without --arch) need a GPU")?)
    } else {
        None
    };
    let limits = gpu.as_ref().map(|g| g.info.limits).unwrap_or_default();
    let variant = variant_with(
        family,
        &args.params,
        args.dtype.unwrap_or(family.dtypes[0]),
        args.epilogue.unwrap_or(family.epilogues[0]),
        args.mask.unwrap_or(family.masks[0]),
        &limits,
    )?;
    let source = Renderer::new(&catalog.templates_dir)?.render(&variant)?;
    if !args.no_source {
        println!("{}", source.code);
    }
    if compiles || args.resources {
        let arch = match (&args.arch, &gpu) {
            (Some(a), _) => a.clone(),
            // Standing in (`--target`): the target's own CUBIN for reading (its ptxas, as on
            // that GPU); its PTX only where the variant is loaded here (--resources).
            (None, Some(g)) => match g.info.stand_in {
                Some(target) if !args.resources => target.arch.to_string(),
                _ => g.info.arch(),
            },
            (None, None) => unreachable!("a GPU was opened above"),
        };
        // A family with an exact `[family] arch` target (sm_90a for wgmma) is compiled for that
        // target, and only for a device or --arch of the same compute capability.
        if let Some(target) = &family.arch {
            let cc = match (&args.arch, &gpu) {
                (None, Some(g)) => g.info.compute_capability,
                _ => {
                    ArchTarget::parse(&arch)
                        .map_err(|e| anyhow::anyhow!("--arch: {e}"))?
                        .compute_capability
                }
            };
            if target.check_device(cc).is_err() {
                bail!(
                    "{} is built for {} only (compute capability {}.{}), not for {arch}",
                    family.name,
                    target.name,
                    target.compute_capability.0,
                    target.compute_capability.1
                );
            }
        }
        let compiler = Compiler::new(&arch)?.for_family(family);
        let arch = compiler.arch.clone();
        if args.ptx {
            println!("// ---- PTX ({arch}) ----\n{}", compiler.ptx(&source)?);
        }
        if !(args.code_size || args.resources) {
            return Ok(());
        }
        let compiled = compiler.compile(&source)?;
        if !compiled.log.is_empty() {
            eprintln!("NVRTC: {}", compiled.log);
        }
        if args.code_size {
            println!("// ---- machine code ({arch}) ----");
            let mut table = vec![vec!["function".to_string(), "code bytes".into()]];
            for (function, bytes) in code_sizes(&compiled.image)? {
                table.push(vec![function, bytes.to_string()]);
            }
            print!("{}", render_table(&table));
        }
        if args.resources {
            let gpu = gpu.as_ref().expect("opened above");
            let loaded = LoadedVariant::load(gpu, &variant, &compiled)?;
            println!("// ---- resources ({}, {arch}) ----", gpu.info.name);
            let mut table = vec![vec![
                "kernel".to_string(),
                "registers".into(),
                "static smem B".into(),
                "local (spill) B".into(),
                "const B".into(),
                "max threads".into(),
            ]];
            for r in loaded.resources()? {
                table.push(vec![
                    format!("{}_{}", source.kernel_name, r.kernel),
                    r.registers.to_string(),
                    r.static_smem_bytes.to_string(),
                    r.local_bytes.to_string(),
                    r.const_bytes.to_string(),
                    r.max_threads.to_string(),
                ]);
            }
            print!("{}", render_table(&table));
        }
    }
    Ok(())
}

pub fn verify(root: &Path, args: VerifyArgs) -> Result<()> {
    let catalog = catalog(root)?;
    if let Some(op) = &args.op {
        if ops::op_by_name(op).is_none() {
            bail!("--op {op}: unknown op (known: {})", ops::op_names().join(", "));
        }
    }
    let families: Vec<_> = catalog
        .families
        .iter()
        .filter(|f| args.op.as_deref().is_none_or(|op| f.op.name() == op))
        .filter(|f| args.family.as_deref().is_none_or(|name| f.name == name))
        .filter(|f| args.dtype.is_none_or(|d| f.dtypes.contains(&d)))
        .cloned()
        .collect();
    if families.is_empty() {
        if let Some(name) = &args.family {
            let family = catalog.family(name)?;
            if let Some(d) = args.dtype {
                bail!(
                    "--family {name} --dtype {d}: the family has no {d} variants (its dtypes: {})",
                    Dtype::list(&family.dtypes)
                );
            }
        }
        bail!("no family matches --op/--family/--dtype");
    }
    let shapes = match &args.shape {
        None => Shapes::TestShapes,
        Some(text) => {
            let ops_named: std::collections::BTreeSet<_> = families.iter().map(|f| f.op.name()).collect();
            if ops_named.len() != 1 {
                bail!(
                    "--shape needs one op: add --op or --family (the families span {})",
                    ops_named.into_iter().collect::<Vec<_>>().join(", ")
                );
            }
            Shapes::Given(ops::parse_shape(families[0].op, text)?)
        }
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let gpu = Gpu::new(0).context("verify runs kernels on the GPU")?;
    let compiler = Compiler::new(&gpu.info.arch())?;
    let renderer = Renderer::new(&catalog.templates_dir)?;
    let points = if args.all_variants {
        Points::All
    } else if let Some(count) = args.sample {
        Points::Sample { count, seed }
    } else {
        Points::Default
    };
    let mut variants = Vec::new();
    for f in &families {
        variants.extend(
            expand(f, points, &gpu.info.limits)?
                .into_iter()
                .filter(|v| args.dtype.is_none_or(|d| v.dtype == d)),
        );
    }
    eprintln!(
        "verifying {} variants of {} families on {} ({}), seed {seed}",
        variants.len(),
        families.len(),
        gpu.info.name,
        gpu.info.arch()
    );
    let bar = indicatif::ProgressBar::new_spinner().with_message("compiling");
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let rows = verify::verify(&gpu, &compiler, &renderer, &variants, &shapes, seed, |row| {
        bar.set_message(format!("{} {}", row.kernel, row.shape));
        bar.inc(1);
    });
    bar.finish_and_clear();
    let failed = rows.iter().filter(|r| matches!(r.status, Status::Fail(_))).count();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", verify_table(&rows));
    }
    let passed = rows.iter().filter(|r| r.status == Status::Pass).count();
    let skipped = rows.len() - passed - failed;
    eprintln!("{passed} passed, {failed} failed, {skipped} skipped (seed {seed})");
    if failed > 0 {
        bail!("{failed} checks failed; rerun with --seed {seed} to reproduce");
    }
    Ok(())
}

fn verify_table(rows: &[Check]) -> String {
    let mut table = vec![vec![
        "kernel".to_string(),
        "shape".into(),
        "rel. L2 error".into(),
        "result".into(),
        "variant".into(),
    ]];
    for r in rows {
        table.push(vec![
            r.kernel.clone(),
            r.shape.clone(),
            r.error.map(|e| format!("{e:.2e}")).unwrap_or_else(|| "-".into()),
            match &r.status {
                Status::Pass => "pass".into(),
                Status::Fail(why) => format!("FAIL: {}", why.lines().next().unwrap_or("")),
                Status::Skip(why) => format!("skip: {why}"),
            },
            r.variant.clone(),
        ]);
    }
    render_table(&table)
}

/// Left-aligned columns separated by two spaces; the first row is the header.
pub(crate) fn render_table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| format!("{cell:<width$}", width = widths[c]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            out.push_str(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
            out.push('\n');
        }
    }
    out
}
