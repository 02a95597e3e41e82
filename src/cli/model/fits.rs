//! The memory check `bench` and `generate` run before they build a backend: a batch whose
//! weights, KV cache and activations do not fit in the free memory of each GPU it would run on
//! (or in the host's available memory, on the CPU) is refused in one line that names the size
//! needed and the largest batch that fits ([`crate::model::memory_fit`]). The GPUs it asks are
//! opened on a thread of their own while the checkpoint loads ([`OpeningGpus`]).

use std::thread::JoinHandle;

use anyhow::{bail, Result};

use super::{gpus_for_batch, BackendOptions, Device};
use crate::gpu::{slice_batch, Gpu};
use crate::model::config::GPT2Config;
use crate::model::memory_fit::{largest_fitting_batch, mem_available_bytes, BatchTooLarge, MemoryNeed, MAX_BATCH};

/// The tokens a sequence holds on the CPU backend, which allocates as it goes (a GPU replica
/// allocates for the whole context up front).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CpuTokens {
    /// Tokens the KV cache holds at the most.
    pub cached: usize,
    /// Tokens of the longest step (the prefill, or a whole forward pass).
    pub step: usize,
    /// Tokens of that step that get a logits row.
    pub logits: usize,
}

/// The CUDA contexts the check opened, to be held until the backend has opened its own (so
/// the driver does not tear a context down only to build it again).
pub(crate) struct CheckedGpus {
    _contexts: Vec<Gpu>,
}

/// The GPUs a batch will run on, being opened on a thread of their own: started before the
/// checkpoint loads, so that the driver's start-up and each CUDA context (a few hundred
/// milliseconds on a large GPU) overlap the host's reading; the templates are parsed meanwhile
/// too (about 0.1 s). [`check_batch_fits`] takes them (their free memory) and keeps them open
/// until the backend has opened the same contexts.
pub(crate) struct OpeningGpus(Option<JoinHandle<Option<Vec<OpenedGpu>>>>);

/// A GPU's ordinal and its opened context.
type OpenedGpu = (usize, Gpu);

impl OpeningGpus {
    /// Starts opening the GPUs `opts` asks for (none on the CPU), and parsing the kernel
    /// templates the backend renders from (on another thread: `Renderer::warm`).
    pub(crate) fn start(device: Device, opts: &BackendOptions) -> OpeningGpus {
        if device == Device::Cpu {
            return OpeningGpus(None);
        }
        if let Ok(root) = crate::cli::project_root(opts.root.as_deref()) {
            crate::codegen::Renderer::warm(&root.join("templates"));
        }
        let (asked, max_batch) = (opts.devices.clone(), opts.max_batch.max(1));
        OpeningGpus(Some(std::thread::spawn(move || {
            let count = crate::gpu::device_count().ok()?;
            let (devices, _) = gpus_for_batch(&asked, count, max_batch).ok()?;
            devices
                .into_iter()
                .map(|d| Gpu::new(d).ok().map(|gpu| (d, gpu)))
                .collect()
        })))
    }

    /// Nothing opened: the check then opens what it asks itself.
    #[cfg(test)]
    pub(crate) fn none() -> OpeningGpus {
        OpeningGpus(None)
    }

    /// The opened GPUs, in the order the batch takes them; `None` when one could not be opened
    /// (the backend then reports why).
    fn wait(self) -> Option<Vec<OpenedGpu>> {
        self.0?.join().ok().flatten()
    }
}

/// Refuses `opts.max_batch` sequences on `device` when they do not fit; `flag` is how the
/// refusal names the batch (`--batch 1,8,512`). On the GPU each device is checked for its slice
/// of the batch as the replicas cut it; when a GPU cannot be opened or asked, the check is left
/// to the backend, which reports that itself. `opening`: the GPUs [`OpeningGpus::start`]ed for
/// these options.
pub(crate) fn check_batch_fits(
    flag: &str,
    device: Device,
    cfg: &GPT2Config,
    opts: &BackendOptions,
    cpu: CpuTokens,
    opening: OpeningGpus,
) -> Result<CheckedGpus> {
    if opts.max_batch > MAX_BATCH {
        bail!(
            "{flag}: {} sequences are more than any device holds; give at most {MAX_BATCH}",
            opts.max_batch
        );
    }
    match device {
        Device::Cpu => {
            check_host(flag, cfg, opts.max_batch.max(1), cpu)?;
            Ok(CheckedGpus { _contexts: Vec::new() })
        }
        Device::Cuda => check_gpus(flag, cfg, opts, opening),
    }
}

fn check_host(flag: &str, cfg: &GPT2Config, batch: usize, cpu: CpuTokens) -> Result<()> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let Some(available) = mem_available_bytes(&meminfo) else {
        return Ok(()); // no figure to check against (not Linux)
    };
    let need = |b: usize| MemoryNeed::on_cpu(cfg, b, cpu.cached, cpu.step, cpu.logits);
    // The weights are loaded already: they hold part of what the batch needs.
    let free = available + need(batch).weights;
    if need(batch).total() <= free {
        return Ok(());
    }
    Err(BatchTooLarge {
        flag: flag.to_string(),
        device: "the host (available memory plus the loaded weights)".to_string(),
        sequences: batch,
        need: need(batch),
        free,
        largest: largest_fitting_batch(batch - 1, |b| need(b).total() <= free),
        also: String::new(),
    }
    .into())
}

fn check_gpus(flag: &str, cfg: &GPT2Config, opts: &BackendOptions, opening: OpeningGpus) -> Result<CheckedGpus> {
    let max_batch = opts.max_batch.max(1);
    let unchecked = |contexts| Ok(CheckedGpus { _contexts: contexts });
    let Some(opened) = opening.wait() else {
        return unchecked(Vec::new());
    };
    let devices: Vec<usize> = opened.iter().map(|(d, _)| *d).collect();
    let (mut contexts, mut free, mut sms) = (Vec::new(), Vec::new(), Vec::new());
    for (_, gpu) in opened {
        let Ok(bytes) = gpu.free_memory() else {
            return unchecked(contexts);
        };
        free.push(bytes);
        sms.push(gpu.info.limits.num_sms as f64);
        contexts.push(gpu);
    }
    let storage = opts.dtype.storage().bytes();
    let need = |sequences: usize| MemoryNeed::on_gpu(cfg, storage, sequences.max(1), opts.unfused);
    // Each GPU holds its slice of the batch, cut as `Replicas::open` cuts it.
    let slices = |batch: usize| slice_batch(batch.max(devices.len()), &sms);
    let misfit = |batch: usize| {
        slices(batch)
            .iter()
            .zip(&free)
            .position(|(slice, &f)| need(slice.len()).total() > f)
    };
    let Some(i) = misfit(max_batch) else {
        return unchecked(contexts);
    };
    let sequences = slices(max_batch)[i].len().max(1);
    let mut also = Vec::new();
    if storage > 2 {
        also.push("a 16-bit --dtype");
    }
    also.push("more GPUs (--devices)");
    Err(BatchTooLarge {
        flag: flag.to_string(),
        device: format!("cuda:{} ({})", devices[i], contexts[i].info.name),
        sequences,
        need: need(sequences),
        free: free[i],
        largest: largest_fitting_batch(max_batch - 1, |b| misfit(b).is_none()),
        also: also.join(" or "),
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Dtype;

    /// The host check on a batch no machine holds: refused in one line with the figures; a
    /// small one passes.
    #[test]
    fn the_host_refuses_a_batch_it_cannot_hold() {
        if mem_available_bytes(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default()).is_none() {
            return; // not Linux: nothing to check against
        }
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let opts = |max_batch| BackendOptions {
            max_batch,
            dtype: Dtype::F32,
            ..Default::default()
        };
        let tokens = CpuTokens {
            cached: 1024,
            step: 1024,
            logits: 1024,
        };
        // 10^6 sequences of 1,024 tokens: petabytes.
        let e = check_batch_fits(
            "--batch 1,1000000",
            Device::Cpu,
            &cfg,
            &opts(1_000_000),
            tokens,
            OpeningGpus::none(),
        )
        .err()
        .expect("refused")
        .to_string();
        assert!(!e.contains('\n'), "{e}");
        assert!(
            e.starts_with("--batch 1,1000000: the host (available memory plus the loaded weights) cannot hold 1000000 sequences: they need "),
            "{e}"
        );
        assert!(
            e.contains("the largest batch that fits is ") || e.contains("not even one sequence fits"),
            "{e}"
        );
        assert!(check_batch_fits(
            "--batch 1",
            Device::Cpu,
            &cfg,
            &opts(1),
            CpuTokens {
                cached: 16,
                step: 8,
                logits: 8
            },
            OpeningGpus::none()
        )
        .is_ok());
    }
}
