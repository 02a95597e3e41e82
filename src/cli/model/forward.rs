//! `kernelforge forward`: the logits of every position of a prompt, the top next tokens, and
//! optionally the whole `[T, vocab]` logits as a .npy file.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use super::{load, make_backend, prompt_ids, ModelArgs};
use crate::model::config::GPT2Config;
use crate::model::npy::write_npy_f32;
use crate::model::tokenizer::Tokenizer;

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
