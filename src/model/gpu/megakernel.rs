//! The megakernel executor: a decode step's plan lowered to a stage table
//! (`stage_table.rs`) that one persistent kernel (the `decode_step` op;
//! `specs/decode_megakernel.toml`, `templates/decode/megakernel.cu.tera`) runs as one
//! cooperative launch per step: the point of the family chosen for the batch (tuned, or fitted
//! by `megakernel_point.rs`), the table and the counters uploaded once per batch size and
//! buffer generation, the occupancy checked before the first launch, and the timeline stamps
//! read back when asked for.

use std::collections::HashMap;

use anyhow::{Context, Result as AnyResult};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::buffers::upload_fits;
use super::lm_head_draw::{drawn_in_lm_head, LmHeadTasks};
use super::megakernel_point::{fitted_default, most_rows, MegakernelSummary, MEGAKERNEL_FAMILY};
use super::plan::{HeadRows, Pass, Plan};
use super::select::{Kernel, Kernels};
use super::stage_table::{
    check_schedule, lower, Geometry, Lowered, MlpFusion, PlanOp, StageRecord, ACC_SPREAD, MAX_TASK_COLS, STAGE_OPS,
};
use super::{ptr, shape, GpuBackend};
use crate::gpu::GpuError;
use crate::model::config::GPT2Config;
use crate::model::engine::{TaskStamp, Timeline};
use crate::model::generate::Draw;
use crate::model::sampling::SamplingParams;
use crate::model::weights::transpose;
use crate::ops::{Epilogue, Mask};
use crate::spec::Dtype;
use crate::tune::registry::variant_kind;
use crate::tune::workloads::op_dtype;

/// The op (and kernel family op) of the megakernel.
pub const DECODE_STEP_OP: &str = crate::ops::decode_step::NAME;
/// Timeline stamps per task: start, inputs ready, weights landed, end.
const STAMPS: usize = 4;

/// The megakernel set up for one batch size: the selected kernel, its table and buffers.
pub(super) struct MegakernelState {
    kernel: Kernel,
    /// (batch, the whole batch this backend runs a slice of, buffers generation) the table was
    /// built for: what decides its point, its attention chunks and its pointers.
    key: (usize, Option<usize>, u64),
    lowered: Lowered,
    config: LaunchConfig,
    table: CudaSlice<u8>,
    counters: CudaSlice<u32>,
    workspace: CudaSlice<f32>,
    /// The f32 residual stream of the fused MLP stages (`fuse_mlp = 1`), `[max_rows, C]`.
    _mlp_acc: Option<CudaSlice<f32>>,
    timeline: Option<CudaSlice<u64>>,
    /// A step with stamps was launched and not read back yet.
    stamped: bool,
}

/// The tuning-database key of the decode step of `b` sequences of `cfg` in `dtype`: the
/// megakernel's op, dtype and shape (the model's dimensions). `tune --decode-step` reads it back
/// without a backend.
pub fn decode_step_key(cfg: &GPT2Config, dtype: Dtype, b: usize) -> crate::tune::db::TuneKey {
    crate::tune::db::TuneKey {
        op: DECODE_STEP_OP.to_string(),
        dtype: op_dtype(dtype).to_string(),
        variant_kind: variant_kind(Epilogue::None, Mask::None).to_string(),
        shape: shape(&[
            ("B", b as i64),
            ("C", cfg.n_embd as i64),
            ("NH", cfg.n_head as i64),
            ("L", cfg.n_layer as i64),
            ("HS", cfg.head_dim() as i64),
            ("Vp", cfg.padded_vocab_size as i64),
            ("max_T", cfg.n_ctx as i64),
            ("elem_bytes", dtype.storage().bytes() as i64),
        ]),
    }
}

impl GpuBackend {
    /// [`decode_step_key`] of this backend's model and dtype.
    pub fn decode_step_key(&self, b: usize) -> crate::tune::db::TuneKey {
        decode_step_key(&self.model.config, self.dtype, b)
    }

    /// The decode_step kernel for batch `b`: tuned or default point of the megakernel family,
    /// for the whole batch when this backend runs a slice of one (see `set_selection_batch`; a
    /// point for more rows runs fewer, and every point of the whole batch's keeps its
    /// arithmetic, such as the layernorm's block reduction, for every sequence).
    fn megakernel_kernel(&mut self, b: usize) -> AnyResult<Kernel> {
        let b = self.megakernel_rows(b);
        let key = self.decode_step_key(b);
        let s = key.shape.clone();
        // The point set for tuning; else a tuned point when the database has one for this model
        // and batch; else the default, fitted to the batch.
        let point = if !self.megakernel_point.is_empty() {
            self.megakernel_point.clone()
        } else {
            if self.registry.db.as_ref().is_some_and(|db| db.get(&key).is_some()) {
                return self.kernel(DECODE_STEP_OP, DECODE_STEP_OP, Epilogue::None, Mask::None, s, None);
            }
            let family = self.registry.catalog.family(MEGAKERNEL_FAMILY)?;
            let point = fitted_default(family, &s, op_dtype(self.dtype), &self.gpu.info.limits);
            let kernel = self.megakernel_at(&s, &point)?;
            // The fitted point is chosen from the limits alone. Where an SM cannot hold a block
            // of it (512 threads need at most 128 registers each in a 64 Ki register file, as a
            // T4 has), 256 threads do. (The point names `threads` only where it changes the
            // spec's default: ask the variant.)
            let threads = kernel.loaded.variant.params.get("threads").copied().unwrap_or(0);
            if threads <= 256 || self.megakernel_fits(&kernel)? {
                return Ok(kernel);
            }
            let mut narrower = point.clone();
            narrower.retain(|(k, _)| k != "threads");
            narrower.push(("threads".to_string(), 256));
            return Ok(self.megakernel_at(&s, &narrower).unwrap_or(kernel));
        };
        self.megakernel_at(&s, &point)
    }

    fn megakernel_at(&mut self, s: &crate::ops::Shape, point: &[(String, i64)]) -> AnyResult<Kernel> {
        let family = Some(MEGAKERNEL_FAMILY);
        self.kernel_at(
            DECODE_STEP_OP,
            DECODE_STEP_OP,
            Epilogue::None,
            Mask::None,
            s.clone(),
            family,
            point,
        )
    }

    /// Whether every SM holds the `blocks_per_sm` blocks of `kernel` at once (a cooperative
    /// launch needs them all resident).
    fn megakernel_fits(&self, kernel: &Kernel) -> AnyResult<bool> {
        let (per_sm, want) = self.megakernel_occupancy(kernel)?;
        Ok(per_sm >= want)
    }

    /// The blocks of `kernel` an SM holds at once, and the blocks per SM its point asks for.
    fn megakernel_occupancy(&self, kernel: &Kernel) -> AnyResult<(u32, u32)> {
        let launch = &kernel.launches[0];
        kernel.loaded.allow_shared_memory(&kernel.launches)?;
        let function = kernel.loaded.function(launch)?;
        let want = kernel
            .loaded
            .variant
            .params
            .get("blocks_per_sm")
            .copied()
            .unwrap_or(1)
            .max(1);
        let per_sm = self.gpu.blocks_per_sm(function, launch.block[0], launch.smem_bytes)?;
        Ok((per_sm, u32::try_from(want).unwrap_or(u32::MAX)))
    }

    /// The batch the megakernel's point and attention chunks are chosen for when it runs `b`
    /// sequences: the whole batch this backend runs a slice of, if a point of the family can
    /// take that many rows (else the slice, as a kernel that cannot run the whole batch is
    /// replaced by the slice's own choice).
    fn megakernel_rows(&self, b: usize) -> usize {
        let whole = self.selection_batch.unwrap_or(b).max(b);
        if whole <= self.megakernel_most_rows() {
            whole
        } else {
            b
        }
    }

    /// The most sequences a point of the megakernel family holds for this model, dtype and GPU
    /// ([`most_rows`]; 0 without the family), worked out once.
    pub(super) fn megakernel_most_rows(&self) -> usize {
        *self.megakernel_rows_held.get_or_init(|| {
            let (cfg, dtype) = (&self.model.config, self.dtype);
            self.registry.catalog.family(MEGAKERNEL_FAMILY).map_or(0, |family| {
                let step_shape = |b: usize| decode_step_key(cfg, dtype, b).shape;
                most_rows(family, &step_shape, op_dtype(dtype), &self.gpu.info.limits)
            })
        })
    }

    /// Run the megakernel at this point of `decode_megakernel` (the default with these params
    /// changed; empty: the tuned winner or the default) from the next decode step on.
    pub fn set_megakernel_point(&mut self, point: Vec<(String, i64)>) {
        if point != self.megakernel_point {
            self.discard_ahead();
            self.megakernel = None;
            self.megakernel_point = point;
        }
    }

    /// Lowers the greedy decode plan of batch `b`, checks it and uploads it (once per batch
    /// size and buffer generation).
    pub(super) fn prepare_megakernel(&mut self, ks: &Kernels, b: usize) -> AnyResult<()> {
        // Checked every step: the key holds the inputs of the table, not what is derived from them.
        let key = (b, self.selection_batch, self.buffers_generation);
        if self.megakernel.as_ref().is_some_and(|m| m.key == key) {
            return Ok(());
        }
        self.megakernel = None;
        let whole = self.megakernel_rows(b);
        let kernel = self.megakernel_kernel(b)?;
        let variant = &kernel.loaded.variant;
        let launch = kernel.launches[0].clone();
        let param = |name: &str| {
            let value = variant.params.get(name).or_else(|| variant.derived.get(name));
            value.copied().unwrap_or(0).max(0) as usize
        };
        let cfg = &self.model.config;
        let geo = Geometry {
            grid: launch.grid[0] as usize,
            slot_bytes: param("slot_bytes"),
            elem_bytes: self.dtype.storage().bytes(),
            max_rows: param("max_rows"),
            input_row_elems: 4 * cfg.n_embd,
            norm_row_elems: launch.block[0] as usize * 16 / self.dtype.storage().bytes(),
            head_dim: param("head_dim"),
            // with tensor cores a task's width barely moves its time (warps take 8-column tiles
            // and split K between them): one pass, whatever the width
            col_unit: if param("tensor_cores") == 1 {
                MAX_TASK_COLS
            } else {
                launch.block[0] as usize / 32 * param("cols_per_warp").max(1)
            },
            chunk_rows: whole,
        };
        // The cache length does not matter to the table: the kernel gets the position.
        let plan: Plan = self.build_plan(
            ks,
            b,
            1,
            self.len.max(1) - 1,
            Pass::Decode {
                from_draw: false,
                slot: 0,
            },
            HeadRows::Greedy,
        )?;
        let ops: Vec<PlanOp> = plan
            .nodes()
            .map(|n| PlanOp {
                role: n.kernel.role.to_string(),
                op: n.kernel.loaded.variant.family.op.name().to_string(),
                epilogue: n.kernel.loaded.variant.epilogue,
                args: n.args.clone(),
                layer: n.layer,
            })
            .collect();
        let mlp_acc = if param("fuse_mlp") == 1 {
            let acc = self
                .gpu
                .stream
                .alloc_zeros::<f32>(geo.max_rows * self.model.config.n_embd.div_ceil(4) * ACC_SPREAD)
                .map_err(GpuError::cuda("allocating the fused MLP's residual stream"))?;
            Some(acc)
        } else {
            None
        };
        let mlp = match &mlp_acc {
            Some(acc) => Some(MlpFusion {
                acc: ptr(&self.gpu, acc),
                transposed: self.mlp_transposed_weights()?,
            }),
            None => None,
        };
        let lowered = lower(&ops, &geo, mlp.as_ref())?;
        check_schedule(&lowered)?;
        // Every block must be resident at once: ask the driver how many fit, before launching.
        let (per_sm, want) = self.megakernel_occupancy(&kernel)?;
        if per_sm < want {
            let function = kernel.loaded.function(&launch)?;
            let registers = function.num_regs().unwrap_or(-1);
            let static_smem = function.shared_size_bytes().unwrap_or(-1);
            anyhow::bail!(
                "{}: {want} blocks per SM of {} threads ({registers} registers each) and {} + {static_smem} bytes of \
                 dynamic + static shared memory do not fit on {} (the occupancy query allows {per_sm}); choose a \
                 smaller point (threads, blocks_per_sm, slot_kib, slots, max_rows) or run --decode-engine graph",
                kernel.label,
                launch.block[0],
                launch.smem_bytes,
                self.gpu.info.name
            );
        }
        let stream = &self.gpu.stream;
        let bytes: Vec<u8> = lowered.stages.iter().flat_map(StageRecord::bytes).collect();
        let table = stream
            .clone_htod(&bytes)
            .map_err(GpuError::cuda("uploading the megakernel stage table"))?;
        let counters = stream
            .alloc_zeros::<u32>(lowered.counters)
            .map_err(GpuError::cuda("allocating the megakernel counters"))?;
        let workspace = stream
            .alloc_zeros::<f32>(lowered.workspace_floats.max(1))
            .map_err(GpuError::cuda("allocating the megakernel workspace"))?;
        let config = LaunchConfig {
            grid_dim: (launch.grid[0], 1, 1),
            block_dim: (launch.block[0], 1, 1),
            shared_mem_bytes: launch.smem_bytes,
        };
        self.megakernel = Some(MegakernelState {
            kernel,
            // After the plan was built: building it may have grown a buffer.
            key: (b, self.selection_batch, self.buffers_generation),
            lowered,
            config,
            table,
            counters,
            workspace,
            _mlp_acc: mlp_acc,
            timeline: None,
            stamped: false,
        });
        Ok(())
    }

    /// Each layer's fc projection weight transposed to `[4C, C]` (uploaded once, on the first
    /// fused MLP stage table), by the pointer of the weight it transposes: an MLP task's share
    /// of the projection is then a run of whole rows, one contiguous copy.
    fn mlp_transposed_weights(&mut self) -> AnyResult<HashMap<u64, u64>> {
        if self.mlp_weights.is_empty() {
            let c = self.model.config.n_embd;
            let storage = self.dtype.storage();
            let layers = &self.model.weights.layers;
            let free = self.free_memory("the fused MLP's weights")?;
            transposed_copy_fits(&self.device_label(), layers.len() * 4 * c * c * storage.bytes(), free)
                .map_err(|why| anyhow::anyhow!(why))?;
            // all layers or none: a failed upload leaves nothing behind for the next step to use
            let mut uploaded = Vec::with_capacity(layers.len());
            for (l, layer) in layers.iter().enumerate() {
                let t = transpose(&layer.fc_proj_w, c, 4 * c); // [C, 4C] -> [4C, C]
                let up = self
                    .gpu
                    .stream
                    .clone_htod(&storage.encode(&t))
                    .map_err(GpuError::cuda(format!("uploading h.{l}.fc_proj_w transposed")))?;
                uploaded.push(up);
            }
            self.mlp_weights = uploaded;
        }
        Ok(self
            .layers
            .iter()
            .zip(&self.mlp_weights)
            .map(|(layer, t)| (layer.fc_proj_w, ptr(&self.gpu, t)))
            .collect())
    }

    /// Whether the last decode step's megakernel draws `params`' tokens in its LM head, with no
    /// sample op after the step (false on the other engines, or before a megakernel step).
    pub fn lm_head_draws(&self, params: &SamplingParams) -> bool {
        self.step_engine() == crate::model::engine::DecodeEngine::Megakernel
            && drawn_in_lm_head(params, self.model.config.vocab_size, self.megakernel_lm_head().as_ref())
    }

    /// The LM head of the megakernel prepared last (for [`drawn_in_lm_head`]).
    pub(super) fn megakernel_lm_head(&self) -> Option<LmHeadTasks> {
        let m = self.megakernel.as_ref()?;
        let head = m.lowered.stages.last()?;
        Some(LmHeadTasks {
            tasks: head.tasks as usize,
            cols: head.cols as usize,
            shared_bytes: m.config.shared_mem_bytes as usize,
        })
    }

    /// One decode step of batch `b` at position `pos` as one cooperative launch: writes the
    /// logits and the next ids, drawn by `draw` (one [`drawn_in_lm_head`] takes for this
    /// megakernel's [`GpuBackend::megakernel_lm_head`]; `None`:
    /// greedy). Its input tokens are the uploaded ids, or with `tokens_on_device` the previous
    /// step's next ids (their slot of `act.next_ids`; this step's go to the other). Launched,
    /// not waited for. The caller has prepared the megakernel for `b`
    /// ([`GpuBackend::prepare_megakernel`]: it decides the draw from the prepared table).
    pub(super) fn megakernel_step(
        &mut self,
        b: usize,
        pos: usize,
        tokens_on_device: bool,
        draw: Option<&Draw>,
    ) -> AnyResult<()> {
        let cfg = self.model.config.clone();
        let events = self.profile_begin()?;
        let gpu = &self.gpu;
        let next_ids = self.act.next_ids.host_ptr(self.draw_slot);
        let next_ids_copy = self.act.next_ids.device_ptr(self.draw_slot);
        let ids = if tokens_on_device {
            self.act.next_ids.input_of(self.draw_slot)
        } else {
            ptr(gpu, &self.act.ids)
        };
        let m = self.megakernel.as_mut().expect("prepared above");
        if self.timeline_on && m.timeline.is_none() {
            m.timeline = Some(
                gpu.stream
                    .alloc_zeros::<u64>(STAMPS * m.lowered.total_tasks())
                    .map_err(GpuError::cuda("allocating the timeline stamps"))?,
            );
        }
        let timeline = match (&m.timeline, self.timeline_on) {
            (Some(t), true) => ptr(gpu, t),
            _ => 0,
        };
        m.stamped = timeline != 0;
        let table = ptr(gpu, &m.table);
        let (counters, workspace) = (ptr(gpu, &m.counters), ptr(gpu, &m.workspace));
        let n_stages = m.lowered.stages.len() as i32;
        let (batch, pos_arg, n_head, max_t, vocab) = (
            b as i32,
            pos as i32,
            cfg.n_head as i32,
            cfg.n_ctx as i32,
            cfg.vocab_size as i32,
        );
        let scale = 1.0f32 / (cfg.head_dim() as f32).sqrt();
        // 0: the argmax; else the Gumbel-max at this temperature, keyed as the sampler keys it,
        // over the whole row (top_k 0) or over what top-k, then top-p, keep.
        let (inv_temperature, seed_lo, seed_hi, seq0, top_k, top_p) = match draw {
            Some(d) if !d.params.is_greedy() => {
                let top_k = if d.params.cuts_top_k(cfg.vocab_size) {
                    d.params.top_k
                } else {
                    0
                };
                (
                    1.0f32 / d.params.temperature,
                    d.seed as u32 as i32,
                    (d.seed >> 32) as u32 as i32,
                    i32::try_from(d.first_sequence).unwrap_or(i32::MAX),
                    i32::try_from(top_k).unwrap_or(i32::MAX),
                    d.params.top_p,
                )
            }
            _ => (0.0f32, 0, 0, 0, 0, 1.0f32),
        };
        let mut launch = gpu
            .stream
            .launch_builder(m.kernel.loaded.function(&m.kernel.launches[0])?);
        launch
            .arg(&table)
            .arg(&n_stages)
            .arg(&counters)
            .arg(&workspace)
            .arg(&ids)
            .arg(&next_ids)
            .arg(&next_ids_copy)
            .arg(&timeline)
            .arg(&batch)
            .arg(&pos_arg)
            .arg(&n_head)
            .arg(&max_t)
            .arg(&vocab)
            .arg(&scale)
            .arg(&inv_temperature)
            .arg(&seed_lo)
            .arg(&seed_hi)
            .arg(&seq0)
            .arg(&top_k)
            .arg(&top_p);
        // SAFETY: the arguments follow the decode_step signature; the table points into this
        // backend's live weights and buffers (rebuilt whenever a buffer is reallocated), the
        // counters are zero between launches (the kernel resets them on exit), and the launch is
        // cooperative, so the driver refuses it unless every block can be resident at once.
        let launched = unsafe { launch.launch_cooperative(m.config) };
        let label = m.kernel.label.clone();
        if let Err(e) = launched {
            self.megakernel = None; // its counters may be anything now
            return Err(GpuError::cuda("launching the decode megakernel (cooperative)")(e).into());
        }
        self.profile_end(events, DECODE_STEP_OP, &label)?;
        if self.sync_each {
            self.gpu.synchronize().context("the decode megakernel failed")?;
        }
        Ok(())
    }

    /// After a synchronized step: the stamps of the last megakernel step, when it recorded any.
    pub(super) fn read_timeline(&mut self) -> AnyResult<()> {
        let Some(m) = self.megakernel.as_mut().filter(|m| m.stamped) else {
            return Ok(());
        };
        m.stamped = false;
        let Some(buffer) = &m.timeline else {
            return Ok(());
        };
        let stamps = self
            .gpu
            .stream
            .clone_dtoh(buffer)
            .map_err(GpuError::cuda("reading the timeline stamps"))?;
        let grid = m.config.grid_dim.0;
        let origin = stamps.iter().step_by(STAMPS).copied().min().unwrap_or(0);
        let mut tasks = Vec::with_capacity(stamps.len() / STAMPS);
        for (s, stage) in m.lowered.stages.iter().enumerate() {
            for t in stage.first_task..stage.first_task + stage.tasks {
                let at = STAMPS * t as usize;
                tasks.push(TaskStamp {
                    block: t as u32 % grid,
                    op: STAGE_OPS[stage.op as usize].to_string(),
                    layer: m.lowered.layers[s].map(|l| l as u32),
                    start_ns: stamps[at].saturating_sub(origin),
                    ready_ns: stamps[at + 1].saturating_sub(origin),
                    data_ns: stamps[at + 2].saturating_sub(origin),
                    end_ns: stamps[at + 3].saturating_sub(origin),
                });
            }
        }
        self.timeline = Some(Timeline { blocks: grid, tasks });
        Ok(())
    }

    /// The megakernel set up last (its point, where the point came from, its table's size),
    /// when one is.
    pub fn megakernel_summary(&self) -> Option<MegakernelSummary> {
        self.megakernel.as_ref().map(|m| MegakernelSummary {
            point: m.kernel.loaded.variant.params.clone(),
            choice: m.kernel.choice,
            stages: m.lowered.stages.len(),
            tasks: m.lowered.total_tasks(),
        })
    }
}

/// `Err` with the figures and the fixes when the fused MLP's transposed projections (`bytes`,
/// every layer's) do not fit in the `free` bytes of `device` (the replica's own estimate at
/// start-up does not count them: only a megakernel point with `fuse_mlp` uploads them).
fn transposed_copy_fits(device: &str, bytes: usize, free: usize) -> Result<(), String> {
    // what the step still allocates after them: the stage table, counters and workspace
    const MARGIN: usize = 64 << 20;
    upload_fits(device, bytes, MARGIN, free, |bytes, free| {
        format!(
            "the decode megakernel's fused MLP stages (fuse_mlp = 1) keep a transposed copy of every fc \
             projection, {bytes:.2} GiB, and the GPU has {free:.2} GiB free; free memory on the GPU (fewer \
             sequences, other processes) or run --decode-engine graph"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::transposed_copy_fits;

    #[test]
    fn the_transposed_copy_is_refused_with_its_size_and_the_fix_when_it_does_not_fit() {
        let gib = 1usize << 30;
        assert!(transposed_copy_fits("cuda:0", gib, 2 * gib).is_ok());
        let e = transposed_copy_fits("cuda:0 (H100)", gib, gib).unwrap_err();
        assert!(e.starts_with("cuda:0 (H100): "), "{e}");
        assert!(e.contains("1.00 GiB, and the GPU has 1.00 GiB free"), "{e}");
        assert!(e.contains("--decode-engine graph") && e.contains("fuse_mlp = 1"), "{e}");
    }
}
