//! The CUDA side: find the device and its limits ([`device`]), pick the GPUs a command runs on
//! and slice a batch across them ([`devices`]), compile rendered sources with
//! NVRTC behind an on-disk cache ([`compile`]) and read what the machine code holds ([`cubin`]), and run a variant on a problem: buffers,
//! constant memory, launch geometry from the spec, poisoned outputs ([`run`]); replay a fixed
//! sequence of launches as one CUDA graph ([`graph`]); build the TMA descriptors some kernels take
//! ([`tensor_map`]); measure the copy bandwidth that bounds memory-bound work ([`bandwidth`]);
//! stand in for an older GPU: its limits, its PTX, its own tuning database ([`stand_in`]).

pub mod bandwidth;
pub mod compile;
pub mod compile_workers;
pub mod cubin;
pub mod device;
pub mod devices;
pub mod graph;
pub mod run;
pub mod stand_in;
pub mod tensor_map;

pub use bandwidth::{copy_bandwidth, BandwidthError, CopyBandwidth};
pub use compile::{CompileError, Compiled, Compiler};
pub use device::{Gpu, GpuError};
pub use devices::{device_count, identify, slice_batch, DeviceIdentity, DeviceListError, DeviceSelection};
pub use graph::{GraphMismatch, GraphUpdateError, KernelGraph};
pub use run::{ArgValue, DeviceProblem, LoadedVariant, RunError};
pub use stand_in::StandIn;
pub use tensor_map::TensorMap;
