//! `kernelforge tokenize`, `forward`, `generate` and `bench`: thin commands over
//! [`crate::model`], implementing the DESIGN.md command-line contract. Text goes to stdout
//! (streamed token by token for `generate`), one stats line goes to stderr at the end, `--json`
//! prints one JSON object instead. `--device` defaults to `cuda` when a GPU opens, else `cpu`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::model::config::GPT2Config;
use crate::model::cpu::CpuBackend;
use crate::model::generate::{generate, Backend, GenerateOptions};
use crate::model::gpu::{GpuBackend, ProfileRow};
use crate::model::hub::HubSettings;
use crate::model::npy::write_npy_f32;
use crate::model::sampling::SamplingParams;
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::model::weights::{load_model, GPT2Model};
use crate::spec::Dtype;

/// Where the forward pass runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

impl Device {
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// `kernelforge tokenize TEXT` / `kernelforge tokenize --decode IDS`.
#[derive(clap::Args, Debug, Clone)]
pub struct TokenizeArgs {
    /// Text to encode with the GPT-2 BPE ("-" reads standard input). Prints the ids, comma-separated.
    #[arg(required_unless_present = "decode")]
    pub text: Option<String>,
    /// Decode these token ids (comma- or space-separated) back to text instead.
    #[arg(long, value_name = "IDS", conflicts_with = "text")]
    pub decode: Option<String>,
    /// Print one JSON object (ids and per-token strings, or the decoded text).
    #[arg(long)]
    pub json: bool,
}

/// What every model command shares: the checkpoint, where to run it, and which kernels.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a Hugging Face folder, an llm.c .bin checkpoint, or a size name
    /// (gpt2, gpt2-medium, gpt2-large, gpt2-xl): taken from the Hugging Face cache, else
    /// downloaded from the hub into it (not with HF_HUB_OFFLINE=1).
    #[arg(long, value_name = "DIR|FILE|NAME")]
    pub model: String,
    /// Where to run (default: cuda when a GPU opens, else cpu).
    #[arg(long, value_enum)]
    pub device: Option<Device>,
    /// GPU: the unfused baseline (separate bias, GELU and residual kernels, naive attention).
    #[arg(long)]
    pub unfused: bool,
    /// Precision. f32: everything in f32 (the CPU's only mode). GPU only: tf32 = f32 storage,
    /// the compute-bound matmuls on tensor cores with inputs rounded to TF32; f16 / bf16 =
    /// weights (converted once at load), activations and KV cache stored in 16 bits, matmuls
    /// and attention on tensor cores, f32 math and accumulation inside every kernel.
    #[arg(long, default_value = "f32", value_parser = super::kernels::parse_dtype)]
    pub dtype: Dtype,
    /// The project folder (specs/, templates/) from the global --root.
    #[arg(skip)]
    pub root: Option<PathBuf>,
}

impl ModelArgs {
    /// The device to run on, checked against --dtype and --unfused.
    fn device(&self) -> Result<Device> {
        let device = resolve_device(self.device);
        check_device(device, self.dtype, self.unfused)?;
        Ok(device)
    }

    /// Backend options for buffers sized to `max_batch` sequences.
    fn backend_options(&self, max_batch: usize) -> BackendOptions {
        BackendOptions {
            max_batch,
            unfused: self.unfused,
            dtype: self.dtype,
            root: self.root.clone(),
        }
    }
}

/// `kernelforge forward`: logits for every position.
#[derive(clap::Args, Debug, Clone)]
pub struct ForwardArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    /// Input token ids, comma-separated (e.g. 15496,11,995).
    #[arg(
        long,
        value_name = "IDS",
        required_unless_present = "prompt",
        conflicts_with = "prompt"
    )]
    pub ids: Option<String>,
    /// Input text, tokenized with the GPT-2 BPE.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Write the logits, [T, vocab] float32, to this .npy file.
    #[arg(long, value_name = "PATH")]
    pub logits_out: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `kernelforge generate`: stream text from a prompt.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    /// Prompt text.
    #[arg(long, value_name = "TEXT", required_unless_present = "ids", conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_name = "IDS")]
    pub ids: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Always take the most likely token.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub greedy: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Random seed; sequence b of the batch uses seed + b.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Run B copies of the prompt as one batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Print the generated token ids (one comma-separated line per sequence) instead of text.
    #[arg(long)]
    pub print_ids: bool,
    /// Keep generating after <|endoftext|>.
    #[arg(long)]
    pub ignore_eot: bool,
    /// Print one JSON object (ids, text, stats) at the end instead of streaming.
    #[arg(long)]
    pub json: bool,
}

/// `kernelforge bench`: forward and generation throughput, and where the time goes.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Tokens per sequence of the timed forward pass (random ids).
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Decode steps to time, after a prefill of --seq tokens (fewer if the steps would not fit
    /// the context); 0: forward only.
    #[arg(long, default_value_t = 32)]
    pub generate: usize,
    /// Timed forward passes (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Time the decode steps kernel by kernel instead of replaying each step as a CUDA graph
    /// (to see what the graphs save).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Parse `15496,11,995` (commas and/or whitespace) into token ids.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>()
                .with_context(|| format!("`{x}` in the id list is not a token id (expected e.g. 15496,11,995)"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("the id list `{s}` is empty");
    }
    Ok(ids)
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Turn `--model` into a path: an existing path as is; a size name (gpt2, gpt2-medium,
/// gpt2-large, gpt2-xl) from the Hugging Face cache, else downloaded from the hub when online
/// (see [`crate::model::hub`]).
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    Ok(crate::model::hub::resolve_model(spec, &HubSettings::from_env())?)
}

/// `--device` as given, or `cuda` when the driver is there and GPU 0 opens, else `cpu`.
pub fn resolve_device(device: Option<Device>) -> Device {
    match device {
        Some(d) => d,
        None if crate::gpu::device::driver_present() && crate::gpu::Gpu::new(0).is_ok() => Device::Cuda,
        None => Device::Cpu,
    }
}

fn check_device(device: Device, dtype: Dtype, unfused: bool) -> Result<()> {
    match device {
        Device::Cuda if !crate::gpu::device::driver_present() => bail!(
            "--device cuda: no CUDA driver found (libcuda.so); this needs an NVIDIA GPU with its driver installed, \
             or pass --device cpu"
        ),
        Device::Cuda => Ok(()),
        Device::Cpu if dtype != Dtype::F32 => {
            bail!("--dtype {dtype}: the CPU backend computes in f32 only; drop --dtype or pass --dtype f32 (or --device cuda)")
        }
        Device::Cpu if unfused => bail!("--unfused selects the GPU baseline kernels; it needs --device cuda"),
        Device::Cpu => Ok(()),
    }
}

fn load(spec: &str) -> Result<Arc<GPT2Model>> {
    let path = resolve_model(spec)?;
    let model = load_model(&path).with_context(|| format!("loading model {}", path.display()))?;
    Ok(Arc::new(model))
}

/// How to build a backend beyond the device.
#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    /// Sequences the GPU buffers are sized for up front (they grow if a larger batch comes).
    pub max_batch: usize,
    /// GPU: the unfused baseline kernels.
    pub unfused: bool,
    /// GPU: the precision (see [`ModelArgs::dtype`]).
    pub dtype: Dtype,
    /// The project folder with specs/ and templates/ (default: [`super::project_root`]).
    pub root: Option<PathBuf>,
}

/// Build the GPU backend: weights uploaded, buffers allocated for `opts.max_batch` sequences.
pub fn make_gpu_backend(model: Arc<GPT2Model>, opts: &BackendOptions) -> Result<GpuBackend> {
    let root = super::project_root(opts.root.as_deref())?;
    let gpu = GpuBackend::with_root(&root, model, opts.max_batch.max(1), opts.unfused, opts.dtype)?;
    for n in gpu.notes() {
        eprintln!("note: {n}");
    }
    Ok(gpu)
}

/// Build the backend for `device`.
pub fn make_backend(
    device: Device,
    dtype: Dtype,
    model: Arc<GPT2Model>,
    opts: &BackendOptions,
) -> Result<Box<dyn Backend>> {
    check_device(device, dtype, opts.unfused)?;
    Ok(match device {
        Device::Cpu => Box::new(CpuBackend::new(model)),
        Device::Cuda => Box::new(make_gpu_backend(model, opts)?),
    })
}

fn prompt_ids(tok: &Tokenizer, ids: &Option<String>, prompt: &Option<String>) -> Result<Vec<u32>> {
    match (ids, prompt) {
        (Some(ids), _) => parse_ids(ids),
        (None, Some(text)) => {
            let ids = tok.encode(text);
            if ids.is_empty() {
                bail!("the prompt is empty: GPT-2 needs at least one token (try --ids 50256)");
            }
            Ok(ids)
        }
        (None, None) => bail!("give --prompt TEXT or --ids IDS"),
    }
}

/// `kernelforge tokenize`.
pub fn run_tokenize(args: &TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::gpt2();
    let mut out = std::io::stdout().lock();
    if let Some(ids) = &args.decode {
        let ids = parse_ids(ids)?;
        let text = tok.decode(&ids)?;
        if args.json {
            writeln!(out, "{}", json!({ "ids": ids, "text": text }))?;
        } else {
            writeln!(out, "{text}")?;
        }
        return Ok(());
    }
    let text = match args.text.as_deref() {
        Some("-") => std::io::read_to_string(std::io::stdin()).context("reading standard input")?,
        Some(t) => t.to_string(),
        None => bail!("give TEXT to encode or --decode IDS"),
    };
    let ids = tok.encode(&text);
    if args.json {
        let pieces = ids
            .iter()
            .map(|&i| tok.decode(&[i]))
            .collect::<crate::model::Result<Vec<_>>>()?;
        writeln!(out, "{}", json!({ "ids": ids, "tokens": pieces, "count": ids.len() }))?;
    } else {
        writeln!(out, "{}", join_ids(&ids))?;
    }
    Ok(())
}

/// `kernelforge forward`.
pub fn run_forward(args: &ForwardArgs) -> Result<()> {
    let device = args.target.device()?;
    let tok = Tokenizer::gpt2();
    let ids = prompt_ids(&tok, &args.ids, &args.prompt)?;
    let model = load(&args.target.model)?;
    let cfg: GPT2Config = model.config.clone();
    let mut backend = make_backend(device, args.target.dtype, model, &args.target.backend_options(1))?;
    let t0 = Instant::now();
    let logits = backend.prefill(std::slice::from_ref(&ids))?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let (t, v) = (logits.seq_len, logits.vocab);
    if let Some(p) = &args.logits_out {
        write_npy_f32(p, &[t, v], &logits.data)?;
    }
    let last = logits.last(0);
    let mut order: Vec<usize> = (0..v).collect();
    let k = 5.min(v);
    order.select_nth_unstable_by(k - 1, |&a, &b| last[b].total_cmp(&last[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]).then(a.cmp(&b)));
    let piece = |i: usize| tok.decode(&[i as u32]).unwrap_or_else(|_| format!("<{i}>"));
    let mut out = std::io::stdout().lock();
    if args.json {
        let top: Vec<_> = order
            .iter()
            .map(|&i| json!({ "id": i, "logit": last[i], "text": piece(i) }))
            .collect();
        let j = json!({
            "device": backend.name(),
            "tokens": ids,
            "shape": [t, v],
            "logits_out": args.logits_out,
            "last_top": top,
            "forward_ms": ms,
            "config": cfg,
        });
        writeln!(out, "{j}")?;
    } else {
        match &args.logits_out {
            Some(p) => writeln!(out, "logits [{t}, {v}] float32 -> {}", p.display())?,
            None => writeln!(out, "logits [{t}, {v}] (pass --logits-out FILE.npy to save them)")?,
        }
        writeln!(out, "most likely next tokens after the last position:")?;
        for &i in &order {
            writeln!(out, "  {i:>6} {:>10.4}  {:?}", last[i], piece(i))?;
        }
    }
    eprintln!("{}: forward of {t} tokens in {ms:.1} ms", backend.name());
    Ok(())
}

/// `kernelforge generate`.
pub fn run_generate(args: &GenerateArgs) -> Result<()> {
    let device = args.target.device()?;
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let tok = Tokenizer::gpt2();
    let ids = prompt_ids(&tok, &args.ids, &args.prompt)?;
    let sampling = if args.greedy {
        SamplingParams::greedy()
    } else {
        SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
        }
    };
    sampling.validate()?;
    let model = load(&args.target.model)?;
    let mut backend = make_backend(
        device,
        args.target.dtype,
        model,
        &args.target.backend_options(args.batch),
    )?;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        seed: args.seed,
        stop_at_eot: !args.ignore_eot,
    };
    let prompts = vec![ids.clone(); args.batch];
    let stream = !args.json && !args.print_ids && args.batch == 1;
    let mut stdout = std::io::stdout().lock();
    let mut dec = StreamDecoder::new();
    if stream {
        write!(stdout, "{}", tok.decode(&ids)?)?;
        stdout.flush()?;
    }
    let result = generate(backend.as_mut(), &prompts, &opts, &mut |_, id| {
        if stream {
            let piece = dec.push(&tok, id)?;
            let io = |e: std::io::Error| crate::model::ModelError::io("<stdout>", e);
            stdout.write_all(piece.as_bytes()).map_err(io)?;
            stdout.flush().map_err(io)?;
        }
        Ok(())
    })?;
    if stream {
        writeln!(stdout, "{}", dec.finish())?;
    } else if args.json {
        let outputs = result
            .tokens
            .iter()
            .map(|t| Ok(json!({ "ids": t, "text": tok.decode(t)? })))
            .collect::<Result<Vec<_>>>()?;
        let j = json!({
            "device": backend.name(),
            "prompt_ids": ids,
            "outputs": outputs,
            "stop": result.stop,
            "message": result.message,
            "sampling": sampling,
            "seed": args.seed,
            "stats": result.stats,
            "decode_tokens_per_s": result.stats.decode_tokens_per_s(),
            "kernels": backend.stats_note(),
        });
        writeln!(stdout, "{j}")?;
    } else if args.print_ids {
        for t in &result.tokens {
            writeln!(stdout, "{}", join_ids(t))?;
        }
    } else {
        let prompt_text = tok.decode(&ids)?;
        for (b, t) in result.tokens.iter().enumerate() {
            writeln!(stdout, "=== sequence {b} ===\n{prompt_text}{}", tok.decode(t)?)?;
        }
    }
    drop(stdout);
    if let Some(m) = &result.message {
        eprintln!("note: {m}");
    }
    match backend.stats_note() {
        Some(note) => eprintln!("{}, {note}", result.stats.summary()),
        None => eprintln!("{}", result.stats.summary()),
    }
    Ok(())
}

/// Deterministic pseudo-random token ids in `0..vocab` (the bench input).
fn bench_tokens(batch: usize, seq: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..batch)
        .map(|_| {
            (0..seq)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 33) % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn profile_table(rows: &[ProfileRow]) -> String {
    let mut table = vec![vec![
        "role".to_string(),
        "kernel".to_string(),
        "calls".to_string(),
        "total ms".to_string(),
        "avg ms".to_string(),
        "%".to_string(),
    ]];
    for r in rows {
        table.push(vec![
            r.role.clone(),
            r.kernel.clone(),
            r.calls.to_string(),
            format!("{:.3}", r.total_ms),
            format!("{:.4}", r.avg_ms),
            format!("{:.1}", r.percent),
        ]);
    }
    super::kernels::render_table(&table)
}

/// `kernelforge bench`: a warm-up, then the median of `--repeats` forward passes over
/// `--batch` × `--seq` random tokens (LM head on every position; on the GPU the logits stay on
/// the device), then `--generate` greedy decode steps after a prefill (each step's tokens
/// chosen by `decode_argmax`, on the GPU like greedy generation), then one profiled forward and
/// decode run for the per-kernel table (GPU only).
pub fn run_bench(args: &BenchArgs) -> Result<()> {
    let device = args.target.device()?;
    if args.batch == 0 || args.seq == 0 {
        bail!("--batch and --seq must be at least 1");
    }
    let model = load(&args.target.model)?;
    let cfg = model.config.clone();
    if args.seq > cfg.n_ctx {
        bail!(
            "--seq {} is longer than the model's context ({} tokens)",
            args.seq,
            cfg.n_ctx
        );
    }
    let steps = args.generate.min(cfg.n_ctx - 1);
    // The decode steps follow a prefill of up to --seq tokens that leaves room for them.
    let decode_prefill = args.seq.min(cfg.n_ctx - steps);
    let mut notes = Vec::new();
    if steps < args.generate {
        notes.push(format!(
            "--generate {} cut to {steps}: the context holds {} tokens",
            args.generate, cfg.n_ctx
        ));
    }
    if decode_prefill < args.seq && steps > 0 {
        notes.push(format!(
            "the decode steps follow a prefill of {decode_prefill} tokens (not {}) so that {steps} more fit the context ({})",
            args.seq, cfg.n_ctx
        ));
    }
    let tokens = bench_tokens(args.batch, args.seq, cfg.vocab_size);
    let decode_tokens: Vec<Vec<u32>> = tokens.iter().map(|t| t[..decode_prefill].to_vec()).collect();
    let repeats = args.repeats.max(1);
    let opts = args.target.backend_options(args.batch);
    let mut gpu = match device {
        Device::Cuda => Some(make_gpu_backend(model.clone(), &opts)?),
        Device::Cpu => None,
    };
    if let Some(g) = gpu.as_mut() {
        if args.no_cuda_graphs {
            g.set_decode_engine(crate::model::DecodeEngine::Launches)?;
        }
    }
    let mut cpu = CpuBackend::new(model.clone());
    let decode_ok = match &gpu {
        Some(g) => match g.decode_unavailable() {
            Some(why) => {
                notes.push(format!("decode not timed: {why}"));
                false
            }
            None => true,
        },
        None => true,
    };
    let steps = if decode_ok { steps } else { 0 };

    // One forward pass: on the GPU without copying the logits back.
    let forward = |gpu: &mut Option<GpuBackend>, cpu: &mut CpuBackend| -> Result<()> {
        match gpu {
            Some(g) => g.forward_on_device(&tokens)?,
            None => {
                cpu.prefill(&tokens)?;
            }
        }
        Ok(())
    };
    // A prefill, then `steps` greedy decode steps; returns the decode wall time in ms.
    let decode_run = |gpu: &mut Option<GpuBackend>, cpu: &mut CpuBackend, steps: usize| -> Result<f64> {
        let backend: &mut dyn Backend = match gpu {
            Some(g) => g,
            None => cpu,
        };
        let logits = backend.prefill_last(&decode_tokens)?;
        let mut next: Vec<u32> = (0..args.batch)
            .map(|b| crate::model::sampling::argmax(logits.last(b)))
            .collect::<Result<_, _>>()?;
        let t0 = Instant::now();
        for _ in 0..steps {
            next = backend.decode_argmax(&next)?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };

    // Warm-up: compiles and loads every kernel, touches every buffer.
    let t0 = Instant::now();
    forward(&mut gpu, &mut cpu)?;
    if steps > 0 {
        decode_run(&mut gpu, &mut cpu, steps.min(2))?;
    }
    let warmup_ms = t0.elapsed().as_secs_f64() * 1e3;

    let mut runs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        forward(&mut gpu, &mut cpu)?;
        runs.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let forward_ms = median(&mut runs.clone());
    let forward_tps = (args.batch * args.seq) as f64 / (forward_ms / 1e3);
    if let Some(g) = gpu.as_mut() {
        g.take_decode_gpu_time(); // forget the warm-up's steps
    }
    let decode_ms = if steps > 0 {
        decode_run(&mut gpu, &mut cpu, steps)?
    } else {
        0.0
    };
    // GPU time of a decode step (first kernel to last): the rest of ms_per_step is the host's.
    let decode_gpu_ms_per_step = gpu.as_mut().and_then(|g| {
        let (ms, n) = g.take_decode_gpu_time();
        (n > 0).then(|| ms / n as f64)
    });
    let decode_tps = if steps > 0 {
        (args.batch * steps) as f64 / (decode_ms / 1e3)
    } else {
        0.0
    };

    // Per-kernel profile (GPU): one forward, then the decode steps.
    let (mut prof_forward, mut prof_decode) = (Vec::new(), Vec::new());
    if let Some(g) = gpu.as_mut() {
        g.set_profiling(true);
        g.forward_on_device(&tokens)?;
        prof_forward = g.take_profile()?;
        if steps > 0 {
            let logits = g.prefill_last(&decode_tokens)?;
            g.take_profile()?; // the prefill is not part of the decode profile
            let mut next: Vec<u32> = (0..args.batch)
                .map(|b| crate::model::sampling::argmax(logits.last(b)))
                .collect::<Result<_, _>>()?;
            for _ in 0..steps {
                next = g.decode_argmax(&next)?;
            }
            prof_decode = g.take_profile()?;
        }
        g.set_profiling(false);
    }

    let decode_graphs = gpu.as_ref().is_some_and(|g| g.decode_graphs());
    let (device_name, tuned, choices, backend_notes) = match &gpu {
        Some(g) => (
            format!(
                "{} ({})",
                g.gpu().info.name,
                if g.unfused() { "unfused" } else { "fused" }
            ),
            Some(g.tuned_kernels()),
            g.kernel_choices(),
            g.notes(),
        ),
        None => ("cpu".to_string(), None, Vec::new(), Vec::new()),
    };
    notes.extend(backend_notes);
    let mut out = std::io::stdout().lock();
    if args.json {
        let j = json!({
            "device": device.as_str(),
            "device_name": device_name,
            "unfused": args.target.unfused,
            "model": args.target.model,
            "config": cfg,
            "batch": args.batch,
            "seq": args.seq,
            "warmup_ms": warmup_ms,
            "forward": {
                "median_ms": forward_ms,
                "runs_ms": runs,
                "tokens": args.batch * args.seq,
                "tokens_per_s": forward_tps,
            },
            "decode": {
                "steps": steps,
                "prefill_tokens": decode_prefill,
                "total_ms": decode_ms,
                "ms_per_step": if steps > 0 { decode_ms / steps as f64 } else { 0.0 },
                "tokens_per_s": decode_tps,
                "cuda_graphs": decode_graphs,
                "gpu_ms_per_step": decode_gpu_ms_per_step,
            },
            "tuned_kernels": tuned.map(|(t, n)| json!({ "tuned": t, "total": n })),
            "kernels": choices
                .iter()
                .map(|(role, kernel, choice, shape)| json!({ "role": role, "kernel": kernel, "choice": choice, "shape": shape }))
                .collect::<Vec<_>>(),
            "profile": { "forward": prof_forward, "decode": prof_decode },
            "notes": notes,
        });
        writeln!(out, "{j}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{device_name}: {} (L={}, NH={}, C={}), batch {} x seq {}",
        args.target.model, cfg.n_layer, cfg.n_head, cfg.n_embd, args.batch, args.seq
    )?;
    writeln!(out, "warm-up (compile + first runs): {warmup_ms:.1} ms")?;
    writeln!(
        out,
        "forward: median {forward_ms:.2} ms of {repeats} ({forward_tps:.0} tokens/s)"
    )?;
    if steps > 0 {
        writeln!(
            out,
            "decode: {steps} steps after a {decode_prefill}-token prefill in {decode_ms:.1} ms ({:.3} ms/step{}, {decode_tps:.1} tokens/s{})",
            decode_ms / steps as f64,
            decode_gpu_ms_per_step.map_or(String::new(), |g| format!(" of which {g:.3} ms on the GPU")),
            if decode_graphs { ", CUDA graphs" } else { "" }
        )?;
    }
    if let Some((t, n)) = tuned {
        writeln!(out, "kernels: {t}/{n} tuned")?;
    }
    if !prof_forward.is_empty() {
        writeln!(out, "\nforward pass, per kernel:\n{}", profile_table(&prof_forward))?;
    }
    if !prof_decode.is_empty() {
        writeln!(
            out,
            "\n{steps} decode steps, per kernel:\n{}",
            profile_table(&prof_decode)
        )?;
    }
    drop(out);
    for n in notes {
        eprintln!("note: {n}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::npy::read_npy_f32;
    use crate::model::weights::{write_hf_folder, write_llmc, GPT2Weights, LlmcVersion};

    #[test]
    fn id_lists() {
        assert_eq!(parse_ids("15496,11, 995").unwrap(), vec![15496, 11, 995]);
        assert_eq!(parse_ids("1 2\t3").unwrap(), vec![1, 2, 3]);
        assert!(parse_ids("1,x").unwrap_err().to_string().contains("`x`"));
        assert!(parse_ids(" , ").is_err());
    }

    #[test]
    fn dtypes_each_device_cannot_run_are_refused_with_the_fix() {
        for dtype in [Dtype::Tf32, Dtype::F16, Dtype::Bf16] {
            let e = check_device(Device::Cpu, dtype, false).unwrap_err().to_string();
            assert!(
                e.contains("f32 only") && e.contains("--dtype f32") && e.contains(dtype.as_str()),
                "{e}"
            );
        }
        assert!(check_device(Device::Cpu, Dtype::F32, false).is_ok());
    }

    fn cpu_target(model: &str) -> ModelArgs {
        ModelArgs {
            model: model.to_string(),
            device: Some(Device::Cpu),
            unfused: false,
            dtype: Dtype::F32,
            root: None,
        }
    }

    #[test]
    fn forward_and_generate_commands_on_a_tiny_model() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(2, 2, 32, 64, 50257).unwrap();
        let w = GPT2Weights::random(&cfg, 5);
        let bin = dir.path().join("m.bin");
        let hf = dir.path().join("hf");
        write_llmc(&bin, &cfg, &w, LlmcVersion::F32).unwrap();
        write_hf_folder(&hf, &cfg, &w).unwrap();
        let mut outs = Vec::new();
        for model in [&bin, &hf] {
            let out = dir.path().join(format!("{}.npy", outs.len()));
            run_forward(&ForwardArgs {
                target: cpu_target(&model.display().to_string()),
                ids: Some("15496,11,995".into()),
                prompt: None,
                logits_out: Some(out.clone()),
                json: true,
            })
            .unwrap();
            let (shape, data) = read_npy_f32(&out).unwrap();
            assert_eq!(shape, vec![3, 50257]);
            outs.push(data);
        }
        assert_eq!(outs[0], outs[1]);
        let gen = GenerateArgs {
            target: cpu_target(&bin.display().to_string()),
            prompt: Some("Hello".into()),
            ids: None,
            max_new_tokens: 3,
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            batch: 2,
            print_ids: true,
            ignore_eot: false,
            json: false,
        };
        run_generate(&gen).unwrap();
        if !crate::gpu::device::driver_present() {
            let cuda = GenerateArgs {
                target: ModelArgs {
                    device: Some(Device::Cuda),
                    ..gen.target.clone()
                },
                ..gen.clone()
            };
            let msg = run_generate(&cuda).unwrap_err().to_string();
            assert!(msg.contains("no CUDA driver") && msg.contains("--device cpu"), "{msg}");
        }
        let unfused_cpu = GenerateArgs {
            target: ModelArgs {
                unfused: true,
                ..gen.target.clone()
            },
            ..gen.clone()
        };
        assert!(run_generate(&unfused_cpu)
            .unwrap_err()
            .to_string()
            .contains("--unfused"));
        let bad = GenerateArgs { batch: 0, ..gen };
        assert!(run_generate(&bad).is_err());
    }

    #[test]
    fn bench_runs_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(1, 2, 32, 16, 100).unwrap();
        let bin = dir.path().join("m.bin");
        write_llmc(&bin, &cfg, &GPT2Weights::random(&cfg, 3), LlmcVersion::F32).unwrap();
        let args = BenchArgs {
            target: cpu_target(&bin.display().to_string()),
            batch: 2,
            seq: 12,
            generate: 8, // 12 + 8 > 16: the decode prefill shrinks to 8 tokens
            repeats: 2,
            no_cuda_graphs: false,
            json: true,
        };
        run_bench(&args).unwrap();
        run_bench(&BenchArgs {
            json: false,
            ..args.clone()
        })
        .unwrap();
        let too_long = BenchArgs { seq: 17, ..args };
        assert!(run_bench(&too_long).unwrap_err().to_string().contains("context"));
    }
}
