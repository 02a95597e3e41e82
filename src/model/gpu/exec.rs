//! The kernel-by-kernel and CUDA-graph executors of a step [`Plan`]: every node launched on the
//! stream in order, or recorded once into a [`KernelGraph`] and replayed, with only the nodes
//! whose arguments changed (the position, the cache length) rewritten between steps. Profiling
//! (a CUDA event pair around every launch) and `KERNELFORGE_SYNC_EACH` live here too.

use anyhow::{bail, Context, Result as AnyResult};
use cudarc::driver::CudaEvent;

use super::plan::{HeadRows, Node, Pass, Plan, Step};
use super::select::Kernels;
use super::GpuBackend;
use crate::gpu::{Gpu, GpuError, GraphUpdateError, KernelGraph};
use crate::model::generate::Draw;
use crate::spec::shape_text;

/// `0` (or `never`) launches every kernel of a step after the one before has ended, in CUDA
/// graphs and on the stream, instead of letting it launch while that one still runs where the
/// kernel waits for it itself (for comparing; see `templates/common/launch.cu.tera`).
pub const PROGRAMMATIC_LAUNCH_ENV: &str = "KERNELFORGE_PROGRAMMATIC_LAUNCH";

/// Whether the value of [`PROGRAMMATIC_LAUNCH_ENV`] leaves programmatic edges on (the default).
pub(super) fn programmatic_launch_from_env(value: Option<&str>) -> bool {
    !matches!(value.map(str::trim), Some("0" | "never" | "off" | "false"))
}

/// What a decode step's CUDA graph is set up to run: the step at position `pos` for `b`
/// sequences, where its input ids come from (`pass`), and the kernel that chooses its next
/// tokens (`draw`; none when the caller reads the logits back). The chooser is a node of the
/// graph like the rest, so it launches while the LM head ends, and writes the ids where the host
/// reads them (`buffers::DrawnIds`): nothing is put on the stream between two steps but events.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct GraphStep {
    pub b: usize,
    pub pos: usize,
    pub pass: Pass,
    pub draw: Option<Draw>,
}

/// How a decode graph chooses its tokens, which decides the kernels at its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Chooser {
    /// No kernel: the caller reads the logits back.
    Nothing,
    Argmax,
    Sampler,
}

/// The graphs a backend keeps: one for each batch size and [`Chooser`], which launch different
/// kernels; the rest of a [`GraphStep`] (the position, the ids' source, the sampling settings)
/// only changes arguments, in place.
pub(super) type GraphKey = (usize, Chooser);

impl GraphStep {
    pub(super) fn key(&self) -> GraphKey {
        let chooser = match &self.draw {
            None => Chooser::Nothing,
            Some(d) if d.params.is_greedy() => Chooser::Argmax,
            Some(_) => Chooser::Sampler,
        };
        (self.b, chooser)
    }
}

/// Where launches go.
pub(super) enum LaunchMode {
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

impl GpuBackend {
    /// A CUDA event for timing (profiles, decode steps).
    pub(super) fn timing_event(&self) -> AnyResult<CudaEvent> {
        Ok(self
            .gpu
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(GpuError::cuda("creating a timing event"))?)
    }

    /// Runs `plan` in the current [`LaunchMode`]: launched kernel by kernel, or recorded into /
    /// replayed against a CUDA graph.
    pub(super) fn execute(&mut self, plan: &Plan) -> AnyResult<()> {
        for step in &plan.steps {
            match step {
                Step::Launch(node) => self.launch_node(node)?,
                Step::Copy { dst, src, elems } => {
                    if !matches!(self.launch_mode, LaunchMode::Direct) {
                        bail!("a plan with device copies cannot be recorded as a CUDA graph");
                    }
                    self.copy_d2d(*dst, *src, *elems)?;
                }
            }
        }
        Ok(())
    }

    /// Launches one node (or adds it to / checks it against the graph being built).
    fn launch_node(&mut self, node: &Node) -> AnyResult<()> {
        let (k, shape, launches, args) = (&node.kernel, &node.shape, &node.launches[..], &node.args[..]);
        let events = self.profile_begin()?;
        let what = || format!("{} ({}) on {}", k.role, k.label, shape_text(shape));
        let programmatic = self.programmatic_launch && k.loaded.waits_for_previous();
        match &mut self.launch_mode {
            // Overlapped only where nothing is put between two launches (a profile's events, a
            // synchronization after each).
            LaunchMode::Direct if programmatic && events.is_none() && !self.sync_each => k
                .loaded
                .launch_args_overlapped(&self.gpu, args, launches)
                .with_context(what)?,
            LaunchMode::Direct => k.loaded.launch_args(&self.gpu, args, launches).with_context(what)?,
            LaunchMode::Record(graph) => {
                k.loaded.allow_shared_memory(launches).with_context(what)?;
                for l in launches {
                    graph
                        .add(k.loaded.function(l).with_context(what)?, l, args, programmatic)
                        .with_context(what)?;
                }
            }
            LaunchMode::Update { graph, next, stale } => {
                k.loaded.allow_shared_memory(launches).with_context(what)?;
                for l in launches {
                    if *stale {
                        break;
                    }
                    match graph.update(*next, k.loaded.function(l).with_context(what)?, l, args, programmatic) {
                        Ok(_) => *next += 1,
                        Err(GraphUpdateError::Mismatch(_)) => *stale = true,
                        Err(GraphUpdateError::Gpu(e)) => return Err(anyhow::Error::new(e).context(what())),
                    }
                }
            }
        }
        self.profile_end(events, k.role, &k.label)?;
        if self.sync_each {
            self.gpu
                .synchronize()
                .with_context(|| format!("{} ({}) on {} failed", k.role, k.label, shape_text(shape)))?;
        }
        Ok(())
    }

    /// With profiling on: a pair of timing events, the first recorded before the launch to time.
    pub(super) fn profile_begin(&self) -> AnyResult<Option<(CudaEvent, CudaEvent)>> {
        if self.profiler.is_none() {
            return Ok(None);
        }
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        record_event(&start, &self.gpu)?;
        Ok(Some((start, end)))
    }

    /// Records the end of what [`GpuBackend::profile_begin`] started and files the pair under
    /// (role, label) for the profile.
    pub(super) fn profile_end(
        &mut self,
        events: Option<(CudaEvent, CudaEvent)>,
        role: &'static str,
        label: &str,
    ) -> AnyResult<()> {
        if let (Some((start, end)), Some(p)) = (events, &mut self.profiler) {
            record_event(&end, &self.gpu)?;
            p.pending.push((role, label.to_string(), start, end));
        }
        Ok(())
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

    /// The launches of a decode step's graph: the step, then its chooser.
    fn graph_plan(&mut self, ks: &Kernels, step: &GraphStep) -> AnyResult<Plan> {
        let mut plan = self.build_plan(ks, step.b, 1, step.pos, step.pass, HeadRows::All)?;
        if let (Some(draw), Pass::Decode { slot, .. }) = (&step.draw, step.pass) {
            plan.steps.push(self.choose_step(ks, step.b, draw, step.pos + 1, slot)?);
        }
        Ok(plan)
    }

    /// Points the graph of `step`'s batch size and chooser at `step`: replays the step's
    /// launches into it, rewriting the nodes whose arguments changed, or records it (again)
    /// when there is none or the launches no longer match it.
    pub(super) fn prepare_decode_graph(&mut self, ks: &Kernels, step: GraphStep) -> AnyResult<()> {
        // The cache-length-dependent workspace is sized for the longest cache up front, so
        // that no step reallocates it under the graph's pointers.
        for (len, k) in &ks.decode_attention {
            let longest = self.decode_attention_shape(k, *len);
            self.ws_ptr(k, Some(&longest))?;
        }
        let key = step.key();
        if let Some(graph) = self.decode_graphs.remove(&key) {
            self.launch_mode = LaunchMode::Update {
                graph,
                next: 0,
                stale: false,
            };
            let walked = self.graph_plan(ks, &step).and_then(|p| self.execute(&p));
            let LaunchMode::Update { graph, next, stale } =
                std::mem::replace(&mut self.launch_mode, LaunchMode::Direct)
            else {
                unreachable!("the launch mode is only changed here")
            };
            walked?;
            if !stale && next == graph.len() {
                self.decode_graphs.insert(key, graph);
                self.prepared = Some((step, self.buffers_generation));
                return Ok(());
            }
            // The launches no longer fit the graph (another number of kernels, a kernel the
            // driver cannot switch a node to): record it again.
        }
        self.launch_mode = LaunchMode::Record(KernelGraph::new(&self.gpu.ctx)?);
        let walked = self.graph_plan(ks, &step).and_then(|p| self.execute(&p));
        let LaunchMode::Record(mut graph) = std::mem::replace(&mut self.launch_mode, LaunchMode::Direct) else {
            unreachable!("the launch mode is only changed here")
        };
        walked?;
        graph.instantiate()?;
        self.graphs_recorded += 1;
        self.decode_graphs.insert(key, graph);
        self.prepared = Some((step, self.buffers_generation));
        Ok(())
    }
}

/// Records `event` on the GPU's stream.
pub(super) fn record_event(event: &CudaEvent, gpu: &Gpu) -> AnyResult<()> {
    Ok(event
        .record(&gpu.stream)
        .map_err(GpuError::cuda("recording a timing event"))?)
}

#[cfg(test)]
mod tests {
    use super::programmatic_launch_from_env;

    #[test]
    fn programmatic_launch_is_on_unless_turned_off() {
        for on in [None, Some("1"), Some("always"), Some("")] {
            assert!(programmatic_launch_from_env(on), "{on:?}");
        }
        for off in ["0", "never", " off ", "false"] {
            assert!(!programmatic_launch_from_env(Some(off)), "{off}");
        }
    }
}
