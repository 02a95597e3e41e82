//! Device discovery: the CUDA context and stream kernelforge uses, and the limits specs see.

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

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
}

impl GpuError {
    pub(crate) fn cuda(what: impl Into<String>) -> impl FnOnce(DriverError) -> GpuError {
        let what = what.into();
        move |source| GpuError::Cuda { what, source }
    }
}

/// What kernelforge knows about the device it runs on.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Driver version as CUDA reports it (13000 = 13.0).
    pub driver_version: i32,
    pub total_memory_bytes: usize,
    pub limits: DeviceLimits,
}

impl DeviceInfo {
    /// `sm_90` for compute capability 9.0: what NVRTC compiles for.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// A CUDA context and the one stream everything runs on.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
}

/// Whether the CUDA driver library can be loaded (false on machines without a GPU).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Gpu {
    /// Opens device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Gpu, GpuError> {
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
        let limits = DeviceLimits {
            max_threads: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_smem_static: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
            max_smem_dynamic: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            num_sms: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            warp_size: attr(Attr::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
            compute_capability,
        };
        let mut driver_version = 0;
        // SAFETY: plain out-parameter call.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(GpuError::cuda("reading the driver version"))?;
        let info = DeviceInfo {
            name: ctx.name().map_err(GpuError::cuda("reading the device name"))?,
            compute_capability,
            driver_version,
            total_memory_bytes: ctx.total_mem().map_err(GpuError::cuda("reading the memory size"))?,
            limits,
        };
        Ok(Gpu { ctx, stream, info })
    }

    /// Waits for all queued work; a kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(GpuError::cuda("waiting for the GPU"))
    }
}
