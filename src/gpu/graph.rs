//! A fixed sequence of kernel launches replayed as one CUDA graph.
//!
//! A decode step launches about a hundred small kernels, each of which runs for only a few
//! microseconds: issued one by one, the CPU-side launch cost and the gaps between kernels are a
//! large part of the step. A [`KernelGraph`] is built once from the same launches (each kernel
//! node depends on the one before, so the order is the stream order), instantiated, and then
//! replayed with a single `cuGraphLaunch`. Between replays only a few arguments change (the
//! position and the cache length), so a replay walks the same launches again and rewrites just
//! the nodes whose arguments, geometry or kernel differ (`cuGraphExecKernelNodeSetParams`), which
//! costs far less than launching, and far less than recording the graph again: when a decode
//! step's cache grows into the next length bucket, its attention nodes switch to that bucket's
//! kernel in place.
//!
//! A node whose kernel waits for its predecessor itself (`griddepcontrol.wait`, see
//! `templates/common/launch.cu.tera`) hangs on a *programmatic* edge: the driver launches it as
//! soon as every block of the node before has started, so its blocks are resident when that one
//! ends instead of being launched then.

use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraphInstantiate_flags};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError};

use super::run::ArgBuffer;
use super::{tensor_map, ArgValue, GpuError};
use crate::spec::Launch;

/// One kernel node and what it was last set to.
struct Node {
    handle: sys::CUgraphNode,
    function: sys::CUfunction,
    /// Hangs on a programmatic edge (see [`KernelGraph::add`]).
    programmatic: bool,
    launch: Launch,
    args: Vec<ArgValue>,
}

/// A chain of kernel nodes, built with [`KernelGraph::add`], then instantiated and replayed.
pub struct KernelGraph {
    ctx: Arc<CudaContext>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    nodes: Vec<Node>,
}

/// A launch cannot be replayed as node `index`: the graph is shorter, the node's edge is of
/// the other kind, or the driver refused to switch the node to the launch's kernel.
#[derive(Debug, thiserror::Error)]
#[error("launch {index} ({launch}) does not match the recorded graph node ({recorded})")]
pub struct GraphMismatch {
    pub index: usize,
    pub launch: String,
    pub recorded: String,
}

/// Calls `f` with the kernel-node parameters of a launch of `function` with `launch` and the
/// op arguments `args` (plus the launch's tensor maps); the argument pointers in them are valid
/// only during the call (the driver copies what they point at).
fn with_node_params<R>(
    function: sys::CUfunction,
    launch: &Launch,
    args: &[ArgValue],
    f: impl FnOnce(&sys::CUDA_KERNEL_NODE_PARAMS) -> R,
) -> Result<R, GpuError> {
    let mut buffer = ArgBuffer::new(&tensor_map::kernel_args(args, launch)?);
    let mut pointers = buffer.pointers();
    let params = sys::CUDA_KERNEL_NODE_PARAMS {
        func: function,
        gridDimX: launch.grid[0],
        gridDimY: launch.grid[1],
        gridDimZ: launch.grid[2],
        blockDimX: launch.block[0],
        blockDimY: launch.block[1],
        blockDimZ: launch.block[2],
        sharedMemBytes: launch.smem_bytes,
        kernelParams: pointers.as_mut_ptr(),
        extra: ptr::null_mut(),
        kern: ptr::null_mut(),
        ctx: ptr::null_mut(),
    };
    Ok(f(&params))
}

impl KernelGraph {
    /// An empty graph on `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<KernelGraph, GpuError> {
        ctx.bind_to_thread()
            .map_err(GpuError::cuda("binding the CUDA context"))?;
        let mut graph = ptr::null_mut();
        // SAFETY: cuGraphCreate writes a new graph handle; flags must be 0.
        unsafe { sys::cuGraphCreate(&mut graph, 0).result() }.map_err(GpuError::cuda("creating a CUDA graph"))?;
        Ok(KernelGraph {
            ctx: ctx.clone(),
            graph,
            exec: ptr::null_mut(),
            nodes: Vec::new(),
        })
    }

    /// Number of kernel nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no node was added.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Appends a launch of `function` after the last node. `waits_for_previous`: the kernel
    /// calls `griddepcontrol.wait` before it touches memory, so it may hang on a programmatic
    /// edge (launched while the node before still runs). Only before [`Self::instantiate`].
    pub fn add(
        &mut self,
        function: &CudaFunction,
        launch: &Launch,
        args: &[ArgValue],
        waits_for_previous: bool,
    ) -> Result<(), GpuError> {
        assert!(self.exec.is_null(), "KernelGraph::add after instantiate");
        let previous = self.nodes.last().map(|n| n.handle);
        let programmatic = waits_for_previous && previous.is_some();
        let (deps, n_deps) = match &previous {
            Some(h) if !programmatic => (h as *const sys::CUgraphNode, 1),
            _ => (ptr::null(), 0),
        };
        let mut handle = ptr::null_mut();
        let graph = self.graph;
        let what = || format!("adding {} to the CUDA graph", launch.function);
        // SAFETY: the graph is live; `params` points at a function of this context and at
        // argument values that outlive the call (the driver copies them).
        with_node_params(function.cu_function(), launch, args, |params| unsafe {
            sys::cuGraphAddKernelNode_v2(&mut handle, graph, deps, n_deps, params).result()
        })?
        .map_err(GpuError::cuda(what()))?;
        if let (true, Some(previous)) = (programmatic, previous) {
            // Fires when every block of `previous` has called `griddepcontrol.launch_dependents`
            // (or exited); the new kernel's `griddepcontrol.wait` then waits for the rest.
            let edge = sys::CUgraphEdgeData {
                from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                to_port: 0,
                type_: sys::CUgraphDependencyType_enum::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                reserved: [0; 5],
            };
            // SAFETY: both nodes are kernel nodes of this live graph; one edge, read in the call.
            unsafe { sys::cuGraphAddDependencies_v2(graph, &previous, &handle, &edge, 1).result() }
                .map_err(GpuError::cuda(what()))?;
        }
        self.nodes.push(Node {
            handle,
            function: function.cu_function(),
            programmatic,
            launch: launch.clone(),
            args: args.to_vec(),
        });
        Ok(())
    }

    /// Makes the graph launchable. Nodes can still change their arguments afterwards.
    pub fn instantiate(&mut self) -> Result<(), GpuError> {
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::cuda("binding the CUDA context"))?;
        // SAFETY: the graph is live and holds only kernel nodes of this context.
        self.exec =
            unsafe { cudarc::driver::result::graph::instantiate(self.graph, CUgraphInstantiate_flags(0)) }.map_err(
                GpuError::cuda(format!("instantiating a CUDA graph of {} kernels", self.len())),
            )?;
        Ok(())
    }

    /// Sets node `index` to launch `function` with `launch` and `args`, rewriting the
    /// instantiated node only when something differs. Returns whether it rewrote it.
    /// `waits_for_previous` as for [`Self::add`]: a node keeps the kind of edge it was recorded
    /// with, so a kernel that waits differently is a mismatch. Another kernel in the node is
    /// asked of the driver, which refuses what a node cannot switch to (another context, a
    /// kernel using dynamic parallelism); a refusal is a mismatch too, and the caller records
    /// the graph again.
    pub fn update(
        &mut self,
        index: usize,
        function: &CudaFunction,
        launch: &Launch,
        args: &[ArgValue],
        waits_for_previous: bool,
    ) -> Result<bool, GraphUpdateError> {
        let node = self.nodes.get_mut(index).ok_or_else(|| GraphMismatch {
            index,
            launch: launch.function.clone(),
            recorded: "nothing: the graph is shorter".into(),
        })?;
        let mismatch = |why: &str| GraphMismatch {
            index,
            launch: launch.function.clone(),
            recorded: format!("{}{why}", node.launch.function),
        };
        let same_kernel = node.function == function.cu_function();
        if (waits_for_previous && index > 0) != node.programmatic {
            return Err(mismatch(", recorded with the other kind of edge").into());
        }
        if same_kernel && node.launch == *launch && node.args == args {
            return Ok(false);
        }
        let exec = self.exec;
        // SAFETY: the executable graph is live and `node.handle` is one of its kernel nodes;
        // the driver copies the argument values before returning.
        let set = with_node_params(function.cu_function(), launch, args, |params| unsafe {
            sys::cuGraphExecKernelNodeSetParams_v2(exec, node.handle, params).result()
        })?;
        match set {
            Ok(()) => {}
            Err(e) if !same_kernel => return Err(mismatch(&format!(", which the driver cannot switch: {e}")).into()),
            Err(e) => return Err(GpuError::cuda(format!("updating {} in the CUDA graph", launch.function))(e).into()),
        }
        node.function = function.cu_function();
        node.launch = launch.clone();
        node.args = args.to_vec();
        Ok(true)
    }

    /// Launches the whole graph on `stream` (asynchronously).
    pub fn launch(&self, stream: &CudaStream) -> Result<(), GpuError> {
        assert!(!self.exec.is_null(), "KernelGraph::launch before instantiate");
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::cuda("binding the CUDA context"))?;
        // SAFETY: the executable graph and the stream are live and of the same context.
        unsafe { cudarc::driver::result::graph::launch(self.exec, stream.cu_stream()) }.map_err(GpuError::cuda(
            format!("launching a CUDA graph of {} kernels", self.len()),
        ))
    }
}

impl Drop for KernelGraph {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the handles were created by this graph and are destroyed once.
        unsafe {
            if !self.exec.is_null() {
                let _: Result<(), DriverError> = cudarc::driver::result::graph::exec_destroy(self.exec);
            }
            let _: Result<(), DriverError> = cudarc::driver::result::graph::destroy(self.graph);
        }
    }
}

/// Replaying a launch into a graph failed.
#[derive(Debug, thiserror::Error)]
pub enum GraphUpdateError {
    /// The launches no longer match the recorded nodes: record the graph again.
    #[error(transparent)]
    Mismatch(#[from] GraphMismatch),
    #[error(transparent)]
    Gpu(#[from] GpuError),
}
