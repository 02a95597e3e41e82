//! The stage table of the decode megakernel: a greedy decode [`Plan`](super::plan::Plan)
//! lowered to stages of tasks ([`lower`]) and checked so that no schedule that can deadlock is
//! ever launched ([`check_schedule`]). Pure data, no GPU: the executor is `megakernel.rs`.
//!
//! Lowering fuses what only exists to be launched: each layernorm into the matrix-vector stage
//! that reads it (the stage recomputes the row statistics), the attention's append into the QKV
//! stage (k and v are written straight into the cache), attention's partial results and their combination
//! into one stage, the residual adds into the projections, the greedy argmax into the LM head.
//! With [`MlpFusion`] (the spec's `fuse_mlp = 1`), each layer's fc and fc projection become
//! one stage: a task computes a slice of the hidden units and adds their share of the
//! projection into an f32 copy of the residual stream (see `StageFlags` in the template).
//! Each stage is cut into tasks (one block's share: a run of output columns, whose weight rows
//! are one contiguous range, or one (sequence, head, cache chunk) of attention) so that a stage
//! is about one wave of the resident grid, and no task's weights outgrow a shared-memory slot.
//!
//! The check: tasks are numbered in stage order and every stage waits only for an earlier
//! stage, for a count that stage reaches. With every block resident (a cooperative launch, which
//! the driver refuses otherwise) and each block running its tasks in increasing order, such a
//! table always completes: the unfinished task with the smallest number never waits.

use crate::gpu::ArgValue;
use crate::ops::{self, Epilogue};

mod record;
use record::*;
pub use record::{StageRecord, STAGE_OPS};

/// The widest matrix-vector task (columns) and the most stages a table may have: `MAX_TASK_COLS`
/// and `MAX_STAGES` of the template.
pub const MAX_TASK_COLS: usize = 128;
/// The longest cache chunk the host gives one attention task (a longer cache gets more chunks a
/// head, so that no task's share of the keys takes much longer than a wave of the others).
const MAX_CHUNK: usize = 1024;
const MAX_STAGES: usize = 512;
/// Floats from one group of 4 values of the fused MLP's f32 residual stream to the next (one
/// group a 128-byte line): `ACC_SPREAD` of the template.
pub const ACC_SPREAD: usize = 32;

/// What the stage table cannot express or would not run safely.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MegakernelError {
    #[error("the megakernel cannot run {role} ({op}): it runs the fused decode plan (embedding, layernorm + matmul, attention_decode, argmax); {fix}")]
    Unsupported { role: String, op: String, fix: String },
    #[error("{role}: one weight row is {row_bytes} bytes but a weight slot of the decode_megakernel point holds {slot_bytes}; choose a point with a larger slot_kib (a smaller batch, and with it max_rows, leaves shared memory for larger slots) or run --decode-engine graph")]
    SlotTooSmall {
        role: String,
        row_bytes: usize,
        slot_bytes: usize,
    },
    #[error("{role}: {why}")]
    Shape { role: String, why: String },
    #[error("unsafe megakernel schedule, stage {stage} ({op}): {why}; refusing to launch it")]
    UnsafeSchedule { stage: usize, op: String, why: String },
}

/// What fusing each layer's fc and fc projection into one stage needs: the f32 residual stream
/// the stage's tasks add their shares into (`[max_rows, C]` floats), and each layer's fc
/// projection weight transposed (`[4C, C]`: a task's hidden units are then whole rows), by the
/// pointer of the weight it transposes.
#[derive(Clone, Debug, Default)]
pub struct MlpFusion {
    pub acc: u64,
    pub transposed: std::collections::HashMap<u64, u64>,
}

/// One node of the decode plan, as much of it as lowering reads.
#[derive(Clone, Debug)]
pub struct PlanOp {
    /// Where in the model: `embedding`, `layernorm`, `qkv`, `attention`, ...
    pub role: String,
    /// The op contract: `encoder`, `layernorm`, `matmul`, `attention_decode`, `argmax`.
    pub op: String,
    pub epilogue: Epilogue,
    /// In the op's signature order.
    pub args: Vec<ArgValue>,
    pub layer: Option<usize>,
}

/// What the table is cut for.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// Resident blocks.
    pub grid: usize,
    /// One weight slot of the ring.
    pub slot_bytes: usize,
    /// Bytes of the storage type.
    pub elem_bytes: usize,
    /// Rows the kernel is compiled for, and the staged input row capacity (elements per row).
    pub max_rows: usize,
    pub input_row_elems: usize,
    /// The widest row a fused layernorm can normalise (one 16-byte vector per thread).
    pub norm_row_elems: usize,
    /// Head size the kernel is compiled for.
    pub head_dim: usize,
    /// Output columns a block computes in one pass (warps x columns per warp): a task of
    /// `cols` columns takes `cols.div_ceil(col_unit)` passes.
    pub col_unit: usize,
    /// Sequences attention's cache chunks are counted for (at least the plan's batch): a replica
    /// running a slice of a batch counts them for the whole batch, so every sequence's keys are
    /// cut and summed as on one GPU.
    pub chunk_rows: usize,
}

/// A lowered decode step.
#[derive(Clone, Debug)]
pub struct Lowered {
    pub stages: Vec<StageRecord>,
    /// The layer of each stage (timeline labels).
    pub layers: Vec<Option<usize>>,
    /// Floats of workspace the kernel needs (attention partials, then argmax partials, then a
    /// top-k draw's heads).
    pub workspace_floats: usize,
    /// Counters: one per stage, one per attention head, argmax arrivals, blocks leaving.
    pub counters: usize,
    pub heads: usize,
}

impl Lowered {
    pub fn total_tasks(&self) -> usize {
        self.stages.last().map_or(0, |s| (s.first_task + s.tasks) as usize)
    }
}

/// The argument called `name` of `node`, found where its op's signature puts it
/// (`templates/README.md`), so that a new argument in a signature moves nothing here.
fn arg_of<'a>(node: &'a PlanOp, name: &str) -> Option<&'a ArgValue> {
    let index = ops::op_by_name(&node.op).and_then(|op| ops::arg_index(op, name));
    debug_assert!(index.is_some(), "the {} op has no argument `{name}`", node.op);
    node.args.get(index?)
}

/// The pointer argument `name` of `node` (0 where it has none).
fn ptr_arg(node: &PlanOp, name: &str) -> u64 {
    match arg_of(node, name) {
        Some(ArgValue::Ptr(p)) => *p,
        _ => 0,
    }
}

/// The int argument `name` of `node` (0 where it has none, or a negative one).
fn int_arg(node: &PlanOp, name: &str) -> usize {
    match arg_of(node, name) {
        Some(ArgValue::I32(v)) => (*v).max(0) as usize,
        _ => 0,
    }
}

fn stage_op(role: &str) -> i32 {
    let name = if role == "embedding" { "embed" } else { role };
    STAGE_OPS.iter().position(|o| *o == name).unwrap_or(0) as i32
}

/// Columns per task for an `n x k` matrix: each task's rows within one slot and at most
/// `MAX_TASK_COLS` columns, cut so that the stage finishes soonest. A stage costs about
/// `waves * (passes + 1)`: `waves` rounds of the grid, each task `passes` passes of the block
/// over its columns plus a fixed cost (its wait, its input, its signal). Of equal costs the
/// narrowest task wins (more blocks share the weight stream).
fn cut_columns(role: &str, n: usize, k: usize, geo: &Geometry) -> Result<usize, MegakernelError> {
    let row_bytes = k * geo.elem_bytes;
    if row_bytes > geo.slot_bytes {
        return Err(MegakernelError::SlotTooSmall {
            role: role.to_string(),
            row_bytes,
            slot_bytes: geo.slot_bytes,
        });
    }
    let cap = (geo.slot_bytes / row_bytes).min(MAX_TASK_COLS).min(n.max(1));
    let cost = |cols: usize| n.div_ceil(cols).div_ceil(geo.grid.max(1)) * (cols.div_ceil(geo.col_unit.max(1)) + 1);
    Ok((1..=cap).min_by_key(|&cols| (cost(cols), cols)).unwrap_or(1))
}

/// Columns per MLP task: its fc rows (`k` each) and its rows of the transposed projection
/// (`n2` each) share a slot, half each.
fn cut_mlp_columns(role: &str, n: usize, k: usize, n2: usize, geo: &Geometry) -> Result<usize, MegakernelError> {
    let half = Geometry {
        slot_bytes: geo.slot_bytes / 2,
        ..*geo
    };
    cut_columns(role, n, k.max(n2), &half)
}

/// Fuses the fc projection `proj` into the fc stage `fc` (a layernorm stage) when `mlp` is
/// given and the plan has the shape the fused stage computes: the projection reads fc's output
/// and adds the residual stream fc's layernorm reads, and that stream is the output of the
/// attention projection just before (`prev`). Returns the buffer the fused projection would
/// have written (later stages read it from `acc` instead).
fn fuse_mlp(
    fc: &mut StageRecord,
    prev: Option<&mut StageRecord>,
    proj: &PlanOp,
    mlp: Option<&MlpFusion>,
    geo: &Geometry,
) -> Result<Option<u64>, MegakernelError> {
    let (Some(mlp), Some(prev)) = (mlp, prev) else {
        return Ok(None);
    };
    let (n2, k2) = (int_arg(proj, "N"), int_arg(proj, "K"));
    let Some(&transposed) = mlp.transposed.get(&ptr_arg(proj, "weight")) else {
        return Ok(None);
    };
    let fits = proj.op == "matmul"
        && proj.epilogue == Epilogue::BiasResidual
        && fc.epilogue == epilogue_code(Epilogue::BiasGelu)
        && fc.flags == FLAG_LAYERNORM
        && ptr_arg(proj, "inp") == fc.out
        && ptr_arg(proj, "residual") == fc.input
        && k2 == fc.n as usize
        && n2 == fc.k as usize
        && n2 % 4 == 0
        && prev.kind == STAGE_MATVEC
        && prev.epilogue == epilogue_code(Epilogue::BiasResidual)
        && prev.out == fc.input
        && prev.n as usize == n2
        // each row's f32 sums of the block's tasks (mlp_project) sit after the staged input row
        && fc.k as usize * geo.elem_bytes + 4 * n2 <= geo.input_row_elems * geo.elem_bytes;
    if !fits {
        return Ok(None);
    }
    fc.cols = cut_mlp_columns(&proj.role, fc.n as usize, fc.k as usize, n2, geo)? as i32;
    fc.tasks = (fc.n as usize).div_ceil(fc.cols as usize) as i32;
    fc.flags |= FLAG_MLP;
    fc.op = stage_op("mlp");
    fc.n2 = n2 as i32;
    fc.weight2 = transposed;
    fc.acc = mlp.acc;
    fc.out = 0;
    prev.flags |= FLAG_INIT_ACC;
    prev.acc = mlp.acc;
    prev.bias2 = ptr_arg(proj, "bias");
    Ok(Some(ptr_arg(proj, "out")))
}

/// Lowers a greedy decode plan to the stage table (see the module docs); `mlp` fuses each
/// layer's fc and fc projection into one stage.
pub fn lower(ops: &[PlanOp], geo: &Geometry, mlp: Option<&MlpFusion>) -> Result<Lowered, MegakernelError> {
    struct PendingNorm {
        out: u64,
        input: u64,
        gamma: u64,
        beta: u64,
    }
    let mut stages: Vec<StageRecord> = Vec::new();
    let mut layers = Vec::new();
    let mut pending: Option<PendingNorm> = None;
    // The buffer whose value lives in `mlp.acc` (the fused MLP's output, never stored).
    let mut in_acc: Option<u64> = None;
    let (mut batch, mut heads, mut attention_floats) = (0usize, 0usize, 0usize);
    let vec_elems = 16 / geo.elem_bytes;
    let mut i = 0;
    while i < ops.len() {
        let node = &ops[i];
        let unsupported = |fix: &str| MegakernelError::Unsupported {
            role: node.role.clone(),
            op: node.op.clone(),
            fix: fix.to_string(),
        };
        let shape_err = |why: String| MegakernelError::Shape {
            role: node.role.clone(),
            why,
        };
        let mut stage = StageRecord {
            op: stage_op(&node.role),
            wait_stage: -1,
            ..Default::default()
        };
        match node.op.as_str() {
            "encoder" => {
                batch = int_arg(node, "B");
                if int_arg(node, "T") != 1 {
                    return Err(shape_err("a decode step embeds one token per sequence".into()));
                }
                stage.kind = STAGE_EMBED;
                stage.tasks = 1;
                stage.n = int_arg(node, "C") as i32;
                stage.out = ptr_arg(node, "out");
                stage.weight = ptr_arg(node, "wte");
                stage.aux = ptr_arg(node, "wpe");
            }
            "layernorm" => {
                // Fused into the stage that reads `out`.
                if pending.is_some() {
                    return Err(unsupported("two layernorms in a row leave the first unread"));
                }
                pending = Some(PendingNorm {
                    out: ptr_arg(node, "out"),
                    input: ptr_arg(node, "inp"),
                    gamma: ptr_arg(node, "gamma"),
                    beta: ptr_arg(node, "beta"),
                });
                i += 1;
                continue;
            }
            "matmul" => {
                let (m, n, k) = (int_arg(node, "M"), int_arg(node, "N"), int_arg(node, "K"));
                if m != batch {
                    return Err(shape_err(format!("{m} rows for a batch of {batch}")));
                }
                if m > geo.max_rows {
                    return Err(shape_err(format!(
                        "batch {m} is larger than the {} rows the decode_megakernel point is compiled for (max_rows)",
                        geo.max_rows
                    )));
                }
                if k % vec_elems != 0 || k > geo.input_row_elems {
                    return Err(shape_err(format!(
                        "K = {k} must be a multiple of {vec_elems} and at most {}",
                        geo.input_row_elems
                    )));
                }
                stage.kind = STAGE_MATVEC;
                stage.n = n as i32;
                stage.k = k as i32;
                stage.cols = cut_columns(&node.role, n, k, geo)? as i32;
                stage.tasks = n.div_ceil(stage.cols as usize) as i32;
                stage.out = ptr_arg(node, "out");
                stage.input = ptr_arg(node, "inp");
                stage.weight = ptr_arg(node, "weight");
                stage.bias = ptr_arg(node, "bias");
                stage.residual = ptr_arg(node, "residual");
                if let Some(norm) = pending.take() {
                    if k > geo.norm_row_elems {
                        return Err(shape_err(format!(
                            "a fused layernorm keeps one 16-byte vector per thread: rows of at most {} elements, \
                             not {k}; choose a decode_megakernel point with more threads",
                            geo.norm_row_elems
                        )));
                    }
                    if norm.out != stage.input {
                        return Err(unsupported("a layernorm must feed the matmul right after it"));
                    }
                    stage.flags |= FLAG_LAYERNORM;
                    stage.input = norm.input;
                    stage.gamma = norm.gamma;
                    stage.beta = norm.beta;
                }
                if node.epilogue.standardizes_input() {
                    return Err(unsupported(
                        "an ln_ matmul (a layernorm folded into a prefill GEMM) is not a decode stage",
                    ));
                }
                stage.epilogue = epilogue_code(node.epilogue);
                if node.epilogue == Epilogue::Qkv {
                    // The attention after it appends the step's k and v to the caches: here the
                    // QKV stage writes them there itself.
                    match ops.get(i + 1) {
                        Some(next) if next.op == "attention_decode" => {
                            stage.k_cache = ptr_arg(next, "k_cache");
                            stage.v_cache = ptr_arg(next, "v_cache");
                        }
                        _ => return Err(unsupported("the QKV matmul must be followed by attention_decode")),
                    }
                }
                if let Some(acc) = in_acc {
                    // x'' of a fused MLP: read from the f32 residual stream
                    if stage.input == acc {
                        if stage.flags & FLAG_LAYERNORM == 0 {
                            return Err(unsupported(
                                "a fused MLP's output is read only through a layernorm or as a residual; \
                                 choose a decode_megakernel point with fuse_mlp = 0",
                            ));
                        }
                        stage.flags |= FLAG_INPUT_ACC;
                        stage.input = 0;
                    }
                    if stage.residual == acc {
                        stage.flags |= FLAG_RESIDUAL_ACC;
                        stage.residual = 0;
                    }
                    if stage.flags & (FLAG_INPUT_ACC | FLAG_RESIDUAL_ACC) != 0 {
                        stage.acc = mlp.map_or(0, |m| m.acc);
                    }
                    if stage.out == acc {
                        in_acc = None;
                    }
                }
                if node.epilogue == Epilogue::BiasGelu {
                    if let Some(proj) = ops.get(i + 1) {
                        if let Some(out) = fuse_mlp(&mut stage, stages.last_mut(), proj, mlp, geo)? {
                            in_acc = Some(out);
                            i += 1;
                        }
                    }
                }
                if let Some(next) = ops.get(i + 1).filter(|o| o.op == "argmax") {
                    // The argmax partials go to the workspace.
                    if ptr_arg(next, "logits") != stage.out {
                        return Err(unsupported("argmax must read the LM head's logits"));
                    }
                    stage.flags |= FLAG_ARGMAX;
                    i += 1;
                }
            }
            "attention_decode" => {
                let (b, nh, max_t, hs) = (
                    int_arg(node, "B"),
                    int_arg(node, "NH"),
                    int_arg(node, "max_T"),
                    int_arg(node, "HS"),
                );
                if hs != geo.head_dim {
                    return Err(shape_err(format!(
                        "head size {hs}, but the decode_megakernel point is compiled for head_dim {}",
                        geo.head_dim
                    )));
                }
                let rows = geo.chunk_rows.max(b);
                let chunks = (geo.grid / (rows * nh).max(1)).max(max_t.div_ceil(MAX_CHUNK)).max(1);
                heads = b * nh;
                stage.kind = STAGE_ATTENTION;
                stage.cols = chunks as i32;
                stage.tasks = (b * nh * chunks) as i32;
                stage.out = ptr_arg(node, "out");
                stage.input = ptr_arg(node, "q");
                stage.k_cache = ptr_arg(node, "k_cache");
                stage.v_cache = ptr_arg(node, "v_cache");
                attention_floats = attention_floats.max(b * nh * chunks * (hs + 2));
            }
            "kv_append" => {
                return Err(unsupported(
                    "a decode step appends to the cache in its attention, not by kv_append",
                ))
            }
            "argmax" => return Err(unsupported("argmax must follow the LM head")),
            _ => return Err(unsupported("run --decode-engine graph for the unfused plan")),
        }
        if pending.is_some() {
            return Err(unsupported("a layernorm must feed the matmul right after it"));
        }
        stages.push(stage);
        layers.push(node.layer);
        i += 1;
    }
    if pending.is_some() {
        return Err(MegakernelError::Unsupported {
            role: "layernorm".into(),
            op: "layernorm".into(),
            fix: "its output is never read".into(),
        });
    }
    if stages.len() > MAX_STAGES {
        return Err(MegakernelError::Unsupported {
            role: "decode step".into(),
            op: format!("{} stages", stages.len()),
            fix: format!("the megakernel runs at most {MAX_STAGES} stages (4 or 5 a layer); run --decode-engine graph"),
        });
    }
    // Task numbers in stage order; each stage waits for the one before it, complete.
    let mut first = 0;
    for s in 0..stages.len() {
        stages[s].first_task = first;
        first += stages[s].tasks;
        if s > 0 {
            stages[s].wait_stage = s as i32 - 1;
            stages[s].wait_count = stages[s - 1].completion(heads) as i32;
        }
    }
    let argmax_offset = attention_floats;
    for s in stages.iter_mut().filter(|s| s.flags & FLAG_ARGMAX != 0) {
        s.ws_offset = argmax_offset as i32;
    }
    let counters = stages.len() + heads + 2;
    // a top-k draw's heads: a float2 a row and LM-head task
    let head_floats = stages
        .last()
        .filter(|s| s.flags & FLAG_ARGMAX != 0)
        .map_or(0, |s| s.tasks as usize)
        * geo.max_rows
        * 2;
    Ok(Lowered {
        // the argmax partials: a float2 a block and row; then the heads
        workspace_floats: argmax_offset + geo.grid * geo.max_rows * 2 + head_floats,
        stages,
        layers,
        counters,
        heads,
    })
}

/// Checks that the table can only complete (see the module docs); the error names the stage.
pub fn check_schedule(lowered: &Lowered) -> Result<(), MegakernelError> {
    let stages = &lowered.stages;
    let unsafe_at = |s: usize, why: String| MegakernelError::UnsafeSchedule {
        stage: s,
        op: STAGE_OPS.get(stages[s].op as usize).copied().unwrap_or("?").to_string(),
        why,
    };
    if stages.is_empty() {
        return Err(MegakernelError::UnsafeSchedule {
            stage: 0,
            op: "-".into(),
            why: "the table is empty".into(),
        });
    }
    let mut next_task = 0;
    for (s, st) in stages.iter().enumerate() {
        if st.tasks <= 0 {
            return Err(unsafe_at(
                s,
                "it has no tasks, so nothing would ever count it complete".into(),
            ));
        }
        if st.first_task != next_task {
            return Err(unsafe_at(
                s,
                format!(
                    "its tasks start at {} instead of {next_task}: tasks must be numbered in stage order",
                    st.first_task
                ),
            ));
        }
        next_task += st.tasks;
        if st.wait_stage >= 0 {
            let w = st.wait_stage as usize;
            if w >= s {
                return Err(unsafe_at(
                    s,
                    format!("it waits for stage {w}, which is not earlier: its tasks could wait for blocks that wait for them"),
                ));
            }
            let reachable = stages[w].completion(lowered.heads);
            if st.wait_count as usize != reachable {
                return Err(unsafe_at(
                    s,
                    format!(
                        "it waits for stage {w} to count {} but that stage only ever counts {reachable}",
                        st.wait_count
                    ),
                ));
            }
        } else if st.kind != STAGE_EMBED {
            return Err(unsafe_at(s, "it reads an input but waits for nothing".into()));
        }
        if st.flags & FLAG_ARGMAX != 0 && s + 1 != stages.len() {
            return Err(unsafe_at(s, "the argmax stage must be the last one".into()));
        }
        if st.kind == STAGE_MATVEC && st.cols as usize > MAX_TASK_COLS {
            return Err(unsafe_at(
                s,
                format!("{} columns per task, the kernel holds {MAX_TASK_COLS}", st.cols),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
