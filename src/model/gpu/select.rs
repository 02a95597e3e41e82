//! Kernel selection for the model: for each op of a step shape, the tuned winner from the
//! tuning database (or the family default), compiled, loaded and planned once, and remembered.

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result as AnyResult};

use super::fold::{FoldRole, FoldedLayernorms};
use super::{shape, GpuBackend, ARGMAX_OP, ATTENTION_DECODE_OP, KV_APPEND_OP, SAMPLE_OP, UNFUSED_ATTENTION_FAMILY};
use crate::gpu::{GpuError, LoadedVariant};
use crate::ops::model_dims::{context_bucket, decode_context_buckets};
use crate::ops::{self, Epilogue, Mask, Shape};
use crate::spec::{expand, shape_text, Dtype, Launch, Points, Variant};
use crate::tune::db::TuneKey;
use crate::tune::registry::{variant_kind, Choice};
use crate::tune::workloads::{
    decode_attention_shape, folds_layernorms, kernel_dtype, next_tokens_shape, op_dtype, sampler_shape,
};

/// One selected, loaded kernel and where it is used.
#[derive(Clone)]
pub(super) struct Kernel {
    /// Where in the model: `qkv`, `attn_proj`, `lm_head`, ...
    pub role: &'static str,
    /// `matmul[bias_gelu] matmul_regtile`.
    pub label: String,
    pub loaded: Arc<LoadedVariant>,
    pub choice: Choice,
    /// The completed shape it was selected for; launches override a few entries of it.
    pub shape: Shape,
    /// Launch geometry for `shape`, planned once.
    pub launches: Arc<Vec<Launch>>,
    /// The tuning database's key it was selected for.
    pub key: Arc<TuneKey>,
}

/// The kernels of one forward shape (a prefill of B×T or a decode step of B).
pub(super) struct Kernels {
    pub encoder: Kernel,
    pub layernorm: Kernel,
    pub qkv: Kernel,
    pub kv_append: Option<Kernel>,
    /// The prefill's attention; for a decode step the kernel of the longest cache (the last
    /// of `decode_attention`).
    pub attention: Kernel,
    /// Decode steps only: the attention kernel of each cache-length bucket (its longest
    /// length, ascending; `ops::model_dims::decode_context_buckets`): a step runs the first
    /// that holds its cache ([`Kernels::decode_attention_for`]).
    pub decode_attention: Vec<(usize, Kernel)>,
    pub attn_proj: Kernel,
    pub fc: Kernel,
    pub fc_proj: Kernel,
    /// Unfused only.
    pub gelu: Option<Kernel>,
    pub residual: Option<Kernel>,
    pub lm_head: Kernel,
    /// Decode steps only: greedy choice of the next tokens on the device.
    pub argmax: Option<Kernel>,
    /// Decode steps only: the next tokens drawn on the device (temperature, top-k, top-p).
    pub sample: Option<Kernel>,
    /// The layernorms this prefill or decode step runs folded into the matmul after them (their
    /// kernels are `ln_` ones; `fold_select.rs`). None for the unfused path and for decode
    /// steps of fewer than `TENSOR_CORE_MIN_ROWS` sequences.
    pub folded: FoldedLayernorms,
}

impl Kernels {
    /// The decode attention kernel for a cache of `len` positions of a model of `n_ctx`: the
    /// kernel of its bucket (`ops::model_dims::context_bucket`; the prefill's attention when
    /// this is not a decode set).
    pub fn decode_attention_for(&self, n_ctx: usize, len: usize) -> &Kernel {
        let bucket = context_bucket(n_ctx, len);
        self.decode_attention
            .iter()
            .find(|(b, _)| *b == bucket)
            .map_or(&self.attention, |(_, k)| k)
    }
}

/// What a kernel is chosen by: see [`GpuBackend::selection_of`].
pub(super) struct Selection {
    /// The completed shape it runs on.
    pub shape: Shape,
    /// The shape it is chosen for (the tuning key's).
    pub select_shape: Shape,
    pub dtype: Dtype,
}

impl GpuBackend {
    /// Select (tuned winner or default; or the default of `force_family`), load and remember
    /// the kernel for (op, epilogue, mask, shape), and make the workspace big enough for it.
    pub(super) fn kernel(
        &mut self,
        role: &'static str,
        op: &str,
        epilogue: Epilogue,
        mask: Mask,
        shape: Shape,
        force_family: Option<&str>,
    ) -> AnyResult<Kernel> {
        self.kernel_at(role, op, epilogue, mask, shape, force_family, &[])
    }

    /// [`GpuBackend::kernel`], at the point of `force_family` given by `point` (the default
    /// with these params changed) when `point` is not empty. With no family forced, a point set
    /// for the database key by [`GpuBackend::set_step_point`] comes before the tuned winner.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kernel_at(
        &mut self,
        role: &'static str,
        op: &str,
        epilogue: Epilogue,
        mask: Mask,
        shape: Shape,
        force_family: Option<&str>,
        point: &[(String, i64)],
    ) -> AnyResult<Kernel> {
        let asked = shape.clone();
        let Selection {
            shape,
            select_shape,
            dtype,
            ..
        } = self
            .selection_of(op, epilogue, mask, shape)
            .with_context(|| role.to_string())?;
        let db_key = TuneKey::of(op, dtype, epilogue, mask, select_shape.clone());
        if force_family.is_none() {
            if let Some((family, point)) = self.step_points.get(&db_key.text()).cloned() {
                return self.kernel_at(role, op, epilogue, mask, asked, Some(&family), &point);
            }
        }
        let key = format!(
            "{role}|{op}|{dtype}|{}|{}|{}|{:?}|{}|{}",
            epilogue.as_str(),
            mask.as_str(),
            force_family.unwrap_or(""),
            point,
            shape_text(&shape),
            shape_text(&select_shape)
        );
        if let Some(k) = self.selected.get(&key) {
            return Ok(k.clone());
        }
        let limits = self.gpu.info.limits;
        let (mut variant, choice) = match force_family {
            Some(name) if !point.is_empty() => {
                let family = self.registry.catalog.family(name)?.clone();
                let v = crate::spec::variant_with(&family, point, dtype, epilogue, mask, &limits)
                    .with_context(|| format!("{role}: the point {point:?} of {name}"))?;
                (v, Choice::Default)
            }
            Some(name) => {
                let family = self.registry.catalog.family(name)?.clone();
                (default_variant(&family, epilogue, mask, &limits)?, Choice::Default)
            }
            None => {
                let s = self
                    .registry
                    .select(op, dtype, epilogue, mask, &select_shape, &limits)
                    .with_context(|| format!("choosing the {role} kernel"))?;
                if select_shape != shape && s.variant.check_shape(&shape, &limits).is_err() {
                    // The whole batch's kernel cannot run this slice: choose for the slice.
                    let own = self
                        .registry
                        .select(op, dtype, epilogue, mask, &shape, &limits)
                        .with_context(|| format!("choosing the {role} kernel"))?;
                    (own.variant, own.choice)
                } else {
                    (s.variant, s.choice)
                }
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
            key: Arc::new(db_key),
        };
        self.selected.insert(key, k.clone());
        Ok(k)
    }

    /// For (op, epilogue, mask, shape): the completed shape, the shape
    /// kernels are chosen for (this one, or the whole batch's when this backend runs a slice of
    /// it: see `set_selection_batch`) and the dtype the kernel runs in.
    pub(super) fn selection_of(
        &self,
        op: &str,
        epilogue: Epilogue,
        mask: Mask,
        mut shape: Shape,
    ) -> AnyResult<Selection> {
        let contract = ops::op_by_name(op).ok_or_else(|| anyhow!("op `{op}` does not exist in this build"))?;
        contract
            .complete_shape(&mut shape, epilogue, mask)
            .with_context(|| format!("shape {}", shape_text(&shape)))?;
        let select_shape = self.selection_shape(contract, epilogue, &shape);
        let dtype = kernel_dtype(op, select_shape.get("M").copied(), self.dtype);
        Ok(Selection {
            shape,
            select_shape,
            dtype,
        })
    }

    /// `shape` with its row dimensions scaled from this backend's batch to the selection batch
    /// (set by [`GpuBackend::kernels`] from [`GpuBackend::set_selection_batch`]); the qkv
    /// matmul's `T` is the sequence length, not a row count, and stays.
    fn selection_shape(&self, contract: &dyn ops::OpContract, epilogue: Epilogue, shape: &Shape) -> Shape {
        let (whole, slice) = self.selection_scale;
        let mut s = shape.clone();
        if whole == slice || slice == 0 {
            return s;
        }
        for dim in contract.row_dims() {
            if *dim == "T" && epilogue.after_product() == Epilogue::Qkv {
                continue;
            }
            if let Some(v) = s.get_mut(*dim) {
                *v = *v / slice as i64 * whole as i64;
            }
        }
        s
    }

    pub(super) fn ensure_workspace(&mut self, elems: usize) -> AnyResult<()> {
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
    pub(super) fn kernels(&mut self, b: usize, t: usize, decode: bool, last_only: bool) -> AnyResult<Arc<Kernels>> {
        let whole = self.selection_batch.unwrap_or(b).max(b);
        let set_key = (b, t, decode, last_only, whole);
        if let Some(k) = self.sets.get(&set_key) {
            return Ok(k.clone());
        }
        self.selection_scale = (whole, b);
        let set = self.select_set(b, t, decode, last_only);
        self.selection_scale = (1, 1);
        let set = Arc::new(set?);
        self.sets.insert(set_key, set.clone());
        Ok(set)
    }

    fn select_set(&mut self, b: usize, t: usize, decode: bool, last_only: bool) -> AnyResult<Kernels> {
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
        // A prefill may fold each layernorm into the matmul after it (not the LM head of the
        // last rows only, which reads copies of the layernorm's output), and so may a decode step
        // of as many sequences as the tensor-core matmuls that fold it take (fewer run on the
        // megakernel or on matvec kernels, which have no ln_ epilogue).
        let foldable = !unfused && folds_layernorms(decode, m);
        let mut folded = FoldedLayernorms::default();
        let mut fold_report = Vec::new();
        let (qkv, qkv_folded) = self.matmul_after_layernorm(
            FoldRole::Qkv,
            Epilogue::Qkv,
            mm(3 * c, c, m, ti),
            foldable,
            &mut fold_report,
        )?;
        folded.set(FoldRole::Qkv, qkv_folded);
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
        let mut decode_attention = Vec::new();
        let attention = if decode {
            if let Some(why) = &self.decode_missing {
                bail!("{why}");
            }
            let engine = self.engine_for(b);
            if engine != self.engine {
                self.notes.push(format!(
                    "batch {b}: the megakernel holds at most {} sequences of this model in {} on this GPU \
                     (max_rows in specs/decode_megakernel.toml; 16 rows need 16-bit storage and sm_80); \
                     decode steps run on the {engine} engine instead",
                    self.megakernel_most_rows(),
                    self.dtype
                ));
            }
            // One kernel per cache-length bucket, each chosen for the bucket's longest length
            // and launched with the current one (and the whole cache's capacity).
            for len in decode_context_buckets(cfg.n_ctx) {
                let k = self.kernel(
                    "attention",
                    ATTENTION_DECODE_OP,
                    Epilogue::None,
                    Mask::None,
                    decode_attention_shape(bi, nh, hs, len as i64),
                    None,
                )?;
                decode_attention.push((len, k));
            }
            decode_attention.last().expect("at least one bucket").1.clone()
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
        let (fc, fc_folded) =
            self.matmul_after_layernorm(FoldRole::Fc, bias_gelu, mm(4 * c, c, m, ti), foldable, &mut fold_report)?;
        folded.set(FoldRole::Fc, fc_folded);
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
        let last_rows = last_only && t > 1;
        let head_shape = if last_rows { mm(vp, c, bi, 1) } else { mm(vp, c, m, ti) };
        let (lm_head, head_folded) = self.matmul_after_layernorm(
            FoldRole::LmHead,
            Epilogue::None,
            head_shape,
            foldable && !last_rows,
            &mut fold_report,
        )?;
        folded.set(FoldRole::LmHead, head_folded);
        if !fold_report.is_empty() {
            self.notes.push(if decode {
                format!("decode step of {b}: {}", fold_report.join("; "))
            } else {
                format!("prefill of {b}x{t}: {}", fold_report.join("; "))
            });
        }
        // The next tokens on the device: the argmax, and the sampler (chosen on the setting it
        // is tuned on, whatever the user's: `sampler_shape`).
        let catalog = &self.registry.catalog;
        let available = |op: &str| ops::op_by_name(op).is_some() && catalog.has_dtype(op, op_dtype(self.dtype));
        let (argmax_available, sample_available) = (available(ARGMAX_OP), available(SAMPLE_OP));
        let rows = next_tokens_shape(&cfg.dims(), bi);
        let argmax = if decode && argmax_available {
            Some(self.kernel("argmax", ARGMAX_OP, Epilogue::None, Mask::None, rows, None)?)
        } else {
            None
        };
        let sample = if decode && sample_available {
            Some(self.kernel(
                "sample",
                SAMPLE_OP,
                Epilogue::None,
                Mask::None,
                sampler_shape(&cfg.dims(), bi),
                None,
            )?)
        } else {
            None
        };
        Ok(Kernels {
            encoder,
            layernorm,
            qkv,
            kv_append,
            attention,
            decode_attention,
            attn_proj,
            fc,
            fc_proj,
            gelu,
            residual,
            lm_head,
            argmax,
            sample,
            folded,
        })
    }
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
