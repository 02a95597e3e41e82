//! The bars to beat, measured in the same run: cuBLAS GEMM (plus the epilogue as a separate
//! kernel, since plain cuBLAS has none) in the workload's dtype (SGEMM in default math for f32,
//! `CUBLAS_TF32_TENSOR_OP_MATH` for tf32, `cublasGemmEx` on f16 / bf16 storage with f32
//! compute for the half dtypes), and the device's measured copy bandwidth, its FP32 FMA peak and
//! measured cuBLAS tensor-core figures (TF32, BF16) for the "% of peak" columns.

use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t, cublasSetMathMode, cublasStatus_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use super::time::{time_with, Timing, TimingPlan};
use crate::codegen::{Renderer, Source};
use crate::gpu::{Compiler, Gpu, GpuError, RunError};
use crate::ops::{Epilogue, HostData, Problem, Storage};
use crate::spec::Dtype;

/// cuBLAS and the separate epilogue kernels (one per epilogue and storage type), ready to time.
pub struct CublasBaseline {
    blas: CudaBlas,
    epilogues: Vec<(Storage, Epilogue, CudaFunction)>,
}

/// The dtype spelling the baseline epilogue template renders `storage_t` from.
fn storage_dtype(storage: Storage) -> &'static str {
    match storage {
        Storage::F32 => "f32",
        Storage::F16 => "f16",
        Storage::Bf16 => "bf16",
    }
}

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

fn launch_err(what: &str) -> impl FnOnce(String) -> RunError + '_ {
    move |message| RunError::Launch {
        kernel: what.to_string(),
        message,
    }
}

/// Puts `blas` in the math mode of `dtype`: default (true FP32, no TF32 anywhere) for f32,
/// TF32 tensor-core math for tf32 (inputs rounded to TF32, f32 accumulation) — the same
/// arithmetic our tf32 kernels do, so the comparison is like for like.
fn set_math_mode(blas: &CudaBlas, dtype: Dtype) -> Result<(), RunError> {
    let mode = match dtype {
        // Half inputs go to the tensor cores in the default mode (f32 accumulation).
        Dtype::F32 | Dtype::F16 | Dtype::Bf16 => cublasMath_t::CUBLAS_DEFAULT_MATH,
        Dtype::Tf32 => cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
    };
    // SAFETY: the handle is live for as long as `blas`.
    let status = unsafe { cublasSetMathMode(*blas.handle(), mode) };
    if status != cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(launch_err("cuBLAS")(format!(
            "cublasSetMathMode({mode:?}) failed: {status:?}"
        )));
    }
    Ok(())
}

impl CublasBaseline {
    /// Creates the cuBLAS handle (its math mode is set per call by the dtype) and compiles the
    /// epilogue kernels from `templates/baseline/epilogue.cu.tera`, for every storage type.
    pub fn new(gpu: &Gpu, compiler: &Compiler, renderer: &Renderer) -> Result<CublasBaseline, RunError> {
        let blas = CudaBlas::new(gpu.stream.clone())
            .map_err(|e| launch_err("cuBLAS")(format!("cannot create a handle: {e:?}")))?;
        let mut epilogues = Vec::new();
        let kinds = [
            Epilogue::Bias,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
            Epilogue::Qkv,
        ];
        for (storage, e) in [Storage::F32, Storage::F16, Storage::Bf16]
            .into_iter()
            .flat_map(|s| kinds.map(|e| (s, e)))
        {
            let dtype = storage_dtype(storage);
            let code = renderer
                .render_template(
                    "baseline/epilogue.cu.tera",
                    &[("epilogue", e.as_str()), ("dtype", dtype)],
                )
                .map_err(|err| launch_err("baseline epilogue")(err.to_string()))?;
            let source = Source {
                kernel_name: format!("baseline_epilogue_{}_{dtype}", e.as_str()),
                code,
            };
            let compiled = compiler
                .compile(&source)
                .map_err(|err| launch_err("baseline epilogue")(err.to_string()))?;
            let module = gpu
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
                .map_err(GpuError::cuda("loading the baseline epilogue"))?;
            let f = module
                .load_function("baseline_epilogue")
                .map_err(GpuError::cuda("finding baseline_epilogue"))?;
            epilogues.push((storage, e, f));
        }
        Ok(CublasBaseline { blas, epilogues })
    }

    /// Times `out = epilogue(inp @ W^T + bias)` as a cuBLAS GEMM in `dtype` (SGEMM in its math
    /// mode for f32 / tf32; `cublasGemmEx` on f16 / bf16 buffers with f32 compute for the half
    /// dtypes) into a scratch matrix followed by the epilogue kernel in the same storage type
    /// (the GEMM alone for `none`), on the problem's full shape.
    pub fn time_matmul(
        &self,
        gpu: &Gpu,
        problem: &Problem,
        dtype: Dtype,
        plan: &TimingPlan,
    ) -> Result<Timing, RunError> {
        set_math_mode(&self.blas, dtype)?;
        match dtype.storage() {
            Storage::F32 => self.time_gemm::<f32>(gpu, problem, Storage::F32, plan),
            Storage::F16 => self.time_gemm::<half::f16>(gpu, problem, Storage::F16, plan),
            Storage::Bf16 => self.time_gemm::<half::bf16>(gpu, problem, Storage::Bf16, plan),
        }
    }

    fn time_gemm<T: BlasElement>(
        &self,
        gpu: &Gpu,
        problem: &Problem,
        storage: Storage,
        plan: &TimingPlan,
    ) -> Result<Timing, RunError>
    where
        CudaBlas: Gemm<T>,
    {
        let dim = |name: &str| problem.shape[name] as i32;
        let (m, n, k, t, n_head) = (dim("M"), dim("N"), dim("K"), dim("T"), dim("n_head"));
        let upload = |name: &str| -> Result<CudaSlice<T>, RunError> {
            let tensor = problem
                .tensors
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| launch_err("cuBLAS")(format!("the matmul problem has no `{name}`")))?;
            let HostData::F32(v) = &tensor.data else {
                return Err(launch_err("cuBLAS")(format!("`{name}` is not f32")));
            };
            // Host values are already rounded to the storage precision (Problem::stored_as):
            // converting is exact.
            let host: Vec<T> = v.iter().map(|x| T::from_f32(*x)).collect();
            Ok(gpu
                .stream
                .clone_htod(&host)
                .map_err(GpuError::cuda(format!("uploading `{name}`")))?)
        };
        let (inp, weight, bias, residual) = (upload("inp")?, upload("weight")?, upload("bias")?, upload("residual")?);
        let mut out = gpu
            .stream
            .alloc_zeros::<T>((m as usize) * (n as usize))
            .map_err(GpuError::cuda("allocating"))?;
        let mut scratch = gpu
            .stream
            .alloc_zeros::<T>((m as usize) * (n as usize))
            .map_err(GpuError::cuda("allocating"))?;
        let epilogue = self
            .epilogues
            .iter()
            .find(|(s, e, _)| *s == storage && *e == problem.epilogue)
            .map(|(_, _, f)| f);
        // Row-major out[M,N] = inp[M,K] @ W[N,K]^T is column-major out^T[N,M] = W^T... i.e.
        // cuBLAS computes C(N x M) = op(W)(N x K) * inp(K x M) with W transposed (ld K).
        let config = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n: m,
            k,
            alpha: T::from_f32(1.0),
            lda: k,
            ldb: k,
            beta: T::from_f32(0.0),
            ldc: n,
        };
        let (out_ptr, scratch_ptr) = (out.device_ptr(&gpu.stream).0, scratch.device_ptr(&gpu.stream).0);
        let (bias_ptr, residual_ptr) = (bias.device_ptr(&gpu.stream).0, residual.device_ptr(&gpu.stream).0);
        time_with(gpu, 1, plan, |_| {
            let target = if epilogue.is_some() { &mut scratch } else { &mut out };
            // SAFETY: buffers hold M*K, N*K and M*N elements as the config says.
            unsafe { self.blas.gemm(config, &weight, &inp, target) }
                .map_err(|e| launch_err("cuBLAS GEMM")(format!("{e:?}")))?;
            if let Some(f) = epilogue {
                let total = (m as u64) * (n as u64);
                let cfg = LaunchConfig {
                    grid_dim: (total.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = gpu.stream.launch_builder(f);
                b.arg(&out_ptr).arg(&scratch_ptr).arg(&bias_ptr).arg(&residual_ptr);
                b.arg(&m).arg(&n).arg(&t).arg(&n_head);
                // SAFETY: the kernel reads M*N gemm values and writes M*N outputs.
                unsafe { b.launch(cfg) }.map_err(GpuError::cuda("launching the baseline epilogue"))?;
            }
            Ok(())
        })
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
