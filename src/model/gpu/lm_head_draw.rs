//! Which draws the decode megakernel's LM head takes itself, with no sample op after the step
//! (`templates/decode/draw.cu.tera`): greedy, a temperature that keeps every token, or a top-k
//! small enough to be found from each LM-head task's largest logit of each row.

use crate::model::sampling::SamplingParams;

/// The largest top-k the megakernel's LM head draws itself (`LM_HEAD_TOP_K` in
/// `templates/decode/megakernel.cu.tera`).
pub const LM_HEAD_TOP_K: usize = 64;

/// What decides whether a top-k draw fits the megakernel's LM head: its stage's tasks and
/// columns a task, and the dynamic shared memory a block has (where the draw keeps its keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmHeadTasks {
    pub tasks: usize,
    pub cols: usize,
    pub shared_bytes: usize,
}

impl LmHeadTasks {
    /// Whether the tasks' heads can give a top-k of `k` over `vocab` tokens: k at most
    /// [`LM_HEAD_TOP_K`] and at most the tasks that hold tokens (the k largest heads are the
    /// floor), and the heads, two sorted lists and the k tasks' keys fit in shared memory
    /// (8 bytes a key; `draw_row_by_heads`).
    pub fn takes_top_k(&self, k: usize, vocab: usize) -> bool {
        let keys = self.tasks + 2 * 2 * LM_HEAD_TOP_K + k * self.cols;
        k <= LM_HEAD_TOP_K && k <= vocab.div_ceil(self.cols.max(1)) && 8 * keys <= self.shared_bytes
    }
}

/// Whether the megakernel's LM head draws the tokens of `params` itself, with no sample op after
/// the step: greedy, a temperature that keeps every token (the Gumbel-max over the row), or a
/// top-k that `head` takes (then any top-p: each task's largest logit, merged once every task is
/// done). Top-p alone, or a larger top-k, runs the sample op after the step. (Each task keeping
/// its best keys instead cost more than the sample op: benches/RESULTS.md, "Top-k in the LM head".)
pub fn drawn_in_lm_head(params: &SamplingParams, vocab: usize, head: Option<&LmHeadTasks>) -> bool {
    params.is_greedy()
        || params.keeps_every_token(vocab)
        || (params.cuts_top_k(vocab) && head.is_some_and(|h| h.takes_top_k(params.top_k, vocab)))
}

#[cfg(test)]
mod tests {
    use super::{drawn_in_lm_head, LmHeadTasks, LM_HEAD_TOP_K};
    use crate::model::sampling::SamplingParams;

    /// Which draws the LM head takes (the rest run the sample op after the step).
    #[test]
    fn the_lm_head_draws_greedy_a_plain_temperature_and_a_small_top_k() {
        let p = |temperature, top_k, top_p| SamplingParams {
            temperature,
            top_k,
            top_p,
        };
        let vocab = 50_257;
        // GPT-2's LM head at batch 1 on an H200's default point: 786 tasks of 64 columns
        let head = LmHeadTasks {
            tasks: 786,
            cols: 64,
            shared_bytes: 3 * 32 * 1024 + 4 * 768 * 2,
        };
        for (params, fused) in [
            (SamplingParams::greedy(), true),
            (p(0.8, 1, 0.5), true),            // top-k 1: greedy
            (SamplingParams::default(), true), // temperature 1, nothing cut
            (p(0.7, vocab, 1.0), true),        // top-k of the whole vocabulary cuts nothing
            (p(0.8, 40, 0.95), true),          // the usual setting: from the tasks' heads
            (p(1.0, 64, 1.0), true),           // the largest top-k the head takes
            (p(1.0, 65, 1.0), false),          // larger: the sample op
            (p(1.0, 0, 0.9), false),           // top-p alone: the sample op
        ] {
            assert_eq!(drawn_in_lm_head(&params, vocab, Some(&head)), fused, "{params:?}");
        }
        // without a prepared megakernel, top-k always runs the sample op
        assert!(!drawn_in_lm_head(&p(0.8, 40, 0.95), vocab, None));
        // fewer tasks holding tokens than k: the k-th head does not exist
        let few = LmHeadTasks {
            tasks: 30,
            cols: 1676,
            shared_bytes: 1 << 20,
        };
        assert!(few.takes_top_k(30, vocab) && !few.takes_top_k(31, vocab));
        // the keys must fit in shared memory: the heads, two lists and k tasks' columns
        let tight = LmHeadTasks {
            shared_bytes: 8 * (786 + 4 * LM_HEAD_TOP_K + 40 * 64),
            ..head
        };
        assert!(tight.takes_top_k(40, vocab) && !tight.takes_top_k(41, vocab));
    }
}
