//! The bars to beat, measured in the same run.
//!
//! Matmuls are compared with the strongest vendor peer for their epilogue ([`peer_name`]):
//! cuBLASLt with its own fused epilogue wherever it has one (none; bias; bias+GELU;
//! bias+residual as beta = 1 with C = the residual; see [`super::cublaslt`]), and cuBLAS
//! (`cublasGemmEx`) followed by the split as a separate kernel for the QKV split, which
//! cuBLASLt cannot fuse. Both run in the workload's dtype (f32: true FP32; tf32: TF32 tensor
//! cores on f32 buffers; f16 / bf16: 16-bit buffers with f32 accumulation), rotate through as
//! many copies of the operands as the kernels are timed on, and are checked against the op's
//! f64 reference before they are timed: a peer over its dtype's bar is reported unavailable,
//! with the reason, instead of timed.
//!
//! The "% of peak" ceilings are in [`super::peaks`].

use std::ffi::c_void;

use cudarc::cublas::result::{self as blas_result, CublasError};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t, cublasOperation_t, cublasSetMathMode, cublasStatus_t,
    cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::cublaslt::{fused, Choice, CublasLt, LtCase, LtPlan, Operands};
pub use super::peer::{entry_peer, peer_cells, peer_name, PeerError, PeerRun, PEER_LEGEND};
use super::peer::{gpu_err, head_error, head_len, head_rows};
use super::time::{rotation_count, time_with, Contestant, Timing, TimingPlan};
use super::verify::tolerance;
use crate::codegen::{Renderer, Source};
use crate::gpu::{Compiler, Gpu, GpuError, RunError};
use crate::ops::{Epilogue, HostData, Problem, Storage};
use crate::spec::Dtype;

/// The dtype spelling the baseline epilogue template renders `storage_t` from.
fn storage_dtype(storage: Storage) -> &'static str {
    match storage {
        Storage::F32 => "f32",
        Storage::F16 => "f16",
        Storage::Bf16 => "bf16",
    }
}

pub(super) fn launch_err(what: &str) -> impl FnOnce(String) -> RunError + '_ {
    move |message| RunError::Launch {
        kernel: what.to_string(),
        message,
    }
}

/// Puts `blas` in the math mode of `dtype`: default (true FP32, no TF32 anywhere) for f32,
/// TF32 tensor-core math for tf32 (inputs rounded to TF32, f32 accumulation) — the same
/// arithmetic our tf32 kernels do, so the comparison is like for like.
pub(super) fn set_math_mode(blas: &CudaBlas, dtype: Dtype) -> Result<(), RunError> {
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

/// The vendor peers, ready to run: cuBLASLt (or why it cannot be opened here), and cuBLAS with
/// the QKV split kernel (one per storage type).
pub struct CublasBaseline {
    blas: CudaBlas,
    split: Vec<(Storage, CudaFunction)>,
    /// The standardization pass the `ln_` epilogues' peers run first, one per storage type.
    standardize: Vec<(Storage, CudaFunction)>,
    lt: Result<CublasLt, String>,
}

/// One copy of a matmul problem's tensors on the device, in its storage type.
struct PeerBuffers {
    inp: CudaSlice<u8>,
    weight: CudaSlice<u8>,
    bias: CudaSlice<u8>,
    residual: CudaSlice<u8>,
    out: CudaSlice<u8>,
    /// The GEMM result the split kernel reads (QKV only).
    scratch: Option<CudaSlice<u8>>,
    /// The standardized rows of `inp` the GEMM reads (`ln_` epilogues only).
    standardized: Option<CudaSlice<u8>>,
}

impl PeerBuffers {
    fn upload(gpu: &Gpu, case: LtCase, problem: &Problem) -> Result<PeerBuffers, PeerError> {
        let upload = |name: &str| -> Result<CudaSlice<u8>, PeerError> {
            let Some(HostData::F32(v)) = problem.tensor(name).map(|t| &t.data) else {
                return Err(PeerError::Problem {
                    case,
                    message: format!("the matmul problem has no f32 tensor `{name}`"),
                });
            };
            // Host values are already rounded to the storage precision (Problem::stored_as):
            // encoding is exact.
            gpu.stream
                .clone_htod(&problem.storage.encode(v))
                .map_err(gpu_err(case, &format!("uploading `{name}` for the peer")))
        };
        let out_bytes = case.m * case.n * problem.storage.bytes();
        let alloc = || {
            gpu.stream
                .alloc_zeros::<u8>(out_bytes)
                .map_err(gpu_err(case, "allocating the peer's output"))
        };
        Ok(PeerBuffers {
            inp: upload("inp")?,
            weight: upload("weight")?,
            bias: upload("bias")?,
            residual: upload("residual")?,
            out: alloc()?,
            scratch: if fused(case.epilogue).is_none() {
                Some(alloc()?)
            } else {
                None
            },
            standardized: if case.epilogue.standardizes_input() {
                Some(
                    gpu.stream
                        .alloc_zeros::<u8>(case.m * case.k * problem.storage.bytes())
                        .map_err(gpu_err(case, "allocating the peer's standardized input"))?,
                )
            } else {
                None
            },
        })
    }

    fn operands(&self, gpu: &Gpu) -> Operands {
        let ptr = |s: &CudaSlice<u8>| s.device_ptr(&gpu.stream).0;
        Operands {
            // The ln_ peers' GEMM reads the standardized rows.
            inp: ptr(self.standardized.as_ref().unwrap_or(&self.inp)),
            weight: ptr(&self.weight),
            bias: ptr(&self.bias),
            residual: ptr(&self.residual),
            out: ptr(&self.out),
        }
    }
}

/// How a session's peer runs.
enum How<'a> {
    Lt { plan: LtPlan<'a>, choice: Choice },
    Split { kernel: &'a CudaFunction },
}

/// A peer set up for one problem: its operands uploaded (several copies to rotate through),
/// its algorithm chosen.
struct Session<'a> {
    baseline: &'a CublasBaseline,
    case: LtCase,
    storage: Storage,
    t: i32,
    n_head: i32,
    copies: Vec<PeerBuffers>,
    operands: Vec<Operands>,
    how: How<'a>,
}

impl Session<'_> {
    /// Enqueues the peer on copy `i`.
    fn enqueue(&self, gpu: &Gpu, i: usize) -> Result<(), PeerError> {
        let ops = &self.operands[i];
        if let Some(standardized) = &self.copies[i].standardized {
            self.enqueue_standardize(gpu, standardized, &self.copies[i].inp)?;
        }
        match &self.how {
            How::Lt { plan, choice } => Ok(plan.enqueue(gpu, ops, &choice.algo)?),
            How::Split { kernel } => {
                let case = self.case;
                let scratch = self.copies[i]
                    .scratch
                    .as_ref()
                    .map(|s| s.device_ptr(&gpu.stream).0)
                    .ok_or_else(|| PeerError::Problem {
                        case,
                        message: "no scratch buffer for the split kernel".into(),
                    })?;
                let (compute, data) = blas_types(case.dtype);
                let (m, n, k) = (case.m as i32, case.n as i32, case.k as i32);
                let (alpha, beta) = (1.0f32, 0.0f32);
                // Row-major out[M,N] = inp[M,K] @ W[N,K]^T is column-major scratch(N x M) =
                // op_T(W buffer, K x N, ld K) · (inp buffer, K x M, ld K): see cublaslt::geometry.
                // SAFETY: weight holds N*K, inp M*K and scratch M*N elements of `data`; alpha and
                // beta are f32 as COMPUTE_32F* wants.
                unsafe {
                    blas_result::gemm_ex(
                        *self.baseline.blas.handle(),
                        cublasOperation_t::CUBLAS_OP_T,
                        cublasOperation_t::CUBLAS_OP_N,
                        n,
                        m,
                        k,
                        &alpha as *const f32 as *const c_void,
                        ops.weight as usize as *const c_void,
                        data,
                        k,
                        ops.inp as usize as *const c_void,
                        data,
                        k,
                        &beta as *const f32 as *const c_void,
                        scratch as usize as *mut c_void,
                        data,
                        n,
                        compute,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|CublasError(status)| PeerError::Cublas {
                    case,
                    call: "cublasGemmEx",
                    status,
                })?;
                let total = (case.m as u64) * (case.n as u64);
                let cfg = LaunchConfig {
                    grid_dim: (total.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = gpu.stream.launch_builder(kernel);
                b.arg(&ops.out).arg(&scratch).arg(&ops.bias).arg(&ops.residual);
                b.arg(&m).arg(&n).arg(&self.t).arg(&self.n_head);
                // SAFETY: the kernel reads M*N GEMM values and writes M*N outputs.
                unsafe { b.launch(cfg) }.map_err(gpu_err(case, "launching the qkv split kernel"))?;
                Ok(())
            }
        }
    }

    /// The `ln_` peers' first pass: the rows of `inp` standardized into `standardized`.
    fn enqueue_standardize(
        &self,
        gpu: &Gpu,
        standardized: &CudaSlice<u8>,
        inp: &CudaSlice<u8>,
    ) -> Result<(), PeerError> {
        let case = self.case;
        let kernel = self
            .baseline
            .standardize
            .iter()
            .find(|(s, _)| *s == self.storage)
            .map(|(_, f)| f)
            .ok_or_else(|| PeerError::Problem {
                case,
                message: "no standardization kernel for this storage type".into(),
            })?;
        const WARPS: u32 = 8; // rows per block, one warp each
        let cfg = LaunchConfig {
            grid_dim: ((case.m as u32).div_ceil(WARPS), 1, 1),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (out, inp) = (standardized.device_ptr(&gpu.stream).0, inp.device_ptr(&gpu.stream).0);
        let (m, k) = (case.m as i32, case.k as i32);
        let mut b = gpu.stream.launch_builder(kernel);
        b.arg(&out).arg(&inp).arg(&m).arg(&k);
        // SAFETY: inp holds M*K values and standardized M*K, both of the storage type.
        unsafe { b.launch(cfg) }.map_err(gpu_err(case, "launching the standardization kernel"))?;
        Ok(())
    }

    /// Runs the peer once on copy 0 and downloads the first `len` output values as f32; those
    /// are poisoned (NaN) first, so a value the peer does not write fails the check.
    fn run_once(&mut self, gpu: &Gpu, len: usize) -> Result<Vec<f32>, PeerError> {
        let case = self.case;
        let bytes = len.min(case.m * case.n) * self.storage.bytes();
        let nan = self.storage.encode(&vec![f32::NAN; bytes / self.storage.bytes()]);
        gpu.stream
            .memcpy_htod(&nan, &mut self.copies[0].out.slice_mut(..bytes))
            .map_err(gpu_err(case, "poisoning the peer's output"))?;
        self.enqueue(gpu, 0)?;
        gpu.synchronize().map_err(|e| PeerError::Run {
            case,
            source: Box::new(e.into()),
        })?;
        let host = gpu
            .stream
            .clone_dtoh(&self.copies[0].out.slice(..bytes))
            .map_err(gpu_err(case, "downloading the peer's output"))?;
        Ok(self.storage.decode(&host))
    }

    /// Times the peer, rotating through the copies.
    fn time(&self, gpu: &Gpu, plan: &TimingPlan) -> Result<Timing, PeerError> {
        let mut failed: Option<PeerError> = None;
        let timed = time_with(gpu, self.copies.len(), plan, |i| {
            self.enqueue(gpu, i % self.copies.len()).map_err(|e| {
                let message = e.to_string();
                failed = Some(e);
                RunError::Launch {
                    kernel: "peer".into(),
                    message,
                }
            })
        });
        match (timed, failed) {
            (Ok(t), _) => Ok(t),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(PeerError::Run {
                case: self.case,
                source: Box::new(e),
            }),
        }
    }
}

/// cuBLAS's compute and element types for `dtype` (the split peer's GEMM).
fn blas_types(dtype: Dtype) -> (cublasComputeType_t, cudaDataType_t) {
    match dtype {
        Dtype::F32 => (cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType_t::CUDA_R_32F),
        Dtype::Tf32 => (
            cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            cudaDataType_t::CUDA_R_32F,
        ),
        Dtype::F16 => (cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType_t::CUDA_R_16F),
        Dtype::Bf16 => (cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType_t::CUDA_R_16BF),
    }
}

/// The identity of a matmul problem, read off its shape.
fn case_of(problem: &Problem, dtype: Dtype) -> LtCase {
    let dim = |name: &str| problem.shape.get(name).copied().unwrap_or(0).max(0) as usize;
    LtCase {
        m: dim("M"),
        n: dim("N"),
        k: dim("K"),
        dtype,
        epilogue: problem.epilogue,
    }
}

impl CublasBaseline {
    /// Creates the cuBLAS handle, opens cuBLASLt (a machine without it still gets the QKV peer;
    /// every fused row then says why it has no peer) and compiles the QKV split kernels from
    /// `templates/baseline/epilogue.cu.tera` and the `ln_` peers' standardization from
    /// `templates/baseline/standardize.cu.tera`, for every storage type.
    pub fn new(gpu: &Gpu, compiler: &Compiler, renderer: &Renderer) -> Result<CublasBaseline, RunError> {
        let blas = CudaBlas::new(gpu.stream.clone())
            .map_err(|e| launch_err("cuBLAS")(format!("cannot create a handle: {e:?}")))?;
        // Default math: the split peer's cublasGemmEx says its compute type (TF32 or not) itself.
        set_math_mode(&blas, Dtype::F32)?;
        let (mut split, mut standardize) = (Vec::new(), Vec::new());
        for storage in [Storage::F32, Storage::F16, Storage::Bf16] {
            let dtype = storage_dtype(storage);
            let load = |template: &str, kernel_name: String, function: &str| -> Result<CudaFunction, RunError> {
                let vars = [("epilogue", Epilogue::Qkv.as_str()), ("dtype", dtype)];
                let code = renderer
                    .render_template(template, &vars)
                    .map_err(|err| launch_err(function)(err.to_string()))?;
                let compiled = compiler
                    .compile(&Source { kernel_name, code })
                    .map_err(|err| launch_err(function)(err.to_string()))?;
                let module = gpu
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.image))
                    .map_err(GpuError::cuda(format!("loading {function}")))?;
                Ok(module
                    .load_function(function)
                    .map_err(GpuError::cuda(format!("finding {function}")))?)
            };
            let qkv = format!("baseline_epilogue_qkv_{dtype}");
            split.push((storage, load("baseline/epilogue.cu.tera", qkv, "baseline_epilogue")?));
            let name = format!("baseline_standardize_{dtype}");
            standardize.push((
                storage,
                load("baseline/standardize.cu.tera", name, "baseline_standardize")?,
            ));
        }
        let lt = CublasLt::new(gpu).map_err(|e| e.to_string());
        Ok(CublasBaseline {
            blas,
            split,
            standardize,
            lt,
        })
    }

    /// Uploads `copies` copies of `problem` and sets its peer up (for cuBLASLt: the algorithm).
    fn session(&self, gpu: &Gpu, problem: &Problem, dtype: Dtype, copies: usize) -> Result<Session<'_>, PeerError> {
        let case = case_of(problem, dtype);
        let problem_err = |message: String| PeerError::Problem { case, message };
        if problem.op != "matmul" {
            return Err(problem_err(format!("the peer runs matmuls, not `{}`", problem.op)));
        }
        if problem.storage != dtype.storage() {
            return Err(problem_err(format!(
                "the problem is stored as {:?}, {dtype} needs {:?} (Problem::stored_as)",
                problem.storage,
                dtype.storage()
            )));
        }
        if case.m == 0 || case.n == 0 || case.k == 0 {
            return Err(problem_err("M, N and K must be positive".into()));
        }
        gpu.ctx.bind_to_thread().map_err(gpu_err(case, "binding the context"))?;
        let copies = (0..copies.max(1))
            .map(|_| PeerBuffers::upload(gpu, case, problem))
            .collect::<Result<Vec<_>, _>>()?;
        let operands: Vec<Operands> = copies.iter().map(|c| c.operands(gpu)).collect();
        let how = if fused(case.epilogue).is_some() {
            let lt = self.lt.as_ref().map_err(|why| PeerError::LtMissing(why.clone()))?;
            let plan = lt.plan(case)?;
            let choice = lt.choose(gpu, &plan, &operands)?;
            How::Lt { plan, choice }
        } else {
            let kernel = self
                .split
                .iter()
                .find(|(s, _)| *s == problem.storage)
                .map(|(_, f)| f)
                .ok_or_else(|| problem_err("no qkv split kernel for this storage type".into()))?;
            How::Split { kernel }
        };
        let dim = |name: &str, default: usize| problem.shape.get(name).map_or(default, |v| *v as usize) as i32;
        Ok(Session {
            baseline: self,
            case,
            storage: problem.storage,
            t: dim("T", case.m),
            n_head: dim("n_head", 1),
            copies,
            operands,
            how,
        })
    }

    /// Runs the peer once on `problem` (stored as `dtype`'s storage) with its output poisoned
    /// first, and returns the whole output as f32, in the op's layout (head-major Q, K, V for
    /// the QKV split).
    pub fn run_matmul(&self, gpu: &Gpu, problem: &Problem, dtype: Dtype) -> Result<Vec<f32>, PeerError> {
        let mut s = self.session(gpu, problem, dtype, 1)?;
        s.run_once(gpu, s.case.m * s.case.n)
    }

    /// The relative L2 error of the peer's output on `problem`, over its first `rows` rows,
    /// against the f64 reference; [`PeerError::Inaccurate`] when over `dtype`'s bar.
    pub fn check_matmul(&self, gpu: &Gpu, problem: &Problem, dtype: Dtype, rows: usize) -> Result<f64, PeerError> {
        let mut s = self.session(gpu, problem, dtype, 1)?;
        check(&mut s, gpu, problem, rows)
    }

    /// Times the peer of `problem`'s epilogue on the full shape (no check: see
    /// [`CublasBaseline::measure_matmul`]).
    pub fn time_matmul(
        &self,
        gpu: &Gpu,
        problem: &Problem,
        dtype: Dtype,
        plan: &TimingPlan,
    ) -> Result<Timing, PeerError> {
        self.session(gpu, problem, dtype, rotation_count(problem))?
            .time(gpu, plan)
    }

    /// What `tune` records: the peer runs once on `problem` and its first `check_rows` rows are
    /// compared with the f64 reference; if within the bar it is timed. Declined, missing or
    /// wrong peers come back as an unavailable [`PeerRun`] with the reason; only GPU errors are
    /// errors.
    pub fn measure_matmul(
        &self,
        gpu: &Gpu,
        problem: &Problem,
        dtype: Dtype,
        plan: &TimingPlan,
        check_rows: usize,
    ) -> Result<PeerRun, PeerError> {
        let ready = match self.prepare_matmul(gpu, problem, dtype, check_rows)? {
            Ok(ready) => ready,
            Err(unavailable) => return Ok(unavailable),
        };
        match ready.session.time(gpu, plan) {
            Ok(t) => Ok(ready.timed(t)),
            Err(e) => unavailable(ready.peer, e),
        }
    }

    /// The peer of `problem` set up on its own copies of the inputs and checked like
    /// [`CublasBaseline::measure_matmul`] does, ready to be timed beside other kernels (see
    /// [`ReadyPeer::contestant`]); or, when it is declined, missing or wrong, the unavailable
    /// [`PeerRun`] that says why.
    pub fn prepare_matmul(
        &self,
        gpu: &Gpu,
        problem: &Problem,
        dtype: Dtype,
        check_rows: usize,
    ) -> Result<Result<ReadyPeer<'_>, PeerRun>, PeerError> {
        let peer = peer_name(problem.epilogue);
        let checked = self
            .session(gpu, problem, dtype, rotation_count(problem))
            .and_then(|mut s| Ok((check(&mut s, gpu, problem, check_rows)?, s)));
        match checked {
            Ok((error, session)) => Ok(Ok(ReadyPeer { session, peer, error })),
            Err(e) => unavailable(peer, e).map(Err),
        }
    }
}

/// A peer set up and checked on a problem (see [`CublasBaseline::prepare_matmul`]).
pub struct ReadyPeer<'a> {
    session: Session<'a>,
    peer: &'static str,
    error: f64,
}

impl<'a> ReadyPeer<'a> {
    /// The peer as one contestant of [`super::time::time_in_turns`].
    pub fn contestant<'c>(&'c self, gpu: &'c Gpu) -> Contestant<'c> {
        let session = &self.session;
        Contestant {
            copies: session.copies.len(),
            enqueue: Box::new(move |i| {
                session
                    .enqueue(gpu, i % session.copies.len())
                    .map_err(|e| RunError::Launch {
                        kernel: "peer".into(),
                        message: e.to_string(),
                    })
            }),
        }
    }

    /// The [`PeerRun`] `tune` records, from the peer's timing.
    pub fn timed(&self, t: Timing) -> PeerRun {
        PeerRun {
            peer: self.peer,
            outcome: Ok(t),
            error: Some(self.error),
        }
    }
}

/// A peer that could not run or failed its check, as an unavailable [`PeerRun`]; GPU errors
/// stay errors.
fn unavailable(peer: &'static str, e: PeerError) -> Result<PeerRun, PeerError> {
    if e.is_fatal() {
        return Err(e);
    }
    Ok(PeerRun {
        peer,
        error: match &e {
            PeerError::Inaccurate { error, .. } => Some(*error),
            _ => None,
        },
        outcome: Err(e.to_string()),
    })
}

/// The honesty check on a set-up session (see [`super::peer`]).
fn check(s: &mut Session<'_>, gpu: &Gpu, problem: &Problem, rows: usize) -> Result<f64, PeerError> {
    let case = s.case;
    let out = s.run_once(gpu, head_len(problem, rows))?;
    let error = head_error(problem, &out, rows).map_err(|message| PeerError::Problem { case, message })?;
    let bar = tolerance(case.dtype);
    if error < bar {
        Ok(error)
    } else {
        Err(PeerError::Inaccurate {
            case,
            peer: peer_name(case.epilogue),
            error,
            rows: head_rows(problem, rows),
            dtype: case.dtype,
            bar,
        })
    }
}
