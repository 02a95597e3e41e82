//! The device buffers of a GPT-2 replica: the activations for up to `max_batch × n_ctx` tokens,
//! the KV cache of every layer, how they grow, and how much memory a replica needs before any
//! of it is allocated (so a GPU that cannot hold it is refused with the figures).

use anyhow::Result as AnyResult;
use cudarc::driver::sys::{cuMemHostGetDevicePointer_v2, CU_MEMHOSTALLOC_DEVICEMAP};
use cudarc::driver::{CudaSlice, PinnedHostSlice};

use super::{ptr, GpuBackend};
use crate::gpu::{Gpu, GpuError};
use crate::model::config::GPT2Config;
use crate::ops::Storage;

/// A device buffer of `len` elements of the model's storage type (f32, f16 or bf16).
pub(super) struct DeviceTensor {
    pub bytes: CudaSlice<u8>,
    pub len: usize,
}

impl DeviceTensor {
    pub fn ptr(&self, gpu: &Gpu) -> u64 {
        ptr(gpu, &self.bytes)
    }
}

/// Activation buffers for up to `rows` tokens.
pub(super) struct Activations {
    pub rows: usize,
    pub ids: CudaSlice<i32>,
    pub x: [DeviceTensor; 2],
    pub ln: DeviceTensor,
    pub qkv: DeviceTensor,
    pub att: DeviceTensor,
    pub fc: DeviceTensor,
    /// Pre-GELU fc output (unfused only; empty otherwise).
    pub fc_pre: DeviceTensor,
    /// The last position of each sequence, gathered for the LM head of `prefill_last`.
    pub last: DeviceTensor,
    pub logits: DeviceTensor,
    /// The tokens each decode step chose on the device (argmax, sampler or the megakernel's
    /// LM head), written where the host reads them.
    pub next_ids: DrawnIds,
}

/// Where decode steps that choose their tokens on the device write them, twice: into page-locked
/// host memory mapped into the GPU's address space, where the host reads them once the step's
/// event has passed, and into device memory, where the next step's embedding reads them. No copy
/// runs between two steps: a copy back was work for a copy engine between two steps' kernels,
/// which cost the megakernel at batch 1 6 µs a step on the H200 (benches/RESULTS.md, "The drawn
/// ids written straight to the host"); and the embedding reading its ids across PCIe waited a
/// round trip before it could fetch its rows.
///
/// Two slots of `capacity` ids in each place: a step writes one while the host may still read
/// the other, which the step before wrote, and the step reads its own input tokens from that
/// other slot's device copy (see `run_ahead.rs`).
pub(super) struct DrawnIds {
    host: PinnedHostSlice<i32>,
    /// `host`'s address in the GPU's address space.
    host_mapped: u64,
    /// Owned for `device_address`, which points into it.
    _device: CudaSlice<i32>,
    device_address: u64,
    capacity: usize,
}

impl DrawnIds {
    fn new(gpu: &Gpu, capacity: usize) -> AnyResult<DrawnIds> {
        let what = || format!("allocating mapped page-locked memory for 2 x {capacity} token ids");
        // SAFETY: nothing reads the memory before a step has written the part read (the host
        // after that step's event); zeroed below.
        let mut host = unsafe {
            gpu.ctx
                .alloc_pinned_with_flags::<i32>(2 * capacity, CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .map_err(GpuError::cuda(what()))?;
        let base = host.as_mut_ptr().map_err(GpuError::cuda(what()))?;
        // SAFETY: `base` is the start of 2 * capacity i32s just allocated, used by nothing yet.
        unsafe { std::ptr::write_bytes(base, 0, 2 * capacity) };
        let mut host_mapped = 0;
        // SAFETY: `base` was allocated above with CU_MEMHOSTALLOC_DEVICEMAP in this context.
        unsafe { cuMemHostGetDevicePointer_v2(&mut host_mapped, base.cast(), 0).result() }
            .map_err(GpuError::cuda(what()))?;
        let device = gpu
            .stream
            .alloc_zeros::<i32>(2 * capacity)
            .map_err(GpuError::cuda(format!(
                "allocating 2 x {capacity} token ids on the device"
            )))?;
        let device_address = ptr(gpu, &device);
        Ok(DrawnIds {
            host,
            host_mapped,
            _device: device,
            device_address,
            capacity,
        })
    }

    fn offset(&self, slot: usize) -> u64 {
        (slot * self.capacity * std::mem::size_of::<i32>()) as u64
    }

    /// Where the step of `slot` (0 or 1) writes the ids the host reads (mapped host memory).
    pub fn host_ptr(&self, slot: usize) -> u64 {
        self.host_mapped + self.offset(slot)
    }

    /// Where the step of `slot` writes the same ids in device memory, for the next step.
    pub fn device_ptr(&self, slot: usize) -> u64 {
        self.device_address + self.offset(slot)
    }

    /// Where the step of `slot` reads its input ids when they are the previous step's choice:
    /// the device copy of the other slot.
    pub fn input_of(&self, slot: usize) -> u64 {
        self.device_ptr(slot ^ 1)
    }

    /// The first `b` ids of `slot`. Only once the step that wrote them has finished (its event
    /// synchronized): the memory is the GPU's to write until then.
    pub fn read(&self, slot: usize, b: usize) -> AnyResult<Vec<i32>> {
        let ids = self
            .host
            .as_slice()
            .map_err(GpuError::cuda("reading the drawn token ids"))?;
        Ok(ids[slot * self.capacity..][..b].to_vec())
    }
}

/// The device memory a replica needs, by what it holds (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaMemory {
    /// Parameters in the storage type (`wte` padded to the padded vocabulary).
    pub weights: usize,
    /// Activations and logits for `max_batch × n_ctx` tokens.
    pub activations: usize,
    /// K and V of every layer for `max_batch` sequences of `n_ctx` tokens.
    pub kv_cache: usize,
}

/// Headroom for what is allocated later and not counted above: kernel workspaces (split-K
/// partials), loaded modules, CUDA graphs, the CUDA context's own allocations.
const HEADROOM_BYTES: usize = 512 << 20;

impl ReplicaMemory {
    /// What [`GpuBackend`] allocates for `max_batch` sequences in `storage_bytes`-byte elements.
    pub fn estimate(cfg: &GPT2Config, storage_bytes: usize, max_batch: usize, unfused: bool) -> ReplicaMemory {
        let (c, l, vp, n_ctx) = (cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size, cfg.n_ctx);
        let params = vp * c + n_ctx * c + l * (12 * c * c + 13 * c) + 2 * c;
        let rows = max_batch.max(1) * n_ctx;
        // x (2), ln, qkv (3), att, fc (4), fc before GELU (4, unfused only), then the logits.
        let per_row = c * (2 + 1 + 3 + 1 + 4 + if unfused { 4 } else { 0 }) + vp;
        ReplicaMemory {
            weights: params * storage_bytes,
            activations: rows * per_row * storage_bytes + rows * 4 + max_batch * c * storage_bytes,
            kv_cache: 2 * l * rows * c * storage_bytes,
        }
    }

    /// Everything, with the headroom.
    pub fn total(&self) -> usize {
        self.weights + self.activations + self.kv_cache + HEADROOM_BYTES
    }

    /// `Err` with the figures and the fixes when `free` bytes cannot hold it.
    pub fn check(&self, device: &str, free: usize, max_batch: usize) -> Result<(), String> {
        if self.total() <= free {
            return Ok(());
        }
        Err(format!(
            "{device} cannot hold the model: it needs {:.2} GiB (weights {:.2}, activations {:.2}, KV cache {:.2} for \
             {max_batch} sequences, {:.2} headroom) and has {:.2} GiB free; use a smaller --batch, a 16-bit --dtype, \
             or more GPUs (--devices)",
            gib(self.total()),
            gib(self.weights),
            gib(self.activations),
            gib(self.kv_cache),
            gib(HEADROOM_BYTES),
            gib(free)
        ))
    }
}

/// Bytes in GiB, for the figures of a memory error.
pub(super) fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `Err` naming `device` when an upload of `bytes`, with `margin` left for what follows it, does
/// not fit in the device's `free` bytes; `explain(bytes, free)` words the rest from the two
/// sizes in GiB.
pub(super) fn upload_fits(
    device: &str,
    bytes: usize,
    margin: usize,
    free: usize,
    explain: impl FnOnce(f64, f64) -> String,
) -> Result<(), String> {
    if bytes + margin <= free {
        return Ok(());
    }
    Err(format!("{device}: {}", explain(gib(bytes), gib(free))))
}

impl GpuBackend {
    /// The replica's device as errors name it: `cuda:0 (NVIDIA H100 80GB HBM3)`.
    pub(super) fn device_label(&self) -> String {
        format!("{} ({})", self.name, self.gpu.info.name)
    }

    /// The device's free bytes now, before an upload the start-up estimate did not count (copies
    /// of weights that only some choices make); `before` says which in an error.
    pub(super) fn free_memory(&self, before: &str) -> AnyResult<usize> {
        let free = self
            .gpu
            .free_memory()
            .map_err(GpuError::cuda(format!("reading the free memory before {before}")))?;
        Ok(free)
    }
}

/// A zeroed device buffer of `n` elements of `storage`.
fn alloc(gpu: &Gpu, storage: Storage, n: usize, what: &str) -> AnyResult<DeviceTensor> {
    let bytes = n.max(1) * storage.bytes();
    let buffer = gpu.stream.alloc_zeros::<u8>(bytes).map_err(GpuError::cuda(format!(
        "allocating {what} ({n} elements, {:.1} MiB)",
        bytes as f64 / (1 << 20) as f64
    )))?;
    Ok(DeviceTensor { bytes: buffer, len: n })
}

impl GpuBackend {
    pub(super) fn alloc_activations(
        gpu: &Gpu,
        storage: Storage,
        cfg: &GPT2Config,
        rows: usize,
        max_batch: usize,
        unfused: bool,
    ) -> AnyResult<Activations> {
        let c = cfg.n_embd;
        Ok(Activations {
            rows,
            ids: gpu
                .stream
                .alloc_zeros::<i32>(rows.max(1))
                .map_err(GpuError::cuda(format!("allocating the token ids ({rows})")))?,
            x: [
                alloc(gpu, storage, rows * c, "residual A")?,
                alloc(gpu, storage, rows * c, "residual B")?,
            ],
            ln: alloc(gpu, storage, rows * c, "layernorm out")?,
            qkv: alloc(gpu, storage, rows * 3 * c, "qkv")?,
            att: alloc(gpu, storage, rows * c, "attention out")?,
            fc: alloc(gpu, storage, rows * 4 * c, "fc")?,
            fc_pre: alloc(gpu, storage, if unfused { rows * 4 * c } else { 0 }, "fc (pre-GELU)")?,
            last: alloc(gpu, storage, max_batch.max(rows / cfg.n_ctx) * c, "last rows")?,
            logits: alloc(gpu, storage, rows * cfg.padded_vocab_size, "logits")?,
            next_ids: DrawnIds::new(gpu, max_batch.max(rows / cfg.n_ctx).max(1))?,
        })
    }

    pub(super) fn alloc_kv(
        gpu: &Gpu,
        storage: Storage,
        cfg: &GPT2Config,
        batch: usize,
    ) -> AnyResult<Vec<(DeviceTensor, DeviceTensor)>> {
        let n = batch * cfg.n_ctx * cfg.n_embd; // [B, NH, n_ctx, HS]
        (0..cfg.n_layer)
            .map(|l| {
                Ok((
                    alloc(gpu, storage, n, &format!("K cache of layer {l}"))?,
                    alloc(gpu, storage, n, &format!("V cache of layer {l}"))?,
                ))
            })
            .collect()
    }

    /// Grow the activations / KV cache for a batch of `b` sequences of `t` tokens.
    pub(super) fn ensure_capacity(&mut self, b: usize, t: usize) -> AnyResult<()> {
        let cfg = self.model.config.clone();
        if b * t > self.act.rows || b > self.act.last.len / cfg.n_embd {
            let rows = (b * cfg.n_ctx).max(self.act.rows);
            let storage = self.dtype.storage();
            // A step launched ahead may still be writing into the buffers about to be freed
            // (the drawn ids are host memory, which freeing does not wait for).
            self.gpu.synchronize()?;
            self.act = Self::alloc_activations(&self.gpu, storage, &cfg, 0, 1, false)?; // free the old ones first
            self.act = Self::alloc_activations(&self.gpu, storage, &cfg, rows, b, self.unfused)?;
            self.buffers_generation += 1;
        }
        if b > self.kv_batch {
            self.kv.clear();
            self.kv = Self::alloc_kv(&self.gpu, self.dtype.storage(), &cfg, b)?;
            self.kv_batch = b;
            self.buffers_generation += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_memory_counts_weights_activations_and_cache() {
        let cfg = GPT2Config::gpt2();
        let m = ReplicaMemory::estimate(&cfg, 2, 8, false);
        // 124M parameters (wte padded to 50304) in bf16.
        assert_eq!(
            m.weights,
            (50304 * 768 + 1024 * 768 + 12 * (12 * 768 * 768 + 13 * 768) + 2 * 768) * 2
        );
        assert_eq!(m.kv_cache, 2 * 12 * 8 * 1024 * 768 * 2);
        assert!(
            m.activations > 8 * 1024 * 50304 * 2,
            "the logits dominate the activations"
        );
        assert!(m.check("cuda:0", 80 << 30, 8).is_ok());
        let e = m.check("cuda:1", 1 << 30, 8).unwrap_err();
        assert!(
            e.starts_with("cuda:1 cannot hold the model") && e.contains("has 1.00 GiB free"),
            "{e}"
        );
        assert!(e.contains("--batch") && e.contains("--devices"), "{e}");
        let unfused = ReplicaMemory::estimate(&cfg, 4, 8, true);
        assert!(unfused.activations > 2 * m.activations);
    }
}
