//! `kernelforge generate`: text from a prompt with the KV cache, streamed token by token (or
//! ids / JSON), with a stats line at the end.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;

use super::fits::{check_batch_fits, CpuTokens, OpeningGpus};
use super::sampling::SamplingArgs;
use super::{decode_engine_for, join_ids, load, make_backend, prompt_ids, BackendOptions, EngineArgs, ModelArgs};
use crate::model::generate::{generate, GenerateOptions};
use crate::model::sampling::SamplingParams;
use crate::model::tokenizer::{StreamDecoder, Tokenizer};

/// `kernelforge generate`: stream text from a prompt.
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt text.
    #[arg(long, value_name = "TEXT", required_unless_present = "ids", conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_name = "IDS")]
    pub ids: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
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

/// `kernelforge generate`.
pub fn run_generate(args: &GenerateArgs) -> Result<()> {
    let device = args.target.device()?;
    let engine = decode_engine_for(device, args.engine.decode_engine)?;
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let backend_options = BackendOptions {
        decode_engine: engine,
        ..args.target.backend_options(args.batch)
    };
    // The GPUs open on a thread of their own (a few hundred milliseconds) while the tokenizer is
    // built (its tables, ~50 ms) and the checkpoint loads.
    let opening_gpus = OpeningGpus::start(device, &backend_options);
    let tok = Tokenizer::gpt2();
    let ids = prompt_ids(&tok, &args.ids, &args.prompt)?;
    // Checked before the model loads (the vocabulary is GPT-2's until then).
    args.sampling.draw(SamplingParams::default(), usize::MAX)?;
    let loading = Instant::now();
    let model = load(&args.target.model)?;
    let load_ms = loading.elapsed().as_secs_f64() * 1e3;
    let (draw, note) = args.sampling.draw(SamplingParams::default(), model.config.vocab_size)?;
    if let Some(note) = note {
        eprintln!("note: {note}");
    }
    // Refused before anything is allocated when the batch does not fit (on the CPU: the prompt's
    // prefill, keeping the last position's logits, and the cache up to the last new token).
    let cpu_tokens = CpuTokens {
        cached: (ids.len() + args.max_new_tokens).min(model.config.n_ctx),
        step: ids.len(),
        logits: 1,
    };
    let flag = format!("--batch {}", args.batch);
    let opening = Instant::now();
    let checked = check_batch_fits(&flag, device, &model.config, &backend_options, cpu_tokens, opening_gpus)?;
    let mut backend = make_backend(device, args.target.dtype, model, &backend_options)?;
    drop(checked); // the contexts the check opened, kept until the backend holds them
    let open_ms = opening.elapsed().as_secs_f64() * 1e3;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: draw.params,
        seed: draw.seed,
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
    let mut result = generate(backend.as_mut(), &prompts, &opts, &mut |_, id| {
        if stream {
            let piece = dec.push(&tok, id)?;
            let io = |e: std::io::Error| crate::model::ModelError::io("<stdout>", e);
            stdout.write_all(piece.as_bytes()).map_err(io)?;
            stdout.flush().map_err(io)?;
        }
        Ok(())
    })?;
    (result.stats.load_ms, result.stats.open_ms) = (load_ms, open_ms);
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
            "sampling": draw.params,
            "seed": draw.seed,
            "stats": result.stats,
            "decode_tokens_per_s": result.stats.decode_tokens_per_s(),
            "kernels": backend.stats_note(),
            "decode_engine": backend.decode_engine(),
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
    let engine = backend
        .decode_engine()
        .map_or(String::new(), |e| format!(", decode engine {e}"));
    match backend.stats_note() {
        Some(note) => eprintln!("{}, {note}{engine}", result.stats.summary()),
        None => eprintln!("{}{engine}", result.stats.summary()),
    }
    Ok(())
}
