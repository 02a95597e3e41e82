//! GPT-2 hyper-parameters: the four released sizes as presets, reading a Hugging Face
//! `config.json`, and the padded vocabulary (a multiple of 64) that the LM head's N uses.

use std::path::Path;

use serde_json::{json, Value};

use super::error::{ModelError, Result};

/// GPT-2's real vocabulary size.
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's context length.
pub const GPT2_CTX: usize = 1024;

/// Round a vocabulary size up to a multiple of 64 (llm.c's `padded_vocab_size`; 50257 → 50304).
pub fn pad_vocab(vocab_size: usize) -> usize {
    vocab_size.div_ceil(64) * 64
}

/// Shape of a GPT-2 model.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GPT2Config {
    /// Number of transformer blocks (L).
    pub n_layer: usize,
    /// Number of attention heads (NH).
    pub n_head: usize,
    /// Channels (C); head dim = C / NH.
    pub n_embd: usize,
    /// Maximum sequence length (`n_positions`, llm.c `maxT`).
    pub n_ctx: usize,
    /// Real vocabulary size (V), 50257 for GPT-2.
    pub vocab_size: usize,
    /// Vocabulary padded to a multiple of 64 (Vp): the N of the LM-head matmul.
    pub padded_vocab_size: usize,
}

/// The preset names accepted by [`GPT2Config::preset`].
pub const PRESET_NAMES: [&str; 4] = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"];

impl GPT2Config {
    /// The dimensions op shapes derive from (the tuner's workloads, the model's kernels).
    pub fn dims(&self) -> crate::ops::model_dims::ModelDims {
        crate::ops::model_dims::ModelDims {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            n_ctx: self.n_ctx,
            vocab_size: self.vocab_size,
            padded_vocab_size: self.padded_vocab_size,
        }
    }

    /// A validated config with `padded_vocab_size = pad_vocab(vocab_size)`.
    pub fn new(n_layer: usize, n_head: usize, n_embd: usize, n_ctx: usize, vocab_size: usize) -> Result<Self> {
        let cfg = GPT2Config {
            n_layer,
            n_head,
            n_embd,
            n_ctx,
            vocab_size,
            padded_vocab_size: pad_vocab(vocab_size),
        };
        cfg.validate("GPT2Config::new")?;
        Ok(cfg)
    }

    /// Check the numbers are usable: all positive, `n_embd` divisible by `n_head`, and
    /// `padded_vocab_size >= vocab_size`. `context` names where the config came from.
    pub fn validate(&self, context: &str) -> Result<()> {
        let bad = |message: String| {
            Err(ModelError::Config {
                context: context.to_string(),
                message,
            })
        };
        for (name, v) in [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("n_ctx", self.n_ctx),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "n_embd {} is not divisible by n_head {}",
                self.n_embd, self.n_head
            ));
        }
        if self.padded_vocab_size < self.vocab_size {
            return bad(format!(
                "padded_vocab_size {} is smaller than vocab_size {}",
                self.padded_vocab_size, self.vocab_size
            ));
        }
        Ok(())
    }

    /// GPT-2 small (124M): L=12, NH=12, C=768.
    pub fn gpt2() -> Self {
        Self::released(12, 12, 768)
    }
    /// GPT-2 medium (355M): L=24, NH=16, C=1024.
    pub fn gpt2_medium() -> Self {
        Self::released(24, 16, 1024)
    }
    /// GPT-2 large (774M): L=36, NH=20, C=1280.
    pub fn gpt2_large() -> Self {
        Self::released(36, 20, 1280)
    }
    /// GPT-2 XL (1.5B): L=48, NH=25, C=1600.
    pub fn gpt2_xl() -> Self {
        Self::released(48, 25, 1600)
    }

    fn released(n_layer: usize, n_head: usize, n_embd: usize) -> Self {
        GPT2Config {
            n_layer,
            n_head,
            n_embd,
            n_ctx: GPT2_CTX,
            vocab_size: GPT2_VOCAB,
            padded_vocab_size: pad_vocab(GPT2_VOCAB),
        }
    }

    /// A preset by name: `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` (also with `_`, and
    /// `gpt2-small`, `124M`, `355M`, `774M`, `1558M`).
    pub fn preset(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().replace('_', "-").as_str() {
            "gpt2" | "gpt2-small" | "124m" => Some(Self::gpt2()),
            "gpt2-medium" | "355m" => Some(Self::gpt2_medium()),
            "gpt2-large" | "774m" => Some(Self::gpt2_large()),
            "gpt2-xl" | "1558m" | "1.5b" => Some(Self::gpt2_xl()),
            _ => None,
        }
    }

    /// Head dimension C / NH (64 for every released size).
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Parameter count with the real vocabulary (tied LM head counted once).
    pub fn num_params(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        self.vocab_size * c + self.n_ctx * c + l * (12 * c * c + 13 * c) + 2 * c
    }

    /// Parse a Hugging Face GPT-2 `config.json` text. Reads `n_layer`, `n_head`, `n_embd`,
    /// `n_positions` (or `n_ctx`), `vocab_size`; `context` names the source in errors.
    pub fn from_hf_json_str(text: &str, context: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| ModelError::Config {
            context: context.to_string(),
            message: format!("invalid JSON: {e}"),
        })?;
        Self::from_hf_value(&v, context)
    }

    /// Read a Hugging Face `config.json` file.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_hf_json_str(&text, &path.display().to_string())
    }

    fn from_hf_value(v: &Value, context: &str) -> Result<Self> {
        let get = |keys: &[&str]| -> Result<usize> {
            for k in keys {
                if let Some(x) = v.get(*k) {
                    return x.as_u64().map(|n| n as usize).ok_or_else(|| ModelError::Config {
                        context: context.to_string(),
                        message: format!("`{k}` is not a non-negative integer: {x}"),
                    });
                }
            }
            Err(ModelError::Config {
                context: context.to_string(),
                message: format!("missing key `{}`", keys.join("` or `")),
            })
        };
        if let Some(act) = v.get("activation_function").and_then(Value::as_str) {
            if !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu") {
                return Err(ModelError::Config {
                    context: context.to_string(),
                    message: format!("activation_function `{act}` is not supported (GPT-2 uses gelu_new)"),
                });
            }
        }
        let vocab_size = get(&["vocab_size"])?;
        let cfg = GPT2Config {
            n_layer: get(&["n_layer", "num_hidden_layers"])?,
            n_head: get(&["n_head", "num_attention_heads"])?,
            n_embd: get(&["n_embd", "hidden_size"])?,
            n_ctx: get(&["n_positions", "n_ctx", "max_position_embeddings"])?,
            vocab_size,
            padded_vocab_size: pad_vocab(vocab_size),
        };
        cfg.validate(context)?;
        Ok(cfg)
    }

    /// The `config.json` that `save_pretrained` writes for this shape (GPT2LMHeadModel).
    pub fn to_hf_json(&self) -> Value {
        json!({
            "activation_function": "gelu_new",
            "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": 0.1,
            "bos_token_id": 50256,
            "embd_pdrop": 0.1,
            "eos_token_id": 50256,
            "initializer_range": 0.02,
            "layer_norm_epsilon": 1e-5,
            "model_type": "gpt2",
            "n_ctx": self.n_ctx,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_inner": null,
            "n_layer": self.n_layer,
            "n_positions": self.n_ctx,
            "reorder_and_upcast_attn": false,
            "resid_pdrop": 0.1,
            "scale_attn_by_inverse_layer_idx": false,
            "scale_attn_weights": true,
            "summary_activation": null,
            "summary_first_dropout": 0.1,
            "summary_proj_to_labels": true,
            "summary_type": "cls_index",
            "summary_use_proj": true,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
            "use_cache": true,
            "vocab_size": self.vocab_size
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_padding() {
        assert_eq!(pad_vocab(50257), 50304);
        assert_eq!(pad_vocab(64), 64);
        assert_eq!(pad_vocab(100), 128);
        let g = GPT2Config::gpt2();
        assert_eq!(g.padded_vocab_size, 50304);
        assert_eq!(g.head_dim(), 64);
        assert_eq!(g.num_params(), 124_439_808);
        for n in PRESET_NAMES {
            let c = GPT2Config::preset(n).unwrap();
            assert_eq!(c.head_dim(), 64, "{n}");
        }
        assert!(GPT2Config::preset("gpt3").is_none());
        // the dimensions the tuner's tests use in place of the presets
        use crate::ops::model_dims::ModelDims;
        assert_eq!(g.dims(), ModelDims::released_gpt2(12, 12, 768));
        assert_eq!(GPT2Config::gpt2_xl().dims(), ModelDims::released_gpt2(48, 25, 1600));
    }

    #[test]
    fn hf_json_round_trip_and_errors() {
        let c = GPT2Config::new(2, 2, 32, 64, 100).unwrap();
        let text = c.to_hf_json().to_string();
        assert_eq!(GPT2Config::from_hf_json_str(&text, "t").unwrap(), c);
        let err = GPT2Config::from_hf_json_str(r#"{"n_layer":2}"#, "cfg.json").unwrap_err();
        assert!(err.to_string().contains("cfg.json"), "{err}");
        let err = GPT2Config::new(2, 3, 32, 64, 100).unwrap_err();
        assert!(err.to_string().contains("not divisible"), "{err}");
    }
}
