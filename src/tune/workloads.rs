//! The exact op shapes a GPT-2 forward pass and decode step use, derived from the model's
//! dimensions (no checkpoint needed for the named sizes).

use crate::ops::model_dims::{decode_context_buckets, ModelDims};
use crate::ops::{Epilogue, Mask, Shape};
use crate::spec::Dtype;

/// One kernel call shape of the model, and how often a forward pass makes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// What it is in the model (`fc (bias+GELU)`), for tables.
    pub role: String,
    pub op: &'static str,
    /// How it computes: only variants of this dtype are candidates, and it is part of the
    /// tuning key.
    pub dtype: Dtype,
    pub epilogue: Epilogue,
    pub mask: Mask,
    pub shape: Shape,
    /// Calls per forward pass (per layer ops × layers).
    pub calls: i64,
}

impl Workload {
    /// Its key in the tuning database: op, dtype, epilogue or mask, shape.
    pub fn key(&self) -> super::db::TuneKey {
        super::db::TuneKey::of(self.op, self.dtype, self.epilogue, self.mask, self.shape.clone())
    }
}

fn shape(pairs: &[(&str, i64)]) -> Shape {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Fewest matmul rows (M) computed in a tensor-core dtype when one is asked for.
pub const TENSOR_CORE_MIN_ROWS: i64 = 64;

/// The dtype a matmul of `rows` rows runs in when `requested` is asked for. f16 and bf16 are
/// storage types, so every matmul takes them. tf32 is only math: the compute-bound matmuls take
/// it; the decode step's few-row matmuls are bound by reading the weights, which tensor cores
/// do not speed up, so they stay f32. The model and the tuner share this rule.
pub fn matmul_dtype(rows: i64, requested: Dtype) -> Dtype {
    if requested == Dtype::Tf32 && rows < TENSOR_CORE_MIN_ROWS {
        Dtype::F32
    } else {
        requested
    }
}

/// The dtype every op other than matmul runs in when `requested` is asked for: the storage
/// type (f32 for tf32, which only changes how matmuls multiply).
pub fn op_dtype(requested: Dtype) -> Dtype {
    match requested {
        Dtype::Tf32 => Dtype::F32,
        other => other,
    }
}

/// The dtype a kernel of `op` runs in when `requested` is asked for (`rows`: a matmul's M):
/// matmuls follow [`matmul_dtype`]; attention takes the requested dtype as it is, tf32
/// included (its two products are matmuls: attention_flash_3xtf32 does them in plain TF32
/// then, one MMA per product instead of three); every other op its storage type
/// ([`op_dtype`]). The model and the tuner share this rule.
pub fn kernel_dtype(op: &str, rows: Option<i64>, requested: Dtype) -> Dtype {
    match (op, rows) {
        ("matmul", Some(rows)) => matmul_dtype(rows, requested),
        ("matmul" | "attention", _) => requested,
        _ => op_dtype(requested),
    }
}

/// Every distinct kernel shape of a forward pass over `batch` sequences of `seq` tokens
/// (prefill when seq > 1, a decode step when seq = 1), each in the dtype [`kernel_dtype`] gives.
pub fn forward_workloads(cfg: &ModelDims, batch: i64, seq: i64, requested: Dtype) -> Vec<Workload> {
    let (c, nh, l) = (cfg.n_embd as i64, cfg.n_head as i64, cfg.n_layer as i64);
    let m = batch * seq;
    let mm = |role: &str, epilogue: Epilogue, n: i64, k: i64, calls: i64| Workload {
        role: role.to_string(),
        op: "matmul",
        dtype: kernel_dtype("matmul", Some(m), requested),
        epilogue,
        mask: Mask::None,
        shape: shape(&[("M", m), ("N", n), ("K", k), ("T", seq), ("n_head", nh)]),
        calls,
    };
    let mut out = vec![
        Workload {
            role: "embedding".into(),
            op: "encoder",
            dtype: kernel_dtype("encoder", None, requested),
            epilogue: Epilogue::None,
            mask: Mask::None,
            shape: shape(&[
                ("B", batch),
                ("T", seq),
                ("C", c),
                ("pos_offset", 0),
                ("V", cfg.vocab_size as i64),
                ("max_T", cfg.n_ctx as i64),
            ]),
            calls: 1,
        },
        Workload {
            role: "layernorm".into(),
            op: "layernorm",
            dtype: kernel_dtype("layernorm", None, requested),
            epilogue: Epilogue::None,
            mask: Mask::None,
            shape: shape(&[("N", m), ("C", c)]),
            calls: 2 * l + 1,
        },
        mm("qkv projection (QKV split)", Epilogue::Qkv, 3 * c, c, l),
        mm("attention output (bias+residual)", Epilogue::BiasResidual, c, c, l),
        mm("fc (bias+GELU)", Epilogue::BiasGelu, 4 * c, c, l),
        mm("fc projection (bias+residual)", Epilogue::BiasResidual, c, 4 * c, l),
        mm("LM head (tied wte)", Epilogue::None, cfg.padded_vocab_size as i64, c, 1),
    ];
    if folds_layernorms(seq == 1, m) {
        // The GEMMs after a layernorm, with the layernorm folded in (an ln_ epilogue): the
        // model runs them instead of layernorm + GEMM where they are faster than the two (see
        // model/gpu/fold_select.rs), in a prefill and in a decode step of at least
        // TENSOR_CORE_MIN_ROWS sequences (the tensor-core kernels that fold it). Offers, not
        // needs: `tune` drops them where no family can run them (SpreadPlan::new). Not the LM
        // head's: in a prefill, summing each row in the K loop costs its consumers more
        // instructions than the MMAs leave them time for (1.32 against 0.95 + 0.015 ms, bf16,
        // M = 8192, H100); in a decode step it was chosen at batch 64 and 128 and the step did
        // not get faster (H200; benches/RESULTS.md, tenth pass). `ln_bias` stays for `tune --op`
        // and the model's forced folding.
        out.extend([
            mm(
                "qkv projection (layernorm folded, QKV split)",
                Epilogue::LnQkv,
                3 * c,
                c,
                l,
            ),
            mm("fc (layernorm folded, bias+GELU)", Epilogue::LnBiasGelu, 4 * c, c, l),
        ]);
    }
    if seq > 1 {
        out.insert(
            3,
            Workload {
                role: "attention (causal)".into(),
                op: "attention",
                dtype: kernel_dtype("attention", None, requested),
                epilogue: Epilogue::None,
                mask: Mask::Causal,
                shape: shape(&[("B", batch), ("NH", nh), ("T", seq), ("HS", c / nh), ("window", 0)]),
                calls: l,
            },
        );
    } else {
        out.extend(decode_attention_workloads(cfg, batch, requested));
        // The sampler, on the setting it is chosen on (see [`sampler_shape`]). Its point
        // matters with the batch: at 256 rows, 256-thread blocks over 4,096-logit chunks take
        // 98 µs against the default's 205; at 1-8 rows the default stays the best or within 5%
        // (H200, bf16; benches/RESULTS.md, sixteenth pass).
        out.push(Workload {
            role: "sampler".into(),
            op: "sample",
            dtype: kernel_dtype("sample", None, requested),
            epilogue: Epilogue::None,
            mask: Mask::None,
            shape: sampler_shape(cfg, batch),
            calls: 1,
        });
    }
    out
}

/// The shape the next tokens of a decode step are drawn on (argmax, sample): `batch` rows of
/// the vocabulary's logits, a padded row apart. `tune --model` tunes the sampler on it (see
/// [`forward_workloads`]) but leaves the argmax out: timed alone, the argmax's points differ by
/// a few percent of their own time, and in the step the one that won alone at batch 64 (8 loads
/// in flight, 54 registers a thread against the default's 4 and 32) cost 7 µs a step more than
/// the default (H200; benches/RESULTS.md, tenth pass). `tune --op argmax --shape ...` still
/// times it.
pub fn next_tokens_shape(cfg: &ModelDims, batch: i64) -> Shape {
    shape(&[
        ("B", batch),
        ("V", cfg.vocab_size as i64),
        ("stride", cfg.padded_vocab_size as i64),
    ])
}

/// The shape a decode step of `batch` sequences tunes and chooses its sampler on: the next
/// tokens' rows at [`crate::ops::sample::TUNED_SETTING`], the other settings at their defaults
/// (the user's temperature and filters are the kernel's arguments, not part of its key).
pub fn sampler_shape(cfg: &ModelDims, batch: i64) -> Shape {
    let mut rows = next_tokens_shape(cfg, batch);
    for (name, value) in crate::ops::sample::TUNED_SETTING {
        rows.insert(name.to_string(), value);
    }
    completed("sample", rows)
}

/// `shape` with the optional variables of `op` set to their defaults, as the model's kernel
/// selection completes the shapes it asks for: a workload's database key must be the key the
/// model looks up (the sampler's shape carries its settings).
fn completed(op: &str, mut shape: Shape) -> Shape {
    if let Some(contract) = crate::ops::op_by_name(op) {
        // The defaults are valid settings: completing a shape the model itself derives cannot fail.
        let _ = contract.complete_shape(&mut shape, Epilogue::None, Mask::None);
    }
    shape
}

/// Whether a prefill, or a decode step (`decode`), of `rows` rows in all may fold its
/// layernorms into the GEMMs after them (the `ln_` epilogues): every prefill, and a decode step
/// of as many rows as the tensor-core kernels that fold them take. The tuner offers those
/// workloads (a seq of 1 being the decode step) and the model considers folding by this one rule.
pub fn folds_layernorms(decode: bool, rows: i64) -> bool {
    !decode || rows >= TENSOR_CORE_MIN_ROWS
}

/// The decode step's attention at each cache-length bucket
/// ([`decode_context_buckets`]), the longest length of each: the model runs the bucket's
/// winner while the cache is within it. The cache holds exactly `T` positions here (the model's
/// holds the context: the same reads, less memory to fill for the test problem).
pub fn decode_attention_workloads(cfg: &ModelDims, batch: i64, requested: Dtype) -> Vec<Workload> {
    let (nh, hs) = (cfg.n_head as i64, cfg.head_dim() as i64);
    decode_context_buckets(cfg.n_ctx)
        .into_iter()
        .map(|len| Workload {
            role: format!("attention (decode, cache up to {len})"),
            op: "attention_decode",
            dtype: kernel_dtype("attention_decode", None, requested),
            epilogue: Epilogue::None,
            mask: Mask::None,
            shape: decode_attention_shape(batch, nh, hs, len as i64),
            calls: cfg.n_layer as i64,
        })
        .collect()
}

/// The shape decode attention is tuned and selected for: `batch` sequences of `nh` heads of
/// `hs` channels attending to a cache of `len` positions (the bucket's longest).
pub fn decode_attention_shape(batch: i64, nh: i64, hs: i64, len: i64) -> Shape {
    shape(&[("B", batch), ("NH", nh), ("T", len), ("HS", hs), ("max_T", len)])
}

/// The workloads of a model at every (batch, seq) asked for, plus the decode step (seq = 1)
/// for each batch, without duplicates, in the dtypes [`forward_workloads`] picks.
pub fn model_workloads(cfg: &ModelDims, batches: &[i64], seqs: &[i64], matmul_dtype: Dtype) -> Vec<Workload> {
    let mut out: Vec<Workload> = Vec::new();
    for &b in batches {
        for &t in seqs.iter().chain(std::iter::once(&1)) {
            for w in forward_workloads(cfg, b, t, matmul_dtype) {
                if !out.iter().any(|o| {
                    o.op == w.op
                        && o.dtype == w.dtype
                        && o.epilogue == w.epilogue
                        && o.mask == w.mask
                        && o.shape == w.shape
                }) {
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

    /// The model completes every shape it asks the database for (`GpuBackend::selection_of`):
    /// a workload whose shape completion would change is tuned under a key the model never
    /// looks up (the sampler's was, until its settings were added).
    #[test]
    fn every_workload_is_tuned_under_the_key_the_model_asks_for() {
        let cfg = ModelDims::released_gpt2(12, 12, 768);
        for (batch, seq) in [(1, 1), (8, 1), (256, 1), (8, 1024)] {
            for w in forward_workloads(&cfg, batch, seq, Dtype::Bf16) {
                let contract = crate::ops::op_by_name(w.op).expect("a known op");
                let mut asked = w.shape.clone();
                contract.complete_shape(&mut asked, w.epilogue, w.mask).unwrap();
                assert_eq!(asked, w.shape, "{} ({}) at batch {batch} x {seq}", w.role, w.op);
            }
        }
        let decode = forward_workloads(&cfg, 64, 1, Dtype::Bf16);
        let sampler = decode
            .iter()
            .find(|w| w.op == "sample")
            .expect("the decode step tunes its sampler");
        // On the filtered setting the model chooses it on, with the other settings at their
        // defaults.
        assert_eq!(sampler.shape, sampler_shape(&cfg, 64));
        let params = crate::ops::sample::params_of(&sampler.shape);
        assert_eq!((params.temperature, params.top_k, params.top_p), (0.8, 40, 0.95));
        assert_eq!(
            (sampler.shape["B"], sampler.shape["seed_lo"], sampler.shape["pos"]),
            (64, 0, 0)
        );
    }

    #[test]
    fn gpt2_small_forward_shapes() {
        let cfg = ModelDims::released_gpt2(12, 12, 768);
        assert_eq!(cfg.padded_vocab_size, 50304);
        let w = forward_workloads(&cfg, 8, 1024, Dtype::F32);
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
                (50304, 768, Epilogue::None),
                (2304, 768, Epilogue::LnQkv),
                (3072, 768, Epilogue::LnBiasGelu),
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
        let cfg = ModelDims::released_gpt2(48, 25, 1600);
        let w = forward_workloads(&cfg, 1, 1, Dtype::F32);
        assert!(w.iter().all(|w| w.op != "attention"));
        // decode attention once per cache-length bucket, each at its longest length
        let lens: Vec<i64> = w
            .iter()
            .filter(|w| w.op == "attention_decode")
            .map(|w| w.shape["T"])
            .collect();
        assert_eq!(lens, vec![128, 256, 512, 1024]);
        assert!(w.iter().filter(|w| w.op == "matmul").all(|w| w.shape["M"] == 1));
        let all = model_workloads(&cfg, &[1, 8], &[1024], Dtype::F32);
        assert_eq!(
            all.len(),
            2 * (forward_workloads(&cfg, 1, 1024, Dtype::F32).len() + forward_workloads(&cfg, 1, 1, Dtype::F32).len())
        );
    }

    #[test]
    fn tf32_applies_to_matmuls_and_attention_only() {
        let cfg = ModelDims::released_gpt2(12, 12, 768);
        let w = model_workloads(&cfg, &[8], &[1024], Dtype::Tf32);
        assert!(w.iter().any(|w| w.op == "matmul"));
        assert!(w.iter().any(|w| w.op == "attention" && w.dtype == Dtype::Tf32));
        for w in &w {
            // The decode step (M = 8 rows) stays f32: it is bound by reading the weights.
            let tensor_cores = (w.op == "matmul" && w.shape["M"] >= TENSOR_CORE_MIN_ROWS) || w.op == "attention";
            let want = if tensor_cores { Dtype::Tf32 } else { Dtype::F32 };
            assert_eq!(w.dtype, want, "{} {} {:?}", w.role, w.op, w.shape);
        }
        assert!(w.iter().any(|w| w.op == "matmul" && w.dtype == Dtype::F32));
    }
}
