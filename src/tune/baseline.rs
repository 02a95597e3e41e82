//! The bars to beat, measured in the same run: cuBLAS SGEMM (plus the epilogue as a separate
//! kernel, since plain cuBLAS has none), and the device's measured copy bandwidth and its
//! FP32 FMA peak for the "% of peak" columns.

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::time::{time_with, Timing, TimingPlan};
use crate::codegen::{Renderer, Source};
use crate::gpu::{Compiler, Gpu, GpuError, RunError};
use crate::ops::{Epilogue, HostData, Problem};

/// cuBLAS and the separate epilogue kernels, ready to time.
pub struct CublasBaseline {
    blas: CudaBlas,
    epilogues: Vec<(Epilogue, CudaFunction)>,
}

fn launch_err(what: &str) -> impl FnOnce(String) -> RunError + '_ {
    move |message| RunError::Launch {
        kernel: what.to_string(),
        message,
    }
}

impl CublasBaseline {
    /// Creates the cuBLAS handle (default math mode: true FP32, no TF32) and compiles the
    /// epilogue kernels from `templates/baseline/epilogue.cu.tera`.
    pub fn new(gpu: &Gpu, compiler: &Compiler, renderer: &Renderer) -> Result<CublasBaseline, RunError> {
        let blas = CudaBlas::new(gpu.stream.clone())
            .map_err(|e| launch_err("cuBLAS")(format!("cannot create a handle: {e:?}")))?;
        let mut epilogues = Vec::new();
        for e in [
            Epilogue::Bias,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
            Epilogue::Qkv,
        ] {
            let code = renderer
                .render_template("baseline/epilogue.cu.tera", &[("epilogue", e.as_str())])
                .map_err(|err| launch_err("baseline epilogue")(err.to_string()))?;
            let source = Source {
                kernel_name: format!("baseline_epilogue_{}", e.as_str()),
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
            epilogues.push((e, f));
        }
        Ok(CublasBaseline { blas, epilogues })
    }

    /// Times `out = epilogue(inp @ W^T + bias)` as cuBLAS SGEMM into a scratch matrix followed by
    /// the epilogue kernel (SGEMM alone for `none`), on the problem's full shape.
    pub fn time_matmul(&self, gpu: &Gpu, problem: &Problem, plan: &TimingPlan) -> Result<Timing, RunError> {
        let dim = |name: &str| problem.shape[name] as i32;
        let (m, n, k, t, n_head) = (dim("M"), dim("N"), dim("K"), dim("T"), dim("n_head"));
        let upload = |name: &str| -> Result<CudaSlice<f32>, RunError> {
            let tensor = problem
                .tensors
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| launch_err("cuBLAS")(format!("the matmul problem has no `{name}`")))?;
            let HostData::F32(v) = &tensor.data else {
                return Err(launch_err("cuBLAS")(format!("`{name}` is not f32")));
            };
            Ok(gpu
                .stream
                .clone_htod(v)
                .map_err(GpuError::cuda(format!("uploading `{name}`")))?)
        };
        let (inp, weight, bias, residual) = (upload("inp")?, upload("weight")?, upload("bias")?, upload("residual")?);
        let mut out = gpu
            .stream
            .alloc_zeros::<f32>((m as usize) * (n as usize))
            .map_err(GpuError::cuda("allocating"))?;
        let mut scratch = gpu
            .stream
            .alloc_zeros::<f32>((m as usize) * (n as usize))
            .map_err(GpuError::cuda("allocating"))?;
        let epilogue = self
            .epilogues
            .iter()
            .find(|(e, _)| *e == problem.epilogue)
            .map(|(_, f)| f);
        // Row-major out[M,N] = inp[M,K] @ W[N,K]^T is column-major out^T[N,M] = W^T... i.e.
        // cuBLAS computes C(N x M) = op(W)(N x K) * inp(K x M) with W transposed (ld K).
        let config = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n: m,
            k,
            alpha: 1.0f32,
            lda: k,
            ldb: k,
            beta: 0.0f32,
            ldc: n,
        };
        let (out_ptr, scratch_ptr) = (out.device_ptr(&gpu.stream).0, scratch.device_ptr(&gpu.stream).0);
        let (bias_ptr, residual_ptr) = (bias.device_ptr(&gpu.stream).0, residual.device_ptr(&gpu.stream).0);
        time_with(gpu, 1, plan, |_| {
            let target = if epilogue.is_some() { &mut scratch } else { &mut out };
            // SAFETY: buffers hold M*K, N*K and M*N floats as the config says.
            unsafe { self.blas.gemm(config, &weight, &inp, target) }
                .map_err(|e| launch_err("cuBLAS SGEMM")(format!("{e:?}")))?;
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
