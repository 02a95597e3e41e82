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
//! or attention_decode (one query against the cache) → matmul[bias_residual] → layernorm →
//! matmul[bias_gelu] → matmul[bias_residual]`; then the final layernorm and the LM head
//! (`matmul[none]` against `wte`). The residual stream ping-pongs between two buffers, so a
//! matmul never writes the buffer it reads its residual from.
//!
//! Unfused (`--unfused`, the seeds' baseline): matmuls with the `bias` epilogue followed by the
//! standalone `gelu` and `residual` kernels, and the three-pass `attention_naive` family for
//! prefill attention (decode keeps `attention_decode`: there is no unfused decode kernel).
//!
//! A step is built as a plan (`plan.rs`: ordered op nodes over these buffers) and run by one of
//! three executors ([`DecodeEngine`]): kernel by kernel or as a CUDA graph (`exec.rs`: the first
//! step of a batch size records its launches as a [`KernelGraph`]; later steps rewrite only the
//! nodes whose arguments changed and replay it with one launch), or lowered to one persistent
//! kernel (`megakernel.rs`). Profiling and `KERNELFORGE_SYNC_EACH` launch kernel by kernel
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

use anyhow::{anyhow, bail, Context, Result as AnyResult};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};

use super::config::GPT2Config;
use super::engine::{DecodeEngine, Timeline};
use super::error::{ModelError, Result};
use super::generate::{Backend, Logits};
use super::weights::GPT2Model;
use crate::gpu::{ArgValue, Gpu, GpuError, KernelGraph};
use crate::ops::Shape;
use crate::spec::{shape_text, Dtype};
use crate::tune::db::DbHeader;
use crate::tune::registry::{Choice, Registry};
use crate::tune::workloads::op_dtype;

mod buffers;
mod decode_tune;
mod exec;
mod megakernel;
mod megakernel_point;
mod open;
mod plan;
mod profile;
mod run_ahead;
mod select;
mod stage_table;

pub use buffers::ReplicaMemory;
use buffers::{Activations, DeviceTensor};
use exec::{record_event, LaunchMode};
pub use megakernel_point::{fitted_default, most_rows, point_text, MegakernelSummary, MEGAKERNEL_FAMILY};
use plan::{HeadRows, Plan};
pub use profile::ProfileRow;
use profile::Profiler;
use select::{Kernel, Kernels};

/// The op (and kernel family) of the decode attention: one query per sequence against the cache.
pub const ATTENTION_DECODE_OP: &str = "attention_decode";
/// The op (and kernel family) that copies new K and V rows into the cache.
pub const KV_APPEND_OP: &str = "kv_append";
/// The op (and kernel family) that picks greedy tokens on the device.
pub const ARGMAX_OP: &str = "argmax";
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
    /// Each layer's fc projection weight transposed, for the megakernel's fused MLP stages
    /// (uploaded when a stage table first fuses them).
    mlp_weights: Vec<CudaSlice<u8>>,
    /// The recorded decode-step graph of each batch size.
    decode_graphs: HashMap<usize, KernelGraph>,
    /// (batch, position, buffers generation) the graph of that batch size is set up for.
    prepared: Option<(usize, usize, u64)>,
    /// Bumped whenever a buffer the kernels address is reallocated.
    buffers_generation: u64,
    /// Logits bytes (in the storage type) copied back by a prefill.
    host_logits: Vec<u8>,
    /// Page-locked staging for the few logits rows of a decode step: a copy into pageable
    /// memory goes through a driver bounce buffer at a fraction of the speed.
    pinned_logits: Option<PinnedHostSlice<u8>>,
    /// CUDA events around the last decode step's kernels, and the GPU time of the steps so far.
    step_events: Option<(CudaEvent, CudaEvent)>,
    /// The greedy step launched ahead of the caller (see `run_ahead.rs`); `len` counts it. And
    /// the ids the last greedy step returned (a caller feeding them back is chaining steps).
    ahead: Option<run_ahead::LaunchedStep>,
    returned: Vec<u32>,
    /// Page-locked landing places of greedy steps' ids (two: one step's ids can still be on
    /// their way while the next step's are copied), and the one the next step uses.
    pinned_ids: Vec<PinnedHostSlice<i32>>,
    next_pinned: usize,
    decode_gpu_ms: (f64, usize),
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

    /// Whether the next decode step runs as a CUDA graph (the graph engine, unless profiling or
    /// `KERNELFORGE_SYNC_EACH` needs launches one by one).
    pub fn decode_graphs(&self) -> bool {
        self.engine == DecodeEngine::Graph && self.profiler.is_none() && !self.sync_each
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

    fn upload_ids(&mut self, tokens: &[Vec<u32>]) -> AnyResult<()> {
        let v = self.model.config.vocab_size;
        let mut ids = Vec::with_capacity(tokens.len() * tokens[0].len());
        for s in tokens {
            for (i, &tok) in s.iter().enumerate() {
                if tok as usize >= v {
                    return Err(ModelError::InvalidToken {
                        token: tok,
                        position: self.len + i,
                        vocab_size: v,
                    }
                    .into());
                }
                ids.push(tok as i32);
            }
        }
        let mut dst = self.act.ids.slice_mut(0..ids.len());
        self.gpu
            .stream
            .memcpy_htod(&ids, &mut dst)
            .map_err(GpuError::cuda(format!("uploading {} token ids", ids.len())))?;
        Ok(())
    }

    /// Copy `rows` logits rows back, keeping the real vocabulary, and finish the call.
    fn read_logits(&mut self, b: usize, seq: usize, rows: usize) -> AnyResult<Logits> {
        let cfg = &self.model.config;
        let (v, vp) = (cfg.vocab_size, cfg.padded_vocab_size);
        let e = self.dtype.storage().bytes();
        let n = rows * vp * e; // bytes
        let src = self.act.logits.bytes.slice(0..n);
        let copy_err = || GpuError::cuda(format!("copying {rows} x {vp} logits back"));
        // A decode step's few rows go through pinned memory; a prefill's many rows (up to GBs)
        // through an ordinary buffer.
        let pinned = rows <= PINNED_LOGITS_ROWS.max(self.kv_batch);
        if pinned && self.pinned_logits.as_ref().is_none_or(|p| p.len() < n) {
            let len = PINNED_LOGITS_ROWS.max(self.kv_batch) * vp * e;
            // SAFETY: the buffer is only read after a device copy has filled the part read.
            // Flags 0: cached host memory (write-combined memory is slow for the CPU to read).
            self.pinned_logits = Some(
                unsafe { self.gpu.ctx.alloc_pinned_with_flags::<u8>(len, 0) }
                    .map_err(GpuError::cuda(format!("allocating {len} bytes of pinned host memory")))?,
            );
        }
        let host: &[u8] = match (pinned, self.pinned_logits.as_mut()) {
            (true, Some(p)) => {
                self.gpu.stream.memcpy_dtoh(&src, p).map_err(copy_err())?;
                self.gpu.synchronize().context(SYNC_HINT)?;
                p.as_slice().map_err(copy_err())?
            }
            _ => {
                if self.host_logits.len() < n {
                    self.host_logits.resize(n, 0);
                }
                self.gpu
                    .stream
                    .memcpy_dtoh(&src, &mut self.host_logits[..n])
                    .map_err(copy_err())?;
                self.gpu.synchronize().context(SYNC_HINT)?;
                &self.host_logits
            }
        };
        let mut data = Vec::with_capacity(rows * v);
        for r in 0..rows {
            data.extend(self.dtype.storage().decode(&host[r * vp * e..(r * vp + v) * e]));
        }
        self.finish_step_timing()?;
        self.flush_profile()?;
        Ok(Logits::new(b, seq, v, data)?)
    }

    /// Adds the finished decode step's GPU time (its events) to the total.
    fn finish_step_timing(&mut self) -> AnyResult<()> {
        if let Some((start, end)) = self.step_events.take() {
            let ms = start
                .elapsed_ms(&end)
                .map_err(GpuError::cuda("reading the decode step events"))?;
            self.decode_gpu_ms.0 += ms as f64;
            self.decode_gpu_ms.1 += 1;
        }
        self.read_timeline()
    }

    /// (total GPU ms, steps) of the decode steps since the last call: the time from the first
    /// kernel of a step to its last, without the host's share (copies, sampling); clears it.
    pub fn take_decode_gpu_time(&mut self) -> (f64, usize) {
        std::mem::take(&mut self.decode_gpu_ms)
    }

    fn prefill_impl(&mut self, tokens: &[Vec<u32>], head: HeadRows) -> AnyResult<Option<Logits>> {
        self.discard_ahead();
        self.returned.clear();
        let cfg = self.model.config.clone();
        let b = tokens.len();
        if b == 0 {
            return Err(ModelError::Batch("no sequences given".into()).into());
        }
        let t = tokens[0].len();
        if t == 0 {
            return Err(ModelError::Batch("sequences must have at least one token".into()).into());
        }
        if let Some(i) = tokens.iter().position(|s| s.len() != t) {
            return Err(ModelError::Batch(format!(
                "sequence {i} has {} tokens but sequence 0 has {t}; a batch must be rectangular",
                tokens[i].len()
            ))
            .into());
        }
        if t > cfg.n_ctx {
            return Err(ModelError::ContextOverflow {
                needed: t,
                n_ctx: cfg.n_ctx,
            }
            .into());
        }
        self.batch = 0;
        self.len = 0;
        self.ensure_capacity(b, t)?;
        self.upload_ids(tokens)?;
        let ks = self.kernels(b, t, false, head == HeadRows::Last)?;
        let plan = self.build_plan(&ks, b, t, 0, false, head)?;
        self.execute(&plan)?;
        let rows = plan.head_rows;
        if ks.kv_append.is_some() {
            self.batch = b;
            self.len = t;
        }
        match head {
            HeadRows::AllOnDevice => {
                self.gpu.synchronize().context(SYNC_HINT)?;
                self.flush_profile()?;
                Ok(None)
            }
            HeadRows::Last => Ok(Some(self.read_logits(b, 1, rows)?)),
            HeadRows::All => Ok(Some(self.read_logits(b, t, rows)?)),
            HeadRows::Greedy => unreachable!("a prefill is not a greedy decode step"),
        }
    }

    /// One decode step up to the LM head (and, when `greedy`, the argmax kernel into
    /// `act.next_ids`), launched but not waited for. Returns the batch size. `last`: the tokens
    /// to feed; `None`: the previous greedy step's ids, still in `act.next_ids` (the megakernel
    /// engine only: see `run_ahead.rs`).
    fn decode_step(&mut self, last: Option<&[u32]>, greedy: bool) -> AnyResult<usize> {
        self.discard_ahead();
        if let Some(why) = &self.decode_missing {
            bail!("{why}");
        }
        let cfg = self.model.config.clone();
        if self.len == 0 {
            bail!("decode called before prefill");
        }
        let b = self.batch;
        if last.is_some_and(|last| last.len() != b) {
            let n = last.map_or(0, <[u32]>::len);
            return Err(ModelError::Batch(format!("decode got {n} tokens for a batch of {b} sequences")).into());
        }
        if self.len + 1 > cfg.n_ctx {
            return Err(ModelError::ContextOverflow {
                needed: self.len + 1,
                n_ctx: cfg.n_ctx,
            }
            .into());
        }
        match last {
            Some(last) => self.upload_ids(&last.iter().map(|&t| vec![t]).collect::<Vec<_>>())?,
            None if self.engine == DecodeEngine::Megakernel && greedy => {}
            None => bail!("a decode step from the previous step's ids runs on the megakernel engine only"),
        }
        let ks = self.kernels(b, 1, true, false)?;
        let pos = self.len;
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        let graphs = self.decode_graphs();
        if self.engine == DecodeEngine::Megakernel {
            record_event(&start, &self.gpu)?;
            self.megakernel_step(&ks, b, pos, last.is_none())?;
        } else if graphs {
            if self.prepared != Some((b, pos, self.buffers_generation)) {
                self.prepare_decode_graph(&ks, b, pos)?;
            }
            record_event(&start, &self.gpu)?;
            self.decode_graphs[&b].launch(&self.gpu.stream)?;
            if greedy {
                let argmax = Plan {
                    steps: vec![self.argmax_step(&ks, b)?],
                    head_rows: b,
                };
                self.execute(&argmax)?;
            }
        } else {
            record_event(&start, &self.gpu)?;
            let head = if greedy { HeadRows::Greedy } else { HeadRows::All };
            let plan = self.build_plan(&ks, b, 1, pos, true, head)?;
            self.execute(&plan)?;
        }
        record_event(&end, &self.gpu)?;
        self.step_events = Some((start, end));
        self.len += 1;
        if graphs {
            // While the GPU runs this step, set the graph up for the next one (only the
            // position and the cache length change): updates do not touch a launched graph.
            self.prepared = None;
            if pos + 1 < cfg.n_ctx {
                self.prepare_decode_graph(&ks, b, pos + 1)?;
            }
        }
        Ok(b)
    }

    fn decode_impl(&mut self, last: &[u32]) -> AnyResult<Logits> {
        let b = self.decode_step(Some(last), false)?;
        self.read_logits(b, 1, b)
    }

    /// A greedy decode step: the argmax token of each sequence, chosen on the device.
    fn decode_argmax_impl(&mut self, last: &[u32]) -> AnyResult<Vec<u32>> {
        let on_device =
            self.decode_missing.is_none() && self.kernels(self.batch.max(1), 1, true, false)?.argmax.is_some();
        if !on_device {
            let logits = self.decode_impl(last)?;
            return (0..last.len())
                .map(|b| crate::model::sampling::argmax(logits.last(b)).map_err(Into::into))
                .collect();
        }
        self.greedy_step_on_device(last)
    }

    /// A full forward pass (LM head on every position) that leaves the logits on the device:
    /// what `bench` times. Fills the KV cache like a prefill.
    pub fn forward_on_device(&mut self, tokens: &[Vec<u32>]) -> Result<()> {
        self.prefill_impl(tokens, HeadRows::AllOnDevice)
            .map(|_| ())
            .map_err(|e| self.model_error(e))
    }

    fn model_error(&self, e: anyhow::Error) -> ModelError {
        match e.downcast::<ModelError>() {
            Ok(m) => m,
            Err(e) => ModelError::Backend {
                backend: self.name.clone(),
                message: format!("{e:#}"),
            },
        }
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
        self.decode_argmax_impl(last).map_err(|e| self.model_error(e))
    }

    fn decode_engine(&self) -> Option<DecodeEngine> {
        Some(self.engine)
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
