//! How a GPU decode step is executed, and what its executors can report.
//!
//! A decode step is one plan (see [`crate::model::gpu`]): the same ordered op nodes over the same
//! buffers. The engines differ only in how the plan reaches the GPU:
//! - [`DecodeEngine::Launches`]: one kernel launch per node (profilable kernel by kernel);
//! - [`DecodeEngine::Graph`]: the nodes recorded once as a CUDA graph and replayed, only the
//!   nodes whose arguments changed rewritten between steps;
//! - [`DecodeEngine::Megakernel`]: the plan lowered to a task table and run by one persistent
//!   kernel rendered from the `decode_megakernel` spec (blocks pull tasks in order, wait on
//!   counters in global memory, stream their next weights while they wait).
//!
//! All three give the same greedy tokens; they differ in time.

use std::fmt;
use std::str::FromStr;

/// How decode steps run on the GPU (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeEngine {
    Launches,
    Graph,
    Megakernel,
}

impl DecodeEngine {
    /// Every engine, slowest-to-set-up first.
    pub const ALL: [DecodeEngine; 3] = [DecodeEngine::Launches, DecodeEngine::Graph, DecodeEngine::Megakernel];

    pub fn as_str(self) -> &'static str {
        match self {
            DecodeEngine::Launches => "launches",
            DecodeEngine::Graph => "graph",
            DecodeEngine::Megakernel => "megakernel",
        }
    }
}

impl fmt::Display for DecodeEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an engine name was not understood.
#[derive(Debug, thiserror::Error)]
#[error("unknown decode engine `{0}` (known: launches, graph, megakernel)")]
pub struct UnknownEngine(pub String);

impl FromStr for DecodeEngine {
    type Err = UnknownEngine;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DecodeEngine::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| UnknownEngine(s.to_string()))
    }
}

/// One task of a megakernel decode step as the GPU stamped it (profiling on): which block ran
/// it, what it was, and when it started and ended (`%globaltimer`, ns, relative to the step's
/// first stamp).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaskStamp {
    pub block: u32,
    /// The op the task belongs to: `embed`, `qkv`, `attention`, `attn_proj`, `fc`, `fc_proj`,
    /// `lm_head`.
    pub op: String,
    /// Layer index (`None` for embed and lm_head).
    pub layer: Option<u32>,
    /// When the task began waiting for its inputs, when they were ready, when the data it
    /// prefetched (weights, cached keys and values) had landed in shared memory (`ready_ns` for
    /// tasks that prefetch nothing), and when it had stored its outputs (before it signalled
    /// them to the stages that wait for them).
    pub start_ns: u64,
    pub ready_ns: u64,
    #[serde(default)]
    pub data_ns: u64,
    pub end_ns: u64,
}

/// The stamps of one decode step of the megakernel: blocks × time.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timeline {
    /// Resident blocks of the persistent grid.
    pub blocks: u32,
    pub tasks: Vec<TaskStamp>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_names_round_trip_and_unknown_ones_are_named() {
        for e in DecodeEngine::ALL {
            assert_eq!(e.as_str().parse::<DecodeEngine>().unwrap(), e);
        }
        let err = "fast".parse::<DecodeEngine>().unwrap_err().to_string();
        assert!(err.contains("`fast`") && err.contains("megakernel"), "{err}");
    }
}
