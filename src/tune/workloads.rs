//! The exact op shapes a GPT-2 forward pass and decode step use, derived from the model's
//! dimensions (no checkpoint needed for the named sizes).

use crate::ops::{Epilogue, Mask, Shape};

/// The dimensions of a GPT-2 that fix its kernel shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelDims {
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
    pub n_ctx: i64,
    pub vocab_size: i64,
    /// The LM head's N: the vocabulary rounded up to a multiple of 64.
    pub padded_vocab: i64,
}

impl ModelDims {
    /// gpt2, gpt2-medium, gpt2-large, gpt2-xl.
    pub fn named(name: &str) -> Option<ModelDims> {
        let (n_layer, n_head, n_embd) = match name {
            "gpt2" => (12, 12, 768),
            "gpt2-medium" => (24, 16, 1024),
            "gpt2-large" => (36, 20, 1280),
            "gpt2-xl" => (48, 25, 1600),
            _ => return None,
        };
        Some(ModelDims::new(n_layer, n_head, n_embd, 1024, 50257))
    }

    pub fn new(n_layer: i64, n_head: i64, n_embd: i64, n_ctx: i64, vocab_size: i64) -> ModelDims {
        ModelDims {
            n_layer,
            n_head,
            n_embd,
            n_ctx,
            vocab_size,
            padded_vocab: (vocab_size + 63) / 64 * 64,
        }
    }
}

/// One kernel call shape of the model, and how often a forward pass makes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// What it is in the model (`fc (bias+GELU)`), for tables.
    pub role: String,
    pub op: &'static str,
    pub epilogue: Epilogue,
    pub mask: Mask,
    pub shape: Shape,
    /// Calls per forward pass (per layer ops × layers).
    pub calls: i64,
}

fn shape(pairs: &[(&str, i64)]) -> Shape {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Every distinct kernel shape of a forward pass over `batch` sequences of `seq` tokens
/// (prefill when seq > 1, a decode step when seq = 1).
pub fn forward_workloads(dims: &ModelDims, batch: i64, seq: i64) -> Vec<Workload> {
    let (c, nh, l) = (dims.n_embd, dims.n_head, dims.n_layer);
    let m = batch * seq;
    let mm = |role: &str, epilogue: Epilogue, n: i64, k: i64, calls: i64| Workload {
        role: role.to_string(),
        op: "matmul",
        epilogue,
        mask: Mask::None,
        shape: shape(&[("M", m), ("N", n), ("K", k), ("T", seq), ("n_head", nh)]),
        calls,
    };
    let mut out = vec![
        Workload {
            role: "embedding".into(),
            op: "encoder",
            epilogue: Epilogue::None,
            mask: Mask::None,
            shape: shape(&[
                ("B", batch),
                ("T", seq),
                ("C", c),
                ("pos_offset", 0),
                ("V", dims.vocab_size),
                ("max_T", dims.n_ctx),
            ]),
            calls: 1,
        },
        Workload {
            role: "layernorm".into(),
            op: "layernorm",
            epilogue: Epilogue::None,
            mask: Mask::None,
            shape: shape(&[("N", m), ("C", c)]),
            calls: 2 * l + 1,
        },
        mm("qkv projection (QKV split)", Epilogue::Qkv, 3 * c, c, l),
        mm("attention output (bias+residual)", Epilogue::BiasResidual, c, c, l),
        mm("fc (bias+GELU)", Epilogue::BiasGelu, 4 * c, c, l),
        mm("fc projection (bias+residual)", Epilogue::BiasResidual, c, 4 * c, l),
        mm("LM head (tied wte)", Epilogue::None, dims.padded_vocab, c, 1),
    ];
    if seq > 1 {
        out.insert(
            3,
            Workload {
                role: "attention (causal)".into(),
                op: "attention",
                epilogue: Epilogue::None,
                mask: Mask::Causal,
                shape: shape(&[("B", batch), ("NH", nh), ("T", seq), ("HS", c / nh), ("window", 0)]),
                calls: l,
            },
        );
    }
    out
}

/// The workloads of a model at every (batch, seq) asked for, plus the decode step (seq = 1)
/// for each batch, without duplicates.
pub fn model_workloads(dims: &ModelDims, batches: &[i64], seqs: &[i64]) -> Vec<Workload> {
    let mut out: Vec<Workload> = Vec::new();
    for &b in batches {
        for &t in seqs.iter().chain(std::iter::once(&1)) {
            for w in forward_workloads(dims, b, t) {
                if !out
                    .iter()
                    .any(|o| o.op == w.op && o.epilogue == w.epilogue && o.mask == w.mask && o.shape == w.shape)
                {
                    out.push(w);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_forward_shapes() {
        let dims = ModelDims::named("gpt2").unwrap();
        assert_eq!(dims.padded_vocab, 50304);
        let w = forward_workloads(&dims, 8, 1024);
        let mm: Vec<_> = w
            .iter()
            .filter(|w| w.op == "matmul")
            .map(|w| (w.shape["N"], w.shape["K"], w.epilogue))
            .collect();
        assert_eq!(
            mm,
            vec![
                (2304, 768, Epilogue::Qkv),
                (768, 768, Epilogue::BiasResidual),
                (3072, 768, Epilogue::BiasGelu),
                (768, 3072, Epilogue::BiasResidual),
                (50304, 768, Epilogue::None)
            ]
        );
        assert!(w.iter().filter(|w| w.op == "matmul").all(|w| w.shape["M"] == 8192));
        let att = w.iter().find(|w| w.op == "attention").unwrap();
        assert_eq!(
            (att.shape["B"], att.shape["NH"], att.shape["T"], att.shape["HS"]),
            (8, 12, 1024, 64)
        );
        assert_eq!(w.iter().find(|w| w.op == "layernorm").unwrap().calls, 25);
    }

    #[test]
    fn decode_step_has_no_prefill_attention_and_no_duplicates() {
        let dims = ModelDims::named("gpt2-xl").unwrap();
        let w = forward_workloads(&dims, 1, 1);
        assert!(w.iter().all(|w| w.op != "attention"));
        assert!(w.iter().filter(|w| w.op == "matmul").all(|w| w.shape["M"] == 1));
        let all = model_workloads(&dims, &[1, 8], &[1024]);
        assert_eq!(
            all.len(),
            2 * (forward_workloads(&dims, 1, 1024).len() + forward_workloads(&dims, 1, 1).len())
        );
        assert!(ModelDims::named("gpt3").is_none());
    }
}
