//! cuBLASLt's view of a kernelforge matmul, the part that needs no GPU: which cuBLASLt
//! epilogue each of ours maps to, the compute and element types per dtype, and the row-major ↔
//! column-major geometry (see [`geometry`]). Used by [`super::cublaslt`].

use cudarc::cublaslt::sys;

use crate::ops::Epilogue;
use crate::spec::Dtype;

/// What cuBLASLt can fuse for one of our epilogues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fused {
    pub epilogue: sys::cublasLtEpilogue_t,
    /// Whether the bias pointer is set (`bias[n]`, one per row of cuBLASLt's D).
    pub bias: bool,
    /// beta = 1 with C = the residual; otherwise beta = 0 and C is not read.
    pub residual_as_c: bool,
}

/// The cuBLASLt epilogue for `epilogue`, or `None` when cuBLASLt has none (the QKV split). For
/// the `ln_` epilogues: the one of the GEMM that follows the peer's standardization pass.
pub fn fused(epilogue: Epilogue) -> Option<Fused> {
    use sys::cublasLtEpilogue_t as E;
    let (epilogue, bias, residual_as_c) = match epilogue {
        Epilogue::None => (E::CUBLASLT_EPILOGUE_DEFAULT, false, false),
        Epilogue::Bias => (E::CUBLASLT_EPILOGUE_BIAS, true, false),
        Epilogue::BiasGelu => (E::CUBLASLT_EPILOGUE_GELU_BIAS, true, false),
        // D = A·B + 1·C + bias: the bias is added after alpha·A·B + beta·C.
        Epilogue::BiasResidual => (E::CUBLASLT_EPILOGUE_BIAS, true, true),
        Epilogue::Qkv => return None,
        Epilogue::LnBias | Epilogue::LnBiasGelu | Epilogue::LnQkv => return fused(epilogue.after_product()),
    };
    Some(Fused {
        epilogue,
        bias,
        residual_as_c,
    })
}

/// Compute type and the element type of A, B, C, D (and the bias) for `dtype`.
pub fn types(dtype: Dtype) -> (sys::cublasComputeType_t, sys::cudaDataType_t) {
    use sys::cublasComputeType_t as C;
    use sys::cudaDataType_t as T;
    match dtype {
        Dtype::F32 => (C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F),
        Dtype::Tf32 => (C::CUBLAS_COMPUTE_32F_FAST_TF32, T::CUDA_R_32F),
        Dtype::F16 => (C::CUBLAS_COMPUTE_32F, T::CUDA_R_16F),
        Dtype::Bf16 => (C::CUBLAS_COMPUTE_32F, T::CUDA_R_16BF),
    }
}

/// A column-major matrix as cuBLASLt's layout describes it: rows, columns, leading dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixShape {
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
}

/// cuBLASLt's view of the row-major `out[M,N] = inp[M,K] · W[N,K]^T`.
///
/// A row-major `R x C` buffer read column-major is its transpose, `C x R` with leading dimension
/// `C`. So `out` is `D = out^T` (N x M, ld N), the weight buffer is `W^T` (K x N, ld K) and the
/// input buffer is `inp^T` (K x M, ld K). `D = op_T(W^T) · inp^T = W · inp^T = (inp · W^T)^T`:
/// A = the weight buffer transposed, B = the input buffer as it is, and cuBLASLt's
/// `(m, n, k) = (N, M, K)`. `bias[n]` is one value per row of D, which is how
/// `CUBLASLT_EPILOGUE_BIAS` broadcasts it; the row-major residual `[M,N]` is laid out exactly
/// like D, so it is C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// cuBLASLt's m, n, k.
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// A and B as stored (before `op`), C and D.
    pub a: MatrixShape,
    pub b: MatrixShape,
    pub d: MatrixShape,
    pub trans_a: bool,
    pub trans_b: bool,
    /// Elements of the bias vector (rows of D).
    pub bias_len: u64,
}

/// The [`Geometry`] of our `M, N, K` matmul.
pub fn geometry(m: usize, n: usize, k: usize) -> Geometry {
    let (m, n, k) = (m as u64, n as u64, k as u64);
    Geometry {
        m: n,
        n: m,
        k,
        a: MatrixShape {
            rows: k,
            cols: n,
            ld: k as i64,
        },
        b: MatrixShape {
            rows: k,
            cols: m,
            ld: k as i64,
        },
        d: MatrixShape {
            rows: n,
            cols: m,
            ld: n as i64,
        },
        trans_a: true,
        trans_b: false,
        bias_len: n,
    }
}

/// One peer problem: the shape, the precision and our epilogue (the key algorithms are kept
/// under, and what every error names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtCase {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: Dtype,
    pub epilogue: Epilogue,
}

impl std::fmt::Display for LtCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "matmul {} {} M={} N={} K={}",
            self.dtype, self.epilogue, self.m, self.n, self.k
        )
    }
}

/// The alignment, in bytes, every one of `ptrs` has: the largest power of two dividing them
/// all, capped at 256 (cuBLASLt's largest requirement and default assumption). No pointers, or
/// only null ones: 256.
pub fn alignment(ptrs: impl IntoIterator<Item = u64>) -> u32 {
    ptrs.into_iter()
        .map(|p| if p == 0 { 256 } else { 1u64 << p.trailing_zeros().min(8) })
        .min()
        .unwrap_or(256) as u32
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::ops::{self, OpContract};

    #[test]
    fn every_epilogue_but_qkv_is_fused() {
        use sys::cublasLtEpilogue_t as E;
        let f = |e| fused(e).map(|f| (f.epilogue, f.bias, f.residual_as_c));
        assert_eq!(f(Epilogue::None), Some((E::CUBLASLT_EPILOGUE_DEFAULT, false, false)));
        assert_eq!(f(Epilogue::Bias), Some((E::CUBLASLT_EPILOGUE_BIAS, true, false)));
        assert_eq!(
            f(Epilogue::BiasGelu),
            Some((E::CUBLASLT_EPILOGUE_GELU_BIAS, true, false))
        );
        assert_eq!(f(Epilogue::BiasResidual), Some((E::CUBLASLT_EPILOGUE_BIAS, true, true)));
        assert_eq!(f(Epilogue::Qkv), None);
        // The values cuBLASLt's header gives them (the attribute is set as a uint32).
        assert_eq!(E::CUBLASLT_EPILOGUE_DEFAULT as u32, 1);
        assert_eq!(E::CUBLASLT_EPILOGUE_BIAS as u32, 4);
        assert_eq!(E::CUBLASLT_EPILOGUE_GELU_BIAS as u32, 36);
    }

    #[test]
    fn compute_and_storage_types_per_dtype() {
        use sys::cublasComputeType_t as C;
        use sys::cudaDataType_t as T;
        assert_eq!(types(Dtype::F32), (C::CUBLAS_COMPUTE_32F, T::CUDA_R_32F));
        assert_eq!(types(Dtype::Tf32), (C::CUBLAS_COMPUTE_32F_FAST_TF32, T::CUDA_R_32F));
        assert_eq!(types(Dtype::F16), (C::CUBLAS_COMPUTE_32F, T::CUDA_R_16F));
        assert_eq!(types(Dtype::Bf16), (C::CUBLAS_COMPUTE_32F, T::CUDA_R_16BF));
    }

    #[test]
    fn alignment_of_pointers() {
        assert_eq!(alignment([0x7f00_0000_0000u64, 0x7f00_0000_0200]), 256);
        assert_eq!(alignment([0x7f00_0000_0000u64, 0x7f00_0000_0010]), 16);
        assert_eq!(alignment([0x7f00_0000_0002u64]), 2);
        assert_eq!(alignment(std::iter::empty()), 256);
        assert_eq!(alignment([0u64]), 256);
    }

    #[test]
    fn geometry_of_the_awkward_shape() {
        let g = geometry(37, 100, 72);
        assert_eq!((g.m, g.n, g.k), (100, 37, 72));
        assert_eq!(
            g.a,
            MatrixShape {
                rows: 72,
                cols: 100,
                ld: 72
            }
        );
        assert_eq!(
            g.b,
            MatrixShape {
                rows: 72,
                cols: 37,
                ld: 72
            }
        );
        assert_eq!(
            g.d,
            MatrixShape {
                rows: 100,
                cols: 37,
                ld: 100
            }
        );
        assert!(g.trans_a && !g.trans_b);
        assert_eq!(g.bias_len, 100);
        for (m, n, k) in [(1, 2304, 768), (130, 3072, 768), (8192, 50304, 768), (5, 13, 7)] {
            let g = geometry(m, n, k);
            // op(A) is m x k and op(B) is k x n in cuBLASLt's terms.
            let op_a = if g.trans_a {
                (g.a.cols, g.a.rows)
            } else {
                (g.a.rows, g.a.cols)
            };
            let op_b = if g.trans_b {
                (g.b.cols, g.b.rows)
            } else {
                (g.b.rows, g.b.cols)
            };
            assert_eq!(op_a, (g.m, g.k));
            assert_eq!(op_b, (g.k, g.n));
            assert_eq!((g.d.rows, g.d.cols), (g.m, g.n));
            // Each stored matrix covers exactly its buffer: ld = rows, ld * cols = elements.
            for (s, elems) in [(g.a, n * k), (g.b, m * k), (g.d, m * n)] {
                assert_eq!(s.ld, s.rows as i64);
                assert_eq!(s.ld as u64 * s.cols, elems as u64);
            }
        }
    }

    /// Emulates cuBLASLt's column-major `D = epilogue(op(A)·op(B) + beta·C + bias)` on the raw
    /// row-major buffers, reading them only through the geometry, and compares with the op's
    /// f64 reference: the mapping is right for every fused epilogue.
    #[test]
    fn the_column_major_view_computes_the_row_major_contract() {
        for e in [
            Epilogue::None,
            Epilogue::Bias,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
        ] {
            let (m, n, k) = (5usize, 7usize, 3usize);
            let shape = ops::shape_of(&[("M", m as i64), ("N", n as i64), ("K", k as i64)]);
            let p = ops::matmul::Matmul
                .problem(&shape, e, ops::Mask::None, &mut rand::rngs::StdRng::seed_from_u64(7))
                .unwrap();
            let want = &ops::matmul::Matmul.reference(&p)[0].1;
            let g = geometry(m, n, k);
            let f = fused(e).unwrap();
            let (a, b) = (p.f32s("weight"), p.f32s("inp"));
            let (bias, residual) = (p.f32s("bias"), p.f32s("residual"));
            let at = |s: MatrixShape, buf: &[f32], r: u64, c: u64| buf[(r as i64 + c as i64 * s.ld) as usize] as f64;
            let mut d = vec![f64::NAN; m * n];
            for j in 0..g.n {
                for i in 0..g.m {
                    let mut x = 0.0;
                    for p in 0..g.k {
                        let av = if g.trans_a { at(g.a, a, p, i) } else { at(g.a, a, i, p) };
                        let bv = if g.trans_b { at(g.b, b, j, p) } else { at(g.b, b, p, j) };
                        x += av * bv;
                    }
                    if f.residual_as_c {
                        x += at(g.d, residual, i, j);
                    }
                    if f.bias {
                        x += bias[i as usize] as f64;
                    }
                    if f.epilogue == sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS {
                        x = ops::gelu_f64(x);
                    }
                    d[(i as i64 + j as i64 * g.d.ld) as usize] = x;
                }
            }
            for (got, want) in d.iter().zip(want) {
                assert!((got - want).abs() < 1e-12, "{e}: {got} vs {want}");
            }
        }
    }
}
