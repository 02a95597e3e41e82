//! layernorm: per row of `C`: `out = (x - mean) * rstd * gamma + beta`,
//! `rstd = 1 / sqrt(var + 1e-5)`, biased variance (divide by `C`).
//!
//! Kernel arguments: `float* out, const float* inp, const float* gamma, const float* beta,
//! int N, int C`. Shape: `N` (rows), `C`.
//! Tensors: `out [N,C]` (output), `inp [N,C]` uniform in `[-1, 1]` plus a per-row offset in
//! `[-2, 2]`, `gamma [C]` in `[0.5, 1.5]`, `beta [C]` in `[-0.5, 0.5]`. The tensors are named
//! exactly `gamma` and `beta`: `const_params` variants copy them into `__constant__` memory by
//! name. No epilogue, no mask.

use rand::rngs::StdRng;

use super::*;

#[derive(Debug)]
pub struct LayerNorm;

/// Layernorm epsilon.
pub const EPS: f64 = 1e-5;

/// A row's mean and `rstd = 1 / sqrt(var + EPS)` (biased variance), in f64: the statistics of
/// this op's reference and of the matmul's `ln_` epilogues.
pub(crate) fn mean_rstd<T: Copy + Into<f64>>(row: &[T]) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&x| x.into()).sum::<f64>() / n;
    let var = row.iter().map(|&x| (x.into() - mean).powi(2)).sum::<f64>() / n;
    (mean, 1.0 / (var + EPS).sqrt())
}

impl OpContract for LayerNorm {
    fn name(&self) -> &'static str {
        "layernorm"
    }
    fn summary(&self) -> &'static str {
        "row-wise layer normalization of an [N,C] matrix with gamma/beta (eps 1e-5)"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* inp, const float* gamma, const float* beta, int N, int C"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["N", "C"]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let n = get_dim(self, shape, "N")?;
        let c = get_dim(self, shape, "C")?;
        check_i32(self, shape, &[("inp [N,C]", n * c)])
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        // C = 200 and 1032 fit 8-element (16-byte half) vectors but leave lanes of a warp with
        // nothing (25 vectors) or one lane with an extra one (129); 100 fits only 4-wide ones.
        [
            (1, 1),
            (1, 37),
            (3, 5),
            (37, 100),
            (9, 200),
            (5, 768),
            (3, 1032),
            (130, 1001),
            (3, 4099),
        ]
        .iter()
        .map(|&(n, c)| shape_of(&[("N", n), ("C", c)]))
        .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        use rand::Rng;
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (n, c) = (shape["N"] as usize, shape["C"] as usize);
        let mut inp = uniform(rng, n * c, -1.0, 1.0);
        for row in inp.chunks_mut(c) {
            let off: f32 = rng.random_range(-2.0..2.0);
            row.iter_mut().for_each(|x| *x += off);
        }
        let tensors = vec![
            TensorArg::output_f32("out", n * c),
            TensorArg::input_f32("inp", inp),
            TensorArg::input_f32("gamma", uniform(rng, c, 0.5, 1.5)),
            TensorArg::input_f32("beta", uniform(rng, c, -0.5, 0.5)),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(1),
            Arg::Tensor(2),
            Arg::Tensor(3),
            Arg::I32(n as i32),
            Arg::I32(c as i32),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let c = problem.dim("C");
        let gamma = problem.f32s("gamma");
        let beta = problem.f32s("beta");
        let mut out = Vec::with_capacity(problem.f32s("inp").len());
        for row in problem.f32s("inp").chunks(c) {
            let (mean, rstd) = mean_rstd(row);
            out.extend(
                row.iter()
                    .zip(gamma.iter().zip(beta))
                    .map(|(&x, (&g, &b))| (x as f64 - mean) * rstd * g as f64 + b as f64),
            );
        }
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn layernorm_by_hand() {
        let shape = shape_of(&[("N", 2), ("C", 3)]);
        let mut p = LayerNorm
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        // Row [1,2,3]: mean 2, var 2/3, rstd = 1/sqrt(2/3 + 1e-5) = 1.2247356859...
        // Row [5,5,5]: var 0 -> out = beta.
        p.tensors[1].data = HostData::F32(vec![1.0, 2.0, 3.0, 5.0, 5.0, 5.0]);
        p.tensors[2].data = HostData::F32(vec![1.0, 2.0, 0.5]);
        p.tensors[3].data = HostData::F32(vec![0.0, 0.25, -1.0]);
        let r = LayerNorm.reference(&p);
        let s = 1.2247356859;
        let want = [-s, 0.25, 0.5 * s - 1.0, 0.0, 0.25, -1.0];
        for (g, w) in r[0].1.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{g} vs {w}");
        }
    }

    #[test]
    fn gamma_beta_named_and_perturbed() {
        let shape = shape_of(&[("N", 4), ("C", 37)]);
        let p = LayerNorm
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(2))
            .unwrap();
        assert_eq!(p.tensor_index("gamma"), Some(2));
        assert_eq!(p.tensor_index("beta"), Some(3));
        assert!(p.f32s("gamma").iter().all(|&g| (0.5..=1.5).contains(&g)));
        assert!(p.f32s("gamma").iter().any(|&g| (g - 1.0).abs() > 0.05));
        assert!(p.f32s("beta").iter().any(|&b| b.abs() > 0.05));
    }
}
