//! Device discovery: the CUDA context and stream kernelforge uses, and the limits specs see.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};

use super::stand_in::StandIn;
use crate::spec::DeviceLimits;

/// No usable GPU, or a CUDA call failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver found (libcuda.so): this needs an NVIDIA GPU with its driver installed")]
    NoDriver,
    #[error("no CUDA device {ordinal}: {source}")]
    NoDevice { ordinal: usize, source: DriverError },
    #[error("CUDA error while {what}: {source}")]
    Cuda { what: String, source: DriverError },
    #[error("{0} (from --target or ${var})", var = super::stand_in::TARGET_VAR)]
    Target(#[from] super::stand_in::UnknownTarget),
    #[error("cannot build the TMA tensor map of `{arg}` for {function}: {message}")]
    TensorMap {
        function: String,
        arg: String,
        message: String,
    },
}

impl GpuError {
    pub(crate) fn cuda(what: impl Into<String>) -> impl FnOnce(DriverError) -> GpuError {
        let what = what.into();
        move |source| GpuError::Cuda { what, source }
    }
}

/// What kernelforge knows about the device it runs on. Under a stand-in
/// ([`super::stand_in`]) the name, compute capability, memory and limits are the target's.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Driver version as CUDA reports it (13000 = 13.0).
    pub driver_version: i32,
    pub total_memory_bytes: usize,
    pub limits: DeviceLimits,
    /// The older GPU this one stands in for (`--target`), if any.
    pub stand_in: Option<&'static StandIn>,
}

impl DeviceInfo {
    /// What NVRTC compiles for: `sm_90` for compute capability 9.0, or the stand-in's PTX
    /// target (`compute_86`), which the driver JIT-compiles for the GPU underneath.
    pub fn arch(&self) -> String {
        super::stand_in::compile_arch(self.compute_capability, self.stand_in)
    }
}

/// A CUDA context and the one stream everything runs on.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    /// The [`Gpu::hold`] kernel, loaded on first use.
    hold_kernel: OnceLock<CudaFunction>,
}

/// One thread spinning on the GPU's nanosecond clock until `nanoseconds` have passed. Plain PTX
/// (the driver JIT-compiles it for any GPU since Volta), so it needs neither NVRTC nor headers.
const HOLD_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry kernelforge_hold(.param .u64 nanoseconds)
{
    .reg .pred %p;
    .reg .u64 %limit, %start, %now;
    ld.param.u64 %limit, [nanoseconds];
    mov.u64 %start, %globaltimer;
SPIN:
    mov.u64 %now, %globaltimer;
    sub.u64 %now, %now, %start;
    setp.lt.u64 %p, %now, %limit;
    @%p bra SPIN;
    ret;
}
"#;

/// Whether the CUDA driver library can be loaded (false on machines without a GPU).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The limits specs see, read through `attr` (a context's attributes, or a device's read
/// without a context).
pub(crate) fn read_limits(
    attr: impl Fn(Attr) -> Result<i64, GpuError>,
    compute_capability: (i32, i32),
) -> Result<DeviceLimits, GpuError> {
    Ok(DeviceLimits {
        max_threads: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        max_smem_static: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
        max_smem_dynamic: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        num_sms: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        warp_size: attr(Attr::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
        compute_capability,
    })
}

/// The CUDA driver's version (13000 = 13.0); needs no context.
pub fn driver_version() -> Result<i32, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    let mut version = 0;
    // SAFETY: plain out-parameter call; the library is present.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(GpuError::cuda("reading the driver version"))?;
    Ok(version)
}

impl Gpu {
    /// Opens device `ordinal`, standing in for this process's target if it has one
    /// ([`super::stand_in::active`]: `--target` or `$KERNELFORGE_TARGET`).
    pub fn new(ordinal: usize) -> Result<Gpu, GpuError> {
        Gpu::standing_in(ordinal, super::stand_in::active()?)
    }

    /// Opens device `ordinal` as a GPU of `target`'s kind (its compute capability, limits and
    /// PTX target), or as itself with `None`.
    pub fn standing_in(ordinal: usize, stand_in: Option<&'static StandIn>) -> Result<Gpu, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(|source| GpuError::NoDevice { ordinal, source })?;
        // Everything runs on one stream, so cudarc's per-buffer event tracking is not needed.
        // SAFETY: no buffer is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let attr = |a: Attr| {
            ctx.attribute(a)
                .map(i64::from)
                .map_err(GpuError::cuda("reading a device attribute"))
        };
        let compute_capability = ctx
            .compute_capability()
            .map_err(GpuError::cuda("reading the compute capability"))?;
        let limits = read_limits(attr, compute_capability)?;
        let driver_version = driver_version()?;
        let name = ctx.name().map_err(GpuError::cuda("reading the device name"))?;
        let total_memory_bytes = ctx.total_mem().map_err(GpuError::cuda("reading the memory size"))?;
        let (name, compute_capability, limits) = super::stand_in::seen_as(stand_in, name, compute_capability, limits);
        let info = DeviceInfo {
            name,
            compute_capability,
            driver_version,
            total_memory_bytes: stand_in.map_or(total_memory_bytes, |t| total_memory_bytes.min(t.memory_bytes)),
            limits,
            stand_in,
        };
        Ok(Gpu {
            ctx,
            stream,
            info,
            hold_kernel: OnceLock::new(),
        })
    }

    /// Queues a kernel that keeps the GPU busy for `nanoseconds`. Queued just before a timed
    /// region, it lets the host enqueue the whole region while the GPU is still busy, so the
    /// events around the region measure GPU time only: without it a short kernel's time also
    /// counts the host's cost of launching it (a library's heuristics, argument packing),
    /// because the start event fires as soon as it is queued on an idle GPU.
    pub fn hold(&self, nanoseconds: u64) -> Result<(), GpuError> {
        let kernel = match self.hold_kernel.get() {
            Some(k) => k,
            None => {
                let module = self
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(HOLD_PTX))
                    .map_err(GpuError::cuda("loading the hold kernel"))?;
                let f = module
                    .load_function("kernelforge_hold")
                    .map_err(GpuError::cuda("loading the hold kernel"))?;
                self.hold_kernel.get_or_init(|| f)
            }
        };
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(&nanoseconds);
        // SAFETY: the kernel takes one u64 and touches no memory.
        unsafe { launch.launch(cfg) }.map_err(GpuError::cuda("launching the hold kernel"))?;
        Ok(())
    }

    /// The device's free memory in bytes now; standing in for a smaller GPU (`--target`), no
    /// more than the target has in all.
    pub fn free_memory(&self) -> Result<usize, DriverError> {
        let (free, _) = self.ctx.mem_get_info()?;
        Ok(free.min(self.info.total_memory_bytes))
    }

    /// Blocks of `function` one SM holds at once with `threads` threads and `dynamic_smem`
    /// bytes of dynamic shared memory: the driver's answer, and under a stand-in no more than
    /// an SM of the target holds (its registers, shared memory and threads per SM).
    pub fn blocks_per_sm(&self, function: &CudaFunction, threads: u32, dynamic_smem: u32) -> Result<u32, GpuError> {
        let what = || GpuError::cuda("asking a kernel's occupancy");
        let here = function
            .occupancy_max_active_blocks_per_multiprocessor(threads, dynamic_smem as usize, None)
            .map_err(what())?;
        let Some(target) = self.info.stand_in else {
            return Ok(here);
        };
        let registers = function.num_regs().map_err(what())?;
        let static_smem = function.shared_size_bytes().map_err(what())?;
        let there = target.blocks_per_sm(
            threads,
            u32::try_from(registers).unwrap_or(0),
            u64::try_from(static_smem).unwrap_or(0) + u64::from(dynamic_smem),
        );
        Ok(here.min(there))
    }

    /// Waits for all queued work; a kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(GpuError::cuda("waiting for the GPU"))
    }
}
