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
//! Decode steps run as a CUDA graph: the first step of a batch size records its launches as a
//! [`KernelGraph`]; later steps walk the same launches again, rewrite only the nodes whose
//! arguments changed (the position, the cache length) and replay the graph with one launch.
//! Profiling, `KERNELFORGE_SYNC_EACH` and [`GpuBackend::set_decode_graphs`]`(false)` launch
//! kernel by kernel instead.
//!
//! Profiling (off by default): a CUDA event pair around every launch, aggregated per kernel.
//! Setting `KERNELFORGE_SYNC_EACH=1` synchronizes after every launch so a faulting kernel is
//! named in the error (slow; for debugging).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result as AnyResult};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};

use super::config::GPT2Config;
use super::engine::{DecodeEngine, Timeline};
use super::error::{ModelError, Result};
use super::generate::{Backend, Logits};
use super::weights::GPT2Model;
use crate::gpu::{ArgValue, Compiler, Gpu, GpuError, GraphUpdateError, KernelGraph, LoadedVariant};
use crate::ops::{self, Epilogue, Mask, Shape, Storage};
use crate::spec::{expand, shape_text, Catalog, Dtype, Launch, Points, Variant};
use crate::tune::db::{default_path, DbHeader, TuningDb};
use crate::tune::registry::{variant_kind, Choice, Registry};
use crate::tune::workloads::{matmul_dtype, op_dtype};

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

/// One selected, loaded kernel and where it is used.
#[derive(Clone)]
struct Kernel {
    /// Where in the model: `qkv`, `attn_proj`, `lm_head`, ...
    role: &'static str,
    /// `matmul[bias_gelu] matmul_regtile`.
    label: String,
    loaded: Arc<LoadedVariant>,
    choice: Choice,
    /// The completed shape it was selected for; launches override a few entries of it.
    shape: Shape,
    /// Launch geometry for `shape`, planned once.
    launches: Arc<Vec<Launch>>,
}

/// The kernels of one forward shape (a prefill of B×T or a decode step of B).
struct Kernels {
    encoder: Kernel,
    layernorm: Kernel,
    qkv: Kernel,
    kv_append: Option<Kernel>,
    attention: Kernel,
    attn_proj: Kernel,
    fc: Kernel,
    fc_proj: Kernel,
    /// Unfused only.
    gelu: Option<Kernel>,
    residual: Option<Kernel>,
    lm_head: Kernel,
    /// Decode steps only: greedy choice of the next tokens on the device.
    argmax: Option<Kernel>,
}

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

/// A device buffer of `len` elements of the model's storage type (f32, f16 or bf16).
struct DeviceTensor {
    bytes: CudaSlice<u8>,
    len: usize,
}

impl DeviceTensor {
    fn ptr(&self, gpu: &Gpu) -> u64 {
        ptr(gpu, &self.bytes)
    }
}

/// Activation buffers for up to `rows` tokens.
struct Activations {
    rows: usize,
    ids: CudaSlice<i32>,
    x: [DeviceTensor; 2],
    ln: DeviceTensor,
    qkv: DeviceTensor,
    att: DeviceTensor,
    fc: DeviceTensor,
    /// Pre-GELU fc output (unfused only; empty otherwise).
    fc_pre: DeviceTensor,
    /// The last position of each sequence, gathered for the LM head of `prefill_last`.
    last: DeviceTensor,
    logits: DeviceTensor,
    /// The argmax token of each sequence (greedy decode steps).
    next_ids: CudaSlice<i32>,
}

/// One row of the per-kernel profile.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileRow {
    pub role: String,
    pub kernel: String,
    pub calls: usize,
    pub total_ms: f64,
    pub avg_ms: f64,
    pub percent: f64,
}

#[derive(Default)]
struct Profiler {
    pending: Vec<(&'static str, String, CudaEvent, CudaEvent)>,
    totals: BTreeMap<(String, String), (usize, f64)>,
}

/// Where launches go.
enum LaunchMode {
    /// Straight to the stream.
    Direct,
    /// Appended to a graph being built (nothing runs until it is launched).
    Record(KernelGraph),
    /// Replayed into a recorded graph: launch `next` rewrites node `next` if it changed.
    /// `stale` is set when a launch does not match its node (the graph must be recorded again).
    Update {
        graph: KernelGraph,
        next: usize,
        stale: bool,
    },
}

/// What a prefill leaves behind.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HeadRows {
    /// LM head on every position, logits copied back.
    All,
    /// LM head on the last position of each sequence only, logits copied back.
    Last,
    /// LM head on every position, nothing copied back (benchmarks).
    AllOnDevice,
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
    sets: HashMap<(usize, usize, bool, bool), Arc<Kernels>>,
    profiler: Option<Profiler>,
    sync_each: bool,
    launch_mode: LaunchMode,
    /// The dtype asked for: f32; tf32 (f32 storage, the compute-bound matmuls on tensor cores,
    /// see [`matmul_dtype`]); or f16 / bf16 (weights, activations and KV cache stored in it,
    /// f32 math inside).
    dtype: Dtype,
    /// How decode steps run (see [`DecodeEngine`]).
    engine: DecodeEngine,
    /// Whether megakernel steps stamp their tasks (see [`GpuBackend::set_timeline`]).
    timeline_on: bool,
    /// The stamps of the last megakernel step, when `timeline_on`.
    timeline: Option<Timeline>,
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
    decode_gpu_ms: (f64, usize),
    notes: Vec<String>,
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

/// A zeroed device buffer of `n` elements of `storage`.
fn alloc(gpu: &Gpu, storage: Storage, n: usize, what: &str) -> AnyResult<DeviceTensor> {
    let bytes = n.max(1) * storage.bytes();
    let buffer = gpu.stream.alloc_zeros::<u8>(bytes).map_err(GpuError::cuda(format!(
        "allocating {what} ({n} elements, {:.1} MiB)",
        bytes as f64 / (1 << 20) as f64
    )))?;
    Ok(DeviceTensor { bytes: buffer, len: n })
}

fn i32_arg(v: usize, what: &str) -> AnyResult<ArgValue> {
    i32::try_from(v)
        .map(ArgValue::I32)
        .map_err(|_| anyhow!("{what} = {v} does not fit a 32-bit kernel argument"))
}

impl GpuBackend {
    /// Open GPU 0, load the kernel catalog from the project folder (see
    /// [`crate::cli::project_root`]), upload the weights and allocate every buffer for
    /// `max_batch` sequences of up to `n_ctx` tokens.
    pub fn new(model: Arc<GPT2Model>, max_batch: usize, unfused: bool, dtype: Dtype) -> AnyResult<GpuBackend> {
        let root = crate::cli::project_root(None)?;
        Self::with_root(&root, model, max_batch, unfused, dtype)
    }

    /// [`GpuBackend::new`] with specs/ and templates/ under `root`.
    pub fn with_root(
        root: &Path,
        model: Arc<GPT2Model>,
        max_batch: usize,
        unfused: bool,
        dtype: Dtype,
    ) -> AnyResult<GpuBackend> {
        let cfg = model.config.clone();
        let max_batch = max_batch.max(1);
        let storage = dtype.storage();
        if unfused && storage != Storage::F32 {
            bail!("--unfused is the f32 baseline of the seeds; it has no {dtype} kernels (drop --unfused or use --dtype f32)");
        }
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates"))
            .with_context(|| format!("loading the kernel specs under {}", root.display()))?;
        // Every op must have a family in the dtype it runs in: the forward pass's ops now (before
        // touching the GPU), the decode ops when a decode step comes.
        let lacking = |op_list: &[&str]| -> Vec<String> {
            op_list
                .iter()
                .filter_map(|&op| {
                    let want = if op == "matmul" { dtype } else { op_dtype(dtype) };
                    let found = ops::op_by_name(op).is_some() && catalog.has_dtype(op, want);
                    (!found).then(|| format!("{op} ({want})"))
                })
                .collect()
        };
        let forward_missing = lacking(&["encoder", "layernorm", "matmul", "attention"]);
        if !forward_missing.is_empty() {
            bail!(
                "--dtype {dtype}: no kernel family implements {}; a family lists the dtypes it \
                 supports in its spec (`dtypes = [...]` in specs/*.toml)",
                forward_missing.join(", ")
            );
        }
        let decode_missing = lacking(&[ATTENTION_DECODE_OP, KV_APPEND_OP]);
        let decode_missing = (!decode_missing.is_empty()).then(|| {
            format!(
                "GPU decode needs kernel families for {}, which this build does not have",
                decode_missing.join(" and ")
            )
        });
        let gpu = Gpu::new(0).context("the GPU backend needs a CUDA GPU (pass --device cpu to run on the CPU)")?;
        let compiler = Compiler::new(&gpu.info.arch()).context("setting up NVRTC")?;
        let mut notes = Vec::new();
        let header = DbHeader::for_device(&gpu, &compiler);
        let db_path = default_path(&header);
        let db = if db_path.exists() {
            match TuningDb::open(&db_path, header) {
                Ok(db) => {
                    if let Some(w) = &db.warning {
                        notes.push(w.clone());
                    }
                    Some(db)
                }
                Err(e) => {
                    notes.push(format!("not using the tuning database: {e}"));
                    None
                }
            }
        } else {
            None
        };
        let registry = Registry::new(catalog, db, compiler)?;

        // Weights, once.
        let w = &model.weights;
        w.validate(&cfg)?;
        let mut weights = Vec::new();
        // Converted to the storage type once, here (f16/bf16 round to nearest even).
        let mut up = |data: &[f32], what: String| -> AnyResult<u64> {
            let s = gpu
                .stream
                .clone_htod(&storage.encode(data))
                .map_err(GpuError::cuda(format!("uploading {what} ({} elements)", data.len())))?;
            let p = ptr(&gpu, &s);
            weights.push(s);
            Ok(p)
        };
        let wte = up(&w.wte_padded(&cfg), "wte (padded)".into())?;
        let wpe = up(&w.wpe, "wpe".into())?;
        let lnf_w = up(&w.lnf_w, "lnf_w".into())?;
        let lnf_b = up(&w.lnf_b, "lnf_b".into())?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, l) in w.layers.iter().enumerate() {
            let mut u = |t: &[f32], name: &str| up(t, format!("h.{i}.{name}"));
            layers.push(LayerPtrs {
                ln1_w: u(&l.ln1_w, "ln1_w")?,
                ln1_b: u(&l.ln1_b, "ln1_b")?,
                qkv_w: u(&l.qkv_w, "qkv_w")?,
                qkv_b: u(&l.qkv_b, "qkv_b")?,
                attn_proj_w: u(&l.attn_proj_w, "attn_proj_w")?,
                attn_proj_b: u(&l.attn_proj_b, "attn_proj_b")?,
                ln2_w: u(&l.ln2_w, "ln2_w")?,
                ln2_b: u(&l.ln2_b, "ln2_b")?,
                fc_w: u(&l.fc_w, "fc_w")?,
                fc_b: u(&l.fc_b, "fc_b")?,
                fc_proj_w: u(&l.fc_proj_w, "fc_proj_w")?,
                fc_proj_b: u(&l.fc_proj_b, "fc_proj_b")?,
            });
        }
        let act = Self::alloc_activations(&gpu, storage, &cfg, max_batch * cfg.n_ctx, max_batch, unfused)?;
        let kv = Self::alloc_kv(&gpu, storage, &cfg, max_batch)?;
        gpu.synchronize()?;
        let sync_each = std::env::var_os("KERNELFORGE_SYNC_EACH").is_some_and(|v| v != "0" && !v.is_empty());
        Ok(GpuBackend {
            model,
            name: format!(
                "cuda:0{}{}",
                if unfused { " unfused" } else { "" },
                if dtype == Dtype::F32 {
                    String::new()
                } else {
                    format!(" {dtype}")
                }
            ),
            unfused,
            gpu,
            registry,
            decode_missing,
            _weights: weights,
            wte,
            wpe,
            lnf_w,
            lnf_b,
            layers,
            act,
            kv,
            kv_batch: max_batch,
            workspace: None,
            batch: 0,
            len: 0,
            selected: HashMap::new(),
            sets: HashMap::new(),
            profiler: None,
            sync_each,
            launch_mode: LaunchMode::Direct,
            dtype,
            engine: DecodeEngine::Graph,
            timeline_on: false,
            timeline: None,
            decode_graphs: HashMap::new(),
            prepared: None,
            buffers_generation: 0,
            host_logits: Vec::new(),
            pinned_logits: None,
            step_events: None,
            decode_gpu_ms: (0.0, 0),
            notes,
        })
    }

    fn alloc_activations(
        gpu: &Gpu,
        storage: Storage,
        cfg: &GPT2Config,
        rows: usize,
        max_batch: usize,
        unfused: bool,
    ) -> AnyResult<Activations> {
        let c = cfg.n_embd;
        Ok(Activations {
            rows,
            ids: gpu
                .stream
                .alloc_zeros::<i32>(rows.max(1))
                .map_err(GpuError::cuda(format!("allocating the token ids ({rows})")))?,
            x: [
                alloc(gpu, storage, rows * c, "residual A")?,
                alloc(gpu, storage, rows * c, "residual B")?,
            ],
            ln: alloc(gpu, storage, rows * c, "layernorm out")?,
            qkv: alloc(gpu, storage, rows * 3 * c, "qkv")?,
            att: alloc(gpu, storage, rows * c, "attention out")?,
            fc: alloc(gpu, storage, rows * 4 * c, "fc")?,
            fc_pre: alloc(gpu, storage, if unfused { rows * 4 * c } else { 0 }, "fc (pre-GELU)")?,
            last: alloc(gpu, storage, max_batch.max(rows / cfg.n_ctx) * c, "last rows")?,
            logits: alloc(gpu, storage, rows * cfg.padded_vocab_size, "logits")?,
            next_ids: gpu
                .stream
                .alloc_zeros::<i32>(max_batch.max(rows / cfg.n_ctx).max(1))
                .map_err(GpuError::cuda("allocating the next-token ids"))?,
        })
    }

    fn alloc_kv(
        gpu: &Gpu,
        storage: Storage,
        cfg: &GPT2Config,
        batch: usize,
    ) -> AnyResult<Vec<(DeviceTensor, DeviceTensor)>> {
        let n = batch * cfg.n_ctx * cfg.n_embd; // [B, NH, n_ctx, HS]
        (0..cfg.n_layer)
            .map(|l| {
                Ok((
                    alloc(gpu, storage, n, &format!("K cache of layer {l}"))?,
                    alloc(gpu, storage, n, &format!("V cache of layer {l}"))?,
                ))
            })
            .collect()
    }

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
            bail!("the megakernel decode engine is not available in this build; use --decode-engine graph");
        }
        self.engine = engine;
        if engine != DecodeEngine::Graph {
            self.decode_graphs.clear();
            self.prepared = None;
        }
        Ok(())
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
        self.timeline_on = on;
        self.timeline = None;
    }

    /// The stamps of the last megakernel decode step with the timeline on; clears them.
    pub fn take_timeline(&mut self) -> Option<Timeline> {
        self.timeline.take()
    }

    /// Turn per-kernel timing on (clearing what was recorded) or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.profiler = on.then(Profiler::default);
    }

    /// The per-kernel profile recorded since profiling was turned on (or since the last
    /// call), largest total first; clears it.
    pub fn take_profile(&mut self) -> AnyResult<Vec<ProfileRow>> {
        self.flush_profile()?;
        let Some(p) = &mut self.profiler else {
            return Ok(Vec::new());
        };
        let totals = std::mem::take(&mut p.totals);
        let sum: f64 = totals.values().map(|(_, ms)| ms).sum();
        let mut rows: Vec<ProfileRow> = totals
            .into_iter()
            .map(|((role, kernel), (calls, total_ms))| ProfileRow {
                role,
                kernel,
                calls,
                total_ms,
                avg_ms: total_ms / calls.max(1) as f64,
                percent: if sum > 0.0 { 100.0 * total_ms / sum } else { 0.0 },
            })
            .collect();
        rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        Ok(rows)
    }

    fn flush_profile(&mut self) -> AnyResult<()> {
        let Some(p) = &mut self.profiler else {
            return Ok(());
        };
        for (role, label, start, end) in p.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(GpuError::cuda(format!("reading the timing events of {label}")))?;
            let e = p.totals.entry((role.to_string(), label)).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ms as f64;
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Kernel selection

    /// Select (tuned winner or default; or the default of `force_family`), load and remember
    /// the kernel for (op, epilogue, mask, shape), and make the workspace big enough for it.
    fn kernel(
        &mut self,
        role: &'static str,
        op: &str,
        epilogue: Epilogue,
        mask: Mask,
        mut shape: Shape,
        force_family: Option<&str>,
    ) -> AnyResult<Kernel> {
        let contract = ops::op_by_name(op).ok_or_else(|| anyhow!("op `{op}` does not exist in this build"))?;
        contract
            .complete_shape(&mut shape, epilogue, mask)
            .with_context(|| format!("{role}: shape {}", shape_text(&shape)))?;
        let dtype = match (op, shape.get("M")) {
            ("matmul", Some(&rows)) => matmul_dtype(rows, self.dtype),
            _ => op_dtype(self.dtype),
        };
        let key = format!(
            "{role}|{op}|{dtype}|{}|{}|{}|{}",
            epilogue.as_str(),
            mask.as_str(),
            force_family.unwrap_or(""),
            shape_text(&shape)
        );
        if let Some(k) = self.selected.get(&key) {
            return Ok(k.clone());
        }
        let limits = self.gpu.info.limits;
        let (mut variant, choice) = match force_family {
            Some(name) => {
                let family = self.registry.catalog.family(name)?.clone();
                (default_variant(&family, epilogue, mask, &limits)?, Choice::Default)
            }
            None => {
                let s = self
                    .registry
                    .select(op, dtype, epilogue, mask, &shape, &limits)
                    .with_context(|| format!("choosing the {role} kernel"))?;
                (s.variant, s.choice)
            }
        };
        if !variant.constants()?.is_empty() {
            // __constant__ parameters are per module, but every layer has its own gamma/beta:
            // take the family default instead (which reads them through pointers).
            let fallback = default_variant(&variant.family, epilogue, mask, &limits)?;
            if !fallback.constants()?.is_empty() {
                bail!(
                    "{role}: {} reads its parameters from __constant__ memory, which the model \
                     cannot refill per layer; give the family a default without constants",
                    variant.family.name
                );
            }
            self.notes.push(format!(
                "{role}: using the {} default instead of the tuned point ({}): __constant__ \
                 parameters cannot differ per layer",
                variant.family.name,
                variant.key()
            ));
            variant = fallback;
        }
        variant.check_shape(&shape, &limits).map_err(|why| {
            anyhow!(
                "{role}: {} cannot run {}: {why}",
                variant.family.name,
                shape_text(&shape)
            )
        })?;
        let ws = variant.workspace_elems(&shape, &limits)?;
        self.ensure_workspace(ws)?;
        let loaded = self
            .registry
            .load(&self.gpu, &variant)
            .with_context(|| format!("compiling the {role} kernel {}", variant.kernel_name()))?;
        let launches = Arc::new(
            loaded
                .plan(&self.gpu, &shape)
                .with_context(|| format!("{role}: planning {} for {}", variant.family.name, shape_text(&shape)))?,
        );
        let kind = variant_kind(epilogue, mask);
        let label = if kind == "none" {
            format!("{op} {}", variant.family.name)
        } else {
            format!("{op}[{kind}] {}", variant.family.name)
        };
        let k = Kernel {
            role,
            label,
            loaded,
            choice,
            shape,
            launches,
        };
        self.selected.insert(key, k.clone());
        Ok(k)
    }

    fn ensure_workspace(&mut self, elems: usize) -> AnyResult<()> {
        if elems > 0 && self.workspace.as_ref().is_none_or(|w| w.len() < elems) {
            self.workspace = None; // free first
            let what = format!("allocating the kernel workspace ({elems} floats)");
            self.workspace = Some(
                self.gpu
                    .stream
                    .alloc_zeros::<f32>(elems)
                    .map_err(GpuError::cuda(what))?,
            );
            self.buffers_generation += 1;
        }
        Ok(())
    }

    /// The kernels of a prefill (`decode = false`, B sequences of T tokens) or of a decode step
    /// (`decode = true`, T = 1), selected once per shape.
    fn kernels(&mut self, b: usize, t: usize, decode: bool, last_only: bool) -> AnyResult<Arc<Kernels>> {
        let set_key = (b, t, decode, last_only);
        if let Some(k) = self.sets.get(&set_key) {
            return Ok(k.clone());
        }
        let cfg = self.model.config.clone();
        let (bi, ti) = (b as i64, t as i64);
        let (c, nh, hs) = (cfg.n_embd as i64, cfg.n_head as i64, cfg.head_dim() as i64);
        let (n_ctx, vp) = (cfg.n_ctx as i64, cfg.padded_vocab_size as i64);
        let m = bi * ti;
        let mm =
            |n: i64, k: i64, rows: i64, tt: i64| shape(&[("M", rows), ("N", n), ("K", k), ("T", tt), ("n_head", nh)]);
        let unfused = self.unfused;
        let (bias_res, bias_gelu) = if unfused {
            (Epilogue::Bias, Epilogue::Bias)
        } else {
            (Epilogue::BiasResidual, Epilogue::BiasGelu)
        };
        let encoder = self.kernel(
            "embedding",
            "encoder",
            Epilogue::None,
            Mask::None,
            shape(&[
                ("B", bi),
                ("T", ti),
                ("C", c),
                ("pos_offset", 0),
                ("V", cfg.vocab_size as i64),
                ("max_T", n_ctx),
            ]),
            None,
        )?;
        let layernorm = self.kernel(
            "layernorm",
            "layernorm",
            Epilogue::None,
            Mask::None,
            shape(&[("N", m), ("C", c)]),
            None,
        )?;
        let qkv = self.kernel("qkv", "matmul", Epilogue::Qkv, Mask::None, mm(3 * c, c, m, ti), None)?;
        let kv_append = if self.decode_missing.is_none() {
            Some(self.kernel(
                "kv_append",
                KV_APPEND_OP,
                Epilogue::None,
                Mask::None,
                shape(&[
                    ("B", bi),
                    ("NH", nh),
                    ("T", ti),
                    ("HS", hs),
                    ("max_T", n_ctx),
                    ("pos", 0),
                ]),
                None,
            )?)
        } else {
            None
        };
        let attention = if decode {
            if let Some(why) = &self.decode_missing {
                bail!("{why}");
            }
            // Selected once for the longest cache; launched with the current length.
            self.kernel(
                "attention",
                ATTENTION_DECODE_OP,
                Epilogue::None,
                Mask::None,
                shape(&[("B", bi), ("NH", nh), ("T", n_ctx), ("HS", hs), ("max_T", n_ctx)]),
                None,
            )?
        } else {
            self.kernel(
                "attention",
                "attention",
                Epilogue::None,
                Mask::Causal,
                shape(&[("B", bi), ("NH", nh), ("T", ti), ("HS", hs), ("window", 0)]),
                unfused.then_some(UNFUSED_ATTENTION_FAMILY),
            )?
        };
        let attn_proj = self.kernel("attn_proj", "matmul", bias_res, Mask::None, mm(c, c, m, ti), None)?;
        let fc = self.kernel("fc", "matmul", bias_gelu, Mask::None, mm(4 * c, c, m, ti), None)?;
        let fc_proj = self.kernel("fc_proj", "matmul", bias_res, Mask::None, mm(c, 4 * c, m, ti), None)?;
        let (gelu, residual) = if unfused {
            (
                Some(self.kernel(
                    "gelu",
                    "gelu",
                    Epilogue::None,
                    Mask::None,
                    shape(&[("N", m * 4 * c)]),
                    None,
                )?),
                Some(self.kernel(
                    "residual",
                    "residual",
                    Epilogue::None,
                    Mask::None,
                    shape(&[("N", m * c)]),
                    None,
                )?),
            )
        } else {
            (None, None)
        };
        let head_shape = if last_only && t > 1 {
            mm(vp, c, bi, 1)
        } else {
            mm(vp, c, m, ti)
        };
        let lm_head = self.kernel("lm_head", "matmul", Epilogue::None, Mask::None, head_shape, None)?;
        let argmax_available =
            ops::op_by_name(ARGMAX_OP).is_some() && self.registry.catalog.has_dtype(ARGMAX_OP, op_dtype(self.dtype));
        let argmax = if decode && argmax_available {
            let s = shape(&[("B", bi), ("V", cfg.vocab_size as i64), ("stride", vp)]);
            Some(self.kernel("argmax", ARGMAX_OP, Epilogue::None, Mask::None, s, None)?)
        } else {
            None
        };
        let set = Arc::new(Kernels {
            encoder,
            layernorm,
            qkv,
            kv_append,
            attention,
            attn_proj,
            fc,
            fc_proj,
            gelu,
            residual,
            lm_head,
            argmax,
        });
        self.sets.insert(set_key, set.clone());
        Ok(set)
    }

    // -----------------------------------------------------------------------------------------
    // Launching

    /// The workspace pointer for `k` launched on `launch_shape` (`None`: its selection shape,
    /// whose need was met when it was selected); 0 when nothing was ever needed.
    fn ws_ptr(&mut self, k: &Kernel, launch_shape: Option<&Shape>) -> AnyResult<u64> {
        if let Some(s) = launch_shape {
            let need = k.loaded.variant.workspace_elems(s, &self.gpu.info.limits)?;
            self.ensure_workspace(need)?;
        }
        Ok(self.workspace.as_ref().map_or(0, |w| ptr(&self.gpu, w)))
    }

    /// Launch geometry of `k` on `shape` (another position or cache length than it was
    /// selected for).
    fn plan(&self, k: &Kernel, shape: &Shape) -> AnyResult<Vec<Launch>> {
        k.loaded
            .plan(&self.gpu, shape)
            .with_context(|| format!("{} ({}): planning {}", k.role, k.label, shape_text(shape)))
    }

    /// Launch `k` with `args` on the shape it was selected for (geometry planned once).
    fn launch(&mut self, k: &Kernel, args: &[ArgValue]) -> AnyResult<()> {
        let launches = k.launches.clone();
        self.launch_with(k, &k.shape, &launches, args)
    }

    /// A CUDA event for timing (profiles, decode steps).
    fn timing_event(&self) -> AnyResult<CudaEvent> {
        Ok(self
            .gpu
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(GpuError::cuda("creating a timing event"))?)
    }

    /// Launch `k` with `args` and the geometry `launches` planned for `shape`.
    fn launch_with(&mut self, k: &Kernel, shape: &Shape, launches: &[Launch], args: &[ArgValue]) -> AnyResult<()> {
        let events = match &self.profiler {
            Some(_) => {
                let (start, end) = (self.timing_event()?, self.timing_event()?);
                record_event(&start, &self.gpu)?;
                Some((start, end))
            }
            None => None,
        };
        let what = || format!("{} ({}) on {}", k.role, k.label, shape_text(shape));
        match &mut self.launch_mode {
            LaunchMode::Direct => k.loaded.launch_args(&self.gpu, args, launches).with_context(what)?,
            LaunchMode::Record(graph) => {
                k.loaded.allow_shared_memory(launches).with_context(what)?;
                for (function, l) in k.loaded.functions().iter().zip(launches) {
                    graph.add(function, l, args).with_context(what)?;
                }
            }
            LaunchMode::Update { graph, next, stale } => {
                k.loaded.allow_shared_memory(launches).with_context(what)?;
                for (function, l) in k.loaded.functions().iter().zip(launches) {
                    if *stale {
                        break;
                    }
                    match graph.update(*next, function, l, args) {
                        Ok(_) => *next += 1,
                        Err(GraphUpdateError::Mismatch(_)) => *stale = true,
                        Err(GraphUpdateError::Gpu(e)) => return Err(anyhow::Error::new(e).context(what())),
                    }
                }
            }
        }
        if let (Some((start, end)), Some(p)) = (events, &mut self.profiler) {
            record_event(&end, &self.gpu)?;
            p.pending.push((k.role, k.label.clone(), start, end));
        }
        if self.sync_each {
            self.gpu
                .synchronize()
                .with_context(|| format!("{} ({}) on {} failed", k.role, k.label, shape_text(shape)))?;
        }
        Ok(())
    }

    fn matmul(&mut self, k: &Kernel, out: u64, inp: u64, weight: u64, bias: u64, residual: u64) -> AnyResult<()> {
        let ws = self.ws_ptr(k, None)?;
        let s = &k.shape;
        let args = [
            ArgValue::Ptr(out),
            ArgValue::Ptr(inp),
            ArgValue::Ptr(weight),
            ArgValue::Ptr(bias),
            ArgValue::Ptr(residual),
            ArgValue::Ptr(ws),
            i32_arg(s["M"] as usize, "M")?,
            i32_arg(s["N"] as usize, "N")?,
            i32_arg(s["K"] as usize, "K")?,
            i32_arg(s["T"] as usize, "T")?,
            i32_arg(s["n_head"] as usize, "n_head")?,
        ];
        self.launch(k, &args)
    }

    fn layernorm(&mut self, k: &Kernel, out: u64, inp: u64, gamma: u64, beta: u64) -> AnyResult<()> {
        let s = &k.shape;
        let args = [
            ArgValue::Ptr(out),
            ArgValue::Ptr(inp),
            ArgValue::Ptr(gamma),
            ArgValue::Ptr(beta),
            i32_arg(s["N"] as usize, "N")?,
            i32_arg(s["C"] as usize, "C")?,
        ];
        self.launch(k, &args)
    }

    /// Device-to-device copy of `elems` values of the storage type between raw pointers.
    fn copy_d2d(&self, dst: u64, src: u64, elems: usize) -> AnyResult<()> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(GpuError::cuda("binding the CUDA context"))?;
        let bytes = elems * self.dtype.storage().bytes();
        // SAFETY: both pointers address live buffers of this backend with room for `elems`
        // values (the caller computes them from the buffer shapes), on our stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.gpu.stream.cu_stream()) }
            .map_err(GpuError::cuda(format!("copying {elems} values on the device")))?;
        Ok(())
    }

    /// Grow the activations / KV cache for a batch of `b` sequences of `t` tokens.
    fn ensure_capacity(&mut self, b: usize, t: usize) -> AnyResult<()> {
        let cfg = self.model.config.clone();
        if b * t > self.act.rows || b > self.act.last.len / cfg.n_embd {
            let rows = (b * cfg.n_ctx).max(self.act.rows);
            let storage = self.dtype.storage();
            self.act = Self::alloc_activations(&self.gpu, storage, &cfg, 0, 1, false)?; // free the old ones first
            self.act = Self::alloc_activations(&self.gpu, storage, &cfg, rows, b, self.unfused)?;
            self.buffers_generation += 1;
        }
        if b > self.kv_batch {
            self.kv.clear();
            self.kv = Self::alloc_kv(&self.gpu, self.dtype.storage(), &cfg, b)?;
            self.kv_batch = b;
            self.buffers_generation += 1;
        }
        Ok(())
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

    /// Everything from the embedding to the LM head for B sequences of T new tokens at
    /// positions `pos..pos+T` (the cache holds `pos` tokens). Returns how many logits rows
    /// the LM head wrote.
    fn run(&mut self, ks: &Kernels, b: usize, t: usize, pos: usize, decode: bool, head: HeadRows) -> AnyResult<usize> {
        let cfg = self.model.config.clone();
        let (c, nh, hs, n_ctx) = (cfg.n_embd, cfg.n_head, cfg.head_dim(), cfg.n_ctx);
        let rows = b * t;
        let g = &self.gpu;
        let ids = ptr(g, &self.act.ids);
        let mut x = self.act.x[0].ptr(g);
        let mut y = self.act.x[1].ptr(g);
        let ln = self.act.ln.ptr(g);
        let qkv = self.act.qkv.ptr(g);
        let att = self.act.att.ptr(g);
        let fc = self.act.fc.ptr(g);
        let fc_pre = self.act.fc_pre.ptr(g);
        let last = self.act.last.ptr(g);
        let logits = self.act.logits.ptr(g);
        let kv: Vec<(u64, u64)> = self.kv.iter().map(|(k, v)| (k.ptr(g), v.ptr(g))).collect();
        let e = self.dtype.storage().bytes(); // bytes per element, for pointer offsets
        let (k_new, v_new) = (qkv + (rows * c * e) as u64, qkv + (2 * rows * c * e) as u64);
        let scale = 1.0 / (hs as f32).sqrt();

        // Embedding.
        let enc_shape = with(&ks.encoder.shape, &[("pos_offset", pos as i64)]);
        let enc_launches = self.plan(&ks.encoder, &enc_shape)?;
        let args = [
            ArgValue::Ptr(x),
            ArgValue::Ptr(ids),
            ArgValue::Ptr(self.wte),
            ArgValue::Ptr(self.wpe),
            i32_arg(b, "B")?,
            i32_arg(t, "T")?,
            i32_arg(c, "C")?,
            i32_arg(pos, "pos_offset")?,
        ];
        self.launch_with(&ks.encoder, &enc_shape, &enc_launches, &args)?;

        // Shapes that differ from the selection ones (position, cache length): planned once per
        // call, the same for every layer.
        let kv_plan = match &ks.kv_append {
            Some(k) => {
                let s = with(&k.shape, &[("pos", pos as i64)]);
                let l = self.plan(k, &s)?;
                Some((s, l))
            }
            None => None,
        };
        let (att_shape, att_launches, att_ws) = if decode {
            let k = &ks.attention;
            let s = with(&k.shape, &[("T", (pos + t) as i64)]);
            let l = self.plan(k, &s)?;
            let ws = self.ws_ptr(k, Some(&s))?;
            (s, l, ws)
        } else {
            let ws = self.ws_ptr(&ks.attention, None)?;
            (ks.attention.shape.clone(), ks.attention.launches.to_vec(), ws)
        };
        for (l, &(kc, vc)) in kv.iter().enumerate() {
            let lw = self.layers[l];
            self.layernorm(&ks.layernorm, ln, x, lw.ln1_w, lw.ln1_b)?;
            self.matmul(&ks.qkv, qkv, ln, lw.qkv_w, lw.qkv_b, 0)?;
            if let (Some(k), Some((s, launches))) = (&ks.kv_append, &kv_plan) {
                let args = [
                    ArgValue::Ptr(kc),
                    ArgValue::Ptr(vc),
                    ArgValue::Ptr(k_new),
                    ArgValue::Ptr(v_new),
                    i32_arg(b, "B")?,
                    i32_arg(nh, "NH")?,
                    i32_arg(t, "T")?,
                    i32_arg(n_ctx, "max_T")?,
                    i32_arg(hs, "HS")?,
                    i32_arg(pos, "pos")?,
                ];
                self.launch_with(k, s, launches, &args)?;
            }
            if decode {
                let args = [
                    ArgValue::Ptr(att),
                    ArgValue::Ptr(qkv),
                    ArgValue::Ptr(kc),
                    ArgValue::Ptr(vc),
                    ArgValue::Ptr(att_ws),
                    i32_arg(b, "B")?,
                    i32_arg(nh, "NH")?,
                    i32_arg(pos + t, "T")?,
                    i32_arg(n_ctx, "max_T")?,
                    i32_arg(hs, "HS")?,
                    ArgValue::F32(scale),
                ];
                self.launch_with(&ks.attention, &att_shape, &att_launches, &args)?;
            } else {
                let args = [
                    ArgValue::Ptr(att),
                    ArgValue::Ptr(qkv),
                    ArgValue::Ptr(k_new),
                    ArgValue::Ptr(v_new),
                    ArgValue::Ptr(att_ws),
                    i32_arg(b, "B")?,
                    i32_arg(nh, "NH")?,
                    i32_arg(t, "T")?,
                    i32_arg(hs, "HS")?,
                    ArgValue::I32(0),
                    ArgValue::F32(scale),
                ];
                self.launch_with(&ks.attention, &att_shape, &att_launches, &args)?;
            }
            // Attention projection + residual: y = x + att @ W^T + b.
            self.residual_matmul(ks, &ks.attn_proj, y, att, x, lw.attn_proj_w, lw.attn_proj_b, ln)?;
            std::mem::swap(&mut x, &mut y);
            self.layernorm(&ks.layernorm, ln, x, lw.ln2_w, lw.ln2_b)?;
            match &ks.gelu {
                None => self.matmul(&ks.fc, fc, ln, lw.fc_w, lw.fc_b, 0)?,
                Some(gelu) => {
                    self.matmul(&ks.fc, fc_pre, ln, lw.fc_w, lw.fc_b, 0)?;
                    let args = [ArgValue::Ptr(fc), ArgValue::Ptr(fc_pre), i32_arg(rows * 4 * c, "N")?];
                    self.launch(gelu, &args)?;
                }
            }
            self.residual_matmul(ks, &ks.fc_proj, y, fc, x, lw.fc_proj_w, lw.fc_proj_b, ln)?;
            std::mem::swap(&mut x, &mut y);
        }

        self.layernorm(&ks.layernorm, ln, x, self.lnf_w, self.lnf_b)?;
        let (head_in, head_rows) = if head == HeadRows::Last && t > 1 {
            for s in 0..b {
                self.copy_d2d(last + (s * c * e) as u64, ln + (((s + 1) * t - 1) * c * e) as u64, c)?;
            }
            (last, b)
        } else {
            (ln, rows)
        };
        debug_assert_eq!(ks.lm_head.shape["M"] as usize, head_rows);
        self.matmul(&ks.lm_head, logits, head_in, self.wte, 0, 0)?;
        Ok(head_rows)
    }

    /// `out = residual + inp @ W^T + bias`: fused (`bias_residual`) or, unfused, a `bias`
    /// matmul into `scratch` followed by the `residual` kernel.
    #[allow(clippy::too_many_arguments)]
    fn residual_matmul(
        &mut self,
        ks: &Kernels,
        k: &Kernel,
        out: u64,
        inp: u64,
        residual: u64,
        weight: u64,
        bias: u64,
        scratch: u64,
    ) -> AnyResult<()> {
        match &ks.residual {
            None => self.matmul(k, out, inp, weight, bias, residual),
            Some(add) => {
                self.matmul(k, scratch, inp, weight, bias, 0)?;
                let n = add.shape["N"] as usize;
                let args = [
                    ArgValue::Ptr(out),
                    ArgValue::Ptr(residual),
                    ArgValue::Ptr(scratch),
                    i32_arg(n, "N")?,
                ];
                self.launch(add, &args)
            }
        }
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
        Ok(())
    }

    /// (total GPU ms, steps) of the decode steps since the last call: the time from the first
    /// kernel of a step to its last, without the host's share (copies, sampling); clears it.
    pub fn take_decode_gpu_time(&mut self) -> (f64, usize) {
        std::mem::take(&mut self.decode_gpu_ms)
    }

    fn prefill_impl(&mut self, tokens: &[Vec<u32>], head: HeadRows) -> AnyResult<Option<Logits>> {
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
        let rows = self.run(&ks, b, t, 0, false, head)?;
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
        }
    }

    /// One decode step up to the LM head (and, when `greedy`, the argmax kernel into
    /// `act.next_ids`), launched but not waited for. Returns the batch size.
    fn decode_step(&mut self, last: &[u32], greedy: bool) -> AnyResult<usize> {
        if let Some(why) = &self.decode_missing {
            bail!("{why}");
        }
        let cfg = self.model.config.clone();
        if self.len == 0 {
            bail!("decode called before prefill");
        }
        let b = self.batch;
        if last.len() != b {
            return Err(
                ModelError::Batch(format!("decode got {} tokens for a batch of {b} sequences", last.len())).into(),
            );
        }
        if self.len + 1 > cfg.n_ctx {
            return Err(ModelError::ContextOverflow {
                needed: self.len + 1,
                n_ctx: cfg.n_ctx,
            }
            .into());
        }
        let tokens: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
        self.upload_ids(&tokens)?;
        let ks = self.kernels(b, 1, true, false)?;
        let pos = self.len;
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        let graphs = self.decode_graphs();
        if graphs {
            if self.prepared != Some((b, pos, self.buffers_generation)) {
                self.prepare_decode_graph(&ks, b, pos)?;
            }
            record_event(&start, &self.gpu)?;
            self.decode_graphs[&b].launch(&self.gpu.stream)?;
        } else {
            record_event(&start, &self.gpu)?;
            self.run(&ks, b, 1, pos, true, HeadRows::All)?;
        }
        if greedy {
            let Some(k) = ks.argmax.as_ref() else {
                bail!("greedy decode on the device needs the {ARGMAX_OP} op and a family for it");
            };
            let (ids, logits) = (ptr(&self.gpu, &self.act.next_ids), self.act.logits.ptr(&self.gpu));
            let (v, vp) = (cfg.vocab_size, cfg.padded_vocab_size);
            let args = [
                ArgValue::Ptr(ids),
                ArgValue::Ptr(logits),
                i32_arg(b, "B")?,
                i32_arg(v, "V")?,
                i32_arg(vp, "stride")?,
            ];
            self.launch(k, &args)?;
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
        let b = self.decode_step(last, false)?;
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
        let b = self.decode_step(last, true)?;
        let mut ids = vec![0i32; b];
        self.gpu
            .stream
            .memcpy_dtoh(&self.act.next_ids.slice(0..b), &mut ids)
            .map_err(GpuError::cuda(format!("copying {b} token ids back")))?;
        self.gpu.synchronize().context(SYNC_HINT)?;
        self.finish_step_timing()?;
        self.flush_profile()?;
        ids.iter()
            .enumerate()
            .map(|(s, &id)| {
                u32::try_from(id).map_err(|_| {
                    ModelError::Sampling(format!(
                        "the logits of sequence {s} contain NaN ({} on the GPU)",
                        self.name
                    ))
                    .into()
                })
            })
            .collect()
    }

    /// Points the graph of batch size `b` at the decode step at position `pos`: replays the
    /// step's launches into it, rewriting the nodes whose arguments changed, or records it
    /// (again) when there is none or the launches no longer match it.
    fn prepare_decode_graph(&mut self, ks: &Kernels, b: usize, pos: usize) -> AnyResult<()> {
        // The cache-length-dependent workspace is sized for the longest cache up front, so
        // that no step reallocates it under the graph's pointers.
        let longest = with(&ks.attention.shape, &[("T", self.model.config.n_ctx as i64)]);
        self.ws_ptr(&ks.attention, Some(&longest))?;
        if let Some(graph) = self.decode_graphs.remove(&b) {
            self.launch_mode = LaunchMode::Update {
                graph,
                next: 0,
                stale: false,
            };
            let walked = self.run(ks, b, 1, pos, true, HeadRows::All);
            let LaunchMode::Update { graph, next, stale } =
                std::mem::replace(&mut self.launch_mode, LaunchMode::Direct)
            else {
                unreachable!("the launch mode is only changed here")
            };
            walked?;
            if !stale && next == graph.len() {
                self.decode_graphs.insert(b, graph);
                self.prepared = Some((b, pos, self.buffers_generation));
                return Ok(());
            }
            // The kernels changed under the graph (a reselection): record it again.
        }
        self.launch_mode = LaunchMode::Record(KernelGraph::new(&self.gpu.ctx)?);
        let walked = self.run(ks, b, 1, pos, true, HeadRows::All);
        let LaunchMode::Record(mut graph) = std::mem::replace(&mut self.launch_mode, LaunchMode::Direct) else {
            unreachable!("the launch mode is only changed here")
        };
        walked?;
        graph.instantiate()?;
        self.decode_graphs.insert(b, graph);
        self.prepared = Some((b, pos, self.buffers_generation));
        Ok(())
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

/// Records `event` on the GPU's stream.
fn record_event(event: &CudaEvent, gpu: &Gpu) -> AnyResult<()> {
    Ok(event
        .record(&gpu.stream)
        .map_err(GpuError::cuda("recording a timing event"))?)
}

/// The default point of `family` for this epilogue and mask.
fn default_variant(
    family: &Arc<crate::spec::Family>,
    epilogue: Epilogue,
    mask: Mask,
    limits: &crate::spec::DeviceLimits,
) -> AnyResult<Variant> {
    expand(family, Points::Default, limits)?
        .into_iter()
        .find(|v| v.epilogue == epilogue && v.mask == mask)
        .ok_or_else(|| anyhow!("{} has no {} variant", family.name, variant_kind(epilogue, mask)))
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

    fn stats_note(&self) -> Option<String> {
        let (tuned, total) = self.tuned_kernels();
        let mut note = format!("{tuned}/{total} kernels tuned");
        for n in &self.registry.notes {
            note += &format!("; note: {n}");
        }
        Some(note)
    }
}
