//! `kernelforge tune`: tune every shape a model uses (or one op at one shape) on one GPU, or
//! spread over several (`--devices`, see [`crate::tune::spread`]), against the vendor peer
//! (cuBLASLt), into the tuning database of each GPU kind; print a table, JSON or an HTML report.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use super::tune_bars::TuneBars;
use super::tune_table::{json_doc, results_table, Peaks};
use crate::gpu::{Compiler, DeviceSelection, Gpu, GpuError};
use crate::model::GPT2Config;
use crate::ops::{self, Epilogue, Mask};
use crate::spec::{Catalog, Dtype};
use crate::tune::db::{DbHeader, TuningDb};
use crate::tune::spread::{KindPlan, SpreadPlan};
use crate::tune::tuner::TuneOptions;
use crate::tune::workloads::{model_workloads, Workload};

/// Tune the kernels a model needs on this GPU and store the winners.
///
/// Derives every op shape of the forward pass and the decode step (matmuls with their fused
/// epilogues, attention, layernorm, embedding, LM head) for each --batch and --seq and searches
/// each shape's variants: first every family's default, the winners of neighbouring shapes
/// already in the database and a small sample of each family; then one-parameter steps from
/// the best points (and the other shapes' best points) while they pay; then the fastest few are
/// timed again, longer (successive halving). Every candidate is screened from its ptxas
/// resources (spills, no block per SM), verified against the f64 CPU reference and timed with
/// CUDA events; the vendor peer (cuBLASLt with its own fused epilogue) is measured on the same
/// shapes, and the winners are saved in the tuning database (one file per GPU kind) with every
/// candidate's fate. Shapes already tuned are read back in seconds; --force re-tunes them;
/// --exhaustive measures every variant instead of searching.
///
/// Kernels compile in worker processes, one per core but one (copies of this binary: NVRTC
/// does not scale across the threads of one process); KERNELFORGE_COMPILE_WORKERS=N sets how
/// many, 0 compiles on threads instead.
///
/// --dtype tf32 tunes the matmuls on tensor cores (TF32 inputs, f32 accumulation, relative L2
/// error < 1e-3) against cuBLASLt in TF32 compute, and the prefill's attention in TF32 too;
/// the other ops of a model stay f32.
/// --dtype f16 / bf16 stores the matmul tensors as halves (f32 accumulation, relative L2
/// error < 1e-2) and compares with cuBLASLt on the same halves (f32 compute).
///
/// --devices 0,1 (or all) spreads the work over several GPUs of this host: the GPUs of one kind
/// (same name and compute capability) split the workloads not tuned yet, longest first to the
/// least busy GPU, each verifying and timing its share on itself and saving into that kind's
/// database; every kind in the list tunes every workload into its own database.
///
/// Examples:
///
///   kernelforge tune --model gpt2 --batch 8 --seq 1024
///
///   kernelforge tune --model gpt2 --batch 1,8 --dtype bf16 --devices all
///
///   kernelforge tune --model gpt2 --batch 1,8 --dtype bf16 --decode-step
///
///   kernelforge tune --op matmul --shape 8192,3072,768 --epilogue bias_gelu
///
///   kernelforge tune --op matmul --shape 8192,3072,768 --dtype tf32
///
///   kernelforge tune --op matmul --shape 1024,768,768 --dtype bf16 --exhaustive
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
    /// with cuBLASLt in TF32 compute), f16 or bf16 (half storage, f32 accumulation; compared
    /// with cuBLASLt on the same halves). With --model, tf32 applies to the matmul workloads and
    /// the prefill's attention: layernorm, embedding and the other ops stay f32.
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
    /// Upper bound in seconds for the whole run (compiles included); the search usually stops
    /// before, when a round of its climb gains less than 0.5%. With --devices, GPUs of one kind
    /// split it in proportion to their share of the work.
    #[arg(long, default_value_t = 120.0)]
    pub budget: f64,
    /// Measure every valid variant of every family instead of searching (no budget; the
    /// tensor-core families hold thousands of points, so this takes hours for a model): the
    /// reference that shows what the search misses.
    #[arg(long)]
    pub exhaustive: bool,
    /// Tuning database (default: the user cache folder, one file per GPU kind). With --devices
    /// naming GPUs of several kinds, leave it out: each kind needs its own file.
    #[arg(long, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// GPUs to tune on: indices such as 0,1, or `all` (default: GPU 0). GPUs of one kind
    /// split the workloads (each measures its share on itself, with the --budget cut in
    /// proportion to its share, so every workload is searched as hard as on one GPU and the run
    /// ends sooner) and save into that kind's database; each kind tunes every workload into
    /// its own database. With --op the one workload runs on the first GPU of each kind.
    /// Peaks and ceilings are measured on the first GPU of each kind.
    #[arg(long, value_name = "LIST|all", value_parser = super::model::parse_devices)]
    pub devices: Option<DeviceSelection>,
    /// Also tune the decode step of --model for each --batch, by timing greedy decode steps on
    /// random weights of the model's shape. First the graph engine's kernels: decode attention
    /// in each cache-length bucket (its steps' caches stay in the bucket), then each matmul the
    /// step runs (qkv, attention output, fc, fc projection, LM head): the kernel --model tuned
    /// alone and the candidates within 5% of it run in steps, and the fastest in the step, if
    /// more than 0.5% faster than the winner alone, becomes the key's winner (near-ties alone
    /// can differ more in the step, where a kernel follows another and loads its weights while
    /// that one still runs; about 40 s per batch for attention and 40 s for the matmuls, GPT-2
    /// small). Then, for each --batch the megakernel
    /// holds (at most 16 in f16/bf16, 8 in f32; larger batches decode on the graph engine, and
    /// are skipped with a note): the decode megakernel's point (threads, blocks per SM, weight
    /// slots, columns per warp, attention chunks, copy engine, tensor cores, the MLP as one
    /// stage), searched by timing steps after a short prompt and after one of three quarters of
    /// the context (where attention's chunking shows), against the graph engine timed the same
    /// way beside it (about a minute per batch). Saved into GPU 0's default database, where
    /// `generate` and `bench` find them. Read back from the database in seconds when this run
    /// tuned no kernel anew (the steps' times depend on the kernels) and --force is not given.
    #[arg(long, requires = "model", conflicts_with_all = ["db", "devices"])]
    pub decode_step: bool,
    /// Re-tune shapes the database already has.
    #[arg(long)]
    pub force: bool,
    /// Do not measure the vendor peer (cuBLASLt).
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

/// The workloads `args` ask for: every shape of --model, or the one --op at --shape.
fn workloads_of(args: &TuneArgs, catalog: &Catalog) -> Result<Vec<Workload>> {
    Ok(match (&args.model, &args.op) {
        (Some(model), _) => {
            let cfg = model_config(model)?;
            if let Some(bad) = args.batch.iter().chain(&args.seq).find(|v| **v < 1) {
                bail!("--batch/--seq: {bad} is not a positive size");
            }
            if let Some(t) = args.seq.iter().find(|t| **t as usize > cfg.n_ctx) {
                bail!("--seq {t}: longer than the model's context ({})", cfg.n_ctx);
            }
            model_workloads(&cfg.dims(), &args.batch, &args.seq, args.dtype)
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
    })
}

/// The CUDA ordinals `--devices` names (GPU 0 without it), checked against the machine.
fn gpus(asked: Option<&DeviceSelection>) -> Result<Vec<usize>> {
    const WHY: &str = "tune measures kernels on the GPU";
    let count = crate::gpu::device_count().context(WHY)?;
    if count == 0 {
        if !crate::gpu::device::driver_present() {
            return Err(GpuError::NoDriver).context(WHY);
        }
        bail!("{WHY}, and the driver reports no CUDA device on this machine (`nvidia-smi -L` lists them)");
    }
    Ok(asked.cloned().unwrap_or_default().resolve(count)?)
}

/// What a kind of GPU is about to do, for stderr: today's line for one GPU, and for several
/// how many workloads each takes.
fn plan_line(plan: &SpreadPlan, kind: &KindPlan) -> String {
    let cached = kind.cached().len();
    let from_db = if cached > 0 {
        format!(" ({cached} already in the database)")
    } else {
        String::new()
    };
    let total = kind.assignment.len();
    if let [slot] = kind.slots[..] {
        let d = &plan.devices[slot];
        return format!(
            "tuning {total} workloads{from_db} on cuda:{} {} ({}), database {}",
            d.ordinal,
            d.name,
            d.arch(),
            kind.db_path.display()
        );
    }
    let shares: Vec<String> = kind
        .slots
        .iter()
        .map(|&slot| format!("cuda:{} {}", plan.devices[slot].ordinal, kind.share(slot).len()))
        .collect();
    format!(
        "tuning {total} workloads{from_db} on {} GPUs {}: {}; database {}",
        kind.slots.len(),
        kind.describe(),
        shares.join(", "),
        kind.db_path.display()
    )
}

pub fn run(root: &Path, args: TuneArgs) -> Result<()> {
    if args.budget <= 0.0 {
        bail!("--budget must be positive (seconds)");
    }
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates"))?;
    let workloads = workloads_of(&args, &catalog)?;
    let ordinals = gpus(args.devices.as_ref())?;

    let started = std::time::Instant::now();
    let plan = SpreadPlan::new(&catalog, &ordinals, args.db.as_deref(), &workloads, args.force)?;
    if let (Some(path), true) = (&args.report, plan.kinds.len() > 1) {
        bail!(
            "--report {}: the GPUs are of {} kinds and a report shows one database; pick GPUs of one kind \
             with --devices, or drop --report and run `kernelforge report --db PATH` for each kind's database",
            path.display(),
            plan.kinds.len()
        );
    }
    for kind in &plan.kinds {
        if let Some(w) = &kind.warning {
            eprintln!("warning: {w}");
        }
        eprintln!("{}", plan_line(&plan, kind));
        let idle: Vec<String> = kind
            .slots
            .iter()
            .filter(|&&s| kind.share(s).is_empty())
            .map(|&s| format!("cuda:{}", plan.devices[s].ordinal))
            .collect();
        if kind.slots.len() > 1 && !idle.is_empty() {
            eprintln!(
                "note: {} workloads to tune on {} GPUs of this kind; nothing for {}",
                kind.assignment.iter().flatten().count(),
                kind.slots.len(),
                idle.join(", ")
            );
        }
    }
    let waiting: Vec<String> = (0..ordinals.len())
        .map(|slot| {
            let n = plan.kinds.iter().map(|k| k.share(slot).len()).sum::<usize>();
            format!("{n} workloads queued")
        })
        .collect();
    let bars = TuneBars::new(&ordinals, &waiting);
    // The one place the tuner's options are built.
    let options = TuneOptions {
        budget: std::time::Duration::from_secs_f64(args.budget),
        seed: args.seed,
        force: args.force,
        baseline: !args.no_baseline,
        exhaustive: args.exhaustive,
    };
    let outcome = plan.run(&catalog, &options, &bars.progress());
    bars.finish();
    let kinds = outcome?;

    // Peaks on the first GPU of each kind, kept as ceilings in its database (the report draws
    // them); figures not measured in this run keep their earlier values. A run that tuned
    // nothing reads them back from the database when it has every figure the table needs.
    let mut measured = Vec::new();
    for kind in &kinds {
        let ordinal = plan.devices[kind.plan.slots[0]].ordinal;
        let gpu = Gpu::new(ordinal).with_context(|| format!("cuda:{ordinal}: opening it to measure the peaks"))?;
        let compiler = Compiler::new(&gpu.info.arch())?;
        let path = &kind.plan.db_path;
        let mut db = TuningDb::open(path, DbHeader::for_device(&gpu, &compiler))?;
        let results = || kind.results.iter().map(|r| &r.result);
        let stored = Peaks::from_ceilings(&db.ceilings, results()).filter(|_| results().all(|r| r.from_db));
        let peaks = match stored {
            Some(peaks) => peaks,
            None => {
                let peaks = Peaks::measure(&gpu, results())
                    .with_context(|| format!("cuda:{ordinal} ({}): measuring the peaks", gpu.info.name))?;
                db.ceilings = peaks.ceilings(&db.ceilings);
                db.save()
                    .with_context(|| format!("saving the measured ceilings to {}", path.display()))?;
                peaks
            }
        };
        measured.push((gpu.info.clone(), peaks));
    }
    let (points, decode) = match (&args.model, args.decode_step) {
        (Some(model), true) => {
            let batches: Vec<usize> = args.batch.iter().map(|&b| b.max(1) as usize).collect();
            let cfg = model_config(model)?;
            // What was timed in whole steps before is read back unless a kernel was just
            // (re)tuned, which may have moved the times it was compared with.
            let kernels_unchanged = kinds.iter().flat_map(|k| &k.results).all(|r| r.result.from_db);
            let reuse = !args.force && kernels_unchanged;
            // The graph engine's kernels first: its step, which the megakernel's points are
            // compared with, runs the attention and matmuls chosen here.
            let points =
                super::tune_decode_points::tune_decode_points(root, &cfg, args.dtype, &batches, args.seed, reuse)?;
            let points_unchanged = points.iter().all(|r| r.from_db || !r.switched());
            let decode = super::tune_decode::tune_decode_steps(
                root,
                &catalog,
                &cfg,
                args.dtype,
                &batches,
                args.seed,
                reuse && points_unchanged,
            )?;
            (points, decode)
        }
        _ => (Vec::new(), Vec::new()),
    };
    let elapsed = started.elapsed().as_secs_f64();
    let several = ordinals.len() > 1;

    if args.json {
        let mut doc = json_doc(&kinds, &measured, elapsed)?;
        if let Some(map) = doc.as_object_mut() {
            if !decode.is_empty() {
                let rows: Vec<serde_json::Value> = decode.iter().map(super::tune_decode::DecodeTuned::json).collect();
                map.insert("decode_step".into(), rows.into());
            }
            let (attention, matmuls): (Vec<_>, Vec<_>) = points.iter().partition(|r| r.bucket.is_some());
            for (name, rows) in [("decode_attention", attention), ("decode_matmul", matmuls)] {
                if !rows.is_empty() {
                    let rows: Vec<serde_json::Value> = rows.into_iter().map(|r| r.json()).collect();
                    map.insert(name.into(), rows.into());
                }
            }
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for (kind, (_, peaks)) in kinds.iter().zip(&measured) {
            if kinds.len() > 1 {
                println!("{} (database {})", kind.plan.describe(), kind.plan.db_path.display());
            }
            print!("{}", results_table(&kind.results, peaks, several));
        }
    }
    if !points.is_empty() && !args.json {
        print!("{}", super::tune_decode_points::points_table(&points));
    }
    if !decode.is_empty() && !args.json {
        print!("{}", super::tune_decode::decode_table(&decode));
    }
    let results = kinds.iter().map(|k| k.results.len()).sum::<usize>();
    let cached = kinds
        .iter()
        .flat_map(|k| &k.results)
        .filter(|r| r.result.from_db)
        .count();
    let mut summary = format!("{results} workloads ({cached} from the database) in {elapsed:.1} s");
    let work: Vec<_> = kinds.iter().flat_map(|k| &k.work).collect();
    if several {
        for w in work {
            summary.push_str(&format!(
                "\n  cuda:{} tuned {} in {:.1} s: {}",
                w.device.ordinal,
                w.tuned,
                w.busy.as_secs_f64(),
                w.phases.text()
            ));
        }
    } else if let Some(w) = work.first() {
        summary.push_str(&format!(": {}", w.phases.text()));
    }
    eprintln!("{summary}");
    if let Some(why) = crate::gpu::compile_workers::global().and_then(|pool| pool.unavailable()) {
        eprintln!("note: compiled in this process, which is slower on many cores: {why}");
    }
    for (kind, (_, peaks)) in kinds.iter().zip(&measured) {
        if kinds.len() > 1 {
            eprintln!("{}: {}", kind.plan.describe(), peaks.legend());
        } else {
            eprintln!("{}", peaks.legend());
        }
    }
    if let Some(path) = &args.report {
        write_report(&catalog, &kinds[0].plan.db_path, path)?;
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::{Cli, Command};
    use crate::gpu::DeviceSelection;
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

    #[test]
    fn tune_takes_devices() {
        let devices = |args: &[&str]| match parse(args) {
            Ok(Command::Tune(a)) => Ok(a.devices),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        assert_eq!(devices(&["tune", "--model", "gpt2"]).unwrap(), None, "GPU 0 by default");
        assert_eq!(
            devices(&["tune", "--model", "gpt2", "--devices", "all"]).unwrap(),
            Some(DeviceSelection::All)
        );
        assert_eq!(
            devices(&["tune", "--model", "gpt2", "--devices", "0,1"]).unwrap(),
            Some(DeviceSelection::List(vec![0, 1]))
        );
        assert_eq!(
            devices(&["tune", "--op", "matmul", "--shape", "64,64,64", "--devices", "cuda:1"]).unwrap(),
            Some(DeviceSelection::List(vec![1]))
        );
        let e = devices(&["tune", "--model", "gpt2", "--devices", "0,0"]).unwrap_err();
        assert!(e.contains("--devices") && e.contains("GPU 0 twice"), "{e}");
        let e = devices(&["tune", "--model", "gpt2", "--devices", "gpu1"]).unwrap_err();
        assert!(e.contains("`gpu1` is not a GPU index"), "{e}");
    }

    /// Without a CUDA driver, `tune --devices` fails with one clear line, not a panic.
    #[test]
    fn tune_without_a_gpu_says_so() {
        if crate::gpu::device::driver_present() {
            return;
        }
        let Command::Tune(args) =
            parse(&["tune", "--op", "layernorm", "--shape", "N=4,C=8", "--devices", "0,1"]).unwrap()
        else {
            panic!("not tune")
        };
        let e = format!(
            "{:#}",
            super::run(std::path::Path::new(env!("CARGO_MANIFEST_DIR")), args).unwrap_err()
        );
        assert!(
            e.contains("tune measures kernels on the GPU") && e.contains("no CUDA driver"),
            "{e}"
        );
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
