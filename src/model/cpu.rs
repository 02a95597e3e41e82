//! The f32 CPU reference forward pass of GPT-2 (rayon-parallel), with a KV cache: the oracle the
//! GPU path is tested against, and a working [`Backend`].
//!
//! Each op is a small public function over row-major slices, with the same contract as the
//! kernels (see DESIGN.md "Op contracts"): [`encoder`], [`layernorm`] (eps 1e-5), [`matmul`]
//! (`out = inp @ W^T + bias`, `W` stored `[N, K]`), [`gelu`] (tanh approximation),
//! [`residual_add`], [`softmax`], [`attention_row`] / [`attention_causal`] (causal, scale
//! 1/sqrt(head_dim)). [`forward`] chains them; logits are `x_final @ wte^T` over the real
//! vocabulary. Layernorm and softmax accumulate in f64; matmul dot products in f32 with eight
//! partial sums.

use std::sync::Arc;

use rayon::prelude::*;

use super::config::GPT2Config;
use super::error::{ModelError, Result};
use super::generate::{Backend, Logits};
use super::weights::GPT2Model;

/// Layernorm epsilon used by GPT-2.
pub const LN_EPS: f32 = 1e-5;

/// `out[t, :] = wte[tokens[t], :] + wpe[pos0 + t, :]` for one sequence; `out` is `[T, C]`.
/// Callers check token ids and positions are in range.
pub fn encoder(out: &mut [f32], tokens: &[u32], pos0: usize, wte: &[f32], wpe: &[f32], c: usize) {
    out.par_chunks_mut(c)
        .zip(tokens.par_iter())
        .enumerate()
        .for_each(|(t, (o, &tok))| {
            let e = &wte[tok as usize * c..(tok as usize + 1) * c];
            let p = &wpe[(pos0 + t) * c..(pos0 + t + 1) * c];
            for i in 0..c {
                o[i] = e[i] + p[i];
            }
        });
}

/// Row-wise layernorm over `C` channels: `out = (x - mean) / sqrt(var + 1e-5) * w + b`
/// (biased variance). `inp` and `out` are `[N, C]`.
pub fn layernorm(out: &mut [f32], inp: &[f32], weight: &[f32], bias: &[f32], c: usize) {
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).for_each(|(o, x)| {
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + LN_EPS as f64).sqrt();
        for i in 0..c {
            o[i] = (((x[i] as f64 - mean) * rstd) as f32) * weight[i] + bias[i];
        }
    });
}

/// Dot product with eight independent partial sums (vectorizes well).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out[M, N] = inp[M, K] @ weight[N, K]^T (+ bias[N])`. Parallel over row blocks when M is
/// large, over output columns when M is small (decode).
pub fn matmul(out: &mut [f32], inp: &[f32], weight: &[f32], bias: Option<&[f32]>, k: usize, n: usize) {
    const MB: usize = 16; // rows of inp per task
    const NB: usize = 16; // rows of weight kept hot while a row block runs over them
    let m = inp.len() / k;
    debug_assert_eq!(out.len(), m * n);
    debug_assert_eq!(weight.len(), n * k);
    let b_at = |j: usize| bias.map_or(0.0, |b| b[j]);
    if m >= 2 * MB {
        out.par_chunks_mut(MB * n)
            .zip(inp.par_chunks(MB * k))
            .for_each(|(o, x)| {
                let rows = x.len() / k;
                for n0 in (0..n).step_by(NB) {
                    let n1 = (n0 + NB).min(n);
                    for r in 0..rows {
                        let xr = &x[r * k..(r + 1) * k];
                        for j in n0..n1 {
                            o[r * n + j] = dot(xr, &weight[j * k..(j + 1) * k]) + b_at(j);
                        }
                    }
                }
            });
    } else {
        for r in 0..m {
            let xr = &inp[r * k..(r + 1) * k];
            out[r * n..(r + 1) * n]
                .par_chunks_mut(64)
                .enumerate()
                .for_each(|(ci, o)| {
                    for (jj, v) in o.iter_mut().enumerate() {
                        let j = ci * 64 + jj;
                        *v = dot(xr, &weight[j * k..(j + 1) * k]) + b_at(j);
                    }
                });
        }
    }
}

/// GELU, tanh approximation (GPT-2's `gelu_new`), one value.
#[inline]
pub fn gelu_scalar(x: f32) -> f32 {
    const S: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (S * (x + 0.044715 * x * x * x)).tanh())
}

/// GELU (tanh approximation) in place.
pub fn gelu(x: &mut [f32]) {
    x.par_iter_mut().for_each(|v| *v = gelu_scalar(*v));
}

/// `x += y` (the residual connection).
pub fn residual_add(x: &mut [f32], y: &[f32]) {
    x.par_iter_mut().zip(y.par_iter()).for_each(|(a, b)| *a += *b);
}

/// Numerically stable softmax of one row, in place (sum in f64).
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Attention of one query row against `n_kv` cached keys/values.
/// `q` and `out` are `[C]` (heads side by side, head h at `h*hd..(h+1)*hd`); `k` and `v` are
/// `[>= n_kv, C]` in the same layout. The caller applies causality by passing
/// `n_kv = position + 1`. Scale `1/sqrt(hd)`.
pub fn attention_row(out: &mut [f32], q: &[f32], k: &[f32], v: &[f32], n_kv: usize, n_head: usize) {
    let c = q.len();
    let hd = c / n_head;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0.0f32; n_kv];
    for h in 0..n_head {
        let qh = &q[h * hd..(h + 1) * hd];
        for (s, sc) in scores.iter_mut().enumerate() {
            *sc = dot(qh, &k[s * c + h * hd..s * c + (h + 1) * hd]) * scale;
        }
        softmax(&mut scores);
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        for (s, &w) in scores.iter().enumerate() {
            let vs = &v[s * c + h * hd..s * c + (h + 1) * hd];
            for i in 0..hd {
                oh[i] += w * vs[i];
            }
        }
    }
}

/// Causal self-attention of B sequences of T tokens from a fused `qkv [B, T, 3C]` (Q | K | V per
/// row, as the QKV matmul writes it); `out` is `[B, T, C]`.
pub fn attention_causal(out: &mut [f32], qkv: &[f32], batch: usize, t: usize, c: usize, n_head: usize) {
    let split = |part: usize| -> Vec<Vec<f32>> {
        (0..batch)
            .map(|b| {
                (0..t)
                    .flat_map(|i| {
                        let row = &qkv[(b * t + i) * 3 * c..(b * t + i + 1) * 3 * c];
                        row[part * c..(part + 1) * c].to_vec()
                    })
                    .collect()
            })
            .collect()
    };
    let (ks, vs) = (split(1), split(2));
    out.par_chunks_mut(c).enumerate().for_each(|(r, o)| {
        let (b, i) = (r / t, r % t);
        let q = &qkv[r * 3 * c..r * 3 * c + c];
        attention_row(o, q, &ks[b], &vs[b], i + 1, n_head);
    });
}

/// Keys and values of every layer for B sequences of equal length: `k[layer][b]` is `[len, C]`.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    batch: usize,
    len: usize,
    n_embd: usize,
    k: Vec<Vec<Vec<f32>>>,
    v: Vec<Vec<Vec<f32>>>,
}

impl KvCache {
    /// An empty cache for `batch` sequences.
    pub fn new(cfg: &GPT2Config, batch: usize) -> Self {
        KvCache {
            batch,
            len: 0,
            n_embd: cfg.n_embd,
            k: vec![vec![Vec::new(); batch]; cfg.n_layer],
            v: vec![vec![Vec::new(); batch]; cfg.n_layer],
        }
    }
    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Tokens cached per sequence (= the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Cached keys of `layer`, sequence `b`: `[len, C]`.
    pub fn keys(&self, layer: usize, b: usize) -> &[f32] {
        &self.k[layer][b]
    }
    /// Cached values of `layer`, sequence `b`: `[len, C]`.
    pub fn values(&self, layer: usize, b: usize) -> &[f32] {
        &self.v[layer][b]
    }
}

/// Run the model on `tokens` (B sequences of the same length T >= 1) appended after what `cache`
/// holds (positions `cache.len() .. cache.len() + T`), extending the cache. Returns logits
/// `[B, T, V]`, or `[B, 1, V]` for the last position only when `last_only`.
/// A prefill is a call on an empty cache; a decode step is a call with T = 1.
pub fn forward(model: &GPT2Model, cache: &mut KvCache, tokens: &[Vec<u32>], last_only: bool) -> Result<Logits> {
    let cfg = &model.config;
    let w = &model.weights;
    let (c, nh, v) = (cfg.n_embd, cfg.n_head, cfg.vocab_size);
    let batch = tokens.len();
    if batch == 0 || batch != cache.batch {
        return Err(ModelError::Batch(format!(
            "got {batch} sequences for a KV cache of {} sequences",
            cache.batch
        )));
    }
    let t = tokens[0].len();
    if t == 0 {
        return Err(ModelError::Batch("sequences must have at least one token".into()));
    }
    if let Some(b) = tokens.iter().position(|s| s.len() != t) {
        return Err(ModelError::Batch(format!(
            "sequence {b} has {} tokens but sequence 0 has {t}; a batch must be rectangular",
            tokens[b].len()
        )));
    }
    let pos0 = cache.len;
    for s in tokens {
        if let Some((i, &tok)) = s.iter().enumerate().find(|(_, &x)| x as usize >= v) {
            return Err(ModelError::InvalidToken {
                token: tok,
                position: pos0 + i,
                vocab_size: v,
            });
        }
    }
    if pos0 + t > cfg.n_ctx {
        return Err(ModelError::ContextOverflow {
            needed: pos0 + t,
            n_ctx: cfg.n_ctx,
        });
    }
    if cache.n_embd != c || cache.k.len() != cfg.n_layer {
        return Err(ModelError::Batch("KV cache was made for a different model".into()));
    }

    let rows = batch * t;
    let mut x = vec![0.0f32; rows * c];
    for (b, s) in tokens.iter().enumerate() {
        encoder(&mut x[b * t * c..(b + 1) * t * c], s, pos0, &w.wte, &w.wpe, c);
    }
    let mut ln = vec![0.0f32; rows * c];
    let mut qkv = vec![0.0f32; rows * 3 * c];
    let mut att = vec![0.0f32; rows * c];
    let mut proj = vec![0.0f32; rows * c];
    let mut fc = vec![0.0f32; rows * 4 * c];
    for (li, lw) in w.layers.iter().enumerate() {
        layernorm(&mut ln, &x, &lw.ln1_w, &lw.ln1_b, c);
        matmul(&mut qkv, &ln, &lw.qkv_w, Some(&lw.qkv_b), c, 3 * c);
        for b in 0..batch {
            for i in 0..t {
                let row = &qkv[(b * t + i) * 3 * c..(b * t + i + 1) * 3 * c];
                cache.k[li][b].extend_from_slice(&row[c..2 * c]);
                cache.v[li][b].extend_from_slice(&row[2 * c..]);
            }
        }
        let (kl, vl) = (&cache.k[li], &cache.v[li]);
        att.par_chunks_mut(c).enumerate().for_each(|(r, o)| {
            let (b, i) = (r / t, r % t);
            attention_row(o, &qkv[r * 3 * c..r * 3 * c + c], &kl[b], &vl[b], pos0 + i + 1, nh);
        });
        matmul(&mut proj, &att, &lw.attn_proj_w, Some(&lw.attn_proj_b), c, c);
        residual_add(&mut x, &proj);
        layernorm(&mut ln, &x, &lw.ln2_w, &lw.ln2_b, c);
        matmul(&mut fc, &ln, &lw.fc_w, Some(&lw.fc_b), c, 4 * c);
        gelu(&mut fc);
        matmul(&mut proj, &fc, &lw.fc_proj_w, Some(&lw.fc_proj_b), 4 * c, c);
        residual_add(&mut x, &proj);
    }
    cache.len += t;

    let (final_in, out_t) = if last_only && t > 1 {
        let last: Vec<f32> = (0..batch)
            .flat_map(|b| x[((b + 1) * t - 1) * c..(b + 1) * t * c].to_vec())
            .collect();
        (last, 1)
    } else {
        (x, t)
    };
    let mut xf = vec![0.0f32; final_in.len()];
    layernorm(&mut xf, &final_in, &w.lnf_w, &w.lnf_b, c);
    let mut logits = vec![0.0f32; batch * out_t * v];
    matmul(&mut logits, &xf, &w.wte, None, c, v);
    Logits::new(batch, out_t, v, logits)
}

/// Logits `[1, T, V]` for every position of one sequence, without keeping a cache.
pub fn forward_sequence(model: &GPT2Model, tokens: &[u32]) -> Result<Logits> {
    let mut cache = KvCache::new(&model.config, 1);
    forward(model, &mut cache, &[tokens.to_vec()], false)
}

/// The CPU reference as a generation [`Backend`].
#[derive(Clone, Debug)]
pub struct CpuBackend {
    model: Arc<GPT2Model>,
    cache: KvCache,
}

impl CpuBackend {
    pub fn new(model: Arc<GPT2Model>) -> Self {
        let cache = KvCache::new(&model.config, 0);
        CpuBackend { model, cache }
    }
    /// The model it runs.
    pub fn model(&self) -> &GPT2Model {
        &self.model
    }
    /// The current KV cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    fn config(&self) -> &GPT2Config {
        &self.model.config
    }
    fn prefill(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        self.cache = KvCache::new(&self.model.config, tokens.len());
        forward(&self.model, &mut self.cache, tokens, false)
    }
    fn prefill_last(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        self.cache = KvCache::new(&self.model.config, tokens.len());
        forward(&self.model, &mut self.cache, tokens, true)
    }
    fn decode(&mut self, last: &[u32]) -> Result<Logits> {
        if self.cache.is_empty() {
            return Err(ModelError::Backend {
                backend: "cpu".into(),
                message: "decode called before prefill".into(),
            });
        }
        let tokens: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
        forward(&self.model, &mut self.cache, &tokens, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_small_and_large_paths_agree() {
        let (k, n) = (37, 45);
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
        let m = 40;
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2).collect();
        let mut big = vec![0.0; m * n];
        matmul(&mut big, &x, &w, Some(&bias), k, n);
        for r in 0..m {
            let mut one = vec![0.0; n];
            matmul(&mut one, &x[r * k..(r + 1) * k], &w, Some(&bias), k, n);
            for j in 0..n {
                let exact: f64 =
                    (0..k).map(|i| x[r * k + i] as f64 * w[j * k + i] as f64).sum::<f64>() + bias[j] as f64;
                assert!((one[j] as f64 - exact).abs() < 1e-4);
                assert_eq!(one[j], big[r * n + j]);
            }
        }
    }

    #[test]
    fn gelu_and_softmax_values() {
        assert!((gelu_scalar(1.0) - 0.841_192).abs() < 1e-5);
        assert_eq!(gelu_scalar(0.0), 0.0);
        let mut r = [1.0f32, 2.0, 3.0];
        softmax(&mut r);
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((r[2] - 0.665_240_9).abs() < 1e-6);
    }
}
