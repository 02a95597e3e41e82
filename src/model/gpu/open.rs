//! Opening the GPU backend: the kernel catalog and this GPU's tuning database, the weights
//! converted to the storage type and uploaded once, every buffer allocated for `max_batch`
//! sequences, and the decode engine the database prefers.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result as AnyResult};

use super::buffers::ReplicaMemory;
use super::exec::{self, LaunchMode};
use super::{ptr, GpuBackend, LayerPtrs, LayernormFolding, ATTENTION_DECODE_OP, FOLD_LAYERNORMS_ENV, KV_APPEND_OP};
use crate::gpu::{Compiler, Gpu, GpuError};
use crate::model::engine::DecodeEngine;
use crate::model::weights::GPT2Model;
use crate::ops::model_dims::ModelDims;
use crate::ops::{self, Storage};
use crate::spec::{Catalog, DeviceLimits, Dtype};
use crate::tune::db::{default_path, DbHeader, TuningDb};
use crate::tune::registry::Registry;
use crate::tune::workloads::{forward_workloads, kernel_dtype};

impl GpuBackend {
    /// Open GPU 0, load the kernel catalog from the project folder (see
    /// [`crate::project::project_root`]), upload the weights and allocate every buffer for
    /// `max_batch` sequences of up to `n_ctx` tokens.
    pub fn new(model: Arc<GPT2Model>, max_batch: usize, unfused: bool, dtype: Dtype) -> AnyResult<GpuBackend> {
        let root = crate::project::project_root(None)?;
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
        Self::on_device(root, 0, model, max_batch, unfused, dtype)
    }

    /// [`GpuBackend::with_root`] on GPU `device` (a CUDA ordinal). Refuses, before uploading
    /// anything, a GPU without the free memory the weights and buffers need.
    pub fn on_device(
        root: &Path,
        device: usize,
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
                    let want = kernel_dtype(op, None, dtype);
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
        let gpu = Gpu::new(device).with_context(|| {
            format!("cuda:{device}: the GPU backend needs a CUDA GPU (pass --device cpu to run on the CPU)")
        })?;
        let name = format!(
            "cuda:{device}{}{}",
            if unfused { " unfused" } else { "" },
            if dtype == Dtype::F32 {
                String::new()
            } else {
                format!(" {dtype}")
            }
        );
        let need = ReplicaMemory::estimate(&cfg, storage.bytes(), max_batch, unfused);
        let free = gpu
            .free_memory()
            .map_err(GpuError::cuda(format!("reading the free memory of cuda:{device}")))?;
        need.check(&format!("cuda:{device} ({})", gpu.info.name), free, max_batch)
            .map_err(|why| anyhow!(why))?;
        let compiler = Compiler::new(&gpu.info.arch()).context("setting up NVRTC")?;
        let mut notes = Vec::new();
        let header = DbHeader::for_device(&gpu, &compiler);
        let db_path = default_path(&header);
        let db_header = header.clone();
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
        let mut registry = Registry::new(catalog, db, compiler)?;
        // A dtype this GPU has no kernels for (bf16 or tf32 before Ampere) is refused now, in
        // one line, with the dtypes that do run here.
        let dims = cfg.dims();
        if !unfused {
            if let Err(why) = prefill_kernels(&mut registry, &dims, dtype, &gpu.info.limits) {
                let here: Vec<String> = Dtype::ALL
                    .into_iter()
                    .filter(|&other| other != dtype)
                    .filter(|&other| prefill_kernels(&mut registry, &dims, other, &gpu.info.limits).is_ok())
                    .map(|other| format!("--dtype {other}"))
                    .collect();
                let (major, minor) = gpu.info.compute_capability;
                bail!(
                    "--dtype {dtype} does not run on {} (compute capability {major}.{minor}): {why}; {} here",
                    gpu.info.name,
                    if here.is_empty() {
                        "no other dtype runs either".to_string()
                    } else {
                        format!("{} run{}", here.join(" or "), if here.len() == 1 { "s" } else { "" })
                    }
                );
            }
        }

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
        let programmatic_launch =
            exec::programmatic_launch_from_env(std::env::var(exec::PROGRAMMATIC_LAUNCH_ENV).ok().as_deref());
        let fold_env = std::env::var(FOLD_LAYERNORMS_ENV).ok();
        let ln_folding = LayernormFolding::from_env_value(fold_env.as_deref()).unwrap_or_else(|why| {
            notes.push(why);
            LayernormFolding::default()
        });
        let mut backend = GpuBackend {
            model,
            name,
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
            selection_batch: None,
            selection_scale: (1, 1),
            profiler: None,
            sync_each,
            programmatic_launch,
            launch_mode: LaunchMode::Direct,
            dtype,
            engine: DecodeEngine::Graph,
            timeline_on: false,
            timeline: None,
            megakernel: None,
            megakernel_point: Vec::new(),
            step_points: HashMap::new(),
            mlp_weights: Vec::new(),
            ln_folding,
            folded: Default::default(),
            decode_graphs: HashMap::new(),
            graphs_recorded: 0,
            prepared: None,
            buffers_generation: 0,
            host_logits: Vec::new(),
            pinned_logits: None,
            step_events: None,
            prefill_events: None,
            ahead: None,
            returned: Vec::new(),
            draw_slot: 0,
            decode_gpu_ms: (0.0, 0),
            megakernel_rows_held: std::sync::OnceLock::new(),
            notes,
            db_header,
        };
        if !unfused {
            // the engine the tuning database found fastest for this batch (`tune --decode-step`)
            backend.engine = backend.tuned_decode_engine(max_batch);
        }
        Ok(backend)
    }
}

/// Whether every kernel of a short prefill in `dtype` has a family that runs on a GPU with
/// `limits`; `Err` names the first op without one and every family's reason.
fn prefill_kernels(
    registry: &mut Registry,
    dims: &ModelDims,
    dtype: Dtype,
    limits: &DeviceLimits,
) -> Result<(), String> {
    let seq = 64.min(dims.n_ctx as i64);
    // The folded-layernorm GEMMs (an ln_ epilogue) are offers the model takes only where a
    // family has them: the plain ones are what every GPU needs.
    for w in forward_workloads(dims, 1, seq, dtype)
        .into_iter()
        .filter(|w| !w.epilogue.standardizes_input())
    {
        let mut shape = w.shape.clone();
        if let Some(contract) = ops::op_by_name(w.op) {
            contract
                .complete_shape(&mut shape, w.epilogue, w.mask)
                .map_err(|e| e.to_string())?;
        }
        registry
            .select(w.op, w.dtype, w.epilogue, w.mask, &shape, limits)
            .map_err(|e| format!("{}: {e}", w.role))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::stand_in;
    use crate::model::config::GPT2Config;

    fn registry() -> Registry {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
        // Selection reads the specs only: a compiler that never runs (no NVRTC needed).
        let compiler = Compiler {
            arch: "sm_90".into(),
            include_dir: None,
            cache_dir: None,
            nvrtc_version: (0, 0),
        };
        Registry::new(catalog, None, compiler).unwrap()
    }

    #[test]
    fn every_dtype_runs_from_ampere_on_and_a_t4_refuses_bf16_and_tf32_naming_why() {
        let mut registry = registry();
        // GPT-2 and the small models of the GPU tests (awkward widths, vocabularies, contexts).
        let models = [
            (2, 128, 128, 300),
            (2, 128, 64, 300),
            (18, 1152, 256, 1001),
            (5, 320, 512, 1001),
            (4, 256, 256, 50257),
        ];
        for (heads, width, n_ctx, vocab) in models {
            let dims = GPT2Config::new(2, heads, width, n_ctx, vocab).unwrap().dims();
            for dtype in Dtype::ALL {
                prefill_kernels(&mut registry, &dims, dtype, &DeviceLimits::default())
                    .unwrap_or_else(|e| panic!("{dtype} on an H100, {dims:?}: {e}"));
            }
        }
        let dims = GPT2Config::gpt2().dims();
        for dtype in Dtype::ALL {
            prefill_kernels(&mut registry, &dims, dtype, &DeviceLimits::default())
                .unwrap_or_else(|e| panic!("{dtype} on an H100: {e}"));
        }
        for ampere_on in ["sm_80", "sm_86", "sm_89"] {
            let limits = stand_in::parse(ampere_on).unwrap().limits(&DeviceLimits::default());
            for dtype in Dtype::ALL {
                prefill_kernels(&mut registry, &dims, dtype, &limits)
                    .unwrap_or_else(|e| panic!("{dtype} on {ampere_on}: {e}"));
            }
        }
        let t4 = stand_in::parse("sm_75").unwrap().limits(&DeviceLimits::default());
        for dtype in [Dtype::F32, Dtype::F16] {
            prefill_kernels(&mut registry, &dims, dtype, &t4).unwrap_or_else(|e| panic!("{dtype} on a T4: {e}"));
        }
        for dtype in [Dtype::Bf16, Dtype::Tf32] {
            let e = prefill_kernels(&mut registry, &dims, dtype, &t4).unwrap_err();
            assert!(e.contains("needs compute capability 8.0"), "{dtype} on a T4: {e}");
        }
    }

    /// Untuned, the halves' prefill attention is the tensor-core family wherever the GPU has
    /// mma.sync (sm_80 on), and the FMA flash attention only on a T4 (the ranks decide; a tie
    /// once let the FMA family win on the H200 by its name and cost the bf16 forward a third).
    #[test]
    fn untuned_prefill_attention_in_halves_is_on_the_tensor_cores_from_ampere_on() {
        let mut registry = registry();
        let dims = GPT2Config::gpt2().dims();
        let attention_family = |registry: &mut Registry, dtype: Dtype, limits: &DeviceLimits| {
            let w = forward_workloads(&dims, 4, 512, dtype)
                .into_iter()
                .find(|w| w.op == "attention")
                .expect("the forward has an attention");
            let mut shape = w.shape.clone();
            ops::op_by_name(w.op)
                .unwrap()
                .complete_shape(&mut shape, w.epilogue, w.mask)
                .unwrap();
            let selected = registry
                .select(w.op, dtype, w.epilogue, w.mask, &shape, limits)
                .unwrap();
            selected.variant.family.name.clone()
        };
        for target in ["sm_80", "sm_86", "sm_89", "sm_90"] {
            let limits = stand_in::parse(target).unwrap().limits(&DeviceLimits::default());
            for dtype in [Dtype::F16, Dtype::Bf16] {
                assert_eq!(
                    attention_family(&mut registry, dtype, &limits),
                    "attention_flash_mma",
                    "{dtype} on {target}"
                );
            }
        }
        let t4 = stand_in::parse("sm_75").unwrap().limits(&DeviceLimits::default());
        assert_eq!(attention_family(&mut registry, Dtype::F16, &t4), "attention_flash");
    }
}
