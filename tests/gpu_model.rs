//! The GPU GPT-2 backend against the f32 CPU reference on a tiny random model (L=2, NH=2,
//! C=128 so the head size is 64 as flash and decode attention need, V=300, n_ctx=128, every
//! bias and layernorm parameter perturbed): prefill logits, KV-cached decode steps, greedy
//! generation, a batch of three prompts, the unfused path, tf32 matmuls, f16/bf16 storage,
//! layernorms folded into the prefill's matmuls, and both checkpoint formats.
//!
//! GPU tests are `#[ignore = "needs a CUDA GPU"]`; run them on a GPU machine from the project
//! folder (they find specs/ and templates/ there) with `-- --ignored`. They take a lock so they
//! never share the GPU. Two tests run everywhere: without a GPU, asking for one is a clear
//! error, not a panic; and a dtype some op has no kernels for is refused before the GPU is used.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kernelforge::cli::model::{make_backend, BackendOptions, Device};
use kernelforge::gpu::device::driver_present;
use kernelforge::gpu::Gpu;
use kernelforge::model::config::GPT2Config;
use kernelforge::model::cpu::CpuBackend;
use kernelforge::model::generate::{generate, Backend, GenerateOptions, Logits};
use kernelforge::model::gpu::{GpuBackend, LayernormFolding};
use kernelforge::model::sampling::{argmax, SamplingParams};
use kernelforge::model::weights::{load_model, write_hf_folder, write_llmc, GPT2Model, GPT2Weights, LlmcVersion};
use kernelforge::spec::Dtype;

const TOL: f64 = 1e-4;

static GPU_LOCK: Mutex<()> = Mutex::new(());

fn gpu_lock() -> MutexGuard<'static, ()> {
    GPU_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn tiny_config() -> GPT2Config {
    GPT2Config::new(2, 2, 128, 128, 300).unwrap()
}

fn tiny_model() -> Arc<GPT2Model> {
    let config = tiny_config();
    let weights = GPT2Weights::random(&config, 2024);
    Arc::new(GPT2Model {
        config,
        weights,
        source: "tiny random".into(),
    })
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    kernelforge::ops::relative_l2_error(got, &want)
}

fn check_logits(what: &str, got: &Logits, want: &Logits) {
    assert_eq!(
        (got.batch, got.seq_len, got.vocab),
        (want.batch, want.seq_len, want.vocab),
        "{what}: logits shape"
    );
    let e = rel_l2(&got.data, &want.data);
    eprintln!("{what}: relative L2 {e:.3e}");
    assert!(e < TOL, "{what}: relative L2 error {e:.3e} >= {TOL:e}");
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed * 101 + 11) % 300).collect()
}

fn gpu(model: &Arc<GPT2Model>, max_batch: usize, unfused: bool) -> GpuBackend {
    gpu_in(model, max_batch, unfused, Dtype::F32)
}

fn gpu_in(model: &Arc<GPT2Model>, max_batch: usize, unfused: bool, dtype: Dtype) -> GpuBackend {
    let g = GpuBackend::new(model.clone(), max_batch, unfused, dtype).expect("opening the GPU backend");
    for n in g.notes() {
        eprintln!("note: {n}");
    }
    g
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_logits_match_the_cpu() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    let mut g = gpu(&model, 1, false);
    for len in [1, 7, 37, 64, 128] {
        let p = vec![prompt(len, 1)];
        check_logits(
            &format!("prefill T={len}"),
            &g.prefill(&p).unwrap(),
            &cpu.prefill(&p).unwrap(),
        );
        check_logits(
            &format!("prefill_last T={len}"),
            &g.prefill_last(&p).unwrap(),
            &cpu.prefill_last(&p).unwrap(),
        );
    }
    let (tuned, total) = g.tuned_kernels();
    assert!(total > 0 && tuned <= total);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_steps_match_the_cpu() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    let mut g = gpu(&model, 1, false);
    let p = vec![prompt(5, 2)];
    let want = cpu.prefill_last(&p).unwrap();
    check_logits("prefill_last", &g.prefill_last(&p).unwrap(), &want);
    let mut next = argmax(want.last(0)).unwrap();
    for step in 0..20 {
        let want = cpu.decode(&[next]).unwrap();
        let got = g.decode(&[next]).unwrap();
        check_logits(&format!("decode step {step}"), &got, &want);
        next = argmax(want.last(0)).unwrap();
    }
}

/// Decode steps replayed as a CUDA graph give exactly the logits of kernel-by-kernel launches,
/// also when the batch size changes between generations (one graph per batch size) and after a
/// new prefill (the graph is replayed with the new cache, not re-recorded).
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_graphs_replay_exactly_what_direct_launches_compute() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut graphed = gpu(&model, 3, false);
    let mut direct = gpu(&model, 3, false);
    assert!(graphed.decode_graphs(), "decode graphs are on by default");
    direct
        .set_decode_engine(kernelforge::model::DecodeEngine::Launches)
        .unwrap();
    for (round, batch) in [(0u32, 1usize), (1, 3), (2, 1)] {
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|i| prompt(6 + round as usize, 7 + i as u32 + round))
            .collect();
        let a = graphed.prefill_last(&prompts).unwrap();
        let b = direct.prefill_last(&prompts).unwrap();
        assert_eq!(a.data, b.data, "round {round}: prefill");
        let mut next: Vec<u32> = (0..batch).map(|s| argmax(b.last(s)).unwrap()).collect();
        for step in 0..9 {
            let a = graphed.decode(&next).unwrap();
            let b = direct.decode(&next).unwrap();
            assert!(
                b.data.iter().all(|x| x.is_finite()),
                "round {round} step {step}: non-finite logits"
            );
            assert_eq!(
                a.data, b.data,
                "round {round} (batch {batch}) step {step}: graph != direct"
            );
            next = (0..batch).map(|s| argmax(b.last(s)).unwrap()).collect();
        }
    }
}

/// Greedy decode steps that choose the tokens on the device give the argmax of the logits
/// that plain decode steps return, step after step, for a batch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_tokens_chosen_on_the_device_are_the_argmax_of_the_logits() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut on_device = gpu(&model, 3, false);
    let mut from_logits = gpu(&model, 3, false);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(4 + i, 20 + i as u32)).collect::<Vec<_>>();
    let prompts: Vec<Vec<u32>> = prompts.iter().map(|p| p[..4].to_vec()).collect();
    let first = from_logits.prefill_last(&prompts).unwrap();
    on_device.prefill_last(&prompts).unwrap();
    let mut next: Vec<u32> = (0..3).map(|s| argmax(first.last(s)).unwrap()).collect();
    for step in 0..12 {
        let logits = from_logits.decode(&next).unwrap();
        let want: Vec<u32> = (0..3).map(|s| argmax(logits.last(s)).unwrap()).collect();
        let got = on_device.decode_argmax(&next).unwrap();
        assert_eq!(got, want, "step {step}");
        next = want;
    }
}

/// On a GPU before Ampere (a T4, or `KERNELFORGE_TARGET=sm_75`), tf32 and bf16 have no prefill
/// kernels: true when `dtype` is refused there, in one line offering the dtypes that run.
fn refused_before_ampere(model: &Arc<GPT2Model>, dtype: Dtype) -> bool {
    let gpu = Gpu::new(0).expect("a CUDA GPU");
    if gpu.info.compute_capability >= (8, 0) || dtype == Dtype::F16 {
        return false;
    }
    drop(gpu);
    let err = match GpuBackend::new(model.clone(), 1, false, dtype) {
        Ok(_) => panic!("{dtype} runs before Ampere: drop it from the refusals"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains(&format!("--dtype {dtype} does not run on")) && err.contains("--dtype f32"),
        "{err}"
    );
    eprintln!("{dtype} refused: {err}");
    true
}

/// Whether the GPU (or the stand-in `KERNELFORGE_TARGET` names) is sm_90, where the `ln_`
/// epilogues' matmuls (Hopper families) run; says so and returns false elsewhere. Asked before a
/// backend opens: in bf16 or tf32 before Ampere the opening itself is refused.
fn runs_sm_90_kernels() -> bool {
    let capability = Gpu::new(0).expect("a CUDA GPU").info.compute_capability;
    if capability != (9, 0) {
        eprintln!("skipping: the ln_ matmuls are sm_90 kernels, this GPU is {capability:?}");
    }
    capability == (9, 0)
}

/// tf32 matmuls (tensor cores, inputs rounded to TF32): the prefill matmuls come from a tf32
/// family, the decode step's few-row matmuls stay f32, and the logits stay close to the f32 CPU
/// reference (TF32 keeps 10 mantissa bits: a looser bar than f32's).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tf32_matmuls_stay_close_to_the_f32_reference() {
    let _lock = gpu_lock();
    let model = tiny_model();
    if refused_before_ampere(&model, Dtype::Tf32) {
        return;
    }
    let mut cpu = CpuBackend::new(model.clone());
    let mut g = gpu_in(&model, 1, false, Dtype::Tf32);
    let p = vec![prompt(100, 3)];
    let got = g.prefill(&p).unwrap();
    let want = cpu.prefill(&p).unwrap();
    let e = rel_l2(&got.data, &want.data);
    eprintln!("tf32 prefill: relative L2 {e:.3e}");
    assert!(e < 1e-2, "tf32 prefill: relative L2 error {e:.3e} >= 1e-2");
    let mut next = argmax(want.last(0)).unwrap();
    for step in 0..4 {
        let want = cpu.decode(&[next]).unwrap();
        let e = rel_l2(&g.decode(&[next]).unwrap().data, &want.data);
        assert!(e < 1e-2, "tf32 decode step {step}: relative L2 error {e:.3e}");
        next = argmax(want.last(0)).unwrap();
    }
    let choices = g.kernel_choices();
    let family_of = |role: &str, rows: &str| {
        choices
            .iter()
            .find(|(r, _, _, shape)| r == role && shape.contains(rows))
            .map(|(_, label, _, _)| label.clone())
            .unwrap_or_else(|| panic!("no {role} kernel for {rows}: {choices:?}"))
    };
    let tensor_core = |label: String| label.contains("matmul_wmma") || label.contains("matmul_wgmma");
    assert!(tensor_core(family_of("fc", "M=100")), "{choices:?}");
    assert!(!tensor_core(family_of("fc", "M=1 ")), "{choices:?}");
}

/// f16 / bf16 storage (weights converted at load, activations and KV cache in 16 bits, f32
/// math inside every kernel): prefill and teacher-forced decode logits stay within 2e-2
/// relative L2 of the f32 CPU reference, every kernel is a 16-bit one, greedy tokens chosen on
/// the device equal the argmax of the logits read back, and a batch of two decodes like one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn half_storage_stays_close_to_the_f32_reference() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let catalog = kernelforge::spec::Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        if refused_before_ampere(&model, dtype) {
            continue;
        }
        let mut g = gpu_in(&model, 2, false, dtype);
        let bar = 2e-2;
        for len in [1, 37, 100] {
            let p = vec![prompt(len, 3)];
            let e = rel_l2(&g.prefill(&p).unwrap().data, &cpu.prefill(&p).unwrap().data);
            eprintln!("{dtype} prefill T={len}: relative L2 {e:.3e}");
            assert!(e < bar, "{dtype} prefill T={len}: relative L2 error {e:.3e} >= {bar:e}");
        }
        let p = vec![prompt(9, 4)];
        let want = cpu.prefill_last(&p).unwrap();
        let e = rel_l2(&g.prefill_last(&p).unwrap().data, &want.data);
        assert!(e < bar, "{dtype} prefill_last: relative L2 error {e:.3e}");
        let mut next = argmax(want.last(0)).unwrap();
        for step in 0..8 {
            let want = cpu.decode(&[next]).unwrap();
            let e = rel_l2(&g.decode(&[next]).unwrap().data, &want.data);
            eprintln!("{dtype} decode step {step}: relative L2 {e:.3e}");
            assert!(
                e < bar,
                "{dtype} decode step {step}: relative L2 error {e:.3e} >= {bar:e}"
            );
            next = argmax(want.last(0)).unwrap();
        }
        for (role, label, _, shape) in g.kernel_choices() {
            let family = label.rsplit(' ').next().unwrap().to_string();
            let f = catalog.family(&family).unwrap();
            assert!(
                f.dtypes.contains(&dtype),
                "{role} {shape}: {family} has no {dtype} variants"
            );
        }
        // Greedy on the device, batch of two, against the argmax of the logits read back.
        let prompts = vec![prompt(6, 5), prompt(6, 6)];
        let mut g2 = gpu_in(&model, 2, false, dtype);
        g.prefill_last(&prompts).unwrap();
        let first = g2.prefill_last(&prompts).unwrap();
        let mut last: Vec<u32> = (0..2).map(|b| argmax(first.last(b)).unwrap()).collect();
        for step in 0..6 {
            let ids = g.decode_argmax(&last).unwrap();
            let logits = g2.decode(&last).unwrap();
            let want: Vec<u32> = (0..2).map(|b| argmax(logits.last(b)).unwrap()).collect();
            assert_eq!(ids, want, "{dtype} greedy step {step}");
            last = want;
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_after_a_long_prefill_reaches_the_context_end() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    let mut g = gpu(&model, 2, false);
    let n_ctx = model.config.n_ctx;
    let p = vec![prompt(n_ctx - 3, 3), prompt(n_ctx - 3, 4)];
    check_logits("prefill", &g.prefill(&p).unwrap(), &cpu.prefill(&p).unwrap());
    for step in 0..3 {
        let next = [step as u32 + 5, 299 - step as u32];
        check_logits(
            &format!("decode at {}", n_ctx - 3 + step),
            &g.decode(&next).unwrap(),
            &cpu.decode(&next).unwrap(),
        );
    }
    let err = g.decode(&[1, 2]).unwrap_err().to_string();
    assert!(err.contains("context"), "{err}");
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        seed: 0,
        stop_at_eot: false,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_generation_is_identical() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    let mut g = gpu(&model, 1, false);
    let prompts = vec![prompt(6, 5)];
    let want = generate(&mut cpu, &prompts, &greedy(20), &mut |_, _| Ok(())).unwrap();
    let got = generate(&mut g, &prompts, &greedy(20), &mut |_, _| Ok(())).unwrap();
    eprintln!("{}", got.stats.summary());
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.tokens[0].len(), 20);
    // The GPU times its prefill (the CPU does not), within the prefill call's wall time.
    let gpu_ms = got.stats.prefill_gpu_ms.expect("the GPU backend times its prefill");
    assert!(
        gpu_ms > 0.0 && gpu_ms <= got.stats.prefill_ms,
        "{gpu_ms} ms GPU, {} ms wall",
        got.stats.prefill_ms
    );
    assert_eq!(want.stats.prefill_gpu_ms, None);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_batch_of_three_prompts() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    // Sized for one sequence: the batch of three makes the buffers grow.
    let mut g = gpu(&model, 1, false);
    let rect = vec![prompt(9, 1), prompt(9, 2), prompt(9, 3)];
    check_logits(
        "batch prefill",
        &g.prefill(&rect).unwrap(),
        &cpu.prefill(&rect).unwrap(),
    );
    for step in 0..5 {
        let next = [step as u32, 100 + step as u32, 200 + step as u32];
        check_logits(
            &format!("batch decode step {step}"),
            &g.decode(&next).unwrap(),
            &cpu.decode(&next).unwrap(),
        );
    }
    let ragged = vec![prompt(3, 7), prompt(8, 8), prompt(5, 9)];
    let want = generate(&mut cpu, &ragged, &greedy(20), &mut |_, _| Ok(())).unwrap();
    let got = generate(&mut g, &ragged, &greedy(20), &mut |_, _| Ok(())).unwrap();
    assert_eq!(got.tokens, want.tokens);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_unfused_path_matches_too() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut cpu = CpuBackend::new(model.clone());
    let mut g = gpu(&model, 2, true);
    let p = vec![prompt(33, 1), prompt(33, 2)];
    check_logits("unfused prefill", &g.prefill(&p).unwrap(), &cpu.prefill(&p).unwrap());
    for step in 0..5 {
        let next = [step as u32 + 1, step as u32 + 50];
        check_logits(
            &format!("unfused decode step {step}"),
            &g.decode(&next).unwrap(),
            &cpu.decode(&next).unwrap(),
        );
    }
    let labels: Vec<String> = g.kernel_choices().into_iter().map(|c| c.1).collect();
    assert!(labels.iter().any(|l| l.contains("attention_naive")), "{labels:?}");
    assert!(labels.iter().any(|l| l.starts_with("gelu")), "{labels:?}");
    assert!(labels.iter().any(|l| l.starts_with("residual")), "{labels:?}");
}

/// A decode step of as many sequences as the tensor-core matmuls take (64) folds its layernorms
/// too, `ln_f` into the LM head included (forced here; `tune` decides otherwise): the ln_
/// kernels run at M = 64, and the logits of every step match the CPU's and the unfolded GPU
/// path's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_steps_of_64_sequences_fold_their_layernorms() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let batch = 64;
    let (dtype, bar) = (Dtype::Bf16, 2e-2);
    if !runs_sm_90_kernels() {
        return;
    }
    let mut folded = gpu_in(&model, batch, false, dtype);
    folded.set_layernorm_folding(LayernormFolding::Always);
    let mut plain = gpu_in(&model, batch, false, dtype);
    plain.set_layernorm_folding(LayernormFolding::Never);
    let mut cpu = CpuBackend::new(model.clone());
    let prompts: Vec<Vec<u32>> = (0..batch as u32).map(|b| prompt(6, 40 + b)).collect();
    let want = cpu.prefill_last(&prompts).unwrap();
    folded.prefill_last(&prompts).unwrap();
    plain.prefill_last(&prompts).unwrap();
    let mut next: Vec<u32> = (0..batch).map(|b| argmax(want.last(b)).unwrap()).collect();
    for step in 0..3 {
        let want = cpu.decode(&next).unwrap();
        let got = folded.decode(&next).unwrap();
        for (against, reference) in [
            ("the CPU", &want.data),
            ("the unfolded GPU path", &plain.decode(&next).unwrap().data),
        ] {
            let e = rel_l2(&got.data, reference);
            eprintln!("folded decode step {step} at batch {batch}: relative L2 {e:.3e} against {against}");
            assert!(
                e < bar,
                "decode step {step} vs {against}: relative L2 error {e:.3e} >= {bar:e}"
            );
        }
        next = (0..batch).map(|b| argmax(want.last(b)).unwrap()).collect();
    }
    let choices = folded.kernel_choices();
    for (role, epilogue) in [("qkv", "[ln_qkv]"), ("fc", "[ln_bias_gelu]"), ("lm_head", "[ln_bias]")] {
        assert!(
            choices.iter().any(|(r, label, _, shape)| r == role
                && label.contains(epilogue)
                && shape.contains("M=64 ")
                && shape.contains("T=1 ")),
            "no folded {role} decode kernel at M=64: {choices:?}"
        );
    }
}

/// Layernorms folded into the prefill's matmuls (`ln_1` into qkv, `ln_2` into fc, `ln_f` into
/// the LM head: the `ln_` epilogues of the Hopper family `matmul_wgmma_tma`), forced with
/// `LayernormFolding::Always` since no tuning database says it pays for the tiny model: in bf16
/// and tf32 the prefill logits stay close to the CPU reference and to the same backend with
/// every layernorm on its own; `prefill_last` (its LM head reads the last rows of ln_f's output,
/// so only qkv and fc fold) and decode steps after a folded prefill (K and V cached by the
/// folded qkv projection) match too; a full forward launches no layernorm at all.
#[test]
#[ignore = "needs a CUDA GPU"]
fn folded_layernorms_match_the_cpu() {
    let _lock = gpu_lock();
    let model = tiny_model();
    if !runs_sm_90_kernels() {
        return;
    }
    let mut cpu = CpuBackend::new(model.clone());
    for (dtype, bar) in [(Dtype::Bf16, 2e-2), (Dtype::Tf32, 1e-2)] {
        let mut folded = gpu_in(&model, 2, false, dtype);
        folded.set_layernorm_folding(LayernormFolding::Always);
        let mut plain = gpu_in(&model, 2, false, dtype);
        plain.set_layernorm_folding(LayernormFolding::Never);
        for p in [
            vec![prompt(100, 3)],
            vec![prompt(37, 5), prompt(37, 6)],
            vec![prompt(128, 7)],
        ] {
            let what = format!("{dtype} folded prefill {}x{}", p.len(), p[0].len());
            let got = folded.prefill(&p).unwrap();
            let e = rel_l2(&got.data, &cpu.prefill(&p).unwrap().data);
            eprintln!("{what}: relative L2 {e:.3e} against the CPU");
            assert!(e < bar, "{what}: relative L2 error {e:.3e} >= {bar:e}");
            let e = rel_l2(&got.data, &plain.prefill(&p).unwrap().data);
            eprintln!("{what}: relative L2 {e:.3e} against the unfolded GPU path");
            assert!(e < bar, "{what} vs unfolded: relative L2 error {e:.3e} >= {bar:e}");
        }
        let choices = folded.kernel_choices();
        for (role, epilogue) in [("qkv", "[ln_qkv]"), ("fc", "[ln_bias_gelu]"), ("lm_head", "[ln_bias]")] {
            assert!(
                choices
                    .iter()
                    .any(|(r, label, _, shape)| r == role && label.contains(epilogue) && shape.contains("M=100 ")),
                "{dtype}: no folded {role} kernel at M=100 (notes: {:?}): {choices:?}",
                folded.notes()
            );
        }
        // The last rows' LM head stays unfolded; qkv and fc fold; decoding goes on from the
        // cache the folded qkv projection filled.
        let p = vec![prompt(90, 8), prompt(90, 9)];
        let want = cpu.prefill_last(&p).unwrap();
        let e = rel_l2(&folded.prefill_last(&p).unwrap().data, &want.data);
        eprintln!("{dtype} folded prefill_last: relative L2 {e:.3e}");
        assert!(
            e < bar,
            "{dtype} folded prefill_last: relative L2 error {e:.3e} >= {bar:e}"
        );
        let mut next: Vec<u32> = (0..2).map(|b| argmax(want.last(b)).unwrap()).collect();
        for step in 0..4 {
            let want = cpu.decode(&next).unwrap();
            let e = rel_l2(&folded.decode(&next).unwrap().data, &want.data);
            eprintln!("{dtype} decode step {step} after a folded prefill: relative L2 {e:.3e}");
            assert!(
                e < bar,
                "{dtype} decode step {step}: relative L2 error {e:.3e} >= {bar:e}"
            );
            next = (0..2).map(|b| argmax(want.last(b)).unwrap()).collect();
        }
        // A full forward with all three folded launches no layernorm.
        let p = vec![prompt(100, 3)];
        folded.set_profiling(true);
        folded.forward_on_device(&p).unwrap();
        let rows = folded.take_profile().unwrap();
        folded.set_profiling(false);
        let calls = |role: &str| rows.iter().filter(|r| r.role == role).map(|r| r.calls).sum::<usize>();
        assert_eq!(
            calls("layernorm"),
            0,
            "{dtype}: {:?}",
            rows.iter().map(|r| (&r.role, &r.kernel)).collect::<Vec<_>>()
        );
        assert_eq!(calls("qkv"), model.config.n_layer);
        assert_eq!(calls("lm_head"), 1);
        for n in folded.notes() {
            eprintln!("note: {n}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn llmc_and_hf_checkpoints_give_the_same_gpu_logits() {
    let _lock = gpu_lock();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model();
    let bin = dir.path().join("tiny.bin");
    let hf = dir.path().join("hf");
    write_llmc(&bin, &model.config, &model.weights, LlmcVersion::F32).unwrap();
    write_hf_folder(&hf, &model.config, &model.weights).unwrap();
    let p = vec![prompt(20, 4)];
    let mut outs = Vec::new();
    for path in [bin.as_path(), hf.as_path()] {
        let m = Arc::new(load_model(Path::new(path)).unwrap());
        let mut g = gpu(&m, 1, false);
        outs.push(g.prefill(&p).unwrap());
    }
    let e = rel_l2(&outs[0].data, &outs[1].data);
    assert!(e < 1e-6, "llm.c vs HF on the GPU: {e:.3e}");
    let mut cpu = CpuBackend::new(model.clone());
    check_logits("llm.c on the GPU vs CPU", &outs[0], &cpu.prefill(&p).unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn profiling_counts_every_launch() {
    let _lock = gpu_lock();
    let model = tiny_model();
    let mut g = gpu(&model, 1, false);
    let p = vec![prompt(16, 1)];
    g.prefill_last(&p).unwrap();
    g.set_profiling(true);
    g.forward_on_device(&p).unwrap();
    let rows = g.take_profile().unwrap();
    for r in &rows {
        eprintln!(
            "{:>10} {:<45} {:>3} {:>8.4} ms {:>5.1}%",
            r.role, r.kernel, r.calls, r.total_ms, r.percent
        );
    }
    let calls = |role: &str| rows.iter().filter(|r| r.role == role).map(|r| r.calls).sum::<usize>();
    let l = model.config.n_layer;
    assert_eq!(calls("embedding"), 1);
    assert_eq!(calls("layernorm"), 2 * l + 1);
    assert_eq!(calls("qkv"), l);
    assert_eq!(calls("attention"), l);
    assert_eq!(calls("lm_head"), 1);
    let total: f64 = rows.iter().map(|r| r.percent).sum();
    assert!((total - 100.0).abs() < 1e-6, "{total}");
    // forward_on_device filled the cache like a prefill: decoding goes on from there.
    let next = g.decode(&[1]).unwrap();
    assert_eq!((next.batch, next.seq_len, next.vocab), (1, 1, model.config.vocab_size));
}

#[test]
fn asking_for_cuda_without_a_gpu_is_a_clear_error() {
    if driver_present() {
        return; // a GPU machine: the ignored tests above cover it
    }
    let model = tiny_model();
    let opts = BackendOptions {
        max_batch: 1,
        ..Default::default()
    };
    let err = match make_backend(Device::Cuda, Dtype::F32, model.clone(), &opts) {
        Ok(_) => panic!("a CUDA backend without a driver"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("CUDA") && err.contains("--device cpu"), "{err}");
    let err = match GpuBackend::new(model, 1, false, Dtype::F32) {
        Ok(_) => panic!("a CUDA backend without a driver"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("CUDA"), "{err}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A dtype that some forward op has no family for is refused before the GPU is touched, naming
/// the op; so is `--unfused` (the f32 baseline) with a 16-bit dtype. Runs with or without a GPU.
#[test]
fn a_dtype_without_kernels_is_refused_naming_the_op() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&root.join("specs"), &dir.path().join("specs"));
    copy_dir(&root.join("templates"), &dir.path().join("templates"));
    for bf16_attention in ["attention_flash_mma", "attention_flash"] {
        std::fs::remove_file(dir.path().join(format!("specs/{bf16_attention}.toml"))).unwrap();
    }
    let err = match GpuBackend::with_root(dir.path(), tiny_model(), 1, false, Dtype::Bf16) {
        Ok(_) => panic!("bf16 without a bf16 attention family"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("--dtype bf16") && err.contains("attention (bf16)") && err.contains("dtypes = [...]"),
        "{err}"
    );
    let err = match GpuBackend::with_root(root, tiny_model(), 1, true, Dtype::F16) {
        Ok(_) => panic!("--unfused in f16"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("--unfused") && err.contains("f16"), "{err}");
}
