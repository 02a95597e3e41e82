//! Standing in for an older GPU (`--target`, `gpu::stand_in`) on the GPU here: the target's
//! limits and compute capability, kernels compiled to its PTX and JIT-compiled by the driver,
//! an instruction newer than the target refused when it loads, and the occupancy of an SM of
//! the target. (The whole pipeline under each target: the GPU suites and the CLI run with
//! `KERNELFORGE_TARGET` set, see benches/stand_in.sh.)

use cudarc::driver::{LaunchConfig, PushKernelArg};
use kernelforge::codegen::Source;
use kernelforge::gpu::stand_in::STAND_INS;
use kernelforge::gpu::{Compiler, Gpu};

/// A plain kernel: stages `3 i` in dynamic shared memory, writes `3 i + 1`.
const PLAIN: &str = r#"
extern "C" __global__ void stand_in_plain(float* out, int n) {
    extern __shared__ float staged[];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    staged[threadIdx.x] = 3.0f * i;
    __syncthreads();
    if (i < n) out[i] = staged[threadIdx.x] + 1.0f;
}
"#;

/// Reads `%cluster_ctarank`, a register PTX has from sm_90 on. NVRTC does not look inside inline
/// assembly, so only the driver's JIT (ptxas for the PTX's `.target`) can refuse it.
const NEWER: &str = r#"
extern "C" __global__ void stand_in_newer(unsigned* out) {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    out[0] = rank;
}
"#;

fn source(kernel_name: &str, code: &str) -> Source {
    Source {
        kernel_name: kernel_name.to_string(),
        code: code.to_string(),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn each_target_runs_its_own_ptx_with_its_limits_and_refuses_newer_instructions() {
    let here = Gpu::standing_in(0, None).expect("a CUDA GPU");
    for target in &STAND_INS {
        let gpu = Gpu::standing_in(0, Some(target)).unwrap();
        let info = &gpu.info;
        assert_eq!(info.arch(), target.virtual_arch());
        assert_eq!(info.compute_capability, target.compute_capability);
        assert_eq!(info.limits.compute_capability, target.compute_capability);
        assert_eq!(info.limits.num_sms, target.sms.min(here.info.limits.num_sms));
        assert_eq!(
            info.limits.max_smem_dynamic,
            target.smem_per_block.min(here.info.limits.max_smem_dynamic)
        );
        assert!(info.total_memory_bytes <= target.memory_bytes);
        assert_eq!(info.name, format!("{} as {}", here.info.name, target.gpu));

        let mut compiler = Compiler::new(&info.arch()).expect("NVRTC");
        compiler.cache_dir = None;
        let plain = compiler.compile(&source("stand_in_plain", PLAIN)).unwrap();
        let ptx = String::from_utf8_lossy(&plain.image);
        assert!(
            ptx.contains(&format!(".target {}", target.arch)),
            "{}: not its PTX",
            target.arch
        );
        assert_eq!(plain.spill_stores, None, "PTX meets ptxas only in the driver");

        // The driver JIT-compiles the PTX for the GPU here; the kernel runs and is right.
        let module = gpu
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(plain.image.clone()))
            .unwrap();
        let function = module.load_function("stand_in_plain").unwrap();
        let n: i32 = 1000; // not a multiple of the block
        let mut out = gpu.stream.clone_htod(&vec![f32::NAN; n as usize]).unwrap();
        let config = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 256 * 4,
        };
        let mut launch = gpu.stream.launch_builder(&function);
        launch.arg(&mut out).arg(&n);
        // SAFETY: `out` holds n floats; the kernel writes only those below n.
        unsafe { launch.launch(config) }.unwrap();
        let got = gpu.stream.clone_dtoh(&out).unwrap();
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, 3.0 * i as f32 + 1.0, "{}: out[{i}]", target.arch);
        }

        // An SM of the target holds what its shared memory allows: 40 KiB blocks (plus the KiB
        // the driver keeps per block from sm_80 on) fit once in a T4's 64 KiB, twice in an RTX
        // 3090's 100 KiB, four times in an A100's 164, five times in an H100's 228.
        let blocks = gpu.blocks_per_sm(&function, 256, 40 * 1024).unwrap();
        let expected = match target.arch {
            "sm_75" => 1,
            "sm_86" | "sm_89" => 2,
            "sm_80" => 4,
            _ => 5,
        };
        assert_eq!(blocks, expected, "{}: blocks of 40 KiB per SM", target.arch);

        // An sm_90 register in the PTX of an older target: the driver's JIT refuses it.
        let newer = compiler.compile(&source("stand_in_newer", NEWER)).unwrap();
        let loaded = gpu.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(newer.image));
        assert_eq!(
            loaded.is_ok(),
            target.compute_capability >= (9, 0),
            "{}: %cluster_ctarank loads only where the target has it",
            target.arch
        );
    }
}
