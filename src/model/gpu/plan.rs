//! The step plan: what one forward pass or decode step runs, as data. An ordered list of op
//! nodes (the selected kernel, the shape it runs on, its launch geometry and its arguments,
//! pointers into the backend's persistent buffers) and device copies. Built once per step
//! shape and position by [`GpuBackend::build_plan`]; the executors (`exec.rs`: kernel by kernel
//! or as a CUDA graph; `megakernel.rs`: lowered to one persistent kernel) only run it.

use std::sync::Arc;

use anyhow::{bail, Context, Result as AnyResult};

use super::fold::FoldRole;
use super::select::{Kernel, Kernels};
use super::{i32_arg, ptr, with, GpuBackend, ARGMAX_OP, SAMPLE_OP};
use crate::gpu::ArgValue;
use crate::model::generate::Draw;
use crate::ops::Shape;
use crate::spec::{shape_text, Launch};

/// One kernel launch of a plan.
#[derive(Clone)]
pub(super) struct Node {
    pub kernel: Kernel,
    /// The shape it runs on (the selection shape with the position or cache length of this step).
    pub shape: Shape,
    pub launches: Arc<Vec<Launch>>,
    /// In the op's signature order.
    pub args: Vec<ArgValue>,
    /// The transformer layer it belongs to (`None`: embedding, final layernorm, LM head).
    pub layer: Option<usize>,
}

/// Which pass a plan runs, and where a decode step's input ids are read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// B sequences of T tokens from the start of the cache, their ids uploaded to `act.ids`.
    Prefill,
    /// One token a sequence after the cache. `from_draw`: the ids are the previous step's
    /// choice, read where its argmax or sampler wrote them (the device copy of the slot of
    /// `act.next_ids` other than `slot`); else uploaded to `act.ids`. A NaN row's -1 there is
    /// read as token 0 (such a step is thrown away). `slot`: where this step's own choice goes,
    /// if it chooses.
    Decode { from_draw: bool, slot: usize },
}

/// One step of a plan.
#[derive(Clone)]
pub(super) enum Step {
    Launch(Node),
    /// A device-to-device copy of `elems` values of the storage type.
    Copy {
        dst: u64,
        src: u64,
        elems: usize,
    },
}

/// Everything one forward pass or decode step runs, in order.
pub(super) struct Plan {
    pub steps: Vec<Step>,
    /// Logits rows the LM head writes.
    pub head_rows: usize,
}

impl Plan {
    /// The launches, in order.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.steps.iter().filter_map(|s| match s {
            Step::Launch(n) => Some(n),
            Step::Copy { .. } => None,
        })
    }
}

/// What a plan ends with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum HeadRows {
    /// LM head on every position, logits copied back.
    All,
    /// LM head on the last position of each sequence only, logits copied back.
    Last,
    /// LM head on every position, nothing copied back (benchmarks).
    AllOnDevice,
    /// Decode steps only: the LM head and the greedy argmax into the next-token ids.
    Greedy,
}

/// Collects the steps of a plan.
#[derive(Default)]
pub(super) struct Builder {
    steps: Vec<Step>,
    /// The layer the next launches belong to.
    layer: Option<usize>,
}

impl Builder {
    /// `k` with `args` on the shape it was selected for (geometry planned once).
    fn launch(&mut self, k: &Kernel, args: &[ArgValue]) {
        self.launch_on(k, k.shape.clone(), k.launches.clone(), args);
    }

    /// `k` with `args` and the geometry `launches` planned for `shape`.
    fn launch_on(&mut self, k: &Kernel, shape: Shape, launches: Arc<Vec<Launch>>, args: &[ArgValue]) {
        self.steps.push(Step::Launch(Node {
            kernel: k.clone(),
            shape,
            launches,
            args: args.to_vec(),
            layer: self.layer,
        }));
    }
}

impl GpuBackend {
    /// The workspace pointer for `k` launched on `launch_shape` (`None`: its selection shape,
    /// whose need was met when it was selected); 0 when nothing was ever needed.
    pub(super) fn ws_ptr(&mut self, k: &Kernel, launch_shape: Option<&Shape>) -> AnyResult<u64> {
        if let Some(s) = launch_shape {
            let need = k.loaded.variant.workspace_elems(s, &self.gpu.info.limits)?;
            self.ensure_workspace(need)?;
        }
        Ok(self.workspace.as_ref().map_or(0, |w| ptr(&self.gpu, w)))
    }

    /// The shape a decode attention kernel `k` is launched on for a cache of `len` positions:
    /// its selection shape (a bucket's longest length, the cache exactly that long) with the
    /// current length and the model's cache capacity, which the rows are laid out by.
    pub(super) fn decode_attention_shape(&self, k: &Kernel, len: usize) -> Shape {
        with(
            &k.shape,
            &[("T", len as i64), ("max_T", self.model.config.n_ctx as i64)],
        )
    }

    /// Launch geometry of `k` on `shape` (another position or cache length than it was
    /// selected for).
    pub(super) fn plan(&self, k: &Kernel, shape: &Shape) -> AnyResult<Vec<Launch>> {
        k.loaded
            .plan(&self.gpu, shape)
            .with_context(|| format!("{} ({}): planning {}", k.role, k.label, shape_text(shape)))
    }

    /// The plan of everything from the embedding to the LM head (and, for greedy decode steps,
    /// the argmax) for B sequences of T new tokens at positions `pos..pos+T` (the cache holds
    /// `pos` tokens).
    pub(super) fn build_plan(
        &mut self,
        ks: &Kernels,
        b: usize,
        t: usize,
        pos: usize,
        pass: Pass,
        head: HeadRows,
    ) -> AnyResult<Plan> {
        let decode = pass != Pass::Prefill;
        let mut plan = Builder::default();
        let cfg = self.model.config.clone();
        let (c, nh, hs, n_ctx) = (cfg.n_embd, cfg.n_head, cfg.head_dim(), cfg.n_ctx);
        let rows = b * t;
        let g = &self.gpu;
        let ids = match pass {
            Pass::Decode { from_draw: true, slot } => self.act.next_ids.input_of(slot),
            _ => ptr(g, &self.act.ids),
        };
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
        let enc_launches = Arc::new(self.plan(&ks.encoder, &enc_shape)?);
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
        plan.launch_on(&ks.encoder, enc_shape, enc_launches, &args);

        // Shapes that differ from the selection ones (position, cache length): planned once per
        // call, the same for every layer.
        // A prefill writes its keys and values into the cache before attending; a decode
        // step's attention appends its one row itself.
        let kv_plan = match &ks.kv_append {
            Some(k) if !decode => {
                let s = with(&k.shape, &[("pos", pos as i64)]);
                let l = Arc::new(self.plan(k, &s)?);
                Some((s, l))
            }
            _ => None,
        };
        // Decode: the kernel of the cache's length bucket, launched for the current length.
        let att_kernel = if decode {
            ks.decode_attention_for(self.model.config.n_ctx, pos + t)
        } else {
            &ks.attention
        };
        let (att_shape, att_launches, att_ws) = if decode {
            let s = self.decode_attention_shape(att_kernel, pos + t);
            let l = Arc::new(self.plan(att_kernel, &s)?);
            let ws = self.ws_ptr(att_kernel, Some(&s))?;
            (s, l, ws)
        } else {
            let ws = self.ws_ptr(&ks.attention, None)?;
            (ks.attention.shape.clone(), ks.attention.launches.clone(), ws)
        };
        for (l, &(kc, vc)) in kv.iter().enumerate() {
            let lw = self.layers[l];
            plan.layer = Some(l);
            // ln_1 and the qkv projection, or the projection with ln_1 folded in, reading x.
            let (inp, weight, bias) = self.after_layernorm(&mut plan, ks, FoldRole::Qkv, Some(l), x)?;
            self.matmul(&mut plan, &ks.qkv, qkv, inp, weight, bias, 0)?;
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
                plan.launch_on(k, s.clone(), launches.clone(), &args);
            }
            if decode {
                let args = [
                    ArgValue::Ptr(att),
                    ArgValue::Ptr(qkv),
                    ArgValue::Ptr(k_new),
                    ArgValue::Ptr(v_new),
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
                plan.launch_on(att_kernel, att_shape.clone(), att_launches.clone(), &args);
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
                plan.launch_on(att_kernel, att_shape.clone(), att_launches.clone(), &args);
            }
            // Attention projection + residual: y = x + att @ W^T + b.
            self.residual_matmul(
                &mut plan,
                ks,
                &ks.attn_proj,
                y,
                att,
                x,
                lw.attn_proj_w,
                lw.attn_proj_b,
                ln,
            )?;
            std::mem::swap(&mut x, &mut y);
            let (inp, weight, bias) = self.after_layernorm(&mut plan, ks, FoldRole::Fc, Some(l), x)?;
            match &ks.gelu {
                None => self.matmul(&mut plan, &ks.fc, fc, inp, weight, bias, 0)?,
                Some(gelu) => {
                    self.matmul(&mut plan, &ks.fc, fc_pre, inp, weight, bias, 0)?;
                    let args = [ArgValue::Ptr(fc), ArgValue::Ptr(fc_pre), i32_arg(rows * 4 * c, "N")?];
                    plan.launch(gelu, &args);
                }
            }
            self.residual_matmul(&mut plan, ks, &ks.fc_proj, y, fc, x, lw.fc_proj_w, lw.fc_proj_b, ln)?;
            std::mem::swap(&mut x, &mut y);
        }

        plan.layer = None;
        let last_rows = head == HeadRows::Last && t > 1;
        if last_rows && ks.folded.lm_head {
            bail!("the LM head of the last rows reads copies of ln_f's output; its kernel set must not fold ln_f");
        }
        let (head_in, head_weight, head_bias) = self.after_layernorm(&mut plan, ks, FoldRole::LmHead, None, x)?;
        let (head_in, head_rows) = if last_rows {
            for s in 0..b {
                plan.steps.push(Step::Copy {
                    dst: last + (s * c * e) as u64,
                    src: ln + (((s + 1) * t - 1) * c * e) as u64,
                    elems: c,
                });
            }
            (last, b)
        } else {
            (head_in, rows)
        };
        debug_assert_eq!(ks.lm_head.shape["M"] as usize, head_rows);
        self.matmul(&mut plan, &ks.lm_head, logits, head_in, head_weight, head_bias, 0)?;
        if let (Pass::Decode { slot, .. }, HeadRows::Greedy) = (pass, head) {
            plan.steps.push(self.argmax_step(ks, b, slot)?);
        }
        Ok(Plan {
            steps: plan.steps,
            head_rows,
        })
    }

    /// What the matmul of `role` after a layernorm reads, as (input, weight, bias): with the
    /// layernorm folded in (see `ks.folded`), the residual stream `x` itself and the folded
    /// operands of `layer`; else the layernorm of `x` into `act.ln`, launched here, and the
    /// model's own weight and bias (the LM head: the tied `wte`, no bias).
    fn after_layernorm(
        &mut self,
        plan: &mut Builder,
        ks: &Kernels,
        role: FoldRole,
        layer: Option<usize>,
        x: u64,
    ) -> AnyResult<(u64, u64, u64)> {
        if ks.folded.get(role) {
            let Some(f) = self.folded.get(role, layer) else {
                bail!(
                    "{} runs with {} folded in, but the folded weights were not uploaded",
                    role.matmul(),
                    role.layernorm()
                );
            };
            return Ok((x, f.weight, f.bias));
        }
        let ((gamma, beta), (weight, bias)) = match (role, layer) {
            (FoldRole::Qkv, Some(l)) => {
                let lw = self.layers[l];
                ((lw.ln1_w, lw.ln1_b), (lw.qkv_w, lw.qkv_b))
            }
            (FoldRole::Fc, Some(l)) => {
                let lw = self.layers[l];
                ((lw.ln2_w, lw.ln2_b), (lw.fc_w, lw.fc_b))
            }
            (FoldRole::LmHead, None) => ((self.lnf_w, self.lnf_b), (self.wte, 0)),
            (role, layer) => bail!("{} has no layernorm before it in layer {layer:?}", role.matmul()),
        };
        let ln = self.act.ln.ptr(&self.gpu);
        self.layernorm(plan, &ks.layernorm, ln, x, gamma, beta)?;
        Ok((ln, weight, bias))
    }

    /// `out = residual + inp @ W^T + bias`: fused (`bias_residual`) or, unfused, a `bias`
    /// matmul into `scratch` followed by the `residual` kernel.
    #[allow(clippy::too_many_arguments)]
    fn residual_matmul(
        &mut self,
        plan: &mut Builder,
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
            None => self.matmul(plan, k, out, inp, weight, bias, residual),
            Some(add) => {
                self.matmul(plan, k, scratch, inp, weight, bias, 0)?;
                let n = add.shape["N"] as usize;
                let args = [
                    ArgValue::Ptr(out),
                    ArgValue::Ptr(residual),
                    ArgValue::Ptr(scratch),
                    i32_arg(n, "N")?,
                ];
                plan.launch(add, &args);
                Ok(())
            }
        }
    }

    /// The greedy argmax of a decode step's logits into `slot` of `act.next_ids`.
    pub(super) fn argmax_step(&self, ks: &Kernels, b: usize, slot: usize) -> AnyResult<Step> {
        let Some(k) = ks.argmax.as_ref() else {
            bail!("greedy decode on the device needs the {ARGMAX_OP} op and a family for it");
        };
        let cfg = &self.model.config;
        let args = [
            ArgValue::Ptr(self.act.next_ids.host_ptr(slot)),
            ArgValue::Ptr(self.act.next_ids.device_ptr(slot)),
            ArgValue::Ptr(self.act.logits.ptr(&self.gpu)),
            i32_arg(b, "B")?,
            i32_arg(cfg.vocab_size, "V")?,
            i32_arg(cfg.padded_vocab_size, "stride")?,
        ];
        let mut one = Builder::default();
        one.launch(k, &args);
        Ok(one.steps.remove(0))
    }

    /// The step that picks a decode step's next tokens into `slot` of `act.next_ids`: the
    /// argmax for a greedy draw, else the sampler, drawing the tokens at `position`.
    pub(super) fn choose_step(
        &mut self,
        ks: &Kernels,
        b: usize,
        draw: &Draw,
        position: usize,
        slot: usize,
    ) -> AnyResult<Step> {
        if draw.params.is_greedy() {
            return self.argmax_step(ks, b, slot);
        }
        let Some(k) = ks.sample.as_ref() else {
            bail!("sampling on the device needs the {SAMPLE_OP} op and a family for it");
        };
        let ws = self.ws_ptr(k, None)?;
        let cfg = &self.model.config;
        let params = &draw.params;
        let args = [
            ArgValue::Ptr(self.act.next_ids.host_ptr(slot)),
            ArgValue::Ptr(self.act.next_ids.device_ptr(slot)),
            ArgValue::Ptr(self.act.logits.ptr(&self.gpu)),
            ArgValue::Ptr(ws),
            i32_arg(b, "B")?,
            i32_arg(cfg.vocab_size, "V")?,
            i32_arg(cfg.padded_vocab_size, "stride")?,
            // top-k beyond the vocabulary keeps everything (the CLI says so): clamp to fit an int
            i32_arg(params.top_k.min(cfg.vocab_size), "top_k")?,
            ArgValue::F32(params.temperature),
            ArgValue::F32(params.top_p),
            ArgValue::I32(draw.seed as u32 as i32),
            ArgValue::I32((draw.seed >> 32) as u32 as i32),
            i32_arg(draw.first_sequence as usize, "first sequence")?,
            i32_arg(position, "position")?,
        ];
        let mut one = Builder::default();
        one.launch(k, &args);
        Ok(one.steps.remove(0))
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &mut self,
        plan: &mut Builder,
        k: &Kernel,
        out: u64,
        inp: u64,
        weight: u64,
        bias: u64,
        residual: u64,
    ) -> AnyResult<()> {
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
        plan.launch(k, &args);
        Ok(())
    }

    fn layernorm(
        &mut self,
        plan: &mut Builder,
        k: &Kernel,
        out: u64,
        inp: u64,
        gamma: u64,
        beta: u64,
    ) -> AnyResult<()> {
        let s = &k.shape;
        let args = [
            ArgValue::Ptr(out),
            ArgValue::Ptr(inp),
            ArgValue::Ptr(gamma),
            ArgValue::Ptr(beta),
            i32_arg(s["N"] as usize, "N")?,
            i32_arg(s["C"] as usize, "C")?,
        ];
        plan.launch(k, &args);
        Ok(())
    }
}
