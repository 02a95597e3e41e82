//! `kernelforge tune`: tune every shape a model uses (or one op at one shape) on this GPU,
//! against cuBLAS, into the tuning database; print a table, JSON or an HTML report.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use super::kernels::render_table;
use crate::codegen::Renderer;
use crate::gpu::{Compiler, Gpu};
use crate::model::GPT2Config;
use crate::ops::{self, Epilogue, Mask};
use crate::spec::{shape_text, Catalog, Dtype};
use crate::tune::baseline::{
    fp32_peak_flops, measure_copy_bandwidth, measure_half_peak, measure_tf32_peak, TF32_PEAK_SIZE,
};
use crate::tune::db::{default_path, Ceilings, DbHeader, TuningDb};
use crate::tune::tuner::{tune, Progress, TuneOptions, TuneResult};
use crate::tune::workloads::{model_workloads, Workload};

/// Tune the kernels a model needs on this GPU and store the winners.
///
/// Derives every op shape of the forward pass and the decode step (matmuls with their fused
/// epilogues, attention, layernorm, embedding, LM head) for each --batch and --seq and searches
/// each shape's variants: first every family's default, the winners of neighbouring shapes
/// already in the database and a small sample of each family; then one-parameter steps from
/// the best points while they pay; then the fastest few are timed again, longer (successive
/// halving). Every candidate is screened from its ptxas resources (spills, no block per SM),
/// verified against the f64 CPU reference and timed with CUDA events; the vendor peer
/// (cuBLASLt with its own fused epilogue) is measured on the same shapes, and the winners are
/// saved in the tuning database (one file per GPU) with every candidate's fate. Shapes already
/// tuned are read back in seconds; --force re-tunes them; --exhaustive measures everything.
///
/// --dtype tf32 tunes the matmuls on tensor cores (TF32 inputs, f32 accumulation, relative L2
/// error < 1e-3) against cuBLAS in TF32 math mode; the other ops of a model stay f32.
/// --dtype f16 / bf16 stores the matmul tensors as halves (f32 accumulation, relative L2
/// error < 1e-2) and compares with cuBLAS on the same halves (cublasGemmEx, f32 compute).
///
/// Examples:
///   kernelforge tune --model gpt2 --batch 8 --seq 1024
///   kernelforge tune --op matmul --shape 8192,3072,768 --epilogue bias_gelu
///   kernelforge tune --op matmul --shape 8192,3072,768 --dtype tf32
///   kernelforge tune --op matmul --shape 8192,3072,768 --dtype bf16
#[derive(Debug, Args)]
pub struct TuneArgs {
    /// gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a Hugging Face folder with config.json.
    #[arg(long, value_name = "NAME|DIR", required_unless_present = "op")]
    pub model: Option<String>,
    /// Batch sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub batch: Vec<i64>,
    /// Sequence lengths of the prefill (comma-separated); the decode step (seq 1) is always added.
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    pub seq: Vec<i64>,
    /// Precision of the matmuls: f32 (FP32 FMA), tf32 (tensor cores, f32 storage; compared
    /// with cuBLAS in TF32 math mode), f16 or bf16 (half storage, f32 accumulation; compared
    /// with cuBLAS on the same halves). With --model, tf32 applies to the matmul workloads only:
    /// layernorm, attention, embedding and the other ops stay f32 (they have no tf32 kernels).
    #[arg(long, default_value = "f32", value_parser = super::kernels::parse_dtype)]
    pub dtype: Dtype,
    /// Tune one op instead of a model (with --shape).
    #[arg(long, requires = "shape", conflicts_with = "model")]
    pub op: Option<String>,
    /// The shape for --op: positional (8192,3072,768 for M,N,K) or named (M=8192,N=3072,...).
    #[arg(long)]
    pub shape: Option<String>,
    /// Epilogue for --op matmul.
    #[arg(long, value_parser = super::kernels::parse_epilogue)]
    pub epilogue: Option<Epilogue>,
    /// Mask for --op attention.
    #[arg(long, value_parser = super::kernels::parse_mask)]
    pub mask: Option<Mask>,
    /// Upper bound in seconds for the whole run (compiles included), shared out among the
    /// workloads. The search usually stops before, when a round of its climb gains less than 1%.
    #[arg(long, default_value_t = 120.0)]
    pub budget: f64,
    /// Measure every valid variant of every family instead of searching (no budget; the
    /// tensor-core families hold thousands of points, so this takes hours for a model): the
    /// reference that shows what the search misses.
    #[arg(long)]
    pub exhaustive: bool,
    /// Tuning database (default: the user cache folder, one file per GPU).
    #[arg(long, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// Re-tune shapes the database already has.
    #[arg(long)]
    pub force: bool,
    /// Do not measure cuBLAS.
    #[arg(long)]
    pub no_baseline: bool,
    /// Seed for inputs and sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write the report site of the whole database (what `kernelforge report --db` writes:
    /// overview with roofline, a page per workload with every variant's time, family pages with
    /// sources and diffs). FILE.html names the site's folder FILE/ beside it and becomes a
    /// page that opens FILE/index.html; a path without .html is the folder itself.
    #[arg(long, value_name = "FILE.html")]
    pub report: Option<PathBuf>,
}

/// Model dimensions from a size name or a folder's config.json.
fn model_config(spec: &str) -> Result<GPT2Config> {
    if let Some(cfg) = GPT2Config::preset(spec) {
        return Ok(cfg);
    }
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(GPT2Config::from_hf_json(&path.join("config.json"))?);
    }
    if path.is_file() {
        return Ok(crate::model::load_model(path)?.config);
    }
    bail!("--model {spec}: not a size name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a folder with config.json, or an llm.c file")
}

struct Bars {
    bar: indicatif::ProgressBar,
}

impl Progress for Bars {
    fn stage(&self, message: &str, total: u64) {
        self.bar.set_position(0);
        self.bar.set_length(total);
        self.bar.set_prefix(message.to_string());
    }
    fn advance(&self, message: &str) {
        self.bar.set_message(message.to_string());
        self.bar.inc(1);
    }
}

pub fn run(root: &Path, args: TuneArgs) -> Result<()> {
    if args.budget <= 0.0 {
        bail!("--budget must be positive (seconds)");
    }
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates"))?;
    let workloads: Vec<Workload> = match (&args.model, &args.op) {
        (Some(model), _) => {
            let cfg = model_config(model)?;
            if let Some(bad) = args.batch.iter().chain(&args.seq).find(|v| **v < 1) {
                bail!("--batch/--seq: {bad} is not a positive size");
            }
            if let Some(t) = args.seq.iter().find(|t| **t as usize > cfg.n_ctx) {
                bail!("--seq {t}: longer than the model's context ({})", cfg.n_ctx);
            }
            model_workloads(&cfg, &args.batch, &args.seq, args.dtype)
        }
        (None, Some(op_name)) => {
            let op = ops::op_by_name(op_name)
                .with_context(|| format!("--op {op_name}: unknown op (known: {})", ops::op_names().join(", ")))?;
            let epilogue = args.epilogue.unwrap_or(op.epilogues()[0]);
            let mask = args.mask.unwrap_or(op.masks()[0]);
            let dtypes: Vec<Dtype> = Dtype::ALL
                .into_iter()
                .filter(|&d| catalog.has_dtype(op.name(), d))
                .collect();
            if !dtypes.contains(&args.dtype) {
                bail!(
                    "--dtype {} --op {op_name}: no {op_name} family lists {}; pick one of: {}",
                    args.dtype,
                    args.dtype,
                    Dtype::list(&dtypes)
                );
            }
            let mut shape = ops::parse_shape(op, args.shape.as_deref().unwrap_or_default())?;
            op.complete_shape(&mut shape, epilogue, mask)?;
            vec![Workload {
                role: format!("{op_name} (--op)"),
                op: op.name(),
                dtype: args.dtype,
                epilogue,
                mask,
                shape,
                calls: 1,
            }]
        }
        (None, None) => bail!("give --model NAME|DIR or --op OP --shape SHAPE"),
    };

    let started = std::time::Instant::now();
    let gpu = Gpu::new(0).context("tune measures kernels on the GPU")?;
    let compiler = Compiler::new(&gpu.info.arch())?;
    let renderer = Renderer::new(&catalog.templates_dir)?;
    let header = DbHeader::for_device(&gpu, &compiler);
    let db_path = args.db.clone().unwrap_or_else(|| default_path(&header));
    let mut db = TuningDb::open(&db_path, header)?;
    if let Some(w) = &db.warning {
        eprintln!("warning: {w}");
    }
    eprintln!(
        "tuning {} workloads on {} ({}), database {}",
        workloads.len(),
        gpu.info.name,
        gpu.info.arch(),
        db_path.display()
    );
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{prefix:.bold} [{bar:30}] {pos}/{len} {wide_msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let options = TuneOptions {
        budget: std::time::Duration::from_secs_f64(args.budget),
        seed: args.seed,
        force: args.force,
        baseline: !args.no_baseline,
        exhaustive: args.exhaustive,
    };
    let run = tune(
        &gpu,
        &compiler,
        &renderer,
        &catalog,
        &mut db,
        &workloads,
        &options,
        &Bars { bar: bar.clone() },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    bar.finish_and_clear();
    let (results, spent) = (run.results, run.phases);
    let ceilings_started = std::time::Instant::now();
    let peaks = Peaks {
        fp32: fp32_peak_flops(&gpu)?,
        // Tensor-core rows are measured against what cuBLAS TF32 reaches on a large square
        // GEMM in this run (a practical peak), not against the FP32 FMA peak.
        tf32: if results.iter().any(|r| r.dtype == Dtype::Tf32 && r.flops > 0.0) {
            Some(measure_tf32_peak(&gpu)?)
        } else {
            None
        },
        // f16 / bf16 rows: cuBLAS BF16 on the same square GEMM (16-bit tensor-core rate).
        half: if results
            .iter()
            .any(|r| matches!(r.dtype, Dtype::F16 | Dtype::Bf16) && r.flops > 0.0)
        {
            Some(measure_half_peak(&gpu)?)
        } else {
            None
        },
        bytes: measure_copy_bandwidth(&gpu)?,
    };
    // Keep the ceilings in the database (the report draws them); figures not measured in this
    // run keep their earlier values.
    db.ceilings = Ceilings {
        fp32_tflops: Some(peaks.fp32 / 1e12),
        tf32_tflops: peaks.tf32.map(|p| p / 1e12),
        bf16_tflops: peaks.half.map(|p| p / 1e12),
        copy_gb_per_s: Some(peaks.bytes / 1e9),
        measured_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }
    .or(&db.ceilings);
    db.save()
        .with_context(|| format!("saving the measured ceilings to {}", db_path.display()))?;
    let elapsed = started.elapsed().as_secs_f64();
    let ceilings_s = ceilings_started.elapsed().as_secs_f64();

    if args.json {
        let doc = serde_json::json!({
            "device": gpu.info,
            "database": db_path,
            "seconds": elapsed,
            "phases": spent,
            "fp32_peak_tflops": peaks.fp32 / 1e12,
            "tf32_cublas_peak_tflops": peaks.tf32.map(|p| p / 1e12),
            "bf16_cublas_peak_tflops": peaks.half.map(|p| p / 1e12),
            "copy_bandwidth_gbs": peaks.bytes / 1e9,
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", results_table(&results, &peaks));
    }
    let cached = results.iter().filter(|r| r.from_db).count();
    eprintln!(
        "{} workloads ({} from the database) in {:.1} s: {}, ceilings {:.1} s\n{}",
        results.len(),
        cached,
        elapsed,
        spent.text(),
        ceilings_s,
        peaks.legend()
    );
    if let Some(path) = &args.report {
        write_report(&catalog, &db_path, path)?;
    }
    Ok(())
}

/// `tune --report`: the report site of the database just written (see [`ReportArgs`]).
///
/// [`ReportArgs`]: super::report::ReportArgs
fn write_report(catalog: &Catalog, db_path: &Path, path: &Path) -> Result<()> {
    let is_page = path.extension().is_some_and(|x| x == "html" || x == "htm");
    let dir = if is_page {
        path.with_extension("")
    } else {
        path.to_path_buf()
    };
    let input = crate::report::ReportInput {
        catalog: catalog.clone(),
        db: Some(TuningDb::read_only(db_path)?),
        benches: Vec::new(),
    };
    let summary = crate::report::render_site(&input, &dir).with_context(|| format!("--report {}", path.display()))?;
    if is_page {
        let folder = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = format!(
            "{}/index.html",
            folder.replace('&', "&amp;").replace('"', "&quot;").replace('<', "&lt;")
        );
        let html = format!(
            "<!doctype html><meta charset=utf-8><meta http-equiv=refresh content=\"0; url={target}\"><title>kernelforge report</title><p><a href=\"{target}\">Open the report</a></p>\n"
        );
        if !crate::gpu::compile::write_atomic(path, html.as_bytes()) {
            bail!("--report {}: cannot write the file", path.display());
        }
    }
    eprintln!(
        "report site written to {} ({} files, {:.1} MB)",
        summary.out.join("index.html").display(),
        summary.files,
        summary.bytes as f64 / 1e6
    );
    Ok(())
}

fn short_params(params: &indexmap::IndexMap<String, i64>) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Throughput and fraction of peak: TFLOP/s for compute-bound ops, GB/s for the rest.
/// The references of the "% peak" column.
struct Peaks {
    /// FP32 FMA peak (SMs x 128 lanes x 2 x clock), for f32 compute-bound rows.
    fp32: f64,
    /// cuBLAS TF32 on an 8192³ GEMM, measured in this run, for tf32 rows (marked `tc`).
    tf32: Option<f64>,
    /// cuBLAS BF16 on the same GEMM, measured in this run, for f16 / bf16 rows (marked `tc`).
    half: Option<f64>,
    /// Measured device-to-device copy bandwidth, for memory-bound rows.
    bytes: f64,
}

impl Peaks {
    fn legend(&self) -> String {
        let mut text = format!(
            "% peak: f32 rows vs the FP32 FMA peak {:.1} TFLOP/s (clock x SMs)",
            self.fp32 / 1e12
        );
        if let Some(tc) = self.tf32 {
            text.push_str(&format!(
                "; tf32 rows (marked tc) vs cuBLAS TF32 on {n}x{n}x{n}, {:.1} TFLOP/s measured now",
                tc / 1e12,
                n = TF32_PEAK_SIZE
            ));
        }
        if let Some(tc) = self.half {
            text.push_str(&format!(
                "; f16/bf16 rows (marked tc) vs cuBLAS BF16 on {n}x{n}x{n}, {:.1} TFLOP/s measured now",
                tc / 1e12,
                n = TF32_PEAK_SIZE
            ));
        }
        text.push_str(&format!(
            "; memory-bound rows vs the copy bandwidth {:.0} GB/s (measured)",
            self.bytes / 1e9
        ));
        text
    }
}

fn throughput(r: &TuneResult, ms: f64, peaks: &Peaks) -> (String, String) {
    if r.flops > 0.0 {
        let f = r.flops / (ms * 1e-3);
        let tensor_peak = match r.dtype {
            Dtype::Tf32 => peaks.tf32,
            Dtype::F16 | Dtype::Bf16 => peaks.half,
            Dtype::F32 => None,
        };
        let pct = match tensor_peak {
            Some(tc) => format!("{:.0}% tc", 100.0 * f / tc),
            None => format!("{:.0}%", 100.0 * f / peaks.fp32),
        };
        (format!("{:.1} TFLOP/s", f / 1e12), pct)
    } else if r.bytes > 0.0 {
        let b = r.bytes / (ms * 1e-3);
        (
            format!("{:.0} GB/s", b / 1e9),
            format!("{:.0}%", 100.0 * b / peaks.bytes),
        )
    } else {
        ("-".into(), "-".into())
    }
}

/// The final table, then what the peers are and why any row has none: "peer ms" is the vendor
/// peer of the row's epilogue (cuBLASLt with its own fused epilogue, or cuBLAS + the qkv split
/// kernel) and "speed vs peer" its time over the winner's.
fn results_table(results: &[TuneResult], peaks: &Peaks) -> String {
    use crate::tune::baseline::{entry_peer, peer_cells, PEER_LEGEND};
    let mut rows = vec![[
        "workload",
        "dtype",
        "shape",
        "winner",
        "time ms",
        "±",
        "throughput",
        "% peak",
        "peer",
        "peer ms",
        "speed vs peer",
        "tried",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect::<Vec<_>>()];
    let mut notes = Vec::new();
    for r in results {
        let Some(w) = &r.winner else {
            rows.push(vec![
                r.role.clone(),
                r.dtype.to_string(),
                shape_text(&r.shape),
                "NO VALID VARIANT".into(),
            ]);
            continue;
        };
        let (tp, pct) = throughput(r, w.median_ms, peaks);
        let (peer_ms, vs_peer) = peer_cells(w);
        if let Some(why) = &w.baseline_unavailable {
            notes.push(format!(
                "no peer time for {} {} {}: {why}",
                r.role,
                r.dtype,
                shape_text(&r.shape)
            ));
        }
        rows.push(vec![
            r.role.clone(),
            r.dtype.to_string(),
            shape_text(&r.shape),
            format!("{} {}", w.family, short_params(&w.params)),
            format!("{:.4}", w.median_ms),
            format!("{:.4}", w.spread_ms),
            tp,
            pct,
            entry_peer(w).unwrap_or("-").to_string(),
            peer_ms,
            vs_peer,
            if r.from_db {
                "(db)".into()
            } else {
                w.variants_tried.to_string()
            },
        ]);
    }
    let mut text = render_table(&rows);
    if results
        .iter()
        .any(|r| r.winner.as_ref().is_some_and(|w| entry_peer(w).is_some()))
    {
        text.push_str(&format!(
            "{PEER_LEGEND}; speed vs peer = peer time / winner time (above 1: the generated kernel is faster)\n"
        ));
    }
    for note in notes {
        text.push_str(&note);
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::{Cli, Command};
    use crate::spec::Dtype;

    fn parse(args: &[&str]) -> Result<Command, String> {
        Cli::try_parse_from(std::iter::once("kernelforge").chain(args.iter().copied()))
            .map(|c| c.command)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn tune_and_verify_take_a_dtype() {
        match parse(&["tune", "--op", "matmul", "--shape", "64,64,64", "--dtype", "tf32"]).unwrap() {
            Command::Tune(args) => assert_eq!(args.dtype, Dtype::Tf32),
            other => panic!("{other:?}"),
        }
        match parse(&["tune", "--model", "gpt2"]).unwrap() {
            Command::Tune(args) => assert_eq!(args.dtype, Dtype::F32, "f32 by default"),
            other => panic!("{other:?}"),
        }
        match parse(&["verify", "--op", "matmul", "--dtype", "tf32"]).unwrap() {
            Command::Verify(args) => assert_eq!(args.dtype, Some(Dtype::Tf32)),
            other => panic!("{other:?}"),
        }
        match parse(&["inspect", "matmul_wmma", "--dtype", "tf32"]).unwrap() {
            Command::Inspect(args) => assert_eq!(args.dtype, Some(Dtype::Tf32)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_bad_dtype_is_refused_with_the_choices() {
        for cmd in [
            vec!["tune", "--model", "gpt2", "--dtype", "fp16"],
            vec!["verify", "--dtype", "fp16"],
            vec!["inspect", "matmul_wmma", "--dtype", "fp16"],
        ] {
            let e = parse(&cmd).unwrap_err();
            assert!(
                e.contains("--dtype") && e.contains("unknown dtype `fp16`") && e.contains("f32, tf32, f16, bf16"),
                "{e}"
            );
        }
    }

    /// `tune --report FILE.html` writes the report site into FILE/ and a page that opens it.
    #[test]
    fn tune_report_writes_the_site_beside_the_page() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let catalog = crate::spec::Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let page = dir.path().join("tuning.html");
        super::write_report(&catalog, &root.join("tests/fixtures/report/db.json"), &page).unwrap();
        let html = std::fs::read_to_string(&page).unwrap();
        assert!(html.contains("href=\"tuning/index.html\""), "{html}");
        assert!(dir.path().join("tuning/index.html").is_file());
        assert!(dir.path().join("tuning/kernelforge-report.json").is_file());
    }

    /// An op whose families lack the dtype is refused before any GPU is needed, with the
    /// dtypes it does have.
    #[test]
    fn a_dtype_no_family_of_the_op_lists_is_refused() {
        let Command::Tune(args) =
            parse(&["tune", "--op", "encoder", "--shape", "B=1,T=4,C=8", "--dtype", "tf32"]).unwrap()
        else {
            panic!("not tune")
        };
        let e = super::run(std::path::Path::new(env!("CARGO_MANIFEST_DIR")), args)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--dtype tf32 --op encoder") && e.contains("pick one of: f32, f16, bf16"),
            "{e}"
        );
    }
}
