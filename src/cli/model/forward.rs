//! `kernelforge forward`: the logits of every position of a prompt (or of a batch of equal-length
//! id sequences), the top next tokens, and optionally the whole logits as a .npy file.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;

use super::{load, make_backend, parse_ids, prompt_ids, ModelArgs};
use crate::model::config::GPT2Config;
use crate::model::npy::write_npy_f32;
use crate::model::tokenizer::Tokenizer;

/// `kernelforge forward`: logits for every position.
#[derive(clap::Args, Debug, Clone)]
pub struct ForwardArgs {
    #[command(flatten)]
    pub target: ModelArgs,
    /// Input token ids, comma-separated (e.g. 15496,11,995). Repeat --ids for a batch of
    /// sequences (all of one length), one forward pass over all of them; with --devices the
    /// batch is sliced across the GPUs.
    #[arg(
        long,
        value_name = "IDS",
        required_unless_present = "prompt",
        conflicts_with = "prompt"
    )]
    pub ids: Vec<String>,
    /// Input text, tokenized with the GPT-2 BPE.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Write the logits to this .npy file, float32: [T, vocab] for one sequence, [B, T, vocab]
    /// for B sequences.
    #[arg(long, value_name = "PATH")]
    pub logits_out: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `kernelforge forward`.
pub fn run_forward(args: &ForwardArgs) -> Result<()> {
    let device = args.target.device()?;
    let tok = Tokenizer::gpt2();
    let sequences = input_sequences(&tok, &args.ids, &args.prompt)?;
    let model = load(&args.target.model)?;
    let cfg: GPT2Config = model.config.clone();
    let batch = sequences.len();
    let mut backend = make_backend(device, args.target.dtype, model, &args.target.backend_options(batch))?;
    let t0 = Instant::now();
    let logits = backend.prefill(&sequences)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let (t, v) = (logits.seq_len, logits.vocab);
    let shape = if batch == 1 { vec![t, v] } else { vec![batch, t, v] };
    if let Some(p) = &args.logits_out {
        write_npy_f32(p, &shape, &logits.data)?;
    }
    let piece = |i: usize| tok.decode(&[i as u32]).unwrap_or_else(|_| format!("<{i}>"));
    let mut out = std::io::stdout().lock();
    let shape_text = shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    if args.json {
        let top = |b: usize| -> Vec<serde_json::Value> {
            let last = logits.last(b);
            top_tokens(last)
                .iter()
                .map(|&i| json!({ "id": i, "logit": last[i], "text": piece(i) }))
                .collect()
        };
        let mut j = json!({
            "device": backend.name(),
            "shape": shape,
            "logits_out": args.logits_out,
            "forward_ms": ms,
            "config": cfg,
        });
        if batch == 1 {
            j["tokens"] = json!(sequences[0]);
            j["last_top"] = json!(top(0));
        } else {
            j["sequences"] = (0..batch)
                .map(|b| json!({ "tokens": sequences[b], "last_top": top(b) }))
                .collect();
        }
        writeln!(out, "{j}")?;
    } else {
        match &args.logits_out {
            Some(p) => writeln!(out, "logits [{shape_text}] float32 -> {}", p.display())?,
            None => writeln!(out, "logits [{shape_text}] (pass --logits-out FILE.npy to save them)")?,
        }
        for b in 0..batch {
            let last = logits.last(b);
            let which = if batch == 1 {
                String::new()
            } else {
                format!(" of sequence {b}")
            };
            writeln!(out, "most likely next tokens after the last position{which}:")?;
            for i in top_tokens(last) {
                writeln!(out, "  {i:>6} {:>10.4}  {:?}", last[i], piece(i))?;
            }
        }
    }
    eprintln!("{}: forward of {batch} x {t} tokens in {ms:.1} ms", backend.name());
    Ok(())
}

/// The sequences to run: each --ids, or the --prompt; all of one length.
fn input_sequences(tok: &Tokenizer, ids: &[String], prompt: &Option<String>) -> Result<Vec<Vec<u32>>> {
    let sequences = if ids.is_empty() {
        vec![prompt_ids(tok, &None, prompt)?]
    } else {
        ids.iter().map(|s| parse_ids(s)).collect::<Result<Vec<_>>>()?
    };
    if let Some(b) = sequences.iter().position(|s| s.len() != sequences[0].len()) {
        bail!(
            "--ids: sequence {b} has {} tokens but sequence 0 has {}; a batch runs sequences of one length \
             (pad them, or run them in separate calls)",
            sequences[b].len(),
            sequences[0].len()
        );
    }
    Ok(sequences)
}

/// The 5 largest logits, largest first (the lower id first on ties).
fn top_tokens(last: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..last.len()).collect();
    let k = 5.min(last.len());
    order.select_nth_unstable_by(k - 1, |&a, &b| last[b].total_cmp(&last[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]).then(a.cmp(&b)));
    order
}
