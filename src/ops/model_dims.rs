//! The dimensions of a GPT-2-shaped model that op shapes are derived from, below both the
//! tuner (which derives the workloads to tune from them, `tune::workloads`) and the model
//! (which selects kernels for the same shapes): neither has to reach into the other.

/// What the op shapes of a forward pass or a decode step depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelDims {
    /// Transformer blocks (L).
    pub n_layer: usize,
    /// Attention heads (NH).
    pub n_head: usize,
    /// Channels (C); a head has C / NH.
    pub n_embd: usize,
    /// The longest sequence (cache capacity).
    pub n_ctx: usize,
    /// Real vocabulary (V).
    pub vocab_size: usize,
    /// Vocabulary padded for the LM-head matmul (its N).
    pub padded_vocab_size: usize,
}

impl ModelDims {
    /// Channels of one head (HS).
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// The role (one of [`MATMUL_ROLES`], as the model's kernel selection names it) of a matmul
    /// of `n` outputs over `k` inputs a row; `None` for a shape this model does not multiply.
    pub fn matmul_role(&self, n: usize, k: usize) -> Option<&'static str> {
        let c = self.n_embd;
        match (n, k) {
            (n, k) if k == c && n == 3 * c => Some("qkv"),
            (n, k) if k == c && n == c => Some("attn_proj"),
            (n, k) if k == c && n == 4 * c => Some("fc"),
            (n, k) if k == 4 * c && n == c => Some("fc_proj"),
            (n, k) if k == c && n == self.padded_vocab_size => Some("lm_head"),
            _ => None,
        }
    }

    /// A released GPT-2's dimensions (1,024 positions, the 50,257-token vocabulary padded to
    /// 50,304), for the tests of the layers below the model; `model::config` checks that its
    /// presets agree.
    #[cfg(test)]
    pub(crate) fn released_gpt2(n_layer: usize, n_head: usize, n_embd: usize) -> ModelDims {
        ModelDims {
            n_layer,
            n_head,
            n_embd,
            n_ctx: 1024,
            vocab_size: 50257,
            padded_vocab_size: 50304,
        }
    }
}

/// The matmuls of a GPT-2 step by role, in the order a step runs them (the LM head last).
pub const MATMUL_ROLES: [&str; 5] = ["qkv", "attn_proj", "fc", "fc_proj", "lm_head"];

/// The cache lengths decode attention is chosen for: powers of two from 128 up to the context,
/// the context itself last. A step attending to `len` positions runs the kernel of the first
/// bucket that holds it ([`context_bucket`]): the best split of the cache differs between
/// 100 and 1,000 cached tokens, and the tuner measures each bucket at its longest length.
pub fn decode_context_buckets(n_ctx: usize) -> Vec<usize> {
    let mut buckets = Vec::new();
    let mut len = 128;
    while len < n_ctx {
        buckets.push(len);
        len *= 2;
    }
    buckets.push(n_ctx.max(1));
    buckets
}

/// The bucket of [`decode_context_buckets`] a cache of `len` positions falls in (the last
/// one for anything longer).
pub fn context_bucket(n_ctx: usize, len: usize) -> usize {
    let buckets = decode_context_buckets(n_ctx);
    buckets
        .iter()
        .copied()
        .find(|&b| len <= b)
        .unwrap_or(buckets[buckets.len() - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_double_from_128_and_end_at_the_context() {
        assert_eq!(decode_context_buckets(1024), vec![128, 256, 512, 1024]);
        assert_eq!(decode_context_buckets(1000), vec![128, 256, 512, 1000]);
        assert_eq!(decode_context_buckets(64), vec![64]);
        assert_eq!(decode_context_buckets(128), vec![128]);
        assert_eq!(context_bucket(1024, 1), 128);
        assert_eq!(context_bucket(1024, 128), 128);
        assert_eq!(context_bucket(1024, 129), 256);
        assert_eq!(context_bucket(1024, 1024), 1024);
        assert_eq!(context_bucket(1000, 600), 1000);
        assert_eq!(context_bucket(64, 64), 64);
    }

    #[test]
    fn a_matmul_is_named_by_its_outputs_and_inputs() {
        let gpt2 = ModelDims::released_gpt2(12, 12, 768);
        let roles: Vec<_> = [
            (2304, 768),
            (768, 768),
            (3072, 768),
            (768, 3072),
            (50304, 768),
            (768, 50304),
        ]
        .into_iter()
        .map(|(n, k)| gpt2.matmul_role(n, k))
        .collect();
        assert_eq!(
            roles,
            [
                Some("qkv"),
                Some("attn_proj"),
                Some("fc"),
                Some("fc_proj"),
                Some("lm_head"),
                None
            ]
        );
        assert_eq!(roles[..5], MATMUL_ROLES.map(Some), "the roles in the step's order");
    }
}
