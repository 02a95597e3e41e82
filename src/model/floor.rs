//! The floor of a decode step: the bytes one step must read from device memory at the least
//! (every weight once, in its storage type, plus the live KV cache), and the arithmetic it must
//! do (the matmuls against every weight, the LM head included, and attention over the cache).
//! The bytes over the measured copy bandwidth ([`crate::gpu::bandwidth`]) and the FLOPs over the
//! measured tensor-core (or FP32) peak ([`crate::tune::peaks`]) each give a time no step can
//! beat on this GPU; the larger is the floor, and `kernelforge bench` reports which share of it
//! a decode step reaches.
//!
//! Activations, the new K/V rows a step writes and the logits are left out of the bytes: at
//! decode sizes they are a few kilobytes against hundreds of megabytes of weights. Bias adds,
//! LayerNorms, GELU and softmax are left out of the FLOPs: a few per element of a row, against a
//! multiply-add per weight.

use super::config::GPT2Config;

/// Bytes a decode step reads at the least (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DecodeBytes {
    /// Every parameter once: the padded token embedding (read by the LM head), one row of the
    /// position embedding, each layer's LayerNorms, QKV, attention projection and MLP weights
    /// and biases, and the final LayerNorm.
    pub weights: usize,
    /// K and V of every layer for `batch` sequences of `cache_len` tokens.
    pub kv_cache: usize,
    /// `weights + kv_cache`.
    pub total: usize,
}

/// Parameters one decode step reads (see [`DecodeBytes::weights`]), in elements.
pub fn decode_step_params(cfg: &GPT2Config) -> usize {
    let c = cfg.n_embd;
    let per_layer = 2 * c // ln_1 gamma + beta
        + c * 3 * c + 3 * c // qkv W + b
        + c * c + c // attention projection W + b
        + 2 * c // ln_2 gamma + beta
        + c * 4 * c + 4 * c // fc W + b
        + 4 * c * c + c; // fc projection W + b
    cfg.padded_vocab_size * c // wte, padded: the LM head reads all of it
        + c // one wpe row
        + cfg.n_layer * per_layer
        + 2 * c // ln_f gamma + beta
}

/// The bytes a decode step must read: weights stored in `storage_bytes` per value (f32 and tf32:
/// 4, f16 and bf16: 2; the KV cache is stored the same way) and a KV cache of `cache_len` tokens
/// for each of `batch` sequences.
pub fn decode_step_bytes(cfg: &GPT2Config, storage_bytes: usize, batch: usize, cache_len: usize) -> DecodeBytes {
    let weights = decode_step_params(cfg) * storage_bytes;
    // Per layer, K and V: batch × n_head × cache_len × head_dim = batch × cache_len × n_embd.
    let kv_cache = cfg.n_layer * 2 * batch * cache_len * cfg.n_embd * storage_bytes;
    DecodeBytes {
        weights,
        kv_cache,
        total: weights + kv_cache,
    }
}

/// Arithmetic a decode step must do at the least (see the module docs), in FLOPs (a multiply-add
/// counts 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DecodeFlops {
    /// `2 × batch ×` the matmul weights ([`decode_step_matmul_params`]): each sequence's row
    /// multiplied against every weight once.
    pub matmuls: usize,
    /// `4 × batch × n_layer × cache_len × n_embd`: per layer and sequence, the scores `q · k`
    /// against every cached key and the weighted sum of the cached values, each
    /// `cache_len × n_embd` multiply-adds over all heads.
    pub attention: usize,
    /// `matmuls + attention`.
    pub total: usize,
}

/// The weights a decode step multiplies against, in elements: each layer's QKV (3C²), attention
/// projection (C²), fc (4C²) and fc projection (4C²) weights, and the LM head's padded token
/// embedding (its padding rows are multiplied too, as they are read: see
/// [`DecodeBytes::weights`]). Biases, LayerNorm values and the position embedding are read but
/// not multiplied.
pub fn decode_step_matmul_params(cfg: &GPT2Config) -> usize {
    let c = cfg.n_embd;
    cfg.n_layer * 12 * c * c + cfg.padded_vocab_size * c
}

/// The FLOPs of a decode step of `batch` sequences with `cache_len` tokens cached each.
pub fn decode_step_flops(cfg: &GPT2Config, batch: usize, cache_len: usize) -> DecodeFlops {
    let matmuls = 2 * batch * decode_step_matmul_params(cfg);
    let attention = 4 * batch * cfg.n_layer * cache_len * cfg.n_embd;
    DecodeFlops {
        matmuls,
        attention,
        total: matmuls + attention,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_bf16_reads_about_247_mb_of_weights() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        // By hand, C = 768, L = 12, padded vocabulary 50304:
        //   wte 50304 × 768 = 38,633,472; one wpe row 768; ln_f 1,536;
        //   a layer: 12 C² = 7,077,888 weights + 13 C = 9,984 biases and LayerNorm values
        //   = 7,087,872, × 12 = 85,054,464;
        //   total 123,690,240 parameters (HF's 124,439,808 counts the whole 1024-row wpe and the
        //   unpadded wte), × 2 bytes = 247,380,480.
        assert_eq!(decode_step_params(&cfg), 123_690_240);
        let (c, padding) = (cfg.n_embd, cfg.padded_vocab_size - cfg.vocab_size);
        assert_eq!(
            decode_step_params(&cfg),
            cfg.num_params() - (cfg.n_ctx - 1) * c + padding * c
        );
        let b = decode_step_bytes(&cfg, 2, 1, 0);
        assert_eq!(b.weights, 247_380_480);
        assert_eq!((b.kv_cache, b.total), (0, b.weights));
        // The KV cache: 12 layers × (K + V) × 8 sequences × 100 tokens × 768 × 2 bytes.
        let b = decode_step_bytes(&cfg, 2, 8, 100);
        assert_eq!(b.kv_cache, 12 * 2 * 8 * 100 * 768 * 2);
        assert_eq!(b.total, b.weights + b.kv_cache);
        // f32 storage doubles everything.
        assert_eq!(decode_step_bytes(&cfg, 4, 8, 100).total, 2 * b.total);
    }

    #[test]
    fn gpt2_xl_bf16_reads_about_3_11_gb_of_weights() {
        let cfg = GPT2Config::preset("gpt2-xl").unwrap();
        // C = 1600, L = 48: wte 50304 × 1600 = 80,486,400; a layer 12 C² + 13 C = 30,740,800,
        // × 48 = 1,475,558,400; wpe row 1,600; ln_f 3,200: 1,556,049,600 parameters, × 2 bytes.
        assert_eq!(decode_step_params(&cfg), 1_556_049_600);
        assert_eq!(decode_step_bytes(&cfg, 2, 1, 0).weights, 3_112_099_200);
    }

    #[test]
    fn gpt2_124m_does_about_247_mflop_a_sequence_and_step() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        // By hand, C = 768, L = 12, padded vocabulary 50304:
        //   a layer's matmul weights 3C² + C² + 4C² + 4C² = 12 × 589,824 = 7,077,888, × 12 layers
        //   = 84,934,656; the LM head 50304 × 768 = 38,633,472; together 123,568,128 (the
        //   123,690,240 parameters a step reads less 122,112 biases, LayerNorm values and one wpe
        //   row), × 2 FLOPs a multiply-add = 247,136,256 FLOPs a sequence.
        assert_eq!(decode_step_matmul_params(&cfg), 123_568_128);
        let biases_and_norms = 12 * 13 * 768 + 768 + 2 * 768;
        assert_eq!(
            decode_step_matmul_params(&cfg) + biases_and_norms,
            decode_step_params(&cfg)
        );
        let f = decode_step_flops(&cfg, 1, 0);
        assert_eq!((f.matmuls, f.attention, f.total), (247_136_256, 0, 247_136_256));
        // Attention after 144 cached tokens: 4 × 12 layers × 144 × 768 = 5,308,416 a sequence.
        let f = decode_step_flops(&cfg, 1, 144);
        assert_eq!(f.attention, 5_308_416);
        assert_eq!(f.total, 252_444_672);
        // Everything scales with the batch: 64 sequences after 1,000 tokens.
        let f = decode_step_flops(&cfg, 64, 1000);
        assert_eq!(f.matmuls, 64 * 247_136_256);
        assert_eq!(f.attention, 64 * 4 * 12 * 1000 * 768);
        assert_eq!(f.total, 15_816_720_384 + 2_359_296_000);
        // With an empty cache at batch 256 and 800 TFLOP/s the matmuls take 0.079 ms, while the bf16 weights
        // (247 MB) at 4,250 GB/s take 0.058 ms: large batches are compute-bound.
        let compute_ms = decode_step_flops(&cfg, 256, 0).total as f64 / 800e12 * 1e3;
        let memory_ms = decode_step_bytes(&cfg, 2, 256, 0).total as f64 / 4250e9 * 1e3;
        assert!(compute_ms > memory_ms, "{compute_ms} vs {memory_ms}");
    }
}
