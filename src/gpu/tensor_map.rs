//! TMA tensor maps: the host-side descriptors (`CUtensorMap`) that Hopper's tensor memory
//! accelerator needs to copy tiles between global and shared memory, built from a spec's
//! `[[kernels.tensor_maps]]` entries and the device pointers of the op's arguments, and passed
//! to the kernel after the op's arguments.

use std::borrow::Cow;

use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;

use super::{ArgValue, GpuError};
use crate::ops::Storage;
use crate::spec::{Launch, TensorMapLaunch};

/// One encoded tensor map, passed by value as a `const __grid_constant__` kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct TensorMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte value the driver copies into the kernel's parameter space, exactly
// what the templates' `TensorMap` parameter type (128 bytes, same alignment) expects.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// The raw bytes, as a kernel parameter.
    pub fn bytes(&self) -> Vec<u8> {
        self.0.opaque.iter().flat_map(|q| q.to_ne_bytes()).collect()
    }
}

/// Encodes the map `plan` describes for the tensor at device address `address`.
pub fn encode(plan: &TensorMapLaunch, address: u64, function: &str) -> Result<TensorMap, GpuError> {
    let error = |message: String| map_error(plan, function, message);
    let element = plan.storage.bytes() as u64;
    let row_bytes = plan.cols * element;
    // The driver's own rules, checked here so the error can say which tensor and what to change.
    let problem = if !address.is_multiple_of(16) {
        Some(format!("its address {address:#x} is not 16-byte aligned"))
    } else if plan.rows > 1 && !row_bytes.is_multiple_of(16) {
        Some(format!(
            "its rows are {row_bytes} bytes apart; TMA needs a multiple of 16 (the spec's shape \
             constraints should require it)"
        ))
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(error(problem));
    }
    let data_type = match plan.storage {
        Storage::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        Storage::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        Storage::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let swizzle = match plan.swizzle {
        32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    };
    // Dimension 0 is the contiguous one. Strides are given for dimensions 1.. only, in bytes.
    let dims = [plan.cols, plan.rows];
    let strides = [row_bytes.max(16)];
    let boxes = [plan.box_cols, plan.box_rows];
    let element_strides = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer is to a live local array of the rank (2) the call is told; the
    // driver only writes the 128-byte map. Out-of-bounds box elements read as zeros
    // (OOB_FILL_NONE), which is what makes partial edge tiles add nothing.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            2,
            address as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    result.result().map_err(|e| {
        error(format!(
            "cuTensorMapEncodeTiled refused {} x {} elements of {} bytes in boxes of {} x {} \
             (swizzle {}): {e}",
            plan.rows, plan.cols, element, plan.box_rows, plan.box_cols, plan.swizzle
        ))
    })?;
    // SAFETY: the call succeeded, so the map is initialised.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

fn map_error(plan: &TensorMapLaunch, function: &str, message: String) -> GpuError {
    GpuError::TensorMap {
        function: function.to_string(),
        arg: plan.arg.clone(),
        message,
    }
}

/// The kernel arguments of `launch`: the op's `values`, then one tensor map per
/// `[[kernels.tensor_maps]]` entry, built from the pointer argument it names. Borrows `values`
/// when the kernel takes no maps (every family but the TMA ones), so launches copy nothing.
pub fn kernel_args<'a>(values: &'a [ArgValue], launch: &Launch) -> Result<Cow<'a, [ArgValue]>, GpuError> {
    if launch.tensor_maps.is_empty() {
        return Ok(Cow::Borrowed(values));
    }
    let mut args = values.to_vec();
    for plan in &launch.tensor_maps {
        let address = match values.get(plan.arg_index) {
            Some(ArgValue::Ptr(p)) => *p,
            other => {
                let message = format!("kernel argument {} is {other:?}, not a device pointer", plan.arg_index);
                return Err(map_error(plan, &launch.function, message));
            }
        };
        args.push(ArgValue::TensorMap(encode(plan, address, &launch.function)?));
    }
    Ok(Cow::Owned(args))
}
