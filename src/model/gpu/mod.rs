//! GPT-2 on the GPU: the forward pass (prefill) and KV-cached decode steps, running the
//! kernels the registry picks (the tuned winner for each shape when the tuning database has
//! one, else each family's default), as a generation [`Backend`].
//!
//! Everything lives in device memory allocated once: the weights (uploaded at construction,
//! `wte` padded with zero rows to `padded_vocab_size` for the tied LM head), the activations
//! for `max_batch × n_ctx` tokens, the KV cache of every layer (`[max_batch, NH, n_ctx, HS]` for
//! K and for V) and one scratch workspace. Buffers only grow, and only in a prefill (a larger
//! batch than planned for); a decode step never allocates on the device.
//!
//! One layer, fused (the default):
//! `layernorm → matmul[qkv] (writes head-major Q, K, V) → kv_append → attention (causal, prefill)
//! or attention_decode (one query against the cache, which it appends the step's K and V to
//! first) → matmul[bias_residual] → layernorm →
//! matmul[bias_gelu] → matmul[bias_residual]`; then the final layernorm and the LM head
//! (`matmul[none]` against `wte`). The residual stream ping-pongs between two buffers, so a
//! matmul never writes the buffer it reads its residual from.
//!
//! A prefill may run a layernorm folded into the matmul after it instead (`ln_1` into qkv,
//! `ln_2` into fc, `ln_f` into the LM head: an `ln_` matmul that standardizes its input rows
//! itself, with gamma and beta folded into a copy of its weight and bias, `fold.rs`), where the
//! tuning database says that is faster (`fold_select.rs`; `KERNELFORGE_FOLD_LAYERNORMS=always`
//! or `never`, or [`GpuBackend::set_layernorm_folding`], overrides the database).
//!
//! Unfused (`--unfused`, the seeds' baseline): matmuls with the `bias` epilogue followed by the
//! standalone `gelu` and `residual` kernels, and the three-pass `attention_naive` family for
//! prefill attention (decode keeps `attention_decode`: there is no unfused decode kernel).
//!
//! A step is built as a plan (`plan.rs`: ordered op nodes over these buffers) and run by one of
//! three executors ([`DecodeEngine`]): kernel by kernel or as a CUDA graph (`exec.rs`: the first
//! step of a batch size and way of choosing its tokens records its launches, the argmax or
//! sampler included, as a [`KernelGraph`]; later steps rewrite only the nodes whose arguments or
//! kernels changed and replay it with one launch), or lowered to one persistent
//! kernel (`megakernel.rs`); `step.rs` runs a prefill or decode step through them (ids in,
//! logits or next ids out). Profiling and `KERNELFORGE_SYNC_EACH` launch kernel by kernel
//! instead of the graph. Kernel selection lives in `select.rs`; opening the backend (catalog,
//! tuning database, weights, buffers) in `open.rs`; what `tune --decode-step` needs (timing
//! greedy steps, the engine the database prefers) in `decode_tune.rs`.
//!
//! Profiling (off by default, `profile.rs`): a CUDA event pair around every launch, aggregated
//! per kernel.
//! Setting `KERNELFORGE_SYNC_EACH=1` synchronizes after every launch so a faulting kernel is
//! named in the error (slow; for debugging).

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result as AnyResult};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};

use super::config::GPT2Config;
use super::engine::{DecodeEngine, Timeline};
use super::error::{ModelError, Result};
use super::generate::{Backend, Draw, Logits};
use super::weights::GPT2Model;
use crate::gpu::{ArgValue, Gpu, KernelGraph};
use crate::ops::Shape;
use crate::spec::{shape_text, Dtype};
use crate::tune::db::DbHeader;
use crate::tune::registry::{Choice, Registry};
use crate::tune::workloads::op_dtype;

mod buffers;
mod decode_tune;
mod exec;
mod fold;
mod fold_select;
mod lm_head_draw;
mod megakernel;
mod megakernel_point;
mod open;
mod plan;
mod profile;
mod run_ahead;
mod select;
mod stage_table;
mod step;

pub use buffers::ReplicaMemory;
use buffers::{Activations, DeviceTensor};
pub use decode_tune::StepTime;
use exec::LaunchMode;
pub use fold_select::{LayernormFolding, FOLD_LAYERNORMS_ENV};
pub use lm_head_draw::{drawn_in_lm_head, LmHeadTasks, LM_HEAD_TOP_K};
pub use megakernel::decode_step_key;
pub use megakernel_point::{fitted_default, most_rows, point_text, MegakernelSummary, MEGAKERNEL_FAMILY};
use plan::HeadRows;
pub use profile::ProfileRow;
use profile::Profiler;
use select::{Kernel, Kernels};

/// The op (and kernel family) of the decode attention: one query per sequence against the cache.
pub const ATTENTION_DECODE_OP: &str = "attention_decode";
/// The op (and kernel family) that copies new K and V rows into the cache.
pub const KV_APPEND_OP: &str = "kv_append";
/// The op (and kernel family) that picks greedy tokens on the device.
pub const ARGMAX_OP: &str = "argmax";
/// The op (and kernel family) that draws sampled tokens on the device.
pub const SAMPLE_OP: &str = "sample";
/// The family the unfused path forces for prefill attention.
pub const UNFUSED_ATTENTION_FAMILY: &str = "attention_naive";

/// Logits rows that a decode step reads back through pinned memory (at least the batch).
const PINNED_LOGITS_ROWS: usize = 8;

const SYNC_HINT: &str =
    "running the forward pass on the GPU (rerun with KERNELFORGE_SYNC_EACH=1 to name the failing kernel)";

/// Device pointers of one layer's parameters.
#[derive(Clone, Copy)]
struct LayerPtrs {
    ln1_w: u64,
    ln1_b: u64,
    qkv_w: u64,
    qkv_b: u64,
    attn_proj_w: u64,
    attn_proj_b: u64,
    ln2_w: u64,
    ln2_b: u64,
    fc_w: u64,
    fc_b: u64,
    fc_proj_w: u64,
    fc_proj_b: u64,
}

/// GPT-2 on one CUDA GPU. See the module docs.
pub struct GpuBackend {
    model: Arc<GPT2Model>,
    name: String,
    unfused: bool,
    gpu: Gpu,
    registry: Registry,
    /// Why decode is unavailable (the decode ops are missing from the catalog), if it is.
    decode_missing: Option<String>,
    /// Keeps the uploaded parameters alive (the pointers below address them).
    _weights: Vec<CudaSlice<u8>>,
    wte: u64,
    wpe: u64,
    lnf_w: u64,
    lnf_b: u64,
    layers: Vec<LayerPtrs>,
    act: Activations,
    /// Per layer: (K cache, V cache), each `[kv_batch, NH, n_ctx, HS]`.
    kv: Vec<(DeviceTensor, DeviceTensor)>,
    kv_batch: usize,
    workspace: Option<CudaSlice<f32>>,
    /// Sequences in the current batch and tokens cached per sequence.
    batch: usize,
    len: usize,
    selected: HashMap<String, Kernel>,
    /// Kernel sets by (batch, tokens, decode, last only, selection batch).
    sets: HashMap<(usize, usize, bool, bool, usize), Arc<Kernels>>,
    /// Choose kernels as for a batch of this many sequences (a replica running a slice of a
    /// larger batch: see [`GpuBackend::set_selection_batch`]).
    selection_batch: Option<usize>,
    /// (whole batch, this batch) while a kernel set is being selected; (1, 1) otherwise.
    selection_scale: (usize, usize),
    profiler: Option<Profiler>,
    sync_each: bool,
    /// Steps launch each kernel while the one before still runs where the kernel waits for it,
    /// in CUDA graphs and on the stream (`exec::PROGRAMMATIC_LAUNCH_ENV` turns it off).
    programmatic_launch: bool,
    launch_mode: LaunchMode,
    /// The dtype asked for: f32; tf32 (f32 storage, the compute-bound matmuls and the prefill's
    /// attention on tensor cores, see [`crate::tune::workloads::kernel_dtype`]); or f16 / bf16
    /// (weights, activations and KV cache stored in it, f32 math inside).
    dtype: Dtype,
    /// How decode steps run (see [`DecodeEngine`]).
    engine: DecodeEngine,
    /// Whether megakernel steps stamp their tasks (see [`GpuBackend::set_timeline`]).
    timeline_on: bool,
    /// The stamps of the last megakernel step, when `timeline_on`.
    timeline: Option<Timeline>,
    /// The megakernel engine's table and buffers for the current batch size.
    megakernel: Option<megakernel::MegakernelState>,
    /// A point of the megakernel family to run instead of the selected one (tuning).
    megakernel_point: Vec<(String, i64)>,
    /// Kernels to run instead of the tuned winners, by tuning-database key: (family, every
    /// parameter of the point) (choosing a decode step's kernels by whole steps, `decode_tune.rs`).
    step_points: HashMap<String, (String, Vec<(String, i64)>)>,
    /// Each layer's fc projection weight transposed, for the megakernel's fused MLP stages
    /// (uploaded when a stage table first fuses them).
    mlp_weights: Vec<CudaSlice<u8>>,
    /// When the prefill folds layernorms into the matmuls after them (`fold_select.rs`).
    ln_folding: LayernormFolding,
    /// The folded weights and biases uploaded so far (`fold.rs`), prefill only.
    folded: fold::FoldedWeights,
    /// The recorded decode-step graphs (see [`exec::GraphStep`]).
    decode_graphs: HashMap<exec::GraphKey, KernelGraph>,
    /// How many times a decode-step graph was recorded (see [`GpuBackend::graphs_recorded`]).
    graphs_recorded: usize,
    /// The step (and buffers generation) the graph of its key is set up for.
    prepared: Option<(exec::GraphStep, u64)>,
    /// Bumped whenever a buffer the kernels address is reallocated.
    buffers_generation: u64,
    /// Logits bytes (in the storage type) copied back by a prefill.
    host_logits: Vec<u8>,
    /// Page-locked staging for the few logits rows of a decode step: a copy into pageable
    /// memory goes through a driver bounce buffer at a fraction of the speed.
    pinned_logits: Option<PinnedHostSlice<u8>>,
    /// CUDA events around the last decode step's kernels, and the GPU time of the steps so far.
    step_events: Option<(CudaEvent, CudaEvent)>,
    /// CUDA events around the last prefill's upload and kernels.
    prefill_events: Option<(CudaEvent, CudaEvent)>,
    /// The step launched ahead of the caller (see `run_ahead.rs`); `len` counts it. And the ids
    /// the last step choosing on the device returned (a caller feeding them back is chaining).
    ahead: Option<run_ahead::LaunchedStep>,
    returned: Vec<u32>,
    /// The slot of `act.next_ids` the decode step being launched writes its chosen ids to (the
    /// step before wrote the other: see `buffers::DrawnIds`).
    draw_slot: usize,
    decode_gpu_ms: (f64, usize),
    /// [`GpuBackend::megakernel_most_rows`], once asked.
    megakernel_rows_held: std::sync::OnceLock<usize>,
    notes: Vec<String>,
    /// What this GPU's tuning database is keyed by (its default file is named after it).
    db_header: DbHeader,
}

fn shape(pairs: &[(&str, i64)]) -> Shape {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn with(base: &Shape, overrides: &[(&str, i64)]) -> Shape {
    let mut s = base.clone();
    for (k, v) in overrides {
        s.insert(k.to_string(), *v);
    }
    s
}

fn ptr<T>(gpu: &Gpu, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(&gpu.stream).0
}

fn i32_arg(v: usize, what: &str) -> AnyResult<ArgValue> {
    i32::try_from(v)
        .map(ArgValue::I32)
        .map_err(|_| anyhow!("{what} = {v} does not fit a 32-bit kernel argument"))
}

impl GpuBackend {
    /// The model it runs.
    pub fn model(&self) -> &GPT2Model {
        &self.model
    }

    /// The GPU it runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether this is the unfused baseline.
    pub fn unfused(&self) -> bool {
        self.unfused
    }

    /// (tuned, total) over every kernel selected so far: tuned means the tuning database
    /// chose it (for this exact shape or the nearest tuned row count).
    pub fn tuned_kernels(&self) -> (usize, usize) {
        let tuned = self.selected.values().filter(|k| k.choice != Choice::Default).count();
        (tuned, self.selected.len())
    }

    /// Every kernel selected so far: (role, kernel label, where it came from, shape).
    pub fn kernel_choices(&self) -> Vec<(String, String, Choice, String)> {
        let mut v: Vec<_> = self
            .selected
            .values()
            .map(|k| (k.role.to_string(), k.label.clone(), k.choice, shape_text(&k.shape)))
            .collect();
        v.sort_by(|a, b| (&a.0, &a.3).cmp(&(&b.0, &b.3)));
        v
    }

    /// Messages worth showing once (tuning database warnings, ignored tuned entries, ...).
    pub fn notes(&self) -> Vec<String> {
        self.notes.iter().chain(&self.registry.notes).cloned().collect()
    }

    /// Why decode steps are unavailable in this build, if they are.
    pub fn decode_unavailable(&self) -> Option<&str> {
        self.decode_missing.as_deref()
    }

    /// Choose how decode steps run (the default is [`DecodeEngine::Graph`]). Fails, and keeps
    /// the engine it had, when this build or GPU cannot run `engine`.
    pub fn set_decode_engine(&mut self, engine: DecodeEngine) -> AnyResult<()> {
        if engine == DecodeEngine::Megakernel {
            if self.unfused {
                bail!("--decode-engine megakernel runs the fused decode plan; drop --unfused or use --decode-engine graph");
            }
            let dtype = op_dtype(self.dtype);
            if !self.registry.catalog.has_dtype(megakernel::DECODE_STEP_OP, dtype) {
                bail!(
                    "--decode-engine megakernel: no kernel family of the `{}` op lists {dtype} (specs/decode_megakernel.toml); \
                     use --decode-engine graph",
                    megakernel::DECODE_STEP_OP
                );
            }
        }
        if engine != self.engine {
            self.discard_ahead();
        }
        self.engine = engine;
        if engine != DecodeEngine::Graph {
            self.decode_graphs.clear();
            self.prepared = None;
        }
        Ok(())
    }

    /// Choose kernels as one GPU would for a batch of `whole` sequences, whatever slice of it
    /// this backend runs (`None`: for the batch it runs). Replicas that each run a slice of a
    /// batch set it to the whole batch, so every sequence goes through the same kernels as on
    /// one GPU and comes out bit-identical. A kernel that cannot run the slice is replaced by
    /// the slice's own choice.
    pub fn set_selection_batch(&mut self, whole: Option<usize>) {
        self.selection_batch = whole;
    }

    /// The engine decode steps were asked to run on.
    pub fn decode_engine(&self) -> DecodeEngine {
        self.engine
    }

    /// The engine decode steps of `b` sequences run on: the one asked for, except that a batch
    /// no point of the megakernel holds (`max_rows` in specs/decode_megakernel.toml) hands off
    /// to the graph engine ([`GpuBackend::prepare`] says so in a note).
    pub fn engine_for(&self, b: usize) -> DecodeEngine {
        if self.engine == DecodeEngine::Megakernel && b > self.megakernel_most_rows() {
            DecodeEngine::Graph
        } else {
            self.engine
        }
    }

    /// [`GpuBackend::engine_for`] the batch decoding now.
    pub(super) fn step_engine(&self) -> DecodeEngine {
        self.engine_for(self.batch)
    }

    /// Whether the next decode step runs as a CUDA graph (the graph engine, unless profiling or
    /// `KERNELFORGE_SYNC_EACH` needs launches one by one).
    pub fn decode_graphs(&self) -> bool {
        self.step_engine() == DecodeEngine::Graph && self.profiler.is_none() && !self.sync_each
    }

    /// How many decode-step graphs this backend has recorded: once per batch size, and again
    /// only when a step's launches no longer fit its graph (another number of kernels, a
    /// reselection the driver cannot switch a node to). A cache growing into the next length
    /// bucket switches the attention nodes in place.
    pub fn graphs_recorded(&self) -> usize {
        self.graphs_recorded
    }

    /// Megakernel only: stamp every task of each decode step (start, inputs ready, end) so that
    /// [`GpuBackend::take_timeline`] can return the last step's blocks × time picture.
    pub fn set_timeline(&mut self, on: bool) {
        self.discard_ahead(); // a step launched ahead would not be stamped
        self.timeline_on = on;
    }

    /// The stamps of the last megakernel decode step with the timeline on; clears them.
    pub fn take_timeline(&mut self) -> Option<Timeline> {
        self.timeline.take()
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn config(&self) -> &GPT2Config {
        &self.model.config
    }

    fn prefill(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        match self.prefill_impl(tokens, HeadRows::All) {
            Ok(l) => Ok(l.expect("prefill reads the logits back")),
            Err(e) => Err(self.model_error(e)),
        }
    }

    fn prefill_last(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        match self.prefill_impl(tokens, HeadRows::Last) {
            Ok(l) => Ok(l.expect("prefill reads the logits back")),
            Err(e) => Err(self.model_error(e)),
        }
    }

    fn decode(&mut self, last: &[u32]) -> Result<Logits> {
        self.decode_impl(last).map_err(|e| self.model_error(e))
    }

    fn decode_argmax(&mut self, last: &[u32]) -> Result<Vec<u32>> {
        self.decode_draw_impl(last, &Draw::greedy())
            .map_err(|e| self.model_error(e))
    }

    fn prepare(&mut self, batch: usize, prompt_len: usize) -> Result<()> {
        self.prepare_impl(batch, prompt_len).map_err(|e| self.model_error(e))
    }

    fn decode_draw(&mut self, last: &[u32], draw: &Draw, position: usize) -> Result<Vec<u32>> {
        // `len` counts a step launched ahead (run_ahead.rs): the caller has not seen it yet.
        let cached = self.len - usize::from(self.ahead.is_some());
        if position != cached + 1 {
            return Err(ModelError::Batch(format!(
                "a decode step after {cached} cached tokens draws the token at position {}, not {position}",
                cached + 1
            )));
        }
        self.decode_draw_impl(last, draw).map_err(|e| self.model_error(e))
    }

    fn decode_engine(&self) -> Option<DecodeEngine> {
        Some(self.step_engine())
    }

    fn prefill_gpu_ms(&mut self) -> Result<Option<f64>> {
        self.take_prefill_gpu_ms().map_err(|e| self.model_error(e))
    }

    fn stats_note(&self) -> Option<String> {
        let (tuned, total) = self.tuned_kernels();
        let mut note = format!("{tuned}/{total} kernels tuned");
        for n in &self.registry.notes {
            note += &format!("; note: {n}");
        }
        Some(note)
    }
}
