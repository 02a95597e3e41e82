//! `kernelforge compile-worker`, the process the tuner hands compiles to, driven through
//! the library's pool as the binary drives it. Needs NVRTC for the CUBIN comparison (not a
//! GPU); where NVRTC is missing, the worker must say so for every kernel.

use std::path::Path;

use kernelforge::codegen::Renderer;
use kernelforge::gpu::compile::nvrtc_present;
use kernelforge::gpu::compile_workers::{use_worker_processes, WorkerPool, WorkerProgram};
use kernelforge::gpu::{CompileError, Compiler};
use kernelforge::spec::{expand, Catalog, DeviceLimits, Points};

fn program() -> WorkerProgram {
    WorkerProgram {
        exe: env!("CARGO_BIN_EXE_kernelforge").into(),
        args: vec!["compile-worker".into()],
    }
}

const BROKEN: &str =
    "extern \"C\" __global__ void broken_k(float* out) {\n  out[0] = 1.0f;\n  out[1] = undefined_name;\n}\n";

#[test]
fn the_worker_compiles_what_this_process_compiles_or_says_nvrtc_is_missing() {
    let pool = WorkerPool::new(program(), 2);
    let options = vec!["--gpu-architecture=sm_90".to_string(), "--std=c++17".to_string()];
    let result = pool.compile("broken_k", BROKEN, &options).expect("the worker starts");
    // The worker stays for the next compile until the idle ones are released.
    assert_eq!(pool.live(), 1);
    pool.release_idle();
    assert_eq!(pool.live(), 0);
    if !nvrtc_present() {
        for kernel in ["broken_k", "another_k"] {
            let text = pool
                .compile(kernel, BROKEN, &options)
                .expect("the worker starts")
                .unwrap_err()
                .to_string();
            assert!(text.contains(kernel) && text.contains("NVRTC"), "{text}");
        }
        eprintln!("NVRTC is missing here: checked that the worker says so; the CUBIN comparison needs NVRTC");
        return;
    }
    // A source NVRTC refuses: the log and the line it points at come back.
    match result {
        Err(CompileError::Failed {
            kernel,
            arch,
            log,
            context,
        }) => {
            assert_eq!((kernel.as_str(), arch.as_str()), ("broken_k", "sm_90"));
            assert!(log.contains("undefined_name"), "{log}");
            assert!(context.contains(">>     3 |   out[1] = undefined_name;"), "{context}");
        }
        other => panic!("expected NVRTC's refusal, got {other:?}"),
    }

    // Real kernels of several families, through `compile_each` with the pool installed as the
    // binary installs it: the same CUBINs as NVRTC in this process.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
    let renderer = Renderer::new(&catalog.templates_dir).unwrap();
    let limits = DeviceLimits {
        max_threads: 1024,
        max_smem_static: 48 * 1024,
        max_smem_dynamic: 227 * 1024,
        num_sms: 132,
        warp_size: 32,
        compute_capability: (9, 0),
    };
    let mut jobs = Vec::new();
    for name in ["layernorm_warp", "matmul_gemv", "attention_flash_mma"] {
        let family = catalog.family(name).unwrap().clone();
        let variants = expand(&family, Points::Sample { count: 1, seed: 7 }, &limits).unwrap();
        for v in variants.iter().take(2) {
            jobs.push((family.clone(), renderer.render(v).unwrap()));
        }
    }
    let mut here = Compiler::new("sm_90").unwrap();
    here.cache_dir = None;
    let expected: Vec<Vec<u8>> = jobs
        .iter()
        .map(|(family, source)| here.for_family(family).compile(source).unwrap().image)
        .collect();
    use_worker_processes(program());
    let got = std::sync::Mutex::new(Vec::new());
    let refs: Vec<_> = jobs.iter().map(|(f, s)| (&**f, s)).collect();
    here.compile_each(&refs, 3, |source, result| {
        got.lock().unwrap().push((source.kernel_name.clone(), result.unwrap()));
    });
    let got = got.into_inner().unwrap();
    assert_eq!(got.len(), jobs.len());
    for ((_, source), cubin) in jobs.iter().zip(&expected) {
        let (_, compiled) = got.iter().find(|(name, _)| *name == source.kernel_name).unwrap();
        assert!(!compiled.cached);
        assert!(compiled.spill_stores.is_some());
        assert!(
            compiled.image == *cubin,
            "{}: the worker's CUBIN differs",
            source.kernel_name
        );
    }
}
