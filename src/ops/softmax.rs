//! softmax: row-wise, numerically stable softmax over `C`:
//! `out[r,c] = exp(inp[r,c] - max_r) / sum_c' exp(inp[r,c'] - max_r)`.
//!
//! Kernel arguments: `float* out, const float* inp, int N, int C`. Shape: `N` (rows), `C`.
//! Tensors: `out [N,C]` (output), `inp [N,C]` uniform in `[-2, 2]` plus a per-row offset of
//! +110 (rows 0, 3, ...) or -110 (rows 2, 5, ...): `exp` of those overflows / underflows in f32,
//! so a kernel that forgets to subtract the row max produces inf/NaN. No epilogue, no mask.

use rand::rngs::StdRng;

use super::*;

#[derive(Debug)]
pub struct Softmax;

/// Offset added to row `r` of the test inputs.
pub(crate) fn row_offset(r: usize) -> f32 {
    match r % 3 {
        0 => 110.0,
        1 => 0.0,
        _ => -110.0,
    }
}

impl OpContract for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn summary(&self) -> &'static str {
        "row-wise numerically stable softmax of an [N,C] matrix"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* inp, int N, int C"
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
        [(1, 1), (1, 37), (3, 5), (37, 100), (5, 1001), (64, 1024), (2, 50257)]
            .iter()
            .map(|&(n, c)| shape_of(&[("N", n), ("C", c)]))
            .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (n, c) = (shape["N"] as usize, shape["C"] as usize);
        let mut inp = uniform(rng, n * c, -2.0, 2.0);
        for (r, row) in inp.chunks_mut(c).enumerate() {
            let off = row_offset(r);
            row.iter_mut().for_each(|x| *x += off);
        }
        let tensors = vec![TensorArg::output_f32("out", n * c), TensorArg::input_f32("inp", inp)];
        let args = vec![Arg::Tensor(0), Arg::Tensor(1), Arg::I32(n as i32), Arg::I32(c as i32)];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let c = problem.dim("C");
        let mut out = Vec::with_capacity(problem.f32s("inp").len());
        for row in problem.f32s("inp").chunks(c) {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let e: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            out.extend(e.iter().map(|x| x / sum));
        }
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn softmax_by_hand() {
        let shape = shape_of(&[("N", 2), ("C", 3)]);
        let mut p = Softmax
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        // Row 0: [0, ln 2, ln 5] -> [1, 2, 5] / 8. Row 1: the same shifted by +1000.
        let (l2, l5) = (2f32.ln(), 5f32.ln());
        p.tensors[1].data = HostData::F32(vec![0.0, l2, l5, 1000.0, 1000.0, 1000.0]);
        let r = Softmax.reference(&p);
        let want = [0.125, 0.25, 0.625, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0];
        for (g, w) in r[0].1.iter().zip(want) {
            assert!((g - w).abs() < 1e-7, "{g} vs {w}");
        }
    }

    #[test]
    fn large_offsets_in_rows() {
        let shape = shape_of(&[("N", 3), ("C", 37)]);
        let p = Softmax
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(3))
            .unwrap();
        let inp = p.f32s("inp");
        assert!(inp[..37].iter().all(|&x| x > 100.0));
        assert!(inp[74..].iter().all(|&x| x < -100.0));
        // Naive exp without the max overflows / underflows in f32.
        assert!(inp[..37].iter().any(|&x| x.exp().is_infinite()));
        assert_eq!(inp[74..].iter().map(|&x| x.exp()).sum::<f32>(), 0.0);
        let r = Softmax.reference(&p);
        for row in r[0].1.chunks(37) {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }
}
