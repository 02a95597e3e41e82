//! Standing in for an older GPU: `--target sm_86` (or `KERNELFORGE_TARGET=sm_86`) makes the GPU
//! kernelforge runs on behave as a GPU of that kind would, so that a pipeline meant for an RTX
//! 3090 can be proven on an H200.
//!
//! What changes under a stand-in, and nothing else:
//! - the compute capability every spec check reads (families that need a newer GPU drop out);
//! - the limits of a real GPU of that kind (shared memory per block and per SM, SM count,
//!   threads, registers, memory), which the specs' expressions, the launch plans, the occupancy
//!   checks and the memory checks read;
//! - every kernel is compiled to the target's PTX (`compute_86`), which the driver JIT-compiles
//!   for the GPU underneath: an instruction newer than the target fails there, as on the user's
//!   machine;
//! - the tuning database is the target's own (`nvidia-h200-as-rtx-3090-sm86.json`).

use std::sync::OnceLock;

use crate::spec::DeviceLimits;

/// A GPU kind kernelforge can stand in for, with the limits of one real GPU of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StandIn {
    /// What `--target` takes: `sm_86`.
    pub arch: &'static str,
    /// The real GPU whose limits are used: `RTX 3090`.
    pub gpu: &'static str,
    pub compute_capability: (i32, i32),
    pub sms: i64,
    /// Shared memory one block may opt in to (`cudaDevAttrMaxSharedMemoryPerBlockOptin`).
    pub smem_per_block: i64,
    /// Shared memory of one SM, all its blocks together.
    pub smem_per_sm: i64,
    pub max_threads_per_sm: i64,
    pub max_blocks_per_sm: i64,
    /// 32-bit registers of one SM (64 Ki on every target here).
    pub registers_per_sm: i64,
    pub memory_bytes: usize,
}

const KIB: i64 = 1024;
const GIB: usize = 1 << 30;

/// The targets `--target` takes, each with the limits of one real GPU (CUDA C++ Programming
/// Guide, "Technical Specifications per Compute Capability", and the GPUs' data sheets).
pub const STAND_INS: [StandIn; 5] = [
    StandIn {
        arch: "sm_75",
        gpu: "Tesla T4",
        compute_capability: (7, 5),
        sms: 40,
        smem_per_block: 64 * KIB,
        smem_per_sm: 64 * KIB,
        max_threads_per_sm: 1024,
        max_blocks_per_sm: 16,
        registers_per_sm: 64 * KIB,
        memory_bytes: 15 * GIB,
    },
    StandIn {
        arch: "sm_80",
        gpu: "A100 80GB",
        compute_capability: (8, 0),
        sms: 108,
        smem_per_block: 163 * KIB,
        smem_per_sm: 164 * KIB,
        max_threads_per_sm: 2048,
        max_blocks_per_sm: 32,
        registers_per_sm: 64 * KIB,
        memory_bytes: 79 * GIB,
    },
    StandIn {
        arch: "sm_86",
        gpu: "RTX 3090",
        compute_capability: (8, 6),
        sms: 82,
        smem_per_block: 99 * KIB,
        smem_per_sm: 100 * KIB,
        max_threads_per_sm: 1536,
        max_blocks_per_sm: 16,
        registers_per_sm: 64 * KIB,
        memory_bytes: 23 * GIB,
    },
    StandIn {
        arch: "sm_89",
        gpu: "RTX 4090",
        compute_capability: (8, 9),
        sms: 128,
        smem_per_block: 99 * KIB,
        smem_per_sm: 100 * KIB,
        max_threads_per_sm: 1536,
        max_blocks_per_sm: 24,
        registers_per_sm: 64 * KIB,
        memory_bytes: 23 * GIB,
    },
    StandIn {
        arch: "sm_90",
        gpu: "H100 SXM",
        compute_capability: (9, 0),
        sms: 132,
        smem_per_block: 227 * KIB,
        smem_per_sm: 228 * KIB,
        max_threads_per_sm: 2048,
        max_blocks_per_sm: 32,
        registers_per_sm: 64 * KIB,
        memory_bytes: 79 * GIB,
    },
];

/// The environment variable that selects a stand-in when `--target` is not given.
pub const TARGET_VAR: &str = "KERNELFORGE_TARGET";

/// `text` is not a target kernelforge can stand in for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a target kernelforge can stand in for: use one of {}", names())]
pub struct UnknownTarget {
    pub text: String,
}

fn names() -> String {
    STAND_INS.iter().map(|s| s.arch).collect::<Vec<_>>().join(", ")
}

impl std::str::FromStr for &'static StandIn {
    type Err = UnknownTarget;

    /// `sm_86` (also `86`, `8.6`, `compute_86`).
    fn from_str(text: &str) -> Result<&'static StandIn, UnknownTarget> {
        let t = text.trim().to_ascii_lowercase();
        let digits = t
            .trim_start_matches("sm_")
            .trim_start_matches("compute_")
            .replace('.', "");
        STAND_INS
            .iter()
            .find(|s| s.arch.trim_start_matches("sm_") == digits)
            .ok_or_else(|| UnknownTarget { text: text.to_string() })
    }
}

/// What NVRTC compiles for on a GPU of compute capability `cc`: its CUBIN target (`sm_90`), or
/// standing in, the target's PTX (`compute_86`), which the driver JIT-compiles when it loads.
pub fn compile_arch(cc: (i32, i32), stand_in: Option<&StandIn>) -> String {
    match stand_in {
        Some(target) => target.virtual_arch(),
        None => format!("sm_{}{}", cc.0, cc.1),
    }
}

/// What a GPU called `name`, of compute capability `cc`, with `limits` is as
/// [`Gpu`](super::Gpu) and [`identify`](super::identify) report it: itself, or standing in for
/// `stand_in`, that target's name on it, compute capability and limits.
pub fn seen_as(
    stand_in: Option<&StandIn>,
    name: String,
    cc: (i32, i32),
    limits: DeviceLimits,
) -> (String, (i32, i32), DeviceLimits) {
    match stand_in {
        Some(target) => (target.name_on(&name), target.compute_capability, target.limits(&limits)),
        None => (name, cc, limits),
    }
}

/// The parser `--target` uses.
pub fn parse(text: &str) -> Result<&'static StandIn, UnknownTarget> {
    text.parse()
}

static SELECTED: OnceLock<Option<&'static StandIn>> = OnceLock::new();

/// Chooses the stand-in of this process (the command line's `--target`), before any GPU is
/// opened. Later calls change nothing: a process stands in for one target.
pub fn select(target: Option<&'static StandIn>) {
    let _ = SELECTED.set(target);
}

/// The stand-in of this process: the one [`select`]ed, else `$KERNELFORGE_TARGET`, else none.
pub fn active() -> Result<Option<&'static StandIn>, UnknownTarget> {
    if let Some(selected) = SELECTED.get() {
        return Ok(*selected);
    }
    let from_env = match std::env::var(TARGET_VAR) {
        Ok(text) if !text.trim().is_empty() => Some(parse(&text)?),
        _ => None,
    };
    Ok(*SELECTED.get_or_init(|| from_env))
}

impl StandIn {
    /// How the GPU underneath is named while it stands in: `NVIDIA H200 as RTX 3090`. This
    /// name heads the tuning database, so each target tunes into a file of its own.
    pub fn name_on(&self, real: &str) -> String {
        format!("{real} as {}", self.gpu)
    }

    /// The PTX target every kernel is compiled to: `compute_86`.
    pub fn virtual_arch(&self) -> String {
        self.arch.replace("sm_", "compute_")
    }

    /// The limits the specs see: the target's, never more than the GPU underneath has.
    pub fn limits(&self, real: &DeviceLimits) -> DeviceLimits {
        DeviceLimits {
            max_threads: real.max_threads.min(1024),
            max_smem_static: real.max_smem_static.min(48 * KIB),
            max_smem_dynamic: real.max_smem_dynamic.min(self.smem_per_block),
            num_sms: real.num_sms.min(self.sms),
            warp_size: real.warp_size,
            compute_capability: self.compute_capability,
        }
    }

    /// Blocks of a kernel one SM of the target holds at once: the least of what its threads,
    /// registers (allocated per warp in units of 256) and shared memory (with the 1 KiB the
    /// driver reserves per block from sm_80 on) allow.
    pub fn blocks_per_sm(&self, threads: u32, registers_per_thread: u32, shared_bytes: u64) -> u32 {
        let threads = i64::from(threads.max(1));
        let warps = (threads + 31) / 32;
        let registers_per_warp = (i64::from(registers_per_thread.max(1)) * 32 + 255) / 256 * 256;
        let reserved = if self.compute_capability >= (8, 0) { KIB } else { 0 };
        let smem = shared_bytes as i64 + reserved;
        let by_threads = self.max_threads_per_sm / threads;
        let by_registers = self.registers_per_sm / (registers_per_warp * warps);
        let by_smem = if smem == 0 { i64::MAX } else { self.smem_per_sm / smem };
        let blocks = by_threads
            .min(by_registers)
            .min(by_smem)
            .min(self.max_blocks_per_sm)
            .max(0);
        u32::try_from(blocks).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_in_the_forms_people_write() {
        for text in ["sm_86", "86", "8.6", "compute_86", " SM_86 "] {
            assert_eq!(parse(text).unwrap().gpu, "RTX 3090", "{text}");
        }
        let e = parse("sm_70").unwrap_err().to_string();
        assert!(
            e.contains("`sm_70`") && e.contains("sm_75, sm_80, sm_86, sm_89, sm_90"),
            "{e}"
        );
    }

    #[test]
    fn limits_are_the_targets_and_never_above_the_gpu_underneath() {
        let h200 = DeviceLimits {
            num_sms: 132,
            ..DeviceLimits::default()
        };
        let t4 = parse("sm_75").unwrap().limits(&h200);
        assert_eq!(
            (t4.num_sms, t4.max_smem_dynamic, t4.compute_capability),
            (40, 64 * KIB, (7, 5))
        );
        let small = DeviceLimits {
            num_sms: 20,
            ..DeviceLimits::default()
        };
        assert_eq!(parse("sm_90").unwrap().limits(&small).num_sms, 20);
    }

    #[test]
    fn occupancy_follows_the_scarcest_resource() {
        let rtx3090 = parse("sm_86").unwrap();
        // 256 threads, 32 registers, no shared memory: threads bound it (1,536 / 256).
        assert_eq!(rtx3090.blocks_per_sm(256, 32, 0), 6);
        // 99 KiB of shared memory: one block (with the reserved KiB, 100 KiB per SM).
        assert_eq!(rtx3090.blocks_per_sm(256, 32, 99 * 1024), 1);
        // 255 registers x 512 threads need 130,560 of 65,536: none fits.
        assert_eq!(rtx3090.blocks_per_sm(512, 255, 0), 0);
        // An H100 holds two blocks of 100 KiB.
        assert_eq!(parse("sm_90").unwrap().blocks_per_sm(256, 32, 100 * 1024), 2);
        // A T4 has no reserved KiB: 64 KiB fits once.
        assert_eq!(parse("sm_75").unwrap().blocks_per_sm(128, 64, 64 * 1024), 1);
    }

    #[test]
    fn the_database_of_a_stand_in_is_its_own() {
        assert_eq!(
            parse("sm_89").unwrap().name_on("NVIDIA H200"),
            "NVIDIA H200 as RTX 4090"
        );
        assert_eq!(parse("sm_75").unwrap().virtual_arch(), "compute_75");
    }
}
