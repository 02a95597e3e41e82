//! `kernelforge tokenize`: GPT-2 BPE ids of a text, and text of ids.

use std::io::Write;

use anyhow::{bail, Context, Result};
use serde_json::json;

use super::{join_ids, parse_ids};
use crate::model::tokenizer::Tokenizer;

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
