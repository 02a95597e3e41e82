//! The ceilings the "% of peak" columns are measured against, measured on the device: its
//! copy bandwidth (memory-bound kernels), its FP32 FMA peak, and what cuBLAS reaches on the
//! tensor cores in TF32 and BF16 (square 8192³ GEMMs of random data).

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

use super::baseline::{launch_err, set_math_mode};
use super::time::{time_with, TimingPlan};
use crate::gpu::{Gpu, GpuError, RunError};
use crate::spec::Dtype;

/// An element type cuBLAS multiplies (`Gemm<T>`) and the device buffers hold.
trait BlasElement: DeviceRepr + ValidAsZeroBits + Copy + Unpin + 'static {
    fn from_f32(x: f32) -> Self;
}
impl BlasElement for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl BlasElement for half::f16 {
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}
impl BlasElement for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer: the
/// practical peak memory-bound kernels are measured against.
pub fn measure_copy_bandwidth(gpu: &Gpu) -> Result<f64, RunError> {
    let elems = 256usize << 20; // 1 GiB of f32
    let src = gpu
        .stream
        .alloc_zeros::<f32>(elems)
        .map_err(GpuError::cuda("allocating"))?;
    let mut dst = gpu
        .stream
        .alloc_zeros::<f32>(elems)
        .map_err(GpuError::cuda("allocating"))?;
    let plan = TimingPlan {
        warmup: 2,
        min_runs: 10,
        max_runs: 10,
        target_ms: 0.0,
    };
    let t = time_with(gpu, 1, &plan, |_| {
        gpu.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(GpuError::cuda("copying"))?;
        Ok(())
    })?;
    Ok(2.0 * (elems * 4) as f64 / (t.median_ms * 1e-3))
}

/// FP32 FMA peak in FLOP/s: SMs × 128 FP32 lanes × 2 FLOP × boost clock (Volta and later).
pub fn fp32_peak_flops(gpu: &Gpu) -> Result<f64, GpuError> {
    let clock_khz = gpu
        .ctx
        .attribute(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
        .map_err(GpuError::cuda("reading the clock"))?;
    Ok(gpu.info.limits.num_sms as f64 * 128.0 * 2.0 * clock_khz as f64 * 1e3)
}

/// Side of the square GEMM [`measure_tf32_peak`] and [`measure_half_peak`] time.
pub const TF32_PEAK_SIZE: usize = 8192;

/// The practical TF32 tensor-core peak in FLOP/s: cuBLAS in TF32 math mode on a square
/// 8192³ GEMM of random data, measured now (H100 SXM's datasheet says ~494 TFLOP/s dense; cuBLAS
/// reaches less). tf32 rows report "% of peak" against this figure.
pub fn measure_tf32_peak(gpu: &Gpu) -> Result<f64, RunError> {
    measure_peak::<f32>(gpu, Dtype::Tf32)
}

/// The practical 16-bit tensor-core peak in FLOP/s: cuBLAS BF16 (f32 compute) on the same
/// square 8192³ GEMM (H100 SXM's datasheet: ~989 TFLOP/s dense). f16 and bf16 rows report
/// "% of peak" against it (the two run at the same tensor-core rate).
pub fn measure_half_peak(gpu: &Gpu) -> Result<f64, RunError> {
    measure_peak::<half::bf16>(gpu, Dtype::Bf16)
}

fn measure_peak<T: BlasElement>(gpu: &Gpu, dtype: Dtype) -> Result<f64, RunError>
where
    CudaBlas: Gemm<T>,
{
    let n = TF32_PEAK_SIZE;
    let blas = CudaBlas::new(gpu.stream.clone())
        .map_err(|e| launch_err("cuBLAS")(format!("cannot create a handle: {e:?}")))?;
    set_math_mode(&blas, dtype)?;
    // Random values in [-1, 1) from a cheap LCG: tensor-core power (and so clocks) depends on
    // the data, and zeros would flatter the figure. A and B share one buffer (both read-only).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let host: Vec<T> = (0..n * n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            T::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect();
    let ab = gpu
        .stream
        .clone_htod(&host)
        .map_err(GpuError::cuda("uploading the peak-measurement matrix"))?;
    let mut c = gpu
        .stream
        .alloc_zeros::<T>(n * n)
        .map_err(GpuError::cuda("allocating"))?;
    let config = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: n as i32,
        k: n as i32,
        alpha: T::from_f32(1.0),
        lda: n as i32,
        ldb: n as i32,
        beta: T::from_f32(0.0),
        ldc: n as i32,
    };
    let plan = TimingPlan {
        warmup: 3,
        min_runs: 10,
        max_runs: 10,
        target_ms: 0.0,
    };
    let t = time_with(gpu, 1, &plan, |_| {
        // SAFETY: every buffer holds n*n elements as the config says.
        unsafe { blas.gemm(config, &ab, &ab, &mut c) }
            .map_err(|e| launch_err(&format!("cuBLAS {dtype} GEMM"))(format!("{e:?}")))?;
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / (t.median_ms * 1e-3))
}
