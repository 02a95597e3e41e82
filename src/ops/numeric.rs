//! Numbers for checking kernels: fresh random inputs (in parallel, from a seed alone), the f64
//! GELU of the references, and the error measures verification compares with.

use rand::rngs::StdRng;

/// Number of elements of `got` that differ from `want` (a length mismatch counts every
/// missing or extra element): the error of an [`super::OpContract::exact`] op.
pub fn mismatch_count(got: &[f32], want: &[f64]) -> f64 {
    let differ = got.iter().zip(want).filter(|(&g, &w)| g as f64 != w).count();
    (differ + got.len().abs_diff(want.len())) as f64
}

/// Relative L2 error `||got - want|| / ||want||` (denominator floored at 1e-30); any NaN/inf in
/// `got`, or a length mismatch, gives `f64::INFINITY`.
pub fn relative_l2_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut diff = 0.0f64;
    let mut norm = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        let d = g as f64 - w;
        diff += d * d;
        norm += w * w;
    }
    let e = diff.sqrt() / norm.sqrt().max(1e-30);
    if e.is_nan() {
        f64::INFINITY
    } else {
        e
    }
}

/// `n` values uniform in `[lo, hi)`.
pub(crate) fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    use rayon::prelude::*;
    // Large tensors (the LM head's weight) in parallel chunks, each from its own generator
    // seeded by `rng`: the values depend on the seed only, not on the thread count.
    const CHUNK: usize = 1 << 16;
    if n <= CHUNK {
        return (0..n).map(|_| rng.random_range(lo..hi)).collect();
    }
    let seeds: Vec<u64> = (0..n.div_ceil(CHUNK)).map(|_| rng.random()).collect();
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK).zip(seeds).for_each(|(chunk, seed)| {
        let mut chunk_rng = StdRng::seed_from_u64(seed);
        chunk.iter_mut().for_each(|v| *v = chunk_rng.random_range(lo..hi));
    });
    out
}

/// GELU, tanh approximation, in f64.
pub(crate) fn gelu_f64(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

pub(crate) fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Storage;

    #[test]
    fn relative_l2() {
        assert_eq!(relative_l2_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        let e = relative_l2_error(&[3.0, 4.0], &[0.0, 5.0]);
        // ||(3,-1)|| / 5
        assert!((e - 10f64.sqrt() / 5.0).abs() < 1e-12);
        assert_eq!(relative_l2_error(&[1.0, f32::NAN], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(relative_l2_error(&[f32::INFINITY], &[1.0]), f64::INFINITY);
        assert_eq!(relative_l2_error(&[f32::NEG_INFINITY], &[1.0]), f64::INFINITY);
        assert_eq!(relative_l2_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(relative_l2_error(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        assert!(relative_l2_error(&[1e-3], &[0.0]) > 1e20);
        assert_eq!(relative_l2_error(&[], &[]), 0.0);
    }

    /// Large tensors are drawn in parallel chunks: the values depend on the seed alone, stay in
    /// range, and differ between seeds; the device encoding (also chunked) matches element by
    /// element.
    #[test]
    fn large_random_tensors_depend_on_the_seed_only() {
        use rand::SeedableRng;
        let n = 3 * (1 << 16) + 17;
        let draw = |seed| uniform(&mut StdRng::seed_from_u64(seed), n, -1.0, 1.0);
        let a = draw(7);
        assert_eq!(a.len(), n);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().map(|v| *v as f64).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        for storage in [Storage::F32, Storage::F16, Storage::Bf16] {
            let bytes = storage.encode(&a);
            assert_eq!(bytes.len(), n * storage.bytes());
            let back = storage.decode(&bytes);
            for (x, y) in a.iter().zip(&back) {
                assert_eq!(storage.round(*x), *y);
            }
        }
    }
}
