//! Runs one variant on one problem: uploads the op's tensors, fills `__constant__` symbols,
//! poisons the outputs with NaN, launches every kernel of the family with the geometry its spec
//! computes for the shape, and reads the outputs back.

use cudarc::driver::sys::{self, CUfunction_attribute as FuncAttr};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{tensor_map, Compiled, Gpu, GpuError, TensorMap};
use crate::ops::{Arg, HostData, Problem, Role, Shape, Storage};
use crate::spec::{ArchTarget, Launch, SpecError, Variant};

/// Running a variant failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("{kernel}: {message}")]
    Launch { kernel: String, message: String },
}

/// A device copy of a problem's tensors plus the variant's workspace.
pub struct DeviceProblem {
    buffers: Vec<DeviceBuffer>,
    workspace: Option<CudaSlice<f32>>,
}

enum DeviceBuffer {
    /// Floating-point values in the problem's storage type, as [`Storage::encode`] lays them out.
    Float(CudaSlice<u8>, Storage),
    I32(CudaSlice<i32>),
}

impl DeviceBuffer {
    fn ptr(&self, gpu: &Gpu) -> u64 {
        match self {
            DeviceBuffer::Float(s, _) => s.device_ptr(&gpu.stream).0,
            DeviceBuffer::I32(s) => s.device_ptr(&gpu.stream).0,
        }
    }
}

impl DeviceProblem {
    /// Uploads every input of `problem`; outputs are allocated at their size, not copied
    /// (verification poisons them before each run, see [`DeviceProblem::poison_outputs`]).
    pub fn upload(gpu: &Gpu, problem: &Problem) -> Result<DeviceProblem, GpuError> {
        let buffers = problem
            .tensors
            .iter()
            .map(|t| {
                let what = format!("uploading `{}` ({} elements)", t.name, t.data.len());
                Ok(match &t.data {
                    HostData::F32(v) if t.role == Role::Output => {
                        let bytes = v.len() * problem.storage.bytes();
                        let slice = gpu.stream.alloc_zeros::<u8>(bytes).map_err(GpuError::cuda(what))?;
                        DeviceBuffer::Float(slice, problem.storage)
                    }
                    HostData::F32(v) => {
                        let bytes = problem.storage.encode(v);
                        let slice = gpu.stream.clone_htod(&bytes).map_err(GpuError::cuda(what))?;
                        DeviceBuffer::Float(slice, problem.storage)
                    }
                    HostData::I32(v) => DeviceBuffer::I32(gpu.stream.clone_htod(v).map_err(GpuError::cuda(what))?),
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(DeviceProblem {
            buffers,
            workspace: None,
        })
    }

    /// Makes sure the workspace holds at least `elems` f32 values.
    pub fn ensure_workspace(&mut self, gpu: &Gpu, elems: usize) -> Result<(), GpuError> {
        if elems > 0 && self.workspace.as_ref().is_none_or(|w| w.len() < elems) {
            let what = format!("allocating a workspace of {elems} floats");
            self.workspace = Some(gpu.stream.alloc_zeros::<f32>(elems).map_err(GpuError::cuda(what))?);
        }
        Ok(())
    }

    /// Fills every output tensor with NaN so that an element a kernel forgets to write fails
    /// verification instead of passing on stale data.
    pub fn poison_outputs(&mut self, gpu: &Gpu, problem: &Problem) -> Result<(), GpuError> {
        for (t, buf) in problem.tensors.iter().zip(self.buffers.iter_mut()) {
            if t.role != Role::Output {
                continue;
            }
            let what = format!("poisoning `{}`", t.name);
            match buf {
                DeviceBuffer::Float(s, storage) => {
                    let nan = storage.encode(&vec![f32::NAN; s.len() / storage.bytes()]);
                    gpu.stream.memcpy_htod(&nan, s).map_err(GpuError::cuda(what))?;
                }
                DeviceBuffer::I32(s) => {
                    let junk = vec![i32::MIN; s.len()];
                    gpu.stream.memcpy_htod(&junk, s).map_err(GpuError::cuda(what))?;
                }
            }
        }
        Ok(())
    }

    /// Copies tensor `index` back to the host as f32.
    pub fn download(&self, gpu: &Gpu, index: usize) -> Result<Vec<f32>, GpuError> {
        match &self.buffers[index] {
            DeviceBuffer::Float(s, storage) => Ok(storage.decode(
                &gpu.stream
                    .clone_dtoh(s)
                    .map_err(GpuError::cuda("downloading an output"))?,
            )),
            DeviceBuffer::I32(s) => Ok(gpu
                .stream
                .clone_dtoh(s)
                .map_err(GpuError::cuda("downloading an output"))?
                .into_iter()
                .map(|v| v as f32)
                .collect()),
        }
    }
}

/// A variant's module loaded on the GPU with its functions resolved.
pub struct LoadedVariant {
    pub variant: Variant,
    module: Arc<CudaModule>,
    /// In the spec's `[[kernels]]` order; `None` for a conditional kernel the template left out.
    functions: Vec<Option<CudaFunction>>,
    /// Per function, its static shared memory in bytes (asked once, at load)...
    static_smem: Vec<usize>,
    /// ... and the dynamic shared memory limit raised for it so far (0: the default), so that a
    /// launch, replayed every step, asks the driver nothing once its limit is raised.
    allowed_smem: Vec<AtomicUsize>,
    /// Whether its kernels wait for the kernel before them (compiled for sm_90 or later, where
    /// `common/launch.cu.tera` emits `griddepcontrol.wait`), so that a CUDA graph may launch
    /// them while that one still runs.
    waits_for_previous: bool,
}

/// Whether code compiled for `arch` (`sm_90a`, or `compute_86` for PTX) has programmatic
/// dependent launch (compute capability 9.0 on).
fn has_programmatic_launch(arch: &str) -> bool {
    let real = arch.replacen("compute_", "sm_", 1);
    ArchTarget::parse(&real).is_ok_and(|target| target.compute_capability >= (9, 0))
}

fn missing_function(variant: &Variant, name: &str, why: &str) -> RunError {
    RunError::Launch {
        kernel: name.to_string(),
        message: format!(
            "the template defines no `extern \"C\" __global__ void {name}` ({why}); every [[kernels]] \
             entry of {} needs one where its `when` holds",
            variant.family.file.display()
        ),
    }
}

impl LoadedVariant {
    /// Loads the module image and finds every kernel the spec names. A kernel with a `when` may be
    /// absent (the template defines it only where it runs); one that a launch needs is not.
    pub fn load(gpu: &Gpu, variant: &Variant, compiled: &Compiled) -> Result<LoadedVariant, RunError> {
        let module = gpu
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.image.clone()))
            .map_err(GpuError::cuda(format!(
                "loading the module of {}",
                compiled.kernel_name
            )))?;
        // The functions the image defines: a kernel with a `when` that the template left out
        // is not asked for, so that no lookup fails (a failed cuModuleGetFunction is an error
        // in compute-sanitizer's count, noise that hides real ones).
        let defined = super::cubin::entry_points(&compiled.image);
        let functions = variant
            .family
            .kernels
            .iter()
            .map(|k| {
                let name = format!("{}_{}", compiled.kernel_name, k.name);
                let absent = defined.as_ref().is_some_and(|d| !d.contains(&name));
                if absent && k.when.is_some() {
                    return Ok(None);
                }
                match module.load_function(&name) {
                    Ok(f) => Ok(Some(f)),
                    Err(_) if k.when.is_some() => Ok(None),
                    Err(e) => Err(missing_function(variant, &name, &e.to_string())),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let static_smem = functions
            .iter()
            .map(|f| match f {
                Some(f) => f
                    .get_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                    .map(|bytes| usize::try_from(bytes).unwrap_or(0))
                    .map_err(GpuError::cuda("asking a kernel's static shared memory")),
                None => Ok(0),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LoadedVariant {
            variant: variant.clone(),
            module,
            allowed_smem: functions.iter().map(|_| AtomicUsize::new(0)).collect(),
            functions,
            static_smem,
            waits_for_previous: has_programmatic_launch(&compiled.arch),
        })
    }

    /// Whether its kernels wait for the kernel launched before them (see the field).
    pub fn waits_for_previous(&self) -> bool {
        self.waits_for_previous
    }

    /// The loaded `__global__` function that `launch` runs.
    pub fn function(&self, launch: &Launch) -> Result<&CudaFunction, RunError> {
        self.functions
            .get(launch.kernel)
            .and_then(Option::as_ref)
            .ok_or_else(|| missing_function(&self.variant, &launch.function, "not in the module"))
    }

    /// Registers, shared memory and local (spill) bytes of each kernel the module holds, as the
    /// driver reports them.
    pub fn resources(&self) -> Result<Vec<KernelResources>, GpuError> {
        self.variant
            .family
            .kernels
            .iter()
            .zip(&self.functions)
            .filter_map(|(k, f)| f.as_ref().map(|f| (k, f)))
            .map(|(k, f)| {
                let err = GpuError::cuda("reading function attributes");
                Ok(KernelResources {
                    kernel: k.name.clone(),
                    registers: f.num_regs().map_err(err)?,
                    static_smem_bytes: f
                        .shared_size_bytes()
                        .map_err(GpuError::cuda("reading function attributes"))?,
                    local_bytes: f
                        .local_size_bytes()
                        .map_err(GpuError::cuda("reading function attributes"))?,
                    const_bytes: f
                        .const_size_bytes()
                        .map_err(GpuError::cuda("reading function attributes"))?,
                    max_threads: f
                        .max_threads_per_block()
                        .map_err(GpuError::cuda("reading function attributes"))?,
                })
            })
            .collect()
    }

    /// Copies the problem's tensors into the variant's `__constant__` symbols.
    pub fn fill_constants(&self, gpu: &Gpu, problem: &Problem) -> Result<(), RunError> {
        for (symbol, tensor) in self.variant.constants()? {
            let index = problem
                .tensors
                .iter()
                .position(|t| t.name == tensor)
                .ok_or_else(|| RunError::Launch {
                    kernel: self.variant.kernel_name(),
                    message: format!(
                        "{}: constants: op `{}` has no tensor `{tensor}`",
                        self.variant.family.file.display(),
                        problem.op
                    ),
                })?;
            let HostData::F32(values) = &problem.tensors[index].data else {
                return Err(RunError::Launch {
                    kernel: self.variant.kernel_name(),
                    message: format!("constant `{symbol}` can only be filled from an f32 tensor"),
                });
            };
            let mut global = self
                .module
                .get_global(symbol, &gpu.stream)
                .map_err(GpuError::cuda(format!("finding __constant__ `{symbol}`")))?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
            if bytes.len() > global.len() {
                return Err(RunError::Launch {
                    kernel: self.variant.kernel_name(),
                    message: format!(
                        "`{tensor}` has {} bytes but __constant__ `{symbol}` holds {}",
                        bytes.len(),
                        global.len()
                    ),
                });
            }
            let mut dst = global.slice_mut(0..bytes.len());
            gpu.stream
                .memcpy_htod(&bytes, &mut dst)
                .map_err(GpuError::cuda(format!("filling `{symbol}`")))?;
        }
        Ok(())
    }

    /// Launch geometry for `shape`, checked against the device limits.
    pub fn plan(&self, gpu: &Gpu, shape: &Shape) -> Result<Vec<Launch>, RunError> {
        let limits = &gpu.info.limits;
        let launches = self.variant.launches(shape, limits)?;
        for l in &launches {
            let function = self.function(l)?;
            let threads: i64 = l.block.iter().map(|v| *v as i64).product();
            // After compilation the register count can lower the block size a kernel can run.
            let compiled_max = function
                .max_threads_per_block()
                .map(i64::from)
                .unwrap_or(limits.max_threads);
            // The opt-in limit is for a block's whole shared memory: the compiled static part
            // counts against it too (the driver would refuse the dynamic size without a reason).
            let static_smem = function.shared_size_bytes().map(i64::from).unwrap_or(0);
            let bad = if threads > limits.max_threads.min(compiled_max) {
                Some(format!(
                    "{threads} threads per block, but the compiled kernel (registers) or the device allows {}",
                    limits.max_threads.min(compiled_max)
                ))
            } else if l.grid[1] > 65535 || l.grid[2] > 65535 {
                Some(format!("grid {:?} exceeds 65535 in y or z", l.grid))
            } else if l.smem_bytes as i64 + static_smem > limits.max_smem_dynamic {
                Some(format!(
                    "{} bytes of dynamic shared memory beside {static_smem} of static, the device allows {} in all",
                    l.smem_bytes, limits.max_smem_dynamic
                ))
            } else {
                None
            };
            if let Some(message) = bad {
                return Err(RunError::Launch {
                    kernel: l.function.clone(),
                    message,
                });
            }
        }
        Ok(launches)
    }

    /// Launches every kernel once on a problem's device copy, in spec order (asynchronously;
    /// synchronize to see faults).
    pub fn launch(
        &self,
        gpu: &Gpu,
        problem: &Problem,
        device: &DeviceProblem,
        launches: &[Launch],
    ) -> Result<(), RunError> {
        let values: Vec<ArgValue> = problem
            .args
            .iter()
            .map(|a| match a {
                Arg::Tensor(i) => ArgValue::Ptr(device.buffers[*i].ptr(gpu)),
                Arg::Workspace => ArgValue::Ptr(device.workspace.as_ref().map_or(0, |w| w.device_ptr(&gpu.stream).0)),
                Arg::I32(v) => ArgValue::I32(*v),
                Arg::F32(v) => ArgValue::F32(*v),
            })
            .collect();
        self.launch_args(gpu, &values, launches)
    }

    /// Raises the dynamic shared memory limit of the kernels whose static and dynamic shared
    /// memory together pass the default 48 KiB for `launches` (before launching them directly or
    /// in a graph; the occupancy query counts none of them resident otherwise). Once per kernel
    /// and size: a limit already raised that far is left alone.
    pub fn allow_shared_memory(&self, launches: &[Launch]) -> Result<(), RunError> {
        const DEFAULT_LIMIT: usize = 48 * 1024; // static + dynamic, without the opt-in below
        for l in launches {
            let smem = l.smem_bytes as usize;
            let (static_bytes, allowed) = match (self.static_smem.get(l.kernel), self.allowed_smem.get(l.kernel)) {
                (Some(&s), Some(a)) => (s, a),
                _ => return Err(missing_function(&self.variant, &l.function, "not in the module")),
            };
            if smem + static_bytes <= DEFAULT_LIMIT || allowed.load(Ordering::Relaxed) >= smem {
                continue;
            }
            self.function(l)?
                .set_attribute(
                    FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    l.smem_bytes as i32,
                )
                .map_err(GpuError::cuda(format!(
                    "allowing {} bytes of shared memory",
                    l.smem_bytes
                )))?;
            allowed.fetch_max(smem, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Launches every kernel once with explicit arguments (device pointers and scalars in the
    /// op's signature order): what the model uses on its own buffers.
    pub fn launch_args(&self, gpu: &Gpu, values: &[ArgValue], launches: &[Launch]) -> Result<(), RunError> {
        self.allow_shared_memory(launches)?;
        for l in launches {
            let args = tensor_map::kernel_args(values, l)?;
            let mut builder = gpu.stream.launch_builder(self.function(l)?);
            for v in args.iter() {
                match v {
                    ArgValue::Ptr(p) => builder.arg(p),
                    ArgValue::I32(x) => builder.arg(x),
                    ArgValue::F32(x) => builder.arg(x),
                    ArgValue::TensorMap(m) => builder.arg(m),
                };
            }
            let config = LaunchConfig {
                grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                block_dim: (l.block[0], l.block[1], l.block[2]),
                shared_mem_bytes: l.smem_bytes,
            };
            // SAFETY: the argument list follows the op contract every template of the op
            // implements, pointers are live device buffers of the sizes the op computed, and the
            // geometry was checked against the device limits in `plan`.
            unsafe { builder.launch(config) }.map_err(GpuError::cuda(format!(
                "launching {} grid {:?} block {:?}",
                l.function, l.grid, l.block
            )))?;
        }
        Ok(())
    }

    /// [`Self::launch_args`], each launch allowed to start while the kernel before it on the
    /// stream still runs (programmatic stream serialization: its blocks launch once every block
    /// of that one has started, and wait in `griddepcontrol.wait`). Only for a variant that
    /// [waits for the previous kernel](Self::waits_for_previous); else it is `launch_args`.
    pub fn launch_args_overlapped(&self, gpu: &Gpu, values: &[ArgValue], launches: &[Launch]) -> Result<(), RunError> {
        if !self.waits_for_previous {
            return self.launch_args(gpu, values, launches);
        }
        self.allow_shared_memory(launches)?;
        gpu.ctx
            .bind_to_thread()
            .map_err(GpuError::cuda("binding the CUDA context"))?;
        for l in launches {
            let mut buffer = ArgBuffer::new(&tensor_map::kernel_args(values, l)?);
            let mut pointers = buffer.pointers();
            // SAFETY: an all-zero attribute value is valid for every member of the union.
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: l.grid[0],
                gridDimY: l.grid[1],
                gridDimZ: l.grid[2],
                blockDimX: l.block[0],
                blockDimY: l.block[1],
                blockDimZ: l.block[2],
                sharedMemBytes: l.smem_bytes,
                hStream: gpu.stream.cu_stream(),
                attrs: &mut attribute,
                numAttrs: 1,
            };
            // SAFETY: as in `launch_args`; the argument pointers and the attribute outlive the
            // call, which copies what they point at.
            unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    self.function(l)?.cu_function(),
                    pointers.as_mut_ptr(),
                    ptr::null_mut(),
                )
                .result()
            }
            .map_err(GpuError::cuda(format!(
                "launching {} grid {:?} block {:?} after the previous kernel",
                l.function, l.grid, l.block
            )))?;
        }
        Ok(())
    }
}

/// Kernel arguments laid out as `cuLaunchKernel` wants them: one pointer per argument to a
/// value of the argument's own size. The pointers are only valid while `self` lives.
pub(crate) struct ArgBuffer {
    values: Vec<Vec<u8>>,
}

impl ArgBuffer {
    pub(crate) fn new(args: &[ArgValue]) -> ArgBuffer {
        ArgBuffer {
            values: args.iter().map(ArgValue::bytes).collect(),
        }
    }

    pub(crate) fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect()
    }
}

/// A kernel argument value: a raw device pointer, a scalar, or a TMA tensor map (which
/// [`tensor_map::kernel_args`] appends from the spec; the op's own arguments are the others).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArgValue {
    Ptr(u64),
    I32(i32),
    F32(f32),
    TensorMap(TensorMap),
}

impl ArgValue {
    /// The value's bytes, as `cuLaunchKernel` reads a parameter of its type.
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            ArgValue::Ptr(p) => p.to_ne_bytes().to_vec(),
            ArgValue::I32(v) => v.to_ne_bytes().to_vec(),
            ArgValue::F32(v) => v.to_ne_bytes().to_vec(),
            ArgValue::TensorMap(m) => m.bytes(),
        }
    }
}

/// Resource usage of one compiled kernel.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelResources {
    pub kernel: String,
    pub registers: i32,
    pub static_smem_bytes: i32,
    pub local_bytes: i32,
    pub const_bytes: i32,
    pub max_threads: i32,
}

#[cfg(test)]
mod tests {
    use super::has_programmatic_launch;

    #[test]
    fn programmatic_launch_from_hopper_on_and_never_below() {
        for arch in ["sm_90", "sm_90a", "compute_90a", "sm_100a", "sm_120"] {
            assert!(has_programmatic_launch(arch), "{arch}");
        }
        for arch in ["sm_75", "sm_80", "sm_89", "compute_86", "", "sm_x"] {
            assert!(!has_programmatic_launch(arch), "{arch}");
        }
    }
}
