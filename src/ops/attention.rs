//! attention: scaled dot-product attention per batch and head,
//! `out[b,t,h*HS+d] = sum_j softmax_j(scale * q[b,h,t,:] . k[b,h,j,:]) * v[b,h,j,d]` over the
//! keys `j` the mask allows query `i = t`: `full` every `j`; `causal` `j <= i`; `window`
//! `i - window < j <= i` (`window >= 1`).
//!
//! Kernel arguments: `float* out, const float* q, const float* k, const float* v,
//! float* workspace, int B, int NH, int T, int HS, int window, float scale`.
//! Shape: `B, NH, T, HS`; optional `window` (required, >= 1, for the `window` mask; 0 by default
//! otherwise, where kernels ignore it). `scale` is `1/sqrt(HS)`.
//! Tensors: `out [B,T,NH*HS]` (output: heads re-interleaved for the output projection), `q`, `k`
//! `[B,NH,T,HS]` uniform in `[-2, 2]` (peaked enough to test the softmax), `v [B,NH,T,HS]`
//! uniform in `[-1, 1]`. Workspace: the variant's own (`[B,NH,T,T]` scores for the naive one).
//! Masks: `causal`, `full`, `window` (no `none`). No epilogue.

use rand::rngs::StdRng;
use rayon::prelude::*;

use super::*;

#[derive(Debug)]
pub struct Attention;

impl OpContract for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn summary(&self) -> &'static str {
        "multi-head scaled dot-product attention, q/k/v [B,NH,T,HS] -> out [B,T,NH*HS], causal/full/window mask"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* q, const float* k, const float* v, float* workspace, int B, int NH, int T, int HS, int window, float scale"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "NH", "T", "HS"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["window"]
    }
    fn masks(&self) -> &'static [Mask] {
        &[Mask::Causal, Mask::Full, Mask::Window]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let b = get_dim(self, shape, "B")?;
        let nh = get_dim(self, shape, "NH")?;
        let t = get_dim(self, shape, "T")?;
        let hs = get_dim(self, shape, "HS")?;
        if mask == Mask::Window {
            match shape.get("window") {
                None => {
                    return Err(OpError::MissingVar {
                        op: self.name(),
                        var: "window".into(),
                        hint: "the window mask needs the window length, e.g. --shape B=1,NH=12,T=1024,HS=64,window=256"
                            .into(),
                    })
                }
                Some(&w) if w < 1 => {
                    return Err(OpError::Shape {
                        op: self.name(),
                        msg: format!("window mask needs window >= 1 (each query sees itself; window={w})"),
                    })
                }
                _ => {}
            }
        } else {
            let w = *shape.entry("window".into()).or_insert(0);
            if w < 0 {
                return Err(OpError::Shape {
                    op: self.name(),
                    msg: format!("window must not be negative (got {w})"),
                });
            }
        }
        check_i32(
            self,
            shape,
            &[
                ("q [B,NH,T,HS]", b * nh * t * hs),
                ("scores [B,NH,T,T]", b * nh * t * t),
            ],
        )
    }
    fn test_shapes(&self, _epilogue: Epilogue, mask: Mask) -> Vec<Shape> {
        // (B, NH, T, HS, window for the window mask)
        [
            (1, 1, 1, 64, 4),
            (2, 3, 5, 64, 1),
            (1, 2, 129, 64, 4),
            (1, 2, 300, 64, 100),
        ]
        .iter()
        .map(|&(b, nh, t, hs, w)| {
            let w = if mask == Mask::Window { w } else { 0 };
            shape_of(&[("B", b), ("NH", nh), ("T", t), ("HS", hs), ("window", w)])
        })
        .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (b, nh, t, hs) = (shape["B"], shape["NH"], shape["T"], shape["HS"]);
        let n = (b * nh * t * hs) as usize;
        let tensors = vec![
            TensorArg::output_f32("out", n),
            TensorArg::input_f32("q", uniform(rng, n, -2.0, 2.0)),
            TensorArg::input_f32("k", uniform(rng, n, -2.0, 2.0)),
            TensorArg::input_f32("v", uniform(rng, n, -1.0, 1.0)),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(1),
            Arg::Tensor(2),
            Arg::Tensor(3),
            Arg::Workspace,
            Arg::I32(b as i32),
            Arg::I32(nh as i32),
            Arg::I32(t as i32),
            Arg::I32(hs as i32),
            Arg::I32(shape["window"] as i32),
            Arg::F32(1.0 / (hs as f32).sqrt()),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let (b, nh, t_len, hs) = (problem.dim("B"), problem.dim("NH"), problem.dim("T"), problem.dim("HS"));
        let window = problem.dim("window");
        let mask = problem.mask;
        let scale = 1.0 / (hs as f64).sqrt();
        let (q, k, v) = (
            to_f64(problem.f32s("q")),
            to_f64(problem.f32s("k")),
            to_f64(problem.f32s("v")),
        );
        // One [T, HS] block per (batch, head).
        let heads: Vec<Vec<f64>> = (0..b * nh)
            .into_par_iter()
            .map(|bh| {
                let base = bh * t_len * hs;
                let mut o = vec![0.0f64; t_len * hs];
                let mut p = vec![0.0f64; t_len];
                for i in 0..t_len {
                    let (lo, hi) = match mask {
                        Mask::Full => (0, t_len),
                        Mask::Window => ((i + 1).saturating_sub(window), i + 1),
                        _ => (0, i + 1),
                    };
                    let qi = &q[base + i * hs..][..hs];
                    let mut max = f64::NEG_INFINITY;
                    for j in lo..hi {
                        let kj = &k[base + j * hs..][..hs];
                        p[j] = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                        max = max.max(p[j]);
                    }
                    let mut sum = 0.0;
                    for pj in &mut p[lo..hi] {
                        *pj = (*pj - max).exp();
                        sum += *pj;
                    }
                    let oi = &mut o[i * hs..][..hs];
                    for j in lo..hi {
                        let w = p[j] / sum;
                        for (od, vd) in oi.iter_mut().zip(&v[base + j * hs..][..hs]) {
                            *od += w * vd;
                        }
                    }
                }
                o
            })
            .collect();
        let c = nh * hs;
        let mut out = vec![0.0f64; b * t_len * c];
        for (bh, o) in heads.iter().enumerate() {
            let (bi, h) = (bh / nh, bh % nh);
            for t in 0..t_len {
                out[(bi * t_len + t) * c + h * hs..][..hs].copy_from_slice(&o[t * hs..][..hs]);
            }
        }
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// B=1, NH=1, T=3, HS=1 (scale 1): q = 1, k = [0, ln 2, 0], v = [1, 2, 4], so the
    /// unnormalised weights are [1, 2, 1].
    fn tiny(mask: Mask, window: i64) -> Vec<f64> {
        let shape = shape_of(&[("B", 1), ("NH", 1), ("T", 3), ("HS", 1), ("window", window)]);
        let mut p = Attention
            .problem(&shape, Epilogue::None, mask, &mut StdRng::seed_from_u64(1))
            .unwrap();
        assert_eq!(p.args[10], Arg::F32(1.0));
        p.tensors[1].data = HostData::F32(vec![1.0; 3]);
        p.tensors[2].data = HostData::F32(vec![0.0, 2f32.ln(), 0.0]);
        p.tensors[3].data = HostData::F32(vec![1.0, 2.0, 4.0]);
        Attention.reference(&p)[0].1.clone()
    }

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn masks_by_hand() {
        // full: (1*1 + 2*2 + 1*4) / 4 for every query.
        close(&tiny(Mask::Full, 0), &[2.25, 2.25, 2.25]);
        // causal: [1], [(1 + 4)/3], [9/4].
        close(&tiny(Mask::Causal, 0), &[1.0, 5.0 / 3.0, 2.25]);
        // window 2: [1], [(1 + 4)/3], keys {1,2}: (2*2 + 1*4)/3.
        close(&tiny(Mask::Window, 2), &[1.0, 5.0 / 3.0, 8.0 / 3.0]);
        // window 1: only the diagonal.
        close(&tiny(Mask::Window, 1), &[1.0, 2.0, 4.0]);
        // window >= T is causal.
        close(&tiny(Mask::Window, 10), &tiny(Mask::Causal, 0));
    }

    #[test]
    fn heads_interleaved() {
        // B=2, NH=2, T=2, HS=2, q = 0: causal output at t is the mean of v[b,h,0..=t,:].
        let shape = shape_of(&[("B", 2), ("NH", 2), ("T", 2), ("HS", 2)]);
        let mut p = Attention
            .problem(&shape, Epilogue::None, Mask::Causal, &mut StdRng::seed_from_u64(1))
            .unwrap();
        p.tensors[1].data = HostData::F32(vec![0.0; 16]);
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        p.tensors[3].data = HostData::F32(v.clone());
        let out = &Attention.reference(&p)[0].1;
        for b in 0..2 {
            for h in 0..2 {
                for t in 0..2 {
                    for d in 0..2 {
                        let vi = |j: usize| v[((b * 2 + h) * 2 + j) * 2 + d] as f64;
                        let want = (0..=t).map(vi).sum::<f64>() / (t + 1) as f64;
                        assert_eq!(out[(b * 2 + t) * 4 + h * 2 + d], want);
                    }
                }
            }
        }
    }

    #[test]
    fn complete_shape_window() {
        let mut s = shape_of(&[("B", 1), ("NH", 2), ("T", 5), ("HS", 64)]);
        Attention.complete_shape(&mut s, Epilogue::None, Mask::Causal).unwrap();
        assert_eq!(s["window"], 0);
        let mut s = shape_of(&[("B", 1), ("NH", 2), ("T", 5), ("HS", 64)]);
        let e = Attention
            .complete_shape(&mut s, Epilogue::None, Mask::Window)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("attention:") && e.contains("window"), "{e}");
        s.insert("window".into(), 0);
        let e = Attention
            .complete_shape(&mut s, Epilogue::None, Mask::Window)
            .unwrap_err()
            .to_string();
        assert!(e.contains("window >= 1"), "{e}");
        let e = Attention
            .complete_shape(&mut s, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mask `none`") && e.contains("causal"), "{e}");
    }
}
