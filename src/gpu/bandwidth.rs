//! The device-memory bandwidth a plain device-to-device copy reaches on this GPU: the practical
//! ceiling of work that streams memory, such as a decode step, whose floor
//! ([`crate::model::floor`]) `kernelforge bench` divides by it.

use cudarc::driver::sys::CUevent_flags;

use super::device::{Gpu, GpuError};

/// What [`copy_bandwidth`] measured.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CopyBandwidth {
    /// Bytes of the copied buffer: each copy reads this many and writes this many.
    pub buffer_bytes: usize,
    /// Copies timed.
    pub copies: usize,
    /// The median time of one copy.
    pub median_ms: f64,
    /// Bytes read plus bytes written per second, in 10⁹ (decimal GB/s).
    pub gb_per_s: f64,
}

/// The buffer [`copy_bandwidth`] copies by default: 1 GiB, far beyond any L2 cache.
pub const DEFAULT_COPY_BYTES: usize = 1 << 30;

/// The least buffer worth timing: still well beyond the L2 cache of current GPUs (50 MB on an
/// H100), so the copy measures device memory.
pub const MIN_COPY_BYTES: usize = 128 << 20;

/// Why the bandwidth was not measured.
#[derive(Debug, thiserror::Error)]
pub enum BandwidthError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(
        "only {free_mib} MiB of GPU memory free: measuring the copy bandwidth needs two buffers of at least {} MiB; \
         free some memory (a smaller --batch) or run on an idle GPU",
        MIN_COPY_BYTES >> 20
    )]
    TooLittleMemory { free_mib: usize },
}

/// Copy a buffer of `max_bytes` (or a third of the free memory, each of source and destination,
/// when that is less) device to device once to warm up, then `repeats` times (at least 1), each
/// between two CUDA events on the GPU's stream; the median copy gives the bandwidth, counted as
/// bytes read + bytes written. The buffers are freed before returning.
pub fn copy_bandwidth(gpu: &Gpu, max_bytes: usize, repeats: usize) -> Result<CopyBandwidth, BandwidthError> {
    let (free, _total) = gpu
        .ctx
        .mem_get_info()
        .map_err(GpuError::cuda("reading the free GPU memory"))?;
    const MIB: usize = 1 << 20;
    let bytes = max_bytes.min(free / 3) / MIB * MIB;
    if bytes < MIN_COPY_BYTES.min(max_bytes) || bytes == 0 {
        return Err(BandwidthError::TooLittleMemory { free_mib: free / MIB });
    }
    let what = format!("allocating two {} MiB buffers for the copy bandwidth", bytes / MIB);
    let src = gpu
        .stream
        .alloc_zeros::<u8>(bytes)
        .map_err(GpuError::cuda(what.clone()))?;
    let mut dst = gpu.stream.alloc_zeros::<u8>(bytes).map_err(GpuError::cuda(what))?;
    let copy = |dst: &mut cudarc::driver::CudaSlice<u8>| {
        gpu.stream
            .memcpy_dtod(&src, dst)
            .map_err(GpuError::cuda("copying on the device"))
    };
    copy(&mut dst)?; // warm-up
    let event = || {
        gpu.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(GpuError::cuda("creating an event"))
    };
    let repeats = repeats.max(1);
    let mut events = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let (start, end) = (event()?, event()?);
        start
            .record(&gpu.stream)
            .map_err(GpuError::cuda("recording an event"))?;
        copy(&mut dst)?;
        end.record(&gpu.stream).map_err(GpuError::cuda("recording an event"))?;
        events.push((start, end));
    }
    gpu.synchronize()?;
    let times = events
        .iter()
        .map(|(start, end)| {
            start
                .elapsed_ms(end)
                .map(f64::from)
                .map_err(GpuError::cuda("reading an event"))
        })
        .collect::<Result<Vec<f64>, GpuError>>()?;
    let median_ms = crate::stats::median(times);
    drop((src, dst));
    gpu.synchronize()?;
    Ok(CopyBandwidth {
        buffer_bytes: bytes,
        copies: repeats,
        median_ms,
        gb_per_s: 2.0 * bytes as f64 / (median_ms.max(1e-6) * 1e-3) / 1e9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_copy_reaches_a_plausible_bandwidth() {
        let gpu = Gpu::new(0).unwrap();
        let bw = copy_bandwidth(&gpu, 256 << 20, 5).unwrap();
        assert_eq!((bw.buffer_bytes, bw.copies), (256 << 20, 5));
        // Any GPU this project runs on copies faster than 50 GB/s and slower than 20 TB/s.
        assert!(bw.gb_per_s > 50.0 && bw.gb_per_s < 20_000.0, "{bw:?}");
    }
}
