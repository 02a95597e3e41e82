//! matmul: `out[m,n] = epilogue(sum_k inp[m,k] * weight[n,k] + bias[n])`, `weight` is `[N,K]`
//! (the PyTorch `Linear` layout).
//!
//! Kernel arguments: `float* out, const float* inp, const float* weight, const float* bias,
//! const float* residual, float* workspace, int M, int N, int K, int T, int n_head`.
//! Shape: `M, N, K`; optional `T` and `n_head` (default `M` and 1, only used by `qkv`, which
//! requires both, `M % T == 0` and `N % (3*n_head) == 0`).
//!
//! Epilogues: `none` (no bias), `bias`, `bias_gelu` (GELU, tanh approximation, after the bias),
//! `bias_residual` (`+ residual[m,n]` after the bias), `qkv` (bias, then scatter into three
//! head-major tensors `[B, n_head, T, HS]`, q then k then v, back to back in `out`: `C = N/3`,
//! `HS = C/n_head`, `B = M/T`; element `(m = b*T + t, n = which*C + h*HS + d)` goes to
//! `which*M*C + ((b*n_head + h)*T + t)*HS + d`).
//!
//! `ln_bias`, `ln_bias_gelu`, `ln_qkv`: the same three after the rows of `inp` are standardized
//! (a layernorm without gamma and beta): `out = epilogue(rstd[m] * (sum_k inp[m,k] *
//! weight[n,k] - mean[m] * wsum[n]) + bias[n])`, `mean[m]` and `rstd[m] = 1 / sqrt(var[m] +
//! 1e-5)` over the K values of row m (biased variance), `bias` holding `2N` values: the bias,
//! then `wsum`. With `wsum[n] = sum_k weight[n,k]` that is `((inp - mean) * rstd) @ weight^T +
//! bias`, and with the layernorm's gamma folded into `weight` (`weight[n,k] * gamma[k]`) and
//! its beta into the bias (`bias[n] + sum_k weight[n,k] * beta[k]`) it is `layernorm(inp) @
//! weight^T + bias`: what the model runs, without the layernorm's own pass over the rows (see
//! `model/gpu/fold.rs`). A kernel has all of a row's K values in hand anyway; it sums them (and
//! their squares) as they pass.
//!
//! Tensors: `out [M*N]` (output), `inp [M,K]` uniform in `[-1, 1]`, `weight [N,K]` uniform in
//! `[-1, 1] / sqrt(K)` (outputs stay O(1) so GELU is tested where it bends), `bias [N]` uniform
//! in `[-1, 1]` (also for `none`, to catch kernels that add it anyway), `residual` `[M,N]` uniform
//! in `[-1, 1]` for `bias_residual`, else a 1-element dummy. Workspace: the variant's own. For
//! the `ln_` epilogues each row of `inp` is shifted by its own offset, uniform in `[-0.5, 0.5]`
//! (a kernel that drops the mean's term is off by about half the output), and `wsum` is the
//! weight rows' sums.

use rand::rngs::StdRng;
use rayon::prelude::*;

use super::layernorm::mean_rstd;
use super::*;

#[derive(Debug)]
pub struct Matmul;

/// Where the qkv epilogue stores element `(m, n)` of the `[M, N]` product.
pub fn qkv_index(m: usize, n: usize, big_m: usize, big_n: usize, t_len: usize, n_head: usize) -> usize {
    let c = big_n / 3;
    let hs = c / n_head;
    let (b, t) = (m / t_len, m % t_len);
    let (which, rem) = (n / c, n % c);
    let (h, d) = (rem / hs, rem % hs);
    which * big_m * c + ((b * n_head + h) * t_len + t) * hs + d
}

/// The sums of the rows of `weight` (`[N, K]`), the `wsum` half of an `ln_` epilogue's bias.
pub fn weight_sums(weight: &[f32], k: usize) -> Vec<f32> {
    weight
        .chunks(k.max(1))
        .map(|row| row.iter().map(|&w| f64::from(w)).sum::<f64>() as f32)
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (ac, bc) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

impl OpContract for Matmul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn summary(&self) -> &'static str {
        "out[M,N] = inp[M,K] @ weight[N,K]^T with a fused epilogue (bias, gelu, residual, qkv split; each but residual also after standardizing inp's rows: ln_)"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* inp, const float* weight, const float* bias, const float* residual, float* workspace, int M, int N, int K, int T, int n_head"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["M", "N", "K"]
    }
    fn row_dims(&self) -> &'static [&'static str] {
        // T defaults to M outside the qkv epilogue, so the two move together.
        &["M", "T"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["T", "n_head"]
    }
    fn epilogues(&self) -> &'static [Epilogue] {
        &[
            Epilogue::None,
            Epilogue::Bias,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
            Epilogue::Qkv,
            Epilogue::LnBias,
            Epilogue::LnBiasGelu,
            Epilogue::LnQkv,
        ]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let m = get_dim(self, shape, "M")?;
        let n = get_dim(self, shape, "N")?;
        let k = get_dim(self, shape, "K")?;
        if epilogue.after_product() == Epilogue::Qkv {
            for var in ["T", "n_head"] {
                if !shape.contains_key(var) {
                    return Err(OpError::MissingVar {
                        op: self.name(),
                        var: var.into(),
                        hint: "the qkv epilogue needs the sequence length and head count, e.g. --shape M=2048,N=2304,K=768,T=1024,n_head=12".into(),
                    });
                }
            }
            let t = get_dim(self, shape, "T")?;
            let nh = get_dim(self, shape, "n_head")?;
            if m % t != 0 {
                return Err(OpError::Shape {
                    op: self.name(),
                    msg: format!("qkv epilogue needs M divisible by T (M=B*T rows; M={m}, T={t})"),
                });
            }
            if n % (3 * nh) != 0 {
                return Err(OpError::Shape {
                    op: self.name(),
                    msg: format!("qkv epilogue needs N divisible by 3*n_head (N={n}, n_head={nh})"),
                });
            }
        } else {
            shape.entry("T".into()).or_insert(m);
            shape.entry("n_head".into()).or_insert(1);
            let (t, nh) = (shape["T"], shape["n_head"]);
            if t <= 0 || nh <= 0 {
                return Err(OpError::Shape {
                    op: self.name(),
                    msg: format!(
                        "T and n_head must be positive (T={t}, n_head={nh}); leave them out unless the epilogue is qkv"
                    ),
                });
            }
        }
        check_i32(
            self,
            shape,
            &[("inp [M,K]", m * k), ("weight [N,K]", n * k), ("out [M,N]", m * n)],
        )
    }
    fn test_shapes(&self, epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        if epilogue.after_product() == Epilogue::Qkv {
            // (M, N, K, T, n_head)
            [
                (4, 12, 3, 1, 2),
                (8, 48, 40, 1, 2),
                (10, 48, 40, 5, 2),
                (21, 108, 72, 7, 3),
                (66, 192, 64, 33, 4),
            ]
            .iter()
            .map(|&(m, n, k, t, nh)| shape_of(&[("M", m), ("N", n), ("K", k), ("T", t), ("n_head", nh)]))
            .collect()
        } else {
            [
                // Tiny edges, but with enough outputs that one element's rounding under
                // cancellation cannot dominate the relative L2 error.
                (1, 37, 1),
                (5, 13, 7),
                (37, 100, 72),
                (3, 100, 72),
                (1, 64, 40),
                (130, 96, 33),
                (64, 192, 64),
            ]
            .iter()
            .map(|&(m, n, k)| shape_of(&[("M", m), ("N", n), ("K", k), ("T", m), ("n_head", 1)]))
            .collect()
        }
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (m, n, k) = (shape["M"] as usize, shape["N"] as usize, shape["K"] as usize);
        let w_scale = 1.0 / (k as f32).sqrt();
        let weight: Vec<f32> = uniform(rng, n * k, -1.0, 1.0)
            .into_iter()
            .map(|w| w * w_scale)
            .collect();
        let residual = if epilogue == Epilogue::BiasResidual {
            uniform(rng, m * n, -1.0, 1.0)
        } else {
            vec![0.5]
        };
        let mut inp = uniform(rng, m * k, -1.0, 1.0);
        let mut bias = uniform(rng, n, -1.0, 1.0);
        if epilogue.standardizes_input() {
            let offsets = uniform(rng, m, -0.5, 0.5);
            for (row, offset) in inp.chunks_mut(k).zip(offsets) {
                row.iter_mut().for_each(|x| *x += offset);
            }
            bias.extend(weight_sums(&weight, k));
        }
        let tensors = vec![
            TensorArg::output_f32("out", m * n),
            TensorArg::input_f32("inp", inp),
            TensorArg::input_f32("weight", weight),
            TensorArg::input_f32("bias", bias),
            TensorArg::input_f32("residual", residual),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(1),
            Arg::Tensor(2),
            Arg::Tensor(3),
            Arg::Tensor(4),
            Arg::Workspace,
            Arg::I32(m as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I32(shape["T"] as i32),
            Arg::I32(shape["n_head"] as i32),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let (m, n, k) = (problem.dim("M"), problem.dim("N"), problem.dim("K"));
        let inp = to_f64(problem.f32s("inp"));
        let weight = to_f64(problem.f32s("weight"));
        let bias = problem.f32s("bias");
        let residual = problem.f32s("residual");
        let standardize = problem.epilogue.standardizes_input();
        let epilogue = problem.epilogue.after_product();
        // Each row's (mean, rstd) for the `ln_` epilogues, and the weight sums they subtract.
        let row_stats: Vec<(f64, f64)> = if standardize {
            inp.chunks(k.max(1)).map(mean_rstd).collect()
        } else {
            Vec::new()
        };
        let mut out = vec![0.0f64; m * n];
        // Blocks of rows share each weight row while it is in cache; at least as many blocks as
        // threads (the tuner checks the LM head on only ~50 rows).
        let rows_per_block = (m / rayon::current_num_threads()).clamp(1, 16);
        out.par_chunks_mut(rows_per_block * n)
            .enumerate()
            .for_each(|(blk, chunk)| {
                let m0 = blk * rows_per_block;
                let rows = chunk.len() / n;
                for j in 0..n {
                    let w = &weight[j * k..][..k];
                    for r in 0..rows {
                        let mm = m0 + r;
                        let mut x = dot(&inp[mm * k..][..k], w);
                        if standardize {
                            let (mean, rstd) = row_stats[mm];
                            x = rstd * (x - mean * bias[n + j] as f64);
                        }
                        if epilogue != Epilogue::None {
                            x += bias[j] as f64;
                        }
                        match epilogue {
                            Epilogue::BiasGelu => x = gelu_f64(x),
                            Epilogue::BiasResidual => x += residual[mm * n + j] as f64,
                            _ => {}
                        }
                        chunk[r * n + j] = x;
                    }
                }
            });
        if epilogue == Epilogue::Qkv {
            let (t, nh) = (problem.dim("T"), problem.dim("n_head"));
            let mut scattered = vec![0.0f64; m * n];
            for mm in 0..m {
                for j in 0..n {
                    scattered[qkv_index(mm, j, m, n, t, nh)] = out[mm * n + j];
                }
            }
            out = scattered;
        }
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn hand_problem(epilogue: Epilogue) -> Problem {
        let shape = shape_of(&[("M", 2), ("N", 3), ("K", 2)]);
        let mut p = Matmul
            .problem(&shape, epilogue, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        p.tensors[1].data = HostData::F32(vec![1.0, 2.0, 3.0, 4.0]);
        p.tensors[2].data = HostData::F32(vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        p.tensors[3].data = HostData::F32(vec![0.5, -1.0, 2.0]);
        p.tensors[4].data = HostData::F32(vec![1.0, 1.0, 1.0, 0.0, 0.0, -1.0]);
        p
    }

    #[test]
    fn matmul_by_hand() {
        // inp [[1,2],[3,4]] @ weight^T with weight [[1,0],[0,1],[1,1]] = [[1,2,3],[3,4,7]].
        let r = |e| Matmul.reference(&hand_problem(e))[0].1.clone();
        assert_eq!(r(Epilogue::None), vec![1.0, 2.0, 3.0, 3.0, 4.0, 7.0]);
        assert_eq!(r(Epilogue::Bias), vec![1.5, 1.0, 5.0, 3.5, 3.0, 9.0]);
        assert_eq!(r(Epilogue::BiasResidual), vec![2.5, 2.0, 6.0, 3.5, 3.0, 8.0]);
        let g = r(Epilogue::BiasGelu);
        assert!((g[1] - 0.8411919906).abs() < 1e-9);
        for (x, want) in g.iter().zip([1.5, 1.0, 5.0, 3.5, 3.0, 9.0]) {
            assert!((x - gelu_f64(want)).abs() < 1e-12);
        }
    }

    #[test]
    fn ln_bias_by_hand() {
        // Rows [1,2] and [3,4] of hand_problem both standardize to [-0.5, 0.5] * rstd, rstd =
        // 1 / sqrt(0.25 + 1e-5) (about 2); @ weight^T = [-0.5, 0.5, 0] * rstd, + bias [0.5, -1, 2].
        let mut p = hand_problem(Epilogue::LnBias);
        p.tensors[3].data = HostData::F32(vec![0.5, -1.0, 2.0, 1.0, 1.0, 2.0]);
        let rstd = 1.0 / (0.25f64 + 1e-5).sqrt();
        let want = [-0.5 * rstd + 0.5, 0.5 * rstd - 1.0, 2.0];
        let got = Matmul.reference(&p)[0].1.clone();
        for (g, w) in got.iter().zip(want.iter().chain(want.iter())) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
    }

    /// Each `ln_` epilogue is its plain epilogue applied to the explicitly standardized rows,
    /// when the bias's second half holds the weight rows' sums (as the problems are built).
    #[test]
    fn ln_epilogues_are_their_epilogue_on_standardized_rows() {
        let plain = shape_of(&[("M", 7), ("N", 12), ("K", 9)]);
        let qkv = shape_of(&[("M", 6), ("N", 12), ("K", 9), ("T", 3), ("n_head", 2)]);
        for e in [Epilogue::LnBias, Epilogue::LnBiasGelu, Epilogue::LnQkv] {
            let shape = if e == Epilogue::LnQkv { &qkv } else { &plain };
            let p = Matmul
                .problem(shape, e, Mask::None, &mut StdRng::seed_from_u64(5))
                .unwrap();
            let (m, n, k) = (p.dim("M"), p.dim("N"), p.dim("K"));
            assert_eq!(p.f32s("bias").len(), 2 * n);
            assert_eq!(&p.f32s("bias")[n..], &weight_sums(p.f32s("weight"), k)[..]);
            let mut q = Matmul
                .problem(shape, e.after_product(), Mask::None, &mut StdRng::seed_from_u64(5))
                .unwrap();
            let standardized: Vec<f32> = p
                .f32s("inp")
                .chunks(k)
                .flat_map(|row| {
                    let (mean, rstd) = mean_rstd(row);
                    row.iter()
                        .map(move |&x| ((x as f64 - mean) * rstd) as f32)
                        .collect::<Vec<_>>()
                })
                .collect();
            q.tensors[1].data = HostData::F32(standardized);
            q.tensors[2].data = p.tensors[2].data.clone();
            q.tensors[3].data = HostData::F32(p.f32s("bias")[..n].to_vec());
            let (got, want) = (&Matmul.reference(&p)[0].1, &Matmul.reference(&q)[0].1);
            assert_eq!(got.len(), m * n);
            let err = relative_l2_error(&got.iter().map(|&x| x as f32).collect::<Vec<_>>(), want);
            assert!(err < 1e-6, "{e}: {err}");
            // The row offsets matter: without the mean's term the result is far off.
            let mut dropped = p.clone();
            dropped.tensors[3].data = HostData::F32([&p.f32s("bias")[..n], &vec![0.0; n][..]].concat());
            let err = relative_l2_error(
                &Matmul.reference(&dropped)[0]
                    .1
                    .iter()
                    .map(|&x| x as f32)
                    .collect::<Vec<_>>(),
                want,
            );
            assert!(err > 0.05, "{e}: {err}");
        }
    }

    #[test]
    fn qkv_index_by_hand() {
        // M=4 (B=2, T=2), N=12, n_head=2: C=4, HS=2.
        // m=3 (b=1,t=1), n=9 (v, h=0, d=1): 2*4*4 + ((1*2+0)*2+1)*2 + 1 = 43.
        assert_eq!(qkv_index(3, 9, 4, 12, 2, 2), 43);
        // m=1 (b=0,t=1), n=6 (k, h=1, d=0): 1*16 + ((0+1)*2+1)*2 + 0 = 22.
        assert_eq!(qkv_index(1, 6, 4, 12, 2, 2), 22);
        assert_eq!(qkv_index(0, 0, 4, 12, 2, 2), 0);
        // A permutation of 0..M*N.
        let mut seen = [false; 48];
        for m in 0..4 {
            for n in 0..12 {
                let i = qkv_index(m, n, 4, 12, 2, 2);
                assert!(!seen[i]);
                seen[i] = true;
            }
        }
    }

    #[test]
    fn qkv_reference_by_hand() {
        // M=2 (B=2, T=1), N=6, n_head=1 (C=2, HS=2), K=1, weight all 1, bias = n, inp = 10*m.
        // Plain row m: [10m + n for n in 0..6]; q rows then k rows then v rows.
        let shape = shape_of(&[("M", 2), ("N", 6), ("K", 1), ("T", 1), ("n_head", 1)]);
        let mut p = Matmul
            .problem(&shape, Epilogue::Qkv, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        p.tensors[1].data = HostData::F32(vec![0.0, 10.0]);
        p.tensors[2].data = HostData::F32(vec![1.0; 6]);
        p.tensors[3].data = HostData::F32(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let want = vec![0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0, 4.0, 5.0, 14.0, 15.0];
        assert_eq!(Matmul.reference(&p)[0].1, want);
    }

    #[test]
    fn complete_shape_defaults_and_errors() {
        let mut s = shape_of(&[("M", 37), ("N", 100), ("K", 72)]);
        Matmul.complete_shape(&mut s, Epilogue::Bias, Mask::None).unwrap();
        assert_eq!((s["T"], s["n_head"]), (37, 1));

        let mut s = shape_of(&[("M", 10), ("N", 100), ("K", 8), ("T", 5), ("n_head", 2)]);
        let e = Matmul
            .complete_shape(&mut s, Epilogue::Qkv, Mask::None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "matmul: qkv epilogue needs N divisible by 3*n_head (N=100, n_head=2)"
        );

        let mut s = shape_of(&[("M", 10), ("N", 48), ("K", 8), ("T", 3), ("n_head", 2)]);
        let e = Matmul
            .complete_shape(&mut s, Epilogue::Qkv, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("M divisible by T"), "{e}");

        let mut s = shape_of(&[("M", 10), ("N", 48), ("K", 8)]);
        let e = Matmul
            .complete_shape(&mut s, Epilogue::Qkv, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("matmul:") && e.contains('T') && e.contains("n_head"),
            "{e}"
        );

        let mut s = shape_of(&[("M", 10), ("N", 48), ("K", 8)]);
        let e = Matmul
            .complete_shape(&mut s, Epilogue::Bias, Mask::Causal)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mask `causal`"), "{e}");

        let mut s = shape_of(&[("M", 100_000), ("N", 100_000), ("K", 8)]);
        assert!(Matmul.complete_shape(&mut s, Epilogue::Bias, Mask::None).is_err());
    }

    #[test]
    fn residual_only_when_used() {
        let mut rng = StdRng::seed_from_u64(3);
        let shape = shape_of(&[("M", 5), ("N", 3), ("K", 7)]);
        let p = Matmul
            .problem(&shape, Epilogue::BiasResidual, Mask::None, &mut rng)
            .unwrap();
        assert_eq!(p.f32s("residual").len(), 15);
        let p = Matmul.problem(&shape, Epilogue::Bias, Mask::None, &mut rng).unwrap();
        assert!(!p.f32s("residual").is_empty());
        assert_eq!(p.f32s("bias").len(), 3);
    }

    #[test]
    fn blocked_reference_matches_naive() {
        let shape = shape_of(&[("M", 37), ("N", 10), ("K", 9)]);
        let p = Matmul
            .problem(&shape, Epilogue::Bias, Mask::None, &mut StdRng::seed_from_u64(4))
            .unwrap();
        let (inp, w, b) = (p.f32s("inp"), p.f32s("weight"), p.f32s("bias"));
        let got = &Matmul.reference(&p)[0].1;
        for m in 0..37 {
            for n in 0..10 {
                let want: f64 = (0..9).map(|k| inp[m * 9 + k] as f64 * w[n * 9 + k] as f64).sum::<f64>() + b[n] as f64;
                assert!((got[m * 10 + n] - want).abs() < 1e-12);
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use rand::SeedableRng;

    /// `cargo test --release --lib ops::matmul::speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn gpt2_mlp_reference_speed() {
        let shape = shape_of(&[("M", 1024), ("N", 3072), ("K", 768)]);
        let t0 = std::time::Instant::now();
        let p = Matmul
            .problem(&shape, Epilogue::BiasGelu, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        let t1 = std::time::Instant::now();
        let r = Matmul.reference(&p);
        println!("problem {:?}, reference {:?}", t1 - t0, t1.elapsed());
        assert_eq!(r[0].1.len(), 1024 * 3072);
    }
}
