//! GPT-2 replicated over GPUs ([`Replicas`]) against one [`GpuBackend`]: the sliced batch, the
//! gathered order, bit-identical prefill logits, identical greedy ids, and the errors that name
//! the device.
//!
//! `replicas_on_one_gpu_equal_one_backend` runs two replicas on GPU 0 (the replica path, the
//! slicing and the gathering on any GPU machine); `two_gpus_equal_one` needs two GPUs and says
//! so when it skips. GPU tests are `#[ignore = "needs a CUDA GPU"]`; run them from the project
//! folder with `-- --ignored`. They take a lock so they never share the GPU.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kernelforge::gpu::device_count;
use kernelforge::model::config::GPT2Config;
use kernelforge::model::generate::{generate, Backend, GenerateOptions, Logits};
use kernelforge::model::gpu::GpuBackend;
use kernelforge::model::replicas::{ReplicaOptions, Replicas};
use kernelforge::model::sampling::SamplingParams;
use kernelforge::model::weights::{GPT2Model, GPT2Weights};
use kernelforge::model::DecodeEngine;
use kernelforge::spec::Dtype;
use rand::{Rng, SeedableRng};

static GPU_LOCK: Mutex<()> = Mutex::new(());

fn gpu_lock() -> MutexGuard<'static, ()> {
    GPU_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn random_model(config: GPT2Config, seed: u64) -> Arc<GPT2Model> {
    let weights = GPT2Weights::random(&config, seed);
    Arc::new(GPT2Model {
        config,
        weights,
        source: "random".into(),
    })
}

/// `batch` fresh random sequences of `len` tokens.
fn random_tokens(batch: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..batch)
        .map(|_| (0..len).map(|_| rng.random_range(0..vocab as u32)).collect())
        .collect()
}

fn options(max_batch: usize, dtype: Dtype) -> ReplicaOptions {
    ReplicaOptions {
        max_batch,
        unfused: false,
        dtype,
        decode_engine: None,
    }
}

/// Prefill logits of every position, then `steps` greedy steps (ids chosen on the device),
/// then one decode step's logits.
fn run(backend: &mut dyn Backend, tokens: &[Vec<u32>], steps: usize) -> (Logits, Vec<Vec<u32>>, Logits) {
    let logits = backend.prefill(tokens).expect("prefill");
    let mut next: Vec<u32> = (0..tokens.len())
        .map(|b| kernelforge::model::sampling::argmax(logits.last(b)).unwrap())
        .collect();
    let mut ids = vec![next.clone()];
    for _ in 0..steps {
        next = backend.decode_argmax(&next).expect("greedy decode step");
        ids.push(next.clone());
    }
    let last = backend.decode(&next).expect("decode step");
    (logits, ids, last)
}

/// Compares a replicated run with one backend's: bit-identical logits, identical ids.
fn compare(what: &str, single: &mut dyn Backend, replicas: &mut Replicas, tokens: &[Vec<u32>], steps: usize) {
    let (want_logits, want_ids, want_last) = run(single, tokens, steps);
    let (got_logits, got_ids, got_last) = run(replicas, tokens, steps);
    let slices: Vec<usize> = replicas.slices().iter().map(|r| r.len()).collect();
    eprintln!(
        "{what}: batch {} sliced {slices:?} over {:?}",
        tokens.len(),
        replicas.devices()
    );
    assert_eq!(slices.iter().sum::<usize>(), tokens.len());
    if tokens.len() >= slices.len() {
        assert!(
            slices.iter().all(|&n| n > 0),
            "{what}: every replica holds sequences: {slices:?}"
        );
    }
    for (name, got, want) in [
        ("prefill", &got_logits, &want_logits),
        ("decode", &got_last, &want_last),
    ] {
        assert_eq!(
            (got.batch, got.seq_len, got.vocab),
            (want.batch, want.seq_len, want.vocab),
            "{what}: {name} logits shape"
        );
        assert!(
            got.data.iter().all(|x| x.is_finite()),
            "{what}: {name} logits are finite"
        );
        if let Some(i) = (0..got.data.len()).find(|&i| got.data[i].to_bits() != want.data[i].to_bits()) {
            let row = i / (got.seq_len * got.vocab);
            panic!(
                "{what}: {name} logits differ first at sequence {row} (flat index {i}): {} vs {}",
                got.data[i], want.data[i]
            );
        }
    }
    assert_eq!(got_ids, want_ids, "{what}: greedy ids");
    // Sequences differ from each other: the gathered order is the input order, not a copy.
    if tokens.len() > 1 {
        assert_ne!(got_logits.last(0), got_logits.last(tokens.len() - 1));
    }
}

/// The megakernel on replicas: each runs the point and the attention chunking one GPU would
/// choose for the whole batch (a slice of one sequence alone would get another block size, and
/// with it another layernorm reduction), so decode logits stay bit-identical.
#[test]
#[ignore = "needs a CUDA GPU"]
fn replicas_with_the_megakernel_equal_one_backend() {
    let _g = gpu_lock();
    let model = random_model(GPT2Config::new(2, 2, 128, 96, 1001).unwrap(), 17);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for batch in [2, 5] {
            let tokens = random_tokens(batch, 11, 1001, 23 + batch as u64);
            let mut single =
                GpuBackend::on_device(root(), 0, model.clone(), batch, false, dtype).expect("one backend on GPU 0");
            single.set_decode_engine(DecodeEngine::Megakernel).unwrap();
            let opts = ReplicaOptions {
                decode_engine: Some(DecodeEngine::Megakernel),
                ..options(batch, dtype)
            };
            let mut replicas = Replicas::open(root(), &[0, 0], model.clone(), &opts).expect("two replicas");
            compare(
                &format!("megakernel, batch {batch} on 2 replicas, {dtype}"),
                &mut single,
                &mut replicas,
                &tokens,
                6,
            );
            assert_eq!(replicas.decode_engine(), Some(DecodeEngine::Megakernel));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replicas_on_one_gpu_equal_one_backend() {
    let _g = gpu_lock();
    // Head size 64 (what the attention kernels need), an awkward vocabulary and context.
    let model = random_model(GPT2Config::new(3, 2, 128, 96, 1001).unwrap(), 7);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let batch = 5;
        let tokens = random_tokens(batch, 13, 1001, 11 + dtype as u64);
        let mut single =
            GpuBackend::on_device(root(), 0, model.clone(), batch, false, dtype).expect("one backend on GPU 0");
        let mut replicas =
            Replicas::open(root(), &[0, 0], model.clone(), &options(batch, dtype)).expect("two replicas");
        assert_eq!(
            replicas.name(),
            format!("cuda:0,0{}", if dtype == Dtype::F32 { "" } else { " bf16" })
        );
        compare(
            &format!("2 replicas on GPU 0, {dtype}"),
            &mut single,
            &mut replicas,
            &tokens,
            8,
        );
        assert_eq!(replicas.slices(), &[0..3, 3..5]);
        // A smaller batch next: nothing is reallocated, and a replica may sit idle.
        let one = random_tokens(1, 9, 1001, 99);
        compare(
            &format!("batch 1 on 2 replicas, {dtype}"),
            &mut single,
            &mut replicas,
            &one,
            4,
        );
        assert_eq!(replicas.slices(), &[0..1, 1..1]);
        // Sampled generation: sequence b samples with seed + b whatever the number of GPUs.
        let prompts = random_tokens(batch, 6, 1001, 5);
        let opts = GenerateOptions {
            max_new_tokens: 20,
            sampling: SamplingParams {
                temperature: 0.9,
                top_k: 50,
                top_p: 0.95,
            },
            seed: 42,
            stop_at_eot: false,
        };
        let want = generate(&mut single, &prompts, &opts, &mut |_, _| Ok(())).unwrap();
        let got = generate(&mut replicas, &prompts, &opts, &mut |_, _| Ok(())).unwrap();
        assert_eq!(got.tokens, want.tokens, "sampled ids, {dtype}");
        assert_ne!(got.tokens[0], got.tokens[1], "each sequence has its own seed");
        // A decode step with the wrong number of tokens is refused.
        let e = replicas.decode(&[1, 2]).unwrap_err().to_string();
        assert!(
            e.contains(&format!("decode got 2 tokens for a batch of {batch}")),
            "{e}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_gpus_equal_one() {
    let _g = gpu_lock();
    let count = device_count().expect("counting GPUs");
    if count < 2 {
        eprintln!("two_gpus_equal_one: skipped: it needs 2 GPUs and this machine has {count}");
        return;
    }
    let model = random_model(GPT2Config::gpt2(), 124);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let batch = 8;
        let tokens = random_tokens(batch, 64, 50257, 3 + dtype as u64);
        let mut single =
            GpuBackend::on_device(root(), 0, model.clone(), batch, false, dtype).expect("one backend on GPU 0");
        let mut replicas = Replicas::open(root(), &[0, 1], model.clone(), &options(batch, dtype)).expect("two GPUs");
        compare(
            &format!("124M on 2 GPUs, {dtype}"),
            &mut single,
            &mut replicas,
            &tokens,
            64,
        );
        assert_eq!(replicas.slices(), &[0..4, 4..8]);
    }
}

/// A device that does not exist, and a replica that does not fit: one error each, naming the
/// device, before anything is uploaded.
#[test]
#[ignore = "needs a CUDA GPU"]
fn errors_name_the_device() {
    let _g = gpu_lock();
    let model = random_model(GPT2Config::new(2, 2, 128, 64, 300).unwrap(), 1);
    let missing = device_count().unwrap() + 3;
    let e = match Replicas::open(root(), &[0, missing], model.clone(), &options(2, Dtype::F32)) {
        Ok(_) => panic!("a replica on a GPU that does not exist"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains(&format!("cuda:{missing}")), "{e}");
    // GPT-2 124M in f32 with buffers for 100,000 sequences needs terabytes.
    let big = random_model(GPT2Config::gpt2(), 2);
    let e = match GpuBackend::on_device(root(), 0, big, 100_000, false, Dtype::F32) {
        Ok(_) => panic!("a replica larger than the GPU"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("cuda:0") && e.contains("cannot hold the model") && e.contains("GiB free"),
        "{e}"
    );
    // The GPU is still usable after the refusals.
    let mut ok = Replicas::open(root(), &[0], model, &options(1, Dtype::F32)).expect("one replica");
    ok.prefill(&[vec![1, 2, 3]]).expect("prefill after the refusals");
}
