//! decode_step: one whole GPT-2 decode step (embedding, every layer, LM head, next token) as
//! a single persistent kernel that runs a task table the model builds from its step plan (see
//! `src/model/gpu/stage_table.rs` for the table and `templates/decode/megakernel.cu.tera` for
//! the kernel).
//!
//! Kernel arguments: `const int* stage_table, int n_stages, unsigned* counters, float* workspace,
//! const int* tokens, int* next_ids, int* next_ids_copy, unsigned long long* timeline, int B,
//! int pos, int NH, int max_T, int V, float scale, float inv_temperature, int seed_lo, int seed_hi,
//! int seq0, int top_k, float top_p`: the next tokens (written to `next_ids` and again to
//! `next_ids_copy`, as the argmax op's `out_copy`) are the argmax (`inv_temperature` 0), the
//! Gumbel-max of a plain temperature (`top_k` 0), or a top-k (then top-p) draw from the LM-head
//! tasks' heads (`src/model/gpu/lm_head_draw.rs` says which), keyed as the `sample` op keys its
//! draws (seed, sequence `seq0 + b`, position `pos + 1`): the same token as the sample op.
//! Shape: `B` (sequences), `C` (embedding width), `NH` (heads), `L` (layers); optional `HS`
//! (`C / NH`), `Vp` (padded vocabulary, default 50304), `max_T` (context, default 1024) and
//! `elem_bytes` (bytes of the storage type, default 4) that the launch geometry reads.
//!
//! There is no stand-alone random problem for it: its inputs are a model's weights and a task
//! table that points into them. It is checked end to end instead, against the kernel-by-kernel
//! decode step and the CPU forward (`tests/gpu_model.rs`); `verify` says so and skips it.

use rand::rngs::StdRng;

use super::*;

/// The op's name (the megakernel's family op and its tuning-database key).
pub const NAME: &str = "decode_step";

#[derive(Debug)]
pub struct DecodeStep;

impl OpContract for DecodeStep {
    fn name(&self) -> &'static str {
        NAME
    }
    fn summary(&self) -> &'static str {
        "a whole GPT-2 decode step from a task table (the megakernel decode engine)"
    }
    fn signature(&self) -> &'static str {
        "const int* stage_table, int n_stages, unsigned* counters, float* workspace, const int* tokens, int* next_ids, int* next_ids_copy, unsigned long long* timeline, int B, int pos, int NH, int max_T, int V, float scale, float inv_temperature, int seed_lo, int seed_hi, int seq0, int top_k, float top_p"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "C", "NH", "L"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["HS", "Vp", "max_T", "elem_bytes"]
    }
    fn checked_end_to_end(&self) -> Option<&'static str> {
        Some("decode_step runs a model's task table; it is checked end to end against the kernel-by-kernel decode step by the GPU model tests (tests/gpu_megakernel.rs), not by verify")
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let (b, c, nh, _l) = (
            get_dim(self, shape, "B")?,
            get_dim(self, shape, "C")?,
            get_dim(self, shape, "NH")?,
            get_dim(self, shape, "L")?,
        );
        if nh == 0 || c % nh != 0 {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!("C={c} is not a multiple of NH={nh}"),
            });
        }
        shape.entry("HS".into()).or_insert(c / nh);
        shape.entry("Vp".into()).or_insert(50304);
        let max_t = *shape.entry("max_T".into()).or_insert(1024);
        let elem = *shape.entry("elem_bytes".into()).or_insert(4);
        if ![2, 4].contains(&elem) {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!("elem_bytes={elem}: the storage types have 2 or 4 bytes"),
            });
        }
        check_i32(self, shape, &[("KV cache [B,NH,max_T,HS]", b * max_t * c)])
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        // GPT-2 124M at batch 1 and 8 (what the catalog summary shows the launch of).
        [(1, 768, 12, 12), (8, 768, 12, 12)]
            .iter()
            .map(|&(b, c, nh, l)| {
                let mut s = shape_of(&[("B", b), ("C", c), ("NH", nh), ("L", l)]);
                self.complete_shape(&mut s, Epilogue::None, Mask::None)
                    .expect("the test shapes are valid");
                s
            })
            .collect()
    }
    fn problem(&self, _shape: &Shape, _epilogue: Epilogue, _mask: Mask, _rng: &mut StdRng) -> Result<Problem, OpError> {
        Err(OpError::Shape {
            op: self.name(),
            msg: self.checked_end_to_end().unwrap_or_default().to_string(),
        })
    }
    fn reference(&self, _problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_complete_with_defaults_and_problems_point_to_the_model_tests() {
        let mut s = shape_of(&[("B", 2), ("C", 768), ("NH", 12), ("L", 12)]);
        DecodeStep.complete_shape(&mut s, Epilogue::None, Mask::None).unwrap();
        assert_eq!((s["HS"], s["Vp"], s["max_T"], s["elem_bytes"]), (64, 50304, 1024, 4));
        let mut bad = shape_of(&[("B", 1), ("C", 100), ("NH", 12), ("L", 1)]);
        let e = DecodeStep
            .complete_shape(&mut bad, Epilogue::None, Mask::None)
            .unwrap_err();
        assert!(e.to_string().contains("not a multiple of NH=12"), "{e}");
        let mut rng = <StdRng as rand::SeedableRng>::seed_from_u64(1);
        let e = DecodeStep
            .problem(&s, Epilogue::None, Mask::None, &mut rng)
            .unwrap_err();
        assert!(e.to_string().contains("gpu_megakernel"), "{e}");
        assert!(DecodeStep.checked_end_to_end().is_some());
    }
}
