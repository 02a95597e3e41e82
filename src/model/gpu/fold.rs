//! Layernorms folded into the matmul after them, for the prefill's `ln_` matmuls (see
//! `ops/matmul.rs`): a kernel that standardizes each input row itself needs the layernorm's
//! gamma and beta in its weight and bias instead.
//!
//! For a layernorm (gamma, beta over K values) before a matmul with weight `W [N,K]` and bias
//! `b [N]` (the LM head has none: `b = 0`):
//! - `W2[n,k] = W[n,k] gamma[k] - mean_k(W[n,k] gamma[k])`: gamma folded in, then each row
//!   centered. A standardized row sums to zero, so a constant added to a weight row changes
//!   nothing in exact math; centered, the rows' sums are about zero and the kernel's
//!   `mean * wsum` subtraction has nothing large to cancel.
//! - the bias, `2N` values: `b[n] + sum_k W[n,k] beta[k]`, then `wsum[n] = sum_k W2[n,k]`
//!   summed (in f64) over `W2` as stored, rounded to the model's storage type, so that the
//!   kernel subtracts exactly what it multiplied.
//!
//! Computed once in f64 from the f32 master weights and uploaded on the first prefill plan whose
//! kernel for that matmul is an `ln_` one; kept for the backend's life. Decode steps use the
//! original weights and their layernorms; the LM head's copy is separate from the tied `wte`.

use anyhow::{anyhow, Result as AnyResult};
use cudarc::driver::CudaSlice;
use rayon::prelude::*;

use super::buffers::upload_fits;
use super::{ptr, GpuBackend};
use crate::gpu::GpuError;
use crate::ops::{Epilogue, Storage};

/// A matmul that follows a layernorm in the model, and so can take it folded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum FoldRole {
    /// `ln_1` into each layer's qkv projection.
    Qkv,
    /// `ln_2` into each layer's fc (bias + GELU).
    Fc,
    /// `ln_f` into the LM head (tied `wte`, no bias).
    LmHead,
}

impl FoldRole {
    /// The layernorm it folds in: `ln_1`, `ln_2`, `ln_f`.
    pub fn layernorm(self) -> &'static str {
        match self {
            FoldRole::Qkv => "ln_1",
            FoldRole::Fc => "ln_2",
            FoldRole::LmHead => "ln_f",
        }
    }

    /// The matmul's role in the kernel set: `qkv`, `fc`, `lm_head`.
    pub fn matmul(self) -> &'static str {
        match self {
            FoldRole::Qkv => "qkv",
            FoldRole::Fc => "fc",
            FoldRole::LmHead => "lm_head",
        }
    }

    /// (the fused prefill's epilogue, the `ln_` epilogue that takes the layernorm in). The LM
    /// head has no bias, but its folded bias holds the beta term: `ln_bias`.
    pub fn epilogues(self) -> (Epilogue, Epilogue) {
        match self {
            FoldRole::Qkv => (Epilogue::Qkv, Epilogue::LnQkv),
            FoldRole::Fc => (Epilogue::BiasGelu, Epilogue::LnBiasGelu),
            FoldRole::LmHead => (Epilogue::None, Epilogue::LnBias),
        }
    }
}

/// Which layernorms a prefill's kernel set runs folded into the matmul after them (the
/// matmul's kernel is then an `ln_` one and its plan skips the layernorm launch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct FoldedLayernorms {
    /// `ln_1` folded into the qkv projection.
    pub qkv: bool,
    /// `ln_2` folded into fc.
    pub fc: bool,
    /// `ln_f` folded into the LM head.
    pub lm_head: bool,
}

impl FoldedLayernorms {
    /// Whether `role`'s layernorm is folded.
    pub fn get(&self, role: FoldRole) -> bool {
        match role {
            FoldRole::Qkv => self.qkv,
            FoldRole::Fc => self.fc,
            FoldRole::LmHead => self.lm_head,
        }
    }

    /// Marks `role`'s layernorm folded (or not).
    pub fn set(&mut self, role: FoldRole, folded: bool) {
        match role {
            FoldRole::Qkv => self.qkv = folded,
            FoldRole::Fc => self.fc = folded,
            FoldRole::LmHead => self.lm_head = folded,
        }
    }
}

/// Device pointers of one folded matmul's operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FoldedPtrs {
    /// `W2 [N,K]` in the storage type.
    pub weight: u64,
    /// `2N` values in the storage type: the folded bias, then `wsum`.
    pub bias: u64,
}

/// The folded copies uploaded so far, per role (empty until a plan first folds that role).
#[derive(Default)]
pub(super) struct FoldedWeights {
    /// Per layer.
    qkv: Vec<FoldedPtrs>,
    /// Per layer.
    fc: Vec<FoldedPtrs>,
    lm_head: Option<FoldedPtrs>,
    /// Keeps the copies alive (the pointers above address them).
    buffers: Vec<CudaSlice<u8>>,
}

impl FoldedWeights {
    /// The folded operands of `role` in `layer` (`None` for the LM head), if uploaded.
    pub fn get(&self, role: FoldRole, layer: Option<usize>) -> Option<FoldedPtrs> {
        match (role, layer) {
            (FoldRole::Qkv, Some(l)) => self.qkv.get(l).copied(),
            (FoldRole::Fc, Some(l)) => self.fc.get(l).copied(),
            (FoldRole::LmHead, None) => self.lm_head,
            _ => None,
        }
    }

    /// Whether `role`'s copies are uploaded.
    fn has(&self, role: FoldRole) -> bool {
        match role {
            FoldRole::Qkv => !self.qkv.is_empty(),
            FoldRole::Fc => !self.fc.is_empty(),
            FoldRole::LmHead => self.lm_head.is_some(),
        }
    }
}

/// A bad input to [`fold_layernorm`].
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    #[error("folding a layernorm into {what}: {detail}")]
    Shape { what: String, detail: String },
}

/// A matmul's operands with the layernorm before it folded in (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FoldedLinear {
    /// `W2 [N,K]`, every value already rounded to the storage type (encoding it is exact).
    pub weight: Vec<f32>,
    /// `2N`: `b[n] + sum_k W[n,k] beta[k]`, then `wsum[n]`, the rows' sums of `weight`.
    pub bias: Vec<f32>,
}

/// One weight row with gamma folded in and centered (`W2[n,·]` in exact f64, into `out`), and
/// its bias with beta folded in, `bias + sum_k row[k] beta[k]`.
fn fold_row(row: &[f32], bias: f64, gamma: &[f32], beta: &[f32], out: &mut [f64]) -> f64 {
    let mut shift = bias;
    for (((o, &w), &g), &b) in out.iter_mut().zip(row).zip(gamma).zip(beta) {
        *o = f64::from(w) * f64::from(g);
        shift += f64::from(w) * f64::from(b);
    }
    let mean = out.iter().sum::<f64>() / out.len().max(1) as f64;
    out.iter_mut().for_each(|o| *o -= mean);
    shift
}

/// Folds the layernorm (`gamma`, `beta`, K values each) into the matmul with `weight [N,K]` and
/// `bias [N]` (`None`: no bias), for a model stored in `storage`; `what` names the matmul in
/// errors.
pub(super) fn fold_layernorm(
    what: &str,
    weight: &[f32],
    bias: Option<&[f32]>,
    gamma: &[f32],
    beta: &[f32],
    storage: Storage,
) -> Result<FoldedLinear, FoldError> {
    let k = gamma.len();
    let bad = |detail: String| FoldError::Shape {
        what: what.to_string(),
        detail,
    };
    if k == 0 || beta.len() != k {
        return Err(bad(format!(
            "the layernorm has {k} gamma and {} beta values (want as many, at least one)",
            beta.len()
        )));
    }
    if !weight.len().is_multiple_of(k) {
        return Err(bad(format!(
            "the weight's {} values are not rows of the layernorm's {k}",
            weight.len()
        )));
    }
    let n = weight.len() / k;
    if let Some(b) = bias.filter(|b| b.len() != n) {
        return Err(bad(format!("the bias has {} values for {n} weight rows", b.len())));
    }
    let mut folded = vec![0.0f32; weight.len()];
    let sums: Vec<(f32, f32)> = folded
        .par_chunks_mut(k)
        .zip(weight.par_chunks(k))
        .enumerate()
        .map_init(
            || vec![0.0f64; k],
            |exact, (row_index, (stored, row))| {
                let b = bias.map_or(0.0, |b| f64::from(b[row_index]));
                let shift = fold_row(row, b, gamma, beta, exact);
                let mut wsum = 0.0f64;
                for (s, &x) in stored.iter_mut().zip(exact.iter()) {
                    *s = storage.round(x as f32);
                    wsum += f64::from(*s);
                }
                (shift as f32, wsum as f32)
            },
        )
        .collect();
    let bias = sums.iter().map(|s| s.0).chain(sums.iter().map(|s| s.1)).collect();
    Ok(FoldedLinear { weight: folded, bias })
}

/// Room left on the device after the folded copies, for what the prefill still allocates (the
/// workspace, loaded modules).
const FOLD_MARGIN_BYTES: usize = 256 << 20;

/// `Err` with the figures when `bytes` of folded copies do not fit in the `free` bytes of
/// `device` (the replica's estimate at start-up does not count them).
fn folded_copies_fit(device: &str, what: &str, bytes: usize, free: usize) -> Result<(), String> {
    upload_fits(device, bytes, FOLD_MARGIN_BYTES, free, |bytes, free| {
        format!("folding {what} needs a {bytes:.2} GiB copy of its weights and the GPU has {free:.2} GiB free")
    })
}

/// One matmul to fold, and the layernorm before it (the model's f32 master weights).
struct FoldSource<'a> {
    /// `h.3.qkv`, `the LM head`: for errors.
    name: String,
    weight: &'a [f32],
    bias: Option<&'a [f32]>,
    gamma: &'a [f32],
    beta: &'a [f32],
}

impl<'a> FoldSource<'a> {
    /// The matmul `name` with `weight` and `bias`, after the layernorm with `gamma` and `beta`.
    fn new(
        name: String,
        weight: &'a [f32],
        bias: Option<&'a [f32]>,
        gamma: &'a [f32],
        beta: &'a [f32],
    ) -> FoldSource<'a> {
        FoldSource {
            name,
            weight,
            bias,
            gamma,
            beta,
        }
    }
}

impl GpuBackend {
    /// Uploads the folded operands of `role` (every layer's, or the LM head's) unless they are
    /// there already. All or nothing: on an error nothing of `role` is kept.
    pub(super) fn ensure_folded(&mut self, role: FoldRole) -> AnyResult<()> {
        if self.folded.has(role) {
            return Ok(());
        }
        let cfg = self.model.config.clone();
        let storage = self.dtype.storage();
        let w = &self.model.weights;
        let c = cfg.n_embd;
        let (rows_per_matmul, count) = match role {
            FoldRole::Qkv => (3 * c, cfg.n_layer),
            FoldRole::Fc => (4 * c, cfg.n_layer),
            FoldRole::LmHead => (cfg.padded_vocab_size, 1),
        };
        let bytes = count * (rows_per_matmul * c + 2 * rows_per_matmul) * storage.bytes();
        let free = self.free_memory("folding a layernorm")?;
        let what = format!("{} into {}", role.layernorm(), role.matmul());
        folded_copies_fit(&self.device_label(), &what, bytes, free).map_err(|why| anyhow!(why))?;
        // Each matmul folded and uploaded in turn: the host holds one folded copy at a time.
        let wte = (role == FoldRole::LmHead).then(|| w.wte_padded(&cfg));
        let sources: Vec<FoldSource> = match role {
            FoldRole::Qkv => (w.layers.iter().enumerate())
                .map(|(l, x)| FoldSource::new(format!("h.{l}.qkv"), &x.qkv_w, Some(&x.qkv_b[..]), &x.ln1_w, &x.ln1_b))
                .collect(),
            FoldRole::Fc => (w.layers.iter().enumerate())
                .map(|(l, x)| FoldSource::new(format!("h.{l}.fc"), &x.fc_w, Some(&x.fc_b[..]), &x.ln2_w, &x.ln2_b))
                .collect(),
            FoldRole::LmHead => vec![FoldSource::new(
                "the LM head".to_string(),
                wte.as_deref().unwrap_or_default(),
                None,
                &w.lnf_w,
                &w.lnf_b,
            )],
        };
        let mut buffers = Vec::with_capacity(2 * sources.len());
        let mut ptrs = Vec::with_capacity(sources.len());
        for FoldSource {
            name,
            weight,
            bias,
            gamma,
            beta,
        } in sources
        {
            let f = fold_layernorm(&name, weight, bias, gamma, beta, storage)?;
            let mut up = |values: &[f32], part: &str| -> AnyResult<u64> {
                let s = self
                    .gpu
                    .stream
                    .clone_htod(&storage.encode(values))
                    .map_err(GpuError::cuda(format!("uploading the folded {part} of {name}")))?;
                let p = ptr(&self.gpu, &s);
                buffers.push(s);
                Ok(p)
            };
            ptrs.push(FoldedPtrs {
                weight: up(&f.weight, "weight")?,
                bias: up(&f.bias, "bias")?,
            });
        }
        match role {
            FoldRole::Qkv => self.folded.qkv = ptrs,
            FoldRole::Fc => self.folded.fc = ptrs,
            FoldRole::LmHead => self.folded.lm_head = ptrs.first().copied(),
        }
        self.folded.buffers.extend(buffers);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::layernorm::mean_rstd;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    }

    /// A tiny random layernorm + linear (rows of inputs with large offsets, as a residual stream
    /// has them).
    struct Tiny {
        k: usize,
        n: usize,
        x: Vec<f32>,
        gamma: Vec<f32>,
        beta: Vec<f32>,
        weight: Vec<f32>,
        bias: Vec<f32>,
    }

    fn tiny(seed: u64) -> Tiny {
        let (m, k, n) = (5, 24, 7);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut x = uniform(&mut rng, m * k, -2.0, 2.0);
        for (r, row) in x.chunks_mut(k).enumerate() {
            row.iter_mut().for_each(|v| *v += 10.0 * r as f32 - 20.0);
        }
        Tiny {
            k,
            n,
            x,
            gamma: uniform(&mut rng, k, 0.5, 1.5),
            beta: uniform(&mut rng, k, -0.5, 0.5),
            weight: uniform(&mut rng, n * k, -0.3, 0.3),
            bias: uniform(&mut rng, n, -1.0, 1.0),
        }
    }

    /// `layernorm(x) @ W^T + b` in f64, the unfolded model.
    fn layernorm_then_linear(t: &Tiny, bias: Option<&[f32]>) -> Vec<f64> {
        let mut out = Vec::new();
        for row in t.x.chunks(t.k) {
            let (mean, rstd) = mean_rstd(row);
            let ln: Vec<f64> = (0..t.k)
                .map(|i| (f64::from(row[i]) - mean) * rstd * f64::from(t.gamma[i]) + f64::from(t.beta[i]))
                .collect();
            for (j, w) in t.weight.chunks(t.k).enumerate() {
                let dot: f64 = ln.iter().zip(w).map(|(a, &b)| a * f64::from(b)).sum();
                out.push(dot + bias.map_or(0.0, |b| f64::from(b[j])));
            }
        }
        out
    }

    /// What an `ln_` kernel computes from raw rows: `rstd (x . W2 - mean wsum) + bias2`, all f64.
    fn standardize_then_folded(t: &Tiny, w2: &[f64], bias2: &[f64], wsum: &[f64]) -> Vec<f64> {
        let mut out = Vec::new();
        for row in t.x.chunks(t.k) {
            let (mean, rstd) = mean_rstd(row);
            for j in 0..t.n {
                let w = &w2[j * t.k..][..t.k];
                let dot: f64 = row.iter().zip(w).map(|(&a, b)| f64::from(a) * b).sum();
                out.push(rstd * (dot - mean * wsum[j]) + bias2[j]);
            }
        }
        out
    }

    #[test]
    fn standardizing_then_the_folded_linear_is_the_layernorm_then_the_linear() {
        for (seed, with_bias) in [(1, true), (2, false)] {
            let t = tiny(seed);
            let bias = with_bias.then_some(&t.bias[..]);
            let mut w2 = vec![0.0f64; t.n * t.k];
            let bias2: Vec<f64> = (0..t.n)
                .map(|j| {
                    let b = bias.map_or(0.0, |b| f64::from(b[j]));
                    fold_row(
                        &t.weight[j * t.k..][..t.k],
                        b,
                        &t.gamma,
                        &t.beta,
                        &mut w2[j * t.k..][..t.k],
                    )
                })
                .collect();
            let wsum: Vec<f64> = w2.chunks(t.k).map(|r| r.iter().sum()).collect();
            assert!(wsum.iter().all(|s| s.abs() < 1e-12), "centered rows: {wsum:?}");
            let got = standardize_then_folded(&t, &w2, &bias2, &wsum);
            let want = layernorm_then_linear(&t, bias);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-9, "seed {seed}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn wsum_is_the_row_sums_of_the_stored_weight() {
        let t = tiny(3);
        for storage in [Storage::Bf16, Storage::F16, Storage::F32] {
            let f = fold_layernorm("test", &t.weight, Some(&t.bias), &t.gamma, &t.beta, storage).unwrap();
            assert_eq!((f.weight.len(), f.bias.len()), (t.n * t.k, 2 * t.n));
            assert!(
                f.weight.iter().all(|&w| storage.round(w) == w),
                "{storage:?}: stored values"
            );
            for (j, row) in f.weight.chunks(t.k).enumerate() {
                let sum = row.iter().map(|&w| f64::from(w)).sum::<f64>() as f32;
                assert_eq!(f.bias[t.n + j], sum, "{storage:?}: row {j}");
                let size: f32 = row.iter().map(|w| w.abs()).sum();
                assert!(sum.abs() < 0.05 * size, "{storage:?}: row {j} is centered");
            }
            // The kernel's formula on the stored operands stays close to the unfolded model
            // (the weight's rounding is the only error).
            let w2: Vec<f64> = f.weight.iter().map(|&w| f64::from(w)).collect();
            let b2: Vec<f64> = f.bias[..t.n].iter().map(|&b| f64::from(b)).collect();
            let ws: Vec<f64> = f.bias[t.n..].iter().map(|&b| f64::from(b)).collect();
            let got: Vec<f32> = standardize_then_folded(&t, &w2, &b2, &ws)
                .iter()
                .map(|&x| x as f32)
                .collect();
            let err = crate::ops::relative_l2_error(&got, &layernorm_then_linear(&t, Some(&t.bias)));
            let bar = if storage == Storage::F32 { 1e-6 } else { 1e-2 };
            assert!(err < bar, "{storage:?}: {err}");
        }
    }

    #[test]
    fn mismatched_shapes_are_errors_naming_the_matmul() {
        let t = tiny(4);
        let cases = [
            fold_layernorm("h.0.fc", &t.weight, Some(&t.bias), &t.gamma, &t.beta[1..], Storage::F32),
            fold_layernorm("h.0.fc", &t.weight[1..], Some(&t.bias), &t.gamma, &t.beta, Storage::F32),
            fold_layernorm("h.0.fc", &t.weight, Some(&t.bias[1..]), &t.gamma, &t.beta, Storage::F32),
            fold_layernorm("h.0.fc", &t.weight, None, &[], &[], Storage::F32),
        ];
        for c in cases {
            let e = c.unwrap_err().to_string();
            assert!(e.starts_with("folding a layernorm into h.0.fc: "), "{e}");
        }
    }

    #[test]
    fn the_copies_are_refused_with_their_size_when_they_do_not_fit() {
        let gib = 1usize << 30;
        assert!(folded_copies_fit("cuda:0", "ln_f into lm_head", gib, 2 * gib).is_ok());
        let e = folded_copies_fit("cuda:0 (H100)", "ln_1 into qkv", gib, gib).unwrap_err();
        assert!(e.contains("ln_1 into qkv") && e.contains("1.00 GiB copy"), "{e}");
    }

    #[test]
    fn folded_layernorms_are_set_and_read_per_role() {
        let mut f = FoldedLayernorms::default();
        f.set(FoldRole::Fc, true);
        assert!(f.get(FoldRole::Fc) && !f.get(FoldRole::Qkv) && !f.get(FoldRole::LmHead));
        for role in [FoldRole::Qkv, FoldRole::Fc, FoldRole::LmHead] {
            let (plain, folded) = role.epilogues();
            assert!(folded.standardizes_input() && !plain.standardizes_input());
            assert!(FoldedWeights::default().get(role, Some(0)).is_none());
        }
        assert_eq!(FoldRole::Fc.epilogues().1, Epilogue::LnBiasGelu);
    }
}
