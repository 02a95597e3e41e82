//! The sampling flags `generate` and `bench` share: greedy, temperature, top-k, top-p, seed.

use anyhow::{bail, Result};

use crate::model::generate::Draw;
use crate::model::sampling::SamplingParams;

/// How the next tokens are drawn (on the GPU on every decode engine; see `ops/draw.rs`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Always take the most likely token.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub greedy: bool,
    /// Sampling temperature: the logits are divided by it (0 = greedy). [generate: 1; bench: 0]
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens, then apply top-p (0 = off; above the vocabulary:
    /// every token).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Keep the smallest set of the most likely tokens whose probability reaches P (1 = off).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Random seed. The draw of sequence b at position p is keyed by (seed, b, p), so a seed
    /// gives the same tokens on every decode engine, GPU count and batch slicing.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The parameters asked for, over `default` (what the command does with no flag), checked;
    /// with a note when top-k is above the `vocab` tokens there are (then it keeps them all).
    pub fn draw(&self, default: SamplingParams, vocab: usize) -> Result<(Draw, Option<String>)> {
        let asked = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        let mut params = if self.greedy {
            SamplingParams::greedy()
        } else if asked {
            SamplingParams {
                temperature: self.temperature.unwrap_or(1.0),
                top_k: self.top_k.unwrap_or(0),
                top_p: self.top_p.unwrap_or(1.0),
            }
        } else {
            default
        };
        if let Err(e) = params.validate() {
            bail!("--temperature / --top-p: {e}");
        }
        let mut note = None;
        if params.top_k > vocab {
            note = Some(format!(
                "--top-k {} is above the vocabulary ({vocab} tokens): keeping every token",
                params.top_k
            ));
            params.top_k = 0;
        }
        let draw = Draw {
            params,
            seed: self.seed,
            first_sequence: 0,
        };
        Ok((draw, note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(temperature: Option<f32>, top_k: Option<usize>, top_p: Option<f32>) -> SamplingArgs {
        SamplingArgs {
            greedy: false,
            temperature,
            top_k,
            top_p,
            seed: 1,
        }
    }

    #[test]
    fn defaults_flags_clamps_and_refusals() {
        let (d, note) = args(None, None, None).draw(SamplingParams::greedy(), 100).unwrap();
        assert!(d.params.is_greedy() && note.is_none());
        let (d, _) = args(None, Some(40), None).draw(SamplingParams::greedy(), 100).unwrap();
        assert_eq!((d.params.temperature, d.params.top_k, d.params.top_p), (1.0, 40, 1.0));
        let (d, note) = args(Some(0.8), Some(1000), None)
            .draw(SamplingParams::default(), 100)
            .unwrap();
        assert_eq!(d.params.top_k, 0);
        assert!(note.unwrap().contains("above the vocabulary (100 tokens)"));
        let e = args(Some(-1.0), None, None)
            .draw(SamplingParams::default(), 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("temperature") && e.contains("-1"), "{e}");
        let e = args(None, None, Some(1.5))
            .draw(SamplingParams::default(), 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("top-p") && e.contains("1.5"), "{e}");
    }
}
