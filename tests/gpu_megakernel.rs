//! The megakernel decode engine against the kernel-by-kernel decode step on random models: the
//! tiny test model (L=2, C=128), a deeper and wider one (L=6, NH=6, C=384, odd vocabulary) and
//! GPT-2 124M's shape, in f32 and bf16, at batch 1 and a larger batch.
//!
//! Each step feeds both engines the kernel-by-kernel path's greedy token (teacher forcing), so
//! one disagreement cannot snowball: the logits must stay within the dtype's bar, and the
//! greedy tokens must be equal except where the reference's own top two logits are closer
//! than the dtype's rounding (a near-tie, which a different summation order may break either
//! way; each such step is printed). A third backend runs the same steps greedily on the device
//! (`decode_argmax`): its ids must be exactly the argmax of the megakernel's logits.
//!
//! What every engine shares (steps run ahead, greedy ids over 256 steps, the batch handoff, the
//! engine `tune --decode-step` stores) is in `gpu_decode_engines.rs`.
//!
//! GPU tests are `#[ignore = "needs a CUDA GPU"]`; the CPU tests of the lowering and the
//! schedule check are unit tests of `model::gpu::stage_table`.

mod decode_support;

use std::sync::Arc;

use decode_support::{backend, gpu_lock, model, tie_gap};
use kernelforge::model::generate::{Backend, Draw, Logits};
use kernelforge::model::sampling::{argmax, SamplingParams};
use kernelforge::model::weights::GPT2Model;
use kernelforge::model::DecodeEngine;
use kernelforge::spec::Dtype;

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    kernelforge::ops::relative_l2_error(got, &want)
}

/// Runs `steps` teacher-forced decode steps on both engines after a prefill of `prompt_len`
/// tokens and checks them (see the module docs). In f16/bf16 the logits bar is against the f32
/// kernel-by-kernel path (the dtype's bar is a bar against the exact values; two half-precision
/// paths may each be within it and still differ from each other by more). Returns the number
/// of near-tie disagreements.
fn compare(what: &str, model: &Arc<GPT2Model>, batch: usize, dtype: Dtype, prompt_len: usize, steps: usize) -> usize {
    compare_at(what, model, batch, dtype, prompt_len, steps, &[])
}

/// [`compare`] with the megakernel at a point of its family (parameters not named keep the
/// spec's default values, `max_rows = 8` among them).
fn compare_at(
    what: &str,
    model: &Arc<GPT2Model>,
    batch: usize,
    dtype: Dtype,
    prompt_len: usize,
    steps: usize,
    point: &[(&str, i64)],
) -> usize {
    let (bar, tie): (f64, f64) = match dtype {
        Dtype::F32 => (1e-4, 1e-4),
        _ => (1e-2, 3e-2),
    };
    let mut reference = backend(model, batch, dtype, DecodeEngine::Launches);
    let mut exact = (dtype != Dtype::F32).then(|| backend(model, batch, Dtype::F32, DecodeEngine::Launches));
    let mut mega = backend(model, batch, dtype, DecodeEngine::Megakernel);
    let mut greedy = backend(model, batch, dtype, DecodeEngine::Megakernel);
    if !point.is_empty() {
        let point: Vec<(String, i64)> = point.iter().map(|&(k, v)| (k.to_string(), v)).collect();
        mega.set_megakernel_point(point.clone());
        greedy.set_megakernel_point(point);
    }
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..prompt_len as u32)
                .map(|i| (i * 37 + b as u32 * 101 + 11) % vocab)
                .collect()
        })
        .collect();
    let first = reference.prefill_last(&prompts).unwrap();
    mega.prefill_last(&prompts).unwrap();
    greedy.prefill_last(&prompts).unwrap();
    if let Some(e) = exact.as_mut() {
        e.prefill_last(&prompts).unwrap();
    }
    let mut next: Vec<u32> = (0..batch).map(|b| argmax(first.last(b)).unwrap()).collect();
    let mut ties = 0;
    let (mut worst, mut worst_reference): (f64, f64) = (0.0, 0.0);
    for step in 0..steps {
        let want: Logits = reference.decode(&next).unwrap();
        let got: Logits = mega.decode(&next).unwrap();
        let on_device = greedy.decode_argmax(&next).unwrap();
        assert!(
            got.data.iter().all(|x| x.is_finite()),
            "{what} step {step}: non-finite logits"
        );
        let truth = match exact.as_mut() {
            Some(e) => e.decode(&next).unwrap(),
            None => want.clone(),
        };
        let e = rel_l2(&got.data, &truth.data);
        let e_reference = rel_l2(&want.data, &truth.data);
        worst = worst.max(e);
        worst_reference = worst_reference.max(e_reference);
        // As accurate as the kernel-by-kernel path in the same dtype (within a margin: the two
        // round at different places), and within the dtype's bar where that path is.
        let allowed = bar.max(1.25 * e_reference + 1e-3);
        assert!(
            e < allowed,
            "{what} step {step}: relative L2 error {e:.3e} >= {allowed:.3e} (kernel by kernel: {e_reference:.3e})"
        );
        let want_ids: Vec<u32> = (0..batch).map(|b| argmax(want.last(b)).unwrap()).collect();
        let got_ids: Vec<u32> = (0..batch).map(|b| argmax(got.last(b)).unwrap()).collect();
        for b in 0..batch {
            // Two runs of the megakernel round alike, except where fused MLP stages add their
            // shares in the order they arrive (fuse_mlp = 1): there only a near-tie may differ.
            if on_device[b] != got_ids[b] {
                let gap = tie_gap(got.last(b), got_ids[b], on_device[b]);
                assert!(
                    gap <= tie,
                    "{what} step {step} sequence {b}: the fused argmax picked {} where the megakernel's logits say {} (gap {gap:.2e})",
                    on_device[b],
                    got_ids[b]
                );
                eprintln!(
                    "{what} step {step} sequence {b}: fused argmax near-tie {} vs {}",
                    on_device[b], got_ids[b]
                );
                ties += 1;
            }
        }
        for b in 0..batch {
            if got_ids[b] != want_ids[b] {
                let row = want.last(b);
                let (best, other) = (row[want_ids[b] as usize], row[got_ids[b] as usize]);
                let gap = tie_gap(row, want_ids[b], got_ids[b]);
                eprintln!(
                    "{what} step {step} sequence {b}: near-tie {} vs {} (reference logits {best} vs {other}, gap {gap:.2e} of the largest)",
                    want_ids[b], got_ids[b]
                );
                assert!(
                    gap <= tie,
                    "{what} step {step} sequence {b}: token {} instead of {} with a gap of {gap:.2e}",
                    got_ids[b],
                    want_ids[b]
                );
                ties += 1;
            }
        }
        next = want_ids;
    }
    eprintln!(
        "{what}: {steps} steps, worst relative L2 {worst:.2e} (kernel by kernel in the same dtype: {worst_reference:.2e}), \
         {ties} near-tie disagreements"
    );
    ties
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_matches_kernel_by_kernel_decode_on_the_tiny_model() {
    let _lock = gpu_lock();
    let tiny = model(2, 2, 128, 128, 300, 2024);
    compare("tiny f32 B=1", &tiny, 1, Dtype::F32, 5, 100);
    compare("tiny f32 B=3", &tiny, 3, Dtype::F32, 7, 100);
    compare("tiny bf16 B=1", &tiny, 1, Dtype::Bf16, 5, 100);
    compare("tiny f16 B=2", &tiny, 2, Dtype::F16, 3, 60);
}

/// Small enough for compute-sanitizer (memcheck, racecheck, synccheck): a few steps on a 2-layer
/// model, with a cache long enough that attention splits into chunks and combines them, in f32
/// with the copy engine and in bf16 with cp.async; and with slots of 16 KiB, which hold 64 cache
/// positions in bf16, so that an attention chunk (~70 positions) reads its last keys and values
/// from memory rather than from its slot; and at batch 8, where the fc projection's input rows
/// (8 x 512 floats) are more than a 16-byte piece a thread and are staged by cp.async; and a
/// one-layer 1,152-wide model with fused MLPs cut into many tasks a block.
#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_small_for_the_sanitizer() {
    let _lock = gpu_lock();
    // Three steps after 140 positions, at 64 cache positions a chunk (the fitted point takes 128):
    // the 141 to 143 positions split into two chunks.
    let check = |what: &str, model: &Arc<GPT2Model>, batch: usize, dtype: Dtype, point: &[(&str, i64)]| {
        let mut split = vec![("min_chunk_keys", 64)];
        split.extend_from_slice(point);
        compare_at(what, model, batch, dtype, 140, 3, &split);
    };
    let tiny = model(2, 2, 128, 512, 300, 77);
    check(
        "sanitizer f32 B=1 (attention takes eight rows a trip)",
        &tiny,
        1,
        Dtype::F32,
        &[],
    );
    check("sanitizer f32 B=2", &tiny, 2, Dtype::F32, &[]);
    check("sanitizer f32 B=8 (inputs by cp.async)", &tiny, 8, Dtype::F32, &[]);
    check("sanitizer bf16 B=2 (tensor cores)", &tiny, 2, Dtype::Bf16, &[]);
    // 16 rows (MMA rows g + 8 too; the draw's warps take a second row each past 8)
    let sixteen = [
        ("max_rows", 16),
        ("threads", 256),
        ("tensor_cores", 1),
        ("cols_per_warp", 1),
    ];
    check(
        "sanitizer bf16 B=13 (16 rows on the tensor cores)",
        &tiny,
        13,
        Dtype::Bf16,
        &sixteen,
    );
    // More heads than blocks (12 sequences of 12 heads on the H200's 132): attention in two
    // waves, the LM head's and the matrix-vector tasks at GPT-2's width
    let heads = model(2, 12, 768, 512, 300, 79);
    check(
        "sanitizer bf16 B=12 of 12 heads (more heads than blocks)",
        &heads,
        12,
        Dtype::Bf16,
        &sixteen,
    );
    check(
        "sanitizer bf16 B=3, fused MLPs",
        &tiny,
        3,
        Dtype::Bf16,
        &[("fuse_mlp", 1)],
    );
    check(
        "sanitizer bf16 B=1, keys past the slot",
        &tiny,
        1,
        Dtype::Bf16,
        &[("slot_kib", 16)],
    );
    // 1,152 wide: at 256 threads and 16 KiB slots an MLP task holds 3 hidden units, so each
    // block sums ~12 tasks of the stage before it adds them into the residual stream, in two
    // passes over the row (256 threads x 4 outputs a pass).
    let wide = model(1, 18, 1152, 160, 300, 78);
    let many = [("fuse_mlp", 1), ("max_rows", 1), ("threads", 256), ("slot_kib", 16)];
    check(
        "sanitizer bf16 B=1, fused MLPs of many tasks a block",
        &wide,
        1,
        Dtype::Bf16,
        &many,
    );
    let kslice = [("fuse_mlp", 1), ("max_rows", 1), ("kslice", 1), ("slot_kib", 16)];
    check(
        "sanitizer bf16 B=1, K cut between threads",
        &wide,
        1,
        Dtype::Bf16,
        &kslice,
    );
    let mut g = backend(&tiny, 1, Dtype::Bf16, DecodeEngine::Megakernel);
    g.set_megakernel_point(vec![("bulk_copy".to_string(), 0), ("max_rows".to_string(), 1)]);
    let first = g
        .prefill_last(&[(0..150u32).map(|i| (i * 7 + 3) % 300).collect()])
        .unwrap();
    let mut next = vec![argmax(first.last(0)).unwrap()];
    for _ in 0..3 {
        next = g.decode_argmax(&next).unwrap();
        assert!((next[0] as usize) < 300, "a token of the vocabulary: {next:?}");
    }
    // A plain temperature: the Gumbel-max drawn in the LM head (Philox noise, float4 reads).
    let draw = Draw {
        params: SamplingParams {
            temperature: 0.7,
            ..SamplingParams::default()
        },
        seed: 5,
        first_sequence: 0,
    };
    for step in 0..3 {
        next = g.decode_draw(&next, &draw, 154 + step).unwrap();
        assert!((next[0] as usize) < 300, "a token of the vocabulary: {next:?}");
    }
    // Top-k and top-p: drawn from the LM-head tasks' heads (decode/draw.cu.tera).
    let draw = Draw {
        params: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.9,
        },
        ..draw
    };
    for step in 0..3 {
        next = g.decode_draw(&next, &draw, 157 + step).unwrap();
        assert!((next[0] as usize) < 300, "a token of the vocabulary: {next:?}");
    }
    assert!(g.lm_head_draws(&draw.params), "top-k 40 drawn in the LM head");
    // Three rows, each drawn by a block of its own once every block has left its heads.
    let mut g = backend(&tiny, 3, Dtype::Bf16, DecodeEngine::Megakernel);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|b| (0..20u32).map(|i| (i * 13 + b * 7) % 300).collect())
        .collect();
    let first = g.prefill_last(&prompts).unwrap();
    let mut next: Vec<u32> = (0..3).map(|b| argmax(first.last(b)).unwrap()).collect();
    for step in 0..3 {
        next = g.decode_draw(&next, &draw, 21 + step).unwrap();
        assert!(next.iter().all(|&t| t < 300), "tokens of the vocabulary: {next:?}");
    }
    assert!(
        g.lm_head_draws(&draw.params),
        "top-k 40 drawn in the LM head at batch 3"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_matches_kernel_by_kernel_decode_on_deeper_wider_and_gpt2_shapes() {
    let _lock = gpu_lock();
    let wide = model(6, 6, 384, 512, 1001, 7);
    compare("L6 C384 f32 B=1", &wide, 1, Dtype::F32, 300, 200);
    compare("L6 C384 bf16 B=8", &wide, 8, Dtype::Bf16, 17, 256);
    let gpt2 = model(12, 12, 768, 1024, 50257, 11);
    compare("124M f32 B=1", &gpt2, 1, Dtype::F32, 16, 256);
    compare("124M bf16 B=1", &gpt2, 1, Dtype::Bf16, 16, 256);
    compare("124M bf16 B=8", &gpt2, 8, Dtype::Bf16, 16, 64);
}

/// Each layer's fc and fc projection as one stage (`fuse_mlp = 1`: each block sums its tasks'
/// shares of the projection and adds them into an f32 residual stream by atomics), against the
/// kernel-by-kernel path: f32 and 16-bit, one row and several, FMAs and tensor cores, the copy
/// engine and cp.async, a model whose hidden units cut unevenly into tasks (C = 320: 1,280 of
/// them), one with many tasks a block (C = 1,152) and GPT-2 small.
#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_with_fused_mlps_matches_kernel_by_kernel_decode() {
    let _lock = gpu_lock();
    let fused = [("fuse_mlp", 1)];
    let tiny = model(2, 2, 128, 128, 300, 2025);
    compare_at("fused tiny f32 B=1", &tiny, 1, Dtype::F32, 5, 100, &fused);
    compare_at("fused tiny bf16 B=3", &tiny, 3, Dtype::Bf16, 7, 100, &fused);
    let uneven = model(4, 5, 320, 512, 1001, 31);
    compare_at("fused L4 C320 f32 B=2", &uneven, 2, Dtype::F32, 40, 64, &fused);
    compare_at("fused L4 C320 f16 B=1", &uneven, 1, Dtype::F16, 40, 64, &fused);
    let copies = [("fuse_mlp", 1), ("bulk_copy", 0)];
    compare_at(
        "fused L4 C320 bf16 B=1 cp.async",
        &uneven,
        1,
        Dtype::Bf16,
        40,
        64,
        &copies,
    );
    let mma = [
        ("fuse_mlp", 1),
        ("tensor_cores", 1),
        ("cols_per_warp", 1),
        ("threads", 256),
    ];
    compare_at(
        "fused L4 C320 bf16 B=5 tensor cores",
        &uneven,
        5,
        Dtype::Bf16,
        40,
        64,
        &mma,
    );
    // Many MLP tasks a block (3 hidden units each in 16-bit storage, 1 in f32: each block sums
    // ~12 or ~35 before it adds them into the residual stream), rows wider than one pass of a
    // block's threads (256 x 4 outputs), in each storage type.
    let wide = model(2, 18, 1152, 256, 1001, 43);
    let many = [("fuse_mlp", 1), ("max_rows", 1), ("threads", 256), ("slot_kib", 16)];
    compare_at(
        "fused L2 C1152 bf16 B=1 many tasks",
        &wide,
        1,
        Dtype::Bf16,
        24,
        64,
        &many,
    );
    compare_at("fused L2 C1152 f16 B=1 many tasks", &wide, 1, Dtype::F16, 24, 32, &many);
    let many_f32 = [("fuse_mlp", 1), ("max_rows", 1), ("threads", 512), ("slot_kib", 16)];
    compare_at(
        "fused L2 C1152 f32 B=1 many tasks",
        &wide,
        1,
        Dtype::F32,
        24,
        32,
        &many_f32,
    );
    // K cut between all threads for the tasks of at most 16 columns (kslice = 1): every MLP task
    // here, the attention projection's, and the rest on the column cut
    let kslice = [("fuse_mlp", 1), ("max_rows", 1), ("kslice", 1), ("slot_kib", 16)];
    compare_at("fused L2 C1152 bf16 B=1 kslice", &wide, 1, Dtype::Bf16, 24, 64, &kslice);
    compare_at("fused L2 C1152 f32 B=1 kslice", &wide, 1, Dtype::F32, 24, 32, &kslice);
    let unfused = [("max_rows", 1), ("kslice", 1)];
    compare_at(
        "L2 C1152 bf16 B=1 kslice unfused",
        &wide,
        1,
        Dtype::Bf16,
        24,
        32,
        &unfused,
    );
    let gpt2 = model(12, 12, 768, 1024, 50257, 41);
    let one_row = [("fuse_mlp", 1), ("max_rows", 1), ("slots", 2), ("slot_kib", 96)];
    compare_at("fused 124M bf16 B=1", &gpt2, 1, Dtype::Bf16, 16, 256, &one_row);
    compare_at("fused 124M f32 B=1", &gpt2, 1, Dtype::F32, 16, 128, &one_row);
    compare_at("fused 124M bf16 B=8 tensor cores", &gpt2, 8, Dtype::Bf16, 16, 64, &mma);
}

/// Points beyond the fitted ones: every columns-per-warp value (how many weight rows each
/// input load serves, and how the lanes' sums are dealt out to finish the outputs) at both block
/// sizes, in f32 and bf16, on a model whose tasks are narrower than a block's warps and on GPT-2
/// small's shapes; and the tensor cores at batches the fitted point leaves to the FMAs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_points_of_every_column_count_and_block_size_match() {
    let _lock = gpu_lock();
    let wide = model(6, 6, 384, 512, 1001, 19);
    let gpt2 = model(12, 12, 768, 1024, 50257, 23);
    for cols_per_warp in [1, 2, 4] {
        for threads in [256, 512] {
            let point = [("cols_per_warp", cols_per_warp), ("threads", threads)];
            let what = |m: &str| format!("{m} cols_per_warp={cols_per_warp} threads={threads}");
            compare_at(&what("L6 C384 f32 B=2"), &wide, 2, Dtype::F32, 40, 48, &point);
            compare_at(&what("L6 C384 bf16 B=1"), &wide, 1, Dtype::Bf16, 40, 48, &point);
        }
        let point = [("cols_per_warp", cols_per_warp)];
        compare_at(
            &format!("124M bf16 B=1 cols_per_warp={cols_per_warp}"),
            &gpt2,
            1,
            Dtype::Bf16,
            16,
            32,
            &point,
        );
    }
    // The tensor cores' matrix-vector tasks (the fitted choice from two rows up) at one row and
    // at a batch that fills part of the MMA's n = 8, at both block sizes, in both 16-bit types.
    for threads in [256, 512] {
        let point = [("tensor_cores", 1), ("cols_per_warp", 1), ("threads", threads)];
        let what = |m: &str| format!("{m} tensor cores threads={threads}");
        compare_at(&what("L6 C384 bf16 B=1"), &wide, 1, Dtype::Bf16, 40, 48, &point);
        compare_at(&what("L6 C384 f16 B=3"), &wide, 3, Dtype::F16, 40, 48, &point);
    }
    let point = [("tensor_cores", 1), ("cols_per_warp", 1)];
    compare_at("124M bf16 B=1 tensor cores", &gpt2, 1, Dtype::Bf16, 16, 32, &point);
}

/// The timeline records every task once, each on the block that ran it, in a sensible order.
#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_timeline_stamps_every_task() {
    let _lock = gpu_lock();
    let tiny = model(2, 2, 128, 128, 300, 5);
    let mut g = backend(&tiny, 1, Dtype::F32, DecodeEngine::Megakernel);
    g.prefill_last(&[vec![1, 2, 3]]).unwrap();
    g.set_timeline(true);
    g.decode_argmax(&[4]).unwrap();
    let t = g.take_timeline().expect("a timeline after a stamped step");
    let summary = g.megakernel_summary().unwrap();
    // one row fuses each layer's fc and fc projection (the fitted point)
    assert_eq!(summary.point["fuse_mlp"], 1);
    assert_eq!(summary.stages, 1 + 2 * 4 + 1);
    assert_eq!(t.tasks.len(), summary.tasks);
    assert!(t.blocks > 0);
    for s in &t.tasks {
        assert!(s.block < t.blocks);
        assert!(
            s.start_ns <= s.ready_ns && s.ready_ns <= s.data_ns && s.data_ns <= s.end_ns,
            "{s:?}"
        );
    }
    let embed = t.tasks.iter().find(|s| s.op == "embed").unwrap();
    let head = t
        .tasks
        .iter()
        .filter(|s| s.op == "lm_head")
        .map(|s| s.end_ns)
        .max()
        .unwrap();
    assert!(embed.end_ns <= head);
    assert!(g.take_timeline().is_none(), "taken once");
}

/// The timeline of a GPT-2 124M megakernel step is a faithful record: every task of every
/// layer is stamped once, in order (start <= ready <= end, data staged in between), and no
/// stage that normalizes a whole row (qkv, fc, the LM head) saw its input ready before the last
/// task producing that row had stored its outputs. The per-op table `bench --timeline` prints
/// is printed too, for reading. With the fitted point (one stage for each layer's MLP) in both
/// dtypes, and with fc and its projection apart.
#[test]
#[ignore = "needs a CUDA GPU"]
fn megakernel_timeline_of_gpt2_small_is_complete_and_ordered() {
    let _lock = gpu_lock();
    let layers = 12;
    let gpt2 = model(layers, 12, 768, 1024, 50257, 3);
    for (dtype, fused) in [(Dtype::Bf16, true), (Dtype::F32, true), (Dtype::Bf16, false)] {
        let mut g = backend(&gpt2, 1, dtype, DecodeEngine::Megakernel);
        if !fused {
            g.set_megakernel_point(vec![("fuse_mlp".to_string(), 0), ("max_rows".to_string(), 1)]);
        }
        g.prefill_last(&[vec![1, 2, 3, 4, 5, 6, 7, 8]]).unwrap();
        let mut next = vec![9];
        for _ in 0..3 {
            next = g.decode_argmax(&next).unwrap();
        }
        g.set_timeline(true);
        g.decode_argmax(&next).unwrap();
        let t = g.take_timeline().unwrap();
        assert!(g.take_timeline().is_none(), "taking the timeline clears it");

        for s in &t.tasks {
            assert!(s.block < t.blocks, "{s:?}");
            assert!(s.start_ns <= s.ready_ns && s.ready_ns <= s.end_ns, "{s:?}");
            assert!(s.start_ns <= s.data_ns && s.data_ns <= s.end_ns, "{s:?}");
        }
        let of = |op: &str, layer: Option<u32>| -> Vec<&kernelforge::model::engine::TaskStamp> {
            t.tasks.iter().filter(|s| s.op == op && s.layer == layer).collect()
        };
        let last_end = |tasks: &[&kernelforge::model::engine::TaskStamp]| tasks.iter().map(|s| s.end_ns).max().unwrap();
        let first_ready =
            |tasks: &[&kernelforge::model::engine::TaskStamp]| tasks.iter().map(|s| s.ready_ns).min().unwrap();
        assert!(!of("embed", None).is_empty() && !of("lm_head", None).is_empty());
        let mut row_done = last_end(&of("embed", None));
        for layer in 0..layers as u32 {
            let stage = |op: &str| {
                let tasks = of(op, Some(layer));
                assert!(!tasks.is_empty(), "{dtype}: no {op} tasks in layer {layer}");
                tasks
            };
            let (qkv, attention, attn_proj) = (stage("qkv"), stage("attention"), stage("attn_proj"));
            let fc = stage(if fused { "mlp" } else { "fc" });
            assert!(!attention.is_empty());
            assert!(
                first_ready(&qkv) >= row_done,
                "{dtype}: layer {layer} qkv ran before its row was done"
            );
            assert!(
                first_ready(&fc) >= last_end(&attn_proj),
                "{dtype}: layer {layer} fc before attn_proj ended"
            );
            row_done = last_end(&if fused { fc } else { stage("fc_proj") });
        }
        assert!(
            first_ready(&of("lm_head", None)) >= row_done,
            "{dtype}: the LM head before the last layer ended"
        );
        let expected = 1 + layers * if fused { 4 } else { 5 } + 1;
        assert!(t.tasks.iter().all(|s| s.layer.is_none_or(|l| l < layers as u32)));

        let table = kernelforge::model::timeline_stats::summarize(&t);
        let stages: usize = table.iter().map(|r| r.stages).sum();
        assert_eq!(stages, expected, "{dtype}: embed, 4 or 5 stages per layer, the LM head");
        let share: f64 = table.iter().map(|r| r.share).sum();
        assert!((share - 1.0).abs() < 1e-6, "{dtype}: shares sum to {share}");
        eprintln!(
            "{dtype}:\n{}",
            kernelforge::model::timeline_stats::summary_table(&table)
        );
    }
}
