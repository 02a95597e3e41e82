//! Whether a batch fits in memory, decided before anything is allocated: what a batch of
//! sequences needs (weights, KV cache, a step's activations), the largest batch a device's free
//! memory holds, and the one-line refusal naming both. `kernelforge bench` and `generate` check
//! it at the command-line edge, so a batch that cannot fit is refused in a second instead of
//! failing half-way through an upload or a prefill.

use super::config::GPT2Config;
use super::gpu::ReplicaMemory;

/// The most sequences a batch is sized for: far beyond any device's memory for a GPT-2 (a
/// million sequences' KV caches alone are tens of terabytes), and it keeps the byte counts
/// below far from overflowing.
pub const MAX_BATCH: usize = 1 << 20;

/// Bytes a backend needs for a batch, by what holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    /// The parameters in their storage type.
    pub weights: usize,
    /// K and V of every layer for every sequence.
    pub kv_cache: usize,
    /// The activations (and logits) of the largest step.
    pub activations: usize,
    /// What is allocated later and not counted above (kernel workspaces, modules, graphs, the
    /// CUDA context's own allocations).
    pub headroom: usize,
}

impl MemoryNeed {
    /// What one GPU replica allocates up front for `batch` sequences in `storage_bytes`-byte
    /// elements ([`ReplicaMemory::estimate`], the figure the backend itself checks): the
    /// weights, a KV cache of `batch × n_ctx` tokens, activations and logits for a prefill of
    /// `batch × n_ctx` tokens, and the backend's headroom.
    pub fn on_gpu(cfg: &GPT2Config, storage_bytes: usize, batch: usize, unfused: bool) -> MemoryNeed {
        let r = ReplicaMemory::estimate(cfg, storage_bytes, batch, unfused);
        MemoryNeed {
            weights: r.weights,
            kv_cache: r.kv_cache,
            activations: r.activations,
            headroom: r.total() - r.weights - r.kv_cache - r.activations,
        }
    }

    /// What the CPU backend holds at the least for `batch` sequences (all f32): the weights, a
    /// KV cache of `cache_tokens` tokens a sequence (it grows with the tokens cached, up to the
    /// context), and the activations of its largest step, `step_tokens` tokens a sequence (the
    /// residual stream, LayerNorm, QKV, attention, projection, fc and final LayerNorm rows:
    /// 12 C a token) with a logits row of the vocabulary for `logits_tokens` of them (every
    /// token for a whole forward pass, the last for a prefill before generation).
    pub fn on_cpu(
        cfg: &GPT2Config,
        batch: usize,
        cache_tokens: usize,
        step_tokens: usize,
        logits_tokens: usize,
    ) -> MemoryNeed {
        let (c, f32_bytes) = (cfg.n_embd, 4);
        MemoryNeed {
            weights: cfg.num_params() * f32_bytes,
            kv_cache: 2 * cfg.n_layer * batch * cache_tokens * c * f32_bytes,
            activations: batch * (step_tokens * 12 * c + logits_tokens * cfg.vocab_size) * f32_bytes,
            headroom: 0,
        }
    }

    /// Everything, headroom included.
    pub fn total(&self) -> usize {
        self.weights + self.kv_cache + self.activations + self.headroom
    }
}

/// The largest batch in `1..=upper` for which `fits` holds, 0 when not even one sequence fits
/// (`fits` must be monotone: a batch fits when a larger one does).
pub fn largest_fitting_batch(upper: usize, fits: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, upper); // fits(lo) (or lo == 0), answer in lo..=hi
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Bytes in GiB, two decimals.
fn gib(bytes: usize) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

/// A batch that does not fit in a device's free memory: the figures, the largest batch that
/// would, and what else would help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{flag}: {device} cannot hold {sequences} sequences: {} and {} GiB are free; {}",
    need_text(self.need),
    gib(self.free),
    self.fix()
)]
pub struct BatchTooLarge {
    /// The flag and value as given (`--batch 1,8,4096`).
    pub flag: String,
    /// The device that cannot hold them (`cuda:0 (NVIDIA H200)`, `the CPU`).
    pub device: String,
    /// Sequences that device would hold (its slice of the batch with several GPUs).
    pub sequences: usize,
    pub need: MemoryNeed,
    /// Free bytes of the device.
    pub free: usize,
    /// The largest whole batch that fits (0: not even one sequence).
    pub largest: usize,
    /// Other ways out, after the smaller batch (`a 16-bit --dtype or more GPUs (--devices)`).
    pub also: String,
}

fn need_text(n: MemoryNeed) -> String {
    let mut parts = vec![
        format!("weights {}", gib(n.weights)),
        format!("KV cache {}", gib(n.kv_cache)),
        format!("activations {}", gib(n.activations)),
    ];
    if n.headroom > 0 {
        parts.push(format!("headroom {}", gib(n.headroom)));
    }
    format!("they need {} GiB ({})", gib(n.total()), parts.join(" + "))
}

impl BatchTooLarge {
    fn fix(&self) -> String {
        let also = if self.also.is_empty() {
            String::new()
        } else {
            format!(", or use {}", self.also)
        };
        match self.largest {
            0 => format!("not even one sequence fits: free some memory{also}"),
            n => format!("the largest batch that fits is {n}: pass --batch {n} or less{also}"),
        }
    }
}

/// The bytes the kernel reports as available (`MemAvailable` in `/proc/meminfo`'s text), if
/// it says.
pub fn mem_available_bytes(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line["MemAvailable:".len()..].split_whitespace();
    let value: usize = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_batch_needs_what_the_replica_allocates() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let need = MemoryNeed::on_gpu(&cfg, 2, 8, false);
        let replica = ReplicaMemory::estimate(&cfg, 2, 8, false);
        assert_eq!(need.total(), replica.total());
        // By hand, bf16, 8 sequences of the 1,024-token context:
        //   KV cache 2 × 12 layers × 8 × 1024 × 768 × 2 bytes = 301,989,888;
        //   activations: 8,192 rows × (11 × 768 + 50,304 logits) × 2 bytes = 962,592,768, the token
        //   ids 8,192 × 4 and the 8 gathered last rows 8 × 768 × 2 = 12,288: 962,637,824;
        //   weights 124,475,904 parameters × 2 (wte padded, the whole wpe); 512 MiB headroom.
        assert_eq!(need.kv_cache, 301_989_888);
        assert_eq!(need.activations, 962_637_824);
        assert_eq!(need.weights, 124_475_904 * 2);
        assert_eq!(need.headroom, 512 << 20);
        // The KV cache and the activations grow with the batch, the weights do not.
        let double = MemoryNeed::on_gpu(&cfg, 2, 16, false);
        assert_eq!(double.kv_cache, 2 * need.kv_cache);
        assert_eq!(double.weights, need.weights);
    }

    #[test]
    fn a_cpu_batch_needs_its_weights_cache_and_step() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        // A bench run: a forward pass of 128 tokens with logits for each, 160 tokens cached.
        let need = MemoryNeed::on_cpu(&cfg, 4, 160, 128, 128);
        assert_eq!(need.weights, 124_439_808 * 4);
        assert_eq!(need.kv_cache, 2 * 12 * 4 * 160 * 768 * 4);
        assert_eq!(need.activations, 4 * 128 * (12 * 768 + 50257) * 4);
        // Generation: the prefill keeps the last position's logits only.
        let need = MemoryNeed::on_cpu(&cfg, 4, 160, 128, 1);
        assert_eq!(need.activations, 4 * (128 * 12 * 768 + 50257) * 4);
        assert_eq!(need.headroom, 0);
        assert_eq!(need.total(), need.weights + need.kv_cache + need.activations);
    }

    #[test]
    fn the_largest_batch_is_found_by_bisection() {
        assert_eq!(largest_fitting_batch(4096, |b| b <= 928), 928);
        assert_eq!(largest_fitting_batch(4096, |b| b <= 4096), 4096);
        assert_eq!(largest_fitting_batch(4096, |_| false), 0);
        assert_eq!(largest_fitting_batch(1, |b| b <= 1), 1);
        assert_eq!(largest_fitting_batch(0, |_| true), 0);
        // Against the GPU figures: 124M bf16 on 40 GiB free.
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let free = 40usize << 30;
        let n = largest_fitting_batch(4096, |b| MemoryNeed::on_gpu(&cfg, 2, b, false).total() <= free);
        assert!(MemoryNeed::on_gpu(&cfg, 2, n, false).total() <= free);
        assert!(MemoryNeed::on_gpu(&cfg, 2, n + 1, false).total() > free);
        assert!((200..400).contains(&n), "{n}");
    }

    #[test]
    fn the_refusal_is_one_line_with_the_size_and_the_largest_batch() {
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let free = 139usize << 30;
        let largest = largest_fitting_batch(4096, |b| MemoryNeed::on_gpu(&cfg, 2, b, false).total() <= free);
        assert_eq!(largest, 939);
        let e = BatchTooLarge {
            flag: "--batch 1,8,4096".into(),
            device: "cuda:0 (NVIDIA H200)".into(),
            sequences: 4096,
            need: MemoryNeed::on_gpu(&cfg, 2, 4096, false),
            free,
            largest,
            also: "a 16-bit --dtype or more GPUs (--devices)".into(),
        }
        .to_string();
        assert!(!e.contains('\n'), "{e}");
        assert!(
            e.starts_with("--batch 1,8,4096: cuda:0 (NVIDIA H200) cannot hold 4096 sequences: they need 603.75 GiB"),
            "{e}"
        );
        assert!(
            e.contains("(weights 0.23 + KV cache 144.00 + activations 459.02 + headroom 0.50)"),
            "{e}"
        );
        assert!(e.contains("and 139.00 GiB are free"), "{e}");
        assert!(
            e.ends_with(
                "the largest batch that fits is 939: pass --batch 939 or less, or use a 16-bit --dtype or more GPUs (--devices)"
            ),
            "{e}"
        );
        let none = BatchTooLarge {
            flag: "--batch 2".into(),
            device: "the CPU".into(),
            sequences: 2,
            need: MemoryNeed::on_cpu(&cfg, 2, 1024, 1024, 1024),
            free: 1 << 30,
            largest: 0,
            also: String::new(),
        }
        .to_string();
        assert!(none.ends_with("not even one sequence fits: free some memory"), "{none}");
        assert!(!none.contains("headroom"), "{none}");
    }

    #[test]
    fn available_memory_is_read_from_meminfo() {
        let text = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536000 kB\n";
        assert_eq!(mem_available_bytes(text), Some(65_536_000 * 1024));
        assert_eq!(mem_available_bytes("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available_bytes("MemAvailable: lots kB\n"), None);
        assert_eq!(mem_available_bytes("MemAvailable: 5 MB\n"), None);
    }
}
