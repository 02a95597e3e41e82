//! Which point of the `decode_megakernel` family runs a decode step: the default fitted to the
//! step's shape when the tuning database has none, the most rows any point holds, and the
//! point's name as `bench` and `tune --decode-step` print it. The executor that runs the point
//! is `megakernel.rs`.

use std::sync::Arc;

use crate::ops::{Epilogue, Mask, Shape};
use crate::spec::{variant_with, DeviceLimits, Dtype, Family};
use crate::tune::decode_search::Point;
use crate::tune::registry::Choice;

/// What `bench` reports of the megakernel that ran decode steps.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MegakernelSummary {
    /// Every parameter of its `decode_megakernel` point, in the spec's order.
    pub point: Point,
    /// Tuned: the tuning database's winner; default: fitted to the batch (or set for tuning).
    pub choice: Choice,
    /// The stage table's stages and tasks.
    pub stages: usize,
    pub tasks: usize,
}

impl MegakernelSummary {
    /// `threads=512 slot_kib=96 ... (fitted to the batch; 62 stages, 1020 tasks)`; the head
    /// size (the model's) left out.
    pub fn line(&self) -> String {
        let from = match self.choice {
            Choice::Tuned | Choice::Nearest => "tuned",
            Choice::Default => "fitted to the batch",
        };
        format!(
            "{} ({from}; {} stages, {} tasks)",
            point_text(&self.point),
            self.stages,
            self.tasks
        )
    }
}

/// A point of the megakernel family as `name=value` pairs, without the head size (the model's).
pub fn point_text(point: &Point) -> String {
    point
        .iter()
        .filter(|(name, _)| name.as_str() != "head_dim")
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The family [`super::GpuBackend::set_megakernel_point`] picks points of.
pub const MEGAKERNEL_FAMILY: &str = "decode_megakernel";

/// The default point of the megakernel family fitted to the decode step `shape` (its batch `B`,
/// width `C` and `elem_bytes`; see [`super::GpuBackend::decode_step_key`]) in `dtype`: the fewest
/// `max_rows` that hold the batch (registers grow with it), two output columns per warp in
/// 16-bit storage and one in f32, and a ring of two slots, each the largest the spec accepts for
/// the shape (its shape constraint: the ring, the staged input rows and the kernel's static
/// shared memory fit the SM's; bigger tasks spread each task's fixed cost over more bytes).
pub fn fitted_default(family: &Arc<Family>, shape: &Shape, dtype: Dtype, limits: &DeviceLimits) -> Vec<(String, i64)> {
    let dim = |name: &str| shape.get(name).copied().unwrap_or(0).max(0) as usize;
    let (batch, c, elem_bytes) = (dim("B"), dim("C"), dim("elem_bytes"));
    let mut point = Vec::new();
    let values = |name: &str| family.params.get(name).cloned().unwrap_or_default();
    let rows = values("max_rows").into_iter().filter(|&r| r >= batch as i64).min();
    if let Some(rows) = rows {
        point.push(("max_rows".to_string(), rows));
        // several rows of input and sums per thread need more registers than 512 threads leave;
        // but the staging of a layernorm's row takes 16 bytes of it per thread (the spec's
        // `C * elem_bytes <= threads * 16`): wider rows (GPT-2 large and 1.5B in f32) keep 512
        if rows > 1 && values("threads").contains(&256) && c * elem_bytes <= 256 * 16 {
            point.push(("threads".to_string(), 256));
        }
    }
    // Tensor cores for several rows in 16-bit storage. Measured on an H200, GPT-2 small: bf16
    // batch 8 0.517 -> 0.413 ms a step, f16 0.508 -> 0.413; at batch 1 the FMAs are faster
    // (bf16 0.294 against 0.308 ms a step).
    // (mma.sync m16n8k16 needs sm_80: a T4 keeps the FMAs.)
    let tensor_cores = elem_bytes == 2 && rows.is_some_and(|r| r > 1) && limits.compute_capability >= (8, 0);
    if values("tensor_cores").contains(&1) {
        point.push(("tensor_cores".to_string(), i64::from(tensor_cores)));
    }
    // Measured on the H100, GPT-2 small after a 1,000-token prompt, batch 1: bf16 0.334 ms a step
    // with two columns per warp against 0.353 with one; f32 0.460 with one against 0.492 with
    // two (16-byte loads carry half as many f32 values: one column keeps more warps busy). With
    // tensor cores a warp takes an 8-column tile: the spec keeps this parameter at 1.
    let cols_per_warp = if elem_bytes == 2 && !tensor_cores { 2 } else { 1 };
    if values("cols_per_warp").contains(&cols_per_warp) {
        point.push(("cols_per_warp".to_string(), cols_per_warp));
    }
    // Two slots, as large as fit: a task's fixed cost (its barriers, its wait for the slot, the
    // epilogue) weighs more than a third slot's head start. Measured on an H200 at batch 1:
    // GPT-2 1.5B bf16 2.59 ms a step with 3 slots of 48 KiB, 2.15 with 3 of 64, 1.99 with 2 of
    // 96; GPT-2 small f32 0.407 -> 0.322 ms (3 x 48 -> 2 x 96 KiB), bf16 0.286 -> 0.278. On the
    // H100 with the MLP as one stage: 1.5B bf16 1.898 / 1.901 ms with 2 of 96, 2.000 / 2.002
    // with 3 of 64.
    if values("slots").contains(&2) {
        point.push(("slots".to_string(), 2));
    }
    // The copy engine's bulk copies (`cp.async.bulk`) exist from sm_90 (Hopper) on: older GPUs
    // fill the ring with cp.async (below sm_80, synchronous copies: common/async_copy.cu.tera).
    if limits.compute_capability < (9, 0) && values("bulk_copy").contains(&0) {
        point.push(("bulk_copy".to_string(), 0));
    }
    // One row: each layer's fc and fc projection as one stage (atomic adds into an f32 residual
    // stream). Measured on the H100 (GPT-2 small, one call, two rounds): bf16 0.267 -> 0.242 ms
    // a step, after 1,000 tokens 0.289 -> 0.273, f32 0.340 -> 0.326; 1.5B bf16 2.005 -> 1.947
    // (one round). Several rows add 8x as many partial sums, from twice the tasks where the MLP's
    // two halves in one slot leave it more than a wave: batch 8 bf16 0.423 -> 0.488 (a dense
    // residual row), so they keep two stages.
    if values("fuse_mlp").contains(&1) {
        point.push(("fuse_mlp".to_string(), i64::from(rows == Some(1))));
    }
    // One row on the FMAs, 16-bit storage, rows of 1,024 and more: a task of at most 16 columns
    // cuts K between all its warps instead of its columns (`matvec_task_kslice`). Measured on
    // the H100, bf16 batch 1 (one call, two rounds each): GPT-2 1.5B 1.898 / 1.901 -> 1.854 /
    // 1.854 ms a step (its fused MLP task of 13 x 1,600 alone: 4,496 -> 3,823 cycles), large
    // 1.075 / 1.079 -> 1.070 / 1.070, medium 0.575 / 0.573 -> 0.566 / 0.564; GPT-2 small 0.237
    // / 0.237 -> 0.240 / 0.239, after 1,000 tokens 0.275 -> 0.278, and in f32 0.326 -> 0.330.
    if values("kslice").contains(&1) {
        let kslice = rows == Some(1) && !tensor_cores && elem_bytes == 2 && c >= 1024;
        point.push(("kslice".to_string(), i64::from(kslice)));
    }
    let accepts = |kib: i64| {
        let mut with = point.clone();
        with.push(("slot_kib".to_string(), kib));
        variant_with(family, &with, dtype, Epilogue::None, Mask::None, limits)
            .is_ok_and(|variant| variant.check_shape(shape, limits).is_ok())
    };
    let mut slot_kibs = values("slot_kib");
    slot_kibs.sort_unstable();
    // None fits (GPT-2 1.5B in f32 from 5 rows): the default's slots stay, and the spec's refusal
    // names the shared memory when the kernel is asked for
    if let Some(kib) = slot_kibs.into_iter().rev().find(|&kib| accepts(kib)) {
        point.push(("slot_kib".to_string(), kib));
    }
    point
}

/// The most sequences the megakernel family holds for a decode step of this model, dtype and GPU:
/// the largest `max_rows` whose [`fitted_default`] is a valid point that fits the step
/// (`step_shape(rows)`, as [`super::decode_step_key`] gives it); 0 when none does. 16 rows need
/// the tensor cores (16-bit storage, sm_80 on), and a wide model runs out of shared memory for
/// its staged rows sooner (GPT-2 1.5B in f32 from 5 rows). A batch past it runs on the graph
/// engine ([`super::GpuBackend::engine_for`]).
pub fn most_rows(
    family: &Arc<Family>,
    step_shape: &dyn Fn(usize) -> Shape,
    dtype: Dtype,
    limits: &DeviceLimits,
) -> usize {
    let mut rows = family.params.get("max_rows").cloned().unwrap_or_default();
    rows.sort_unstable();
    rows.into_iter()
        .rev()
        .filter(|&r| r > 0)
        .find(|&r| {
            let shape = step_shape(r as usize);
            let point = fitted_default(family, &shape, dtype, limits);
            variant_with(family, &point, dtype, Epilogue::None, Mask::None, limits)
                .is_ok_and(|variant| variant.check_shape(&shape, limits).is_ok())
        })
        .map_or(0, |r| r as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpu::shape;
    use crate::spec::Catalog;

    fn catalog() -> Catalog {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        Catalog::load(&root.join("specs"), &root.join("templates")).unwrap()
    }

    /// The decode step's shape for a GPT-2 of width `c` (1,024 positions, the padded vocabulary).
    fn gpt2_shape(batch: usize, c: usize, heads: i64, layers: i64, elem_bytes: usize) -> crate::ops::Shape {
        shape(&[
            ("B", batch as i64),
            ("C", c as i64),
            ("NH", heads),
            ("L", layers),
            ("HS", 64),
            ("Vp", 50304),
            ("max_T", 1024),
            ("elem_bytes", elem_bytes as i64),
        ])
    }

    fn fitted(batch: usize, elem_bytes: usize) -> std::collections::BTreeMap<String, i64> {
        fitted_wide(batch, 768, 12, elem_bytes)
    }

    fn fitted_wide(batch: usize, c: usize, heads: i64, elem_bytes: usize) -> std::collections::BTreeMap<String, i64> {
        let catalog = catalog();
        let family = catalog.family(MEGAKERNEL_FAMILY).unwrap();
        let dtype = if elem_bytes == 2 {
            crate::spec::Dtype::Bf16
        } else {
            crate::spec::Dtype::F32
        };
        fitted_default(
            family,
            &gpt2_shape(batch, c, heads, 12, elem_bytes),
            dtype,
            &DeviceLimits::default(),
        )
        .into_iter()
        .collect()
    }

    /// The fitted point of GPT-2 small on an H100: the rows the batch needs, the columns per
    /// warp of the storage width, and the largest slot that leaves room for the staged input.
    #[test]
    fn the_fitted_point_follows_the_batch_and_the_storage_width() {
        let bf16 = fitted(1, 2);
        assert_eq!((bf16["max_rows"], bf16["cols_per_warp"]), (1, 2));
        assert_eq!((bf16["slots"], bf16["slot_kib"]), (2, 96), "two slots, as large as fit");
        assert!(!bf16.contains_key("threads"), "one row keeps the default 512 threads");
        assert_eq!(bf16["tensor_cores"], 0, "one row runs on the FMAs");
        assert_eq!(bf16["fuse_mlp"], 1, "one row fuses the MLP");
        assert_eq!(bf16["kslice"], 0, "GPT-2 small cuts its narrow tasks by columns");
        assert_eq!(fitted_wide(1, 1600, 25, 2)["kslice"], 1, "1.5B cuts them along K");
        assert_eq!(fitted_wide(1, 1600, 25, 4)["kslice"], 0, "f32 by columns");
        let f32 = fitted(1, 4);
        assert_eq!((f32["max_rows"], f32["cols_per_warp"], f32["tensor_cores"]), (1, 1, 0));
        let batch = fitted(5, 2);
        assert_eq!((batch["max_rows"], batch["threads"]), (8, 256));
        assert_eq!(
            (batch["tensor_cores"], batch["cols_per_warp"]),
            (1, 1),
            "rows share the tensor cores' n = 8"
        );
        assert_eq!(fitted(5, 4)["tensor_cores"], 0, "f32 keeps exact FMAs");
        assert_eq!(batch["fuse_mlp"], 0, "several rows keep fc and its projection apart");
        assert_eq!(batch["kslice"], 0, "the K cut is for one row");
        // 2 slots of 96 KiB, 8 rows of 4 * 768 bf16 and the static 16 KiB exceed 227 KiB
        assert_eq!((batch["slots"], batch["slot_kib"]), (2, 64));
        // 9 to 16 rows: the tensor cores' m16n8k16 takes all 16 at once; 2 slots of 48 KiB
        // beside 16 staged rows and the LM head's 16-row tile
        let sixteen = fitted(9, 2);
        assert_eq!(
            (sixteen["max_rows"], sixteen["threads"], sixteen["tensor_cores"]),
            (16, 256, 1)
        );
        assert_eq!((sixteen["slots"], sixteen["slot_kib"]), (2, 48));
        assert!(!fitted(17, 2).contains_key("max_rows"), "no point holds 17 rows");
        // the copy engine's bulk copies need sm_90: older GPUs fill the ring with cp.async
        assert!(!bf16.contains_key("bulk_copy"), "Hopper keeps the default bulk copies");
        let catalog = catalog();
        let family = catalog.family(MEGAKERNEL_FAMILY).unwrap();
        let ampere = DeviceLimits {
            compute_capability: (8, 6),
            ..DeviceLimits::default()
        };
        let point: std::collections::BTreeMap<String, i64> = fitted_default(
            family,
            &gpt2_shape(1, 768, 12, 12, 2),
            crate::spec::Dtype::Bf16,
            &ampere,
        )
        .into_iter()
        .collect();
        assert_eq!(point["bulk_copy"], 0, "{point:?}");
        let turing = DeviceLimits {
            compute_capability: (7, 5),
            ..DeviceLimits::default()
        };
        let point: std::collections::BTreeMap<String, i64> =
            fitted_default(family, &gpt2_shape(5, 768, 12, 12, 2), crate::spec::Dtype::F16, &turing)
                .into_iter()
                .collect();
        assert_eq!(
            (point["bulk_copy"], point["tensor_cores"]),
            (0, 0),
            "no m16n8k16 on a T4: {point:?}"
        );
    }

    /// How many sequences the megakernel holds depends on the storage, the GPU and the model: 16
    /// rows on the tensor cores (16-bit storage from sm_80), 8 on the FMAs (f32, a T4), fewer
    /// where the staged rows outgrow shared memory (GPT-2 1.5B in f32).
    #[test]
    fn the_rows_the_megakernel_holds_follow_storage_gpu_and_model() {
        let catalog = catalog();
        let family = catalog.family(MEGAKERNEL_FAMILY).unwrap();
        let held = |c: usize, heads: i64, dtype: crate::spec::Dtype, limits: &DeviceLimits| {
            let elem_bytes = if dtype == crate::spec::Dtype::F32 { 4 } else { 2 };
            most_rows(family, &|b| gpt2_shape(b, c, heads, 12, elem_bytes), dtype, limits)
        };
        let hopper = DeviceLimits::default();
        let turing = DeviceLimits {
            compute_capability: (7, 5),
            ..DeviceLimits::default()
        };
        use crate::spec::Dtype::{Bf16, F16, F32};
        assert_eq!(held(768, 12, Bf16, &hopper), 16);
        assert_eq!(held(768, 12, F16, &hopper), 16);
        assert_eq!(held(768, 12, F32, &hopper), 8, "f32 keeps the FMAs");
        assert_eq!(held(768, 12, F16, &turing), 8, "no m16n8k16 on a T4");
        assert_eq!(
            held(1600, 25, F32, &hopper),
            4,
            "1.5B's staged f32 rows fill shared memory from 5"
        );
    }

    /// The line `bench` prints (the point without the model's head size, then where it came
    /// from) and its `--json` object.
    #[test]
    fn the_summary_line_names_the_point_and_where_it_came_from() {
        let mut summary = MegakernelSummary {
            point: [("threads", 512), ("slot_kib", 96), ("head_dim", 64), ("slots", 2)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            choice: Choice::Default,
            stages: 62,
            tasks: 1020,
        };
        assert_eq!(
            summary.line(),
            "threads=512 slot_kib=96 slots=2 (fitted to the batch; 62 stages, 1020 tasks)"
        );
        summary.choice = Choice::Tuned;
        assert!(
            summary.line().ends_with("(tuned; 62 stages, 1020 tasks)"),
            "{}",
            summary.line()
        );
        // bench --json's decode.megakernel: the point by name, the choice, the table's size
        assert_eq!(
            serde_json::to_value(&summary).unwrap(),
            serde_json::json!({
                "point": {"threads": 512, "slot_kib": 96, "head_dim": 64, "slots": 2},
                "choice": "tuned",
                "stages": 62,
                "tasks": 1020
            })
        );
    }

    /// Every fitted point of every GPT-2 size, batch and storage width passes the spec's checks
    /// and fits an H100's shared memory beside the kernel's static shared memory (the spec's
    /// allowance, which covers the 11,664 bytes ptxas reports for the largest of the spec's
    /// points), with two slots as large as fit: one size up would not.
    #[test]
    fn fitted_points_of_every_gpt2_size_fit_shared_memory() {
        let catalog = catalog();
        let family = catalog.family(MEGAKERNEL_FAMILY).unwrap();
        let limits = DeviceLimits::default();
        let mut slot_kibs = family.params["slot_kib"].clone();
        slot_kibs.sort_unstable();
        for (c, heads, layers) in [(768, 12, 12), (1024, 16, 24), (1280, 20, 36), (1600, 25, 48)] {
            for (elem_bytes, dtype) in [(2, crate::spec::Dtype::Bf16), (4, crate::spec::Dtype::F32)] {
                for batch in 1..=8 {
                    let what = format!("C={c} elem_bytes={elem_bytes} B={batch}");
                    let at = gpt2_shape(batch, c, heads, layers, elem_bytes);
                    let point = fitted_default(family, &at, dtype, &limits);
                    let variant = crate::spec::variant_with(family, &point, dtype, Epilogue::None, Mask::None, &limits)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let static_bytes = variant.derived["static_smem"];
                    assert!(
                        static_bytes >= 11_664,
                        "{what}: the static allowance is below ptxas's figure"
                    );
                    let smem = variant.launches(&at, &limits).unwrap()[0].smem_bytes as i64;
                    let slot = variant.params["slot_kib"];
                    if !point.iter().any(|(name, _)| name == "slot_kib") {
                        // 1.5B in f32 from 5 rows: 8 staged rows of 4C floats leave no room for
                        // two of the smallest slots; the spec refuses the point before it is
                        // compiled, naming the shared memory
                        let smallest = smem - 2 * (slot - slot_kibs[0]) * 1024;
                        assert!(
                            smallest + static_bytes > limits.max_smem_dynamic,
                            "{what}: a slot would fit"
                        );
                        let e = variant.check_shape(&at, &limits).unwrap_err();
                        assert!(e.contains("max_smem_dynamic"), "{what}: {e}");
                        continue;
                    }
                    variant
                        .check_shape(&at, &limits)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(
                        smem + static_bytes <= limits.max_smem_dynamic,
                        "{what}: {smem} bytes of dynamic shared memory"
                    );
                    assert_eq!(variant.params["slots"], 2, "{what}");
                    if batch <= 4 {
                        // the longest weight row (the fc projection's 4C) fits one slot
                        assert!(slot * 1024 >= (4 * c * elem_bytes) as i64, "{what}: slot_kib {slot}");
                    }
                    if let Some(&bigger) = slot_kibs.iter().find(|&&kib| kib > slot) {
                        let grown = smem + 2 * (bigger - slot) * 1024;
                        assert!(
                            grown + static_bytes > limits.max_smem_dynamic,
                            "{what}: slot_kib {bigger} would fit too"
                        );
                    }
                }
            }
        }
    }

    /// Tensor cores are a 16-bit choice with one warp share per 8-column tile: the spec refuses
    /// them for f32 storage (naming the constraint) and with more columns per warp, so the
    /// decode tuner never times a point that would only repeat another.
    #[test]
    fn tensor_core_points_are_16_bit_and_one_column_per_warp() {
        let catalog = catalog();
        let family = catalog.family(MEGAKERNEL_FAMILY).unwrap();
        let limits = DeviceLimits::default();
        let point = |pairs: &[(&str, i64)], dtype| {
            let pairs: Vec<(String, i64)> = pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect();
            crate::spec::variant_with(family, &pairs, dtype, Epilogue::None, Mask::None, &limits)
        };
        let tensor_cores = [("tensor_cores", 1), ("cols_per_warp", 1)];
        let shape_with = |elem_bytes| gpt2_shape(8, 768, 12, 12, elem_bytes);
        let bf16 = point(&tensor_cores, crate::spec::Dtype::Bf16).unwrap();
        bf16.check_shape(&shape_with(2), &limits).unwrap();
        let f32 = point(&tensor_cores, crate::spec::Dtype::F32).unwrap();
        let e = f32.check_shape(&shape_with(4), &limits).unwrap_err();
        assert!(e.contains("tensor_cores * elem_bytes <= 2"), "{e}");
        let e = point(&[("tensor_cores", 1), ("cols_per_warp", 2)], crate::spec::Dtype::Bf16).unwrap_err();
        assert!(e.to_string().contains("cols_per_warp"), "{e}");
    }
}
