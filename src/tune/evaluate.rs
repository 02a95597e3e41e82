//! Measuring candidate variants on the GPU, one step at a time: render and compile them (in
//! parallel, behind the on-disk cache), load them, refuse those whose ptxas resources rule them
//! out before they run (local-memory spills, no block resident on an SM), verify the rest
//! against the f64 reference, time them. Keeps the seconds each phase took, so `tune` can say
//! where its time went.

use std::collections::HashMap;
use std::time::Instant;

use super::records::Resources;
use super::time::{time_in_turns, Contestant, Timing, TimingPlan};
use super::verify::{error_text, run_and_compare, tolerance, RunFailure};
use crate::codegen::{Renderer, Source};
use crate::gpu::{Compiled, Compiler, DeviceProblem, Gpu, LoadedVariant};
use crate::ops::{Problem, Shape};
use crate::spec::{Family, Variant};

/// Where a tuning run's time went, in seconds, and how many kernels it compiled.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Phases {
    /// Building inputs and f64 references, expanding the families, uploading.
    pub prepare_s: f64,
    /// Rendering and NVRTC + ptxas: the wall time spent waiting for compiles (measuring runs
    /// while the rest of a batch compiles; that overlap is not counted here).
    pub compile_s: f64,
    /// Kernels compiled in this run (not found in the on-disk cache).
    pub compiled: usize,
    /// Kernels taken from the on-disk cache.
    pub cached: usize,
    /// Loading modules, reading resources, running against the f64 reference.
    pub verify_s: f64,
    /// Timing candidates (screen and halving rounds).
    pub time_s: f64,
    /// Timing the vendor peer.
    pub peer_s: f64,
}

impl Phases {
    /// What was spent since `earlier` (a snapshot of the same clock).
    pub fn since(&self, earlier: &Phases) -> Phases {
        Phases {
            prepare_s: self.prepare_s - earlier.prepare_s,
            compile_s: self.compile_s - earlier.compile_s,
            compiled: self.compiled - earlier.compiled,
            cached: self.cached - earlier.cached,
            verify_s: self.verify_s - earlier.verify_s,
            time_s: self.time_s - earlier.time_s,
            peer_s: self.peer_s - earlier.peer_s,
        }
    }

    pub fn add(&mut self, other: &Phases) {
        self.prepare_s += other.prepare_s;
        self.compile_s += other.compile_s;
        self.compiled += other.compiled;
        self.cached += other.cached;
        self.verify_s += other.verify_s;
        self.time_s += other.time_s;
        self.peer_s += other.peer_s;
    }

    /// `inputs 2.0 s, compile 12.1 s (140 kernels, 12 cached), verify 1.2 s, timing 3.4 s, peer 0.8 s`.
    pub fn text(&self) -> String {
        format!(
            "inputs {:.1} s, compile {:.1} s ({} kernels, {} cached), verify {:.1} s, timing {:.1} s, peer {:.1} s",
            self.prepare_s, self.compile_s, self.compiled, self.cached, self.verify_s, self.time_s, self.peer_s
        )
    }
}

/// Compiles, loads, screens, verifies and times variants on one GPU; compiled and loaded
/// variants are kept for the whole run (workloads of one epilogue share most of them).
/// `compile_s` counts the wall time of compiling that measuring did not overlap.
pub struct Evaluator<'a> {
    pub gpu: &'a Gpu,
    compiler: &'a Compiler,
    renderer: &'a Renderer,
    compiled: HashMap<String, Result<Compiled, String>>,
    loaded: HashMap<String, LoadedVariant>,
    pub phases: Phases,
}

impl<'a> Evaluator<'a> {
    pub fn new(gpu: &'a Gpu, compiler: &'a Compiler, renderer: &'a Renderer) -> Evaluator<'a> {
        Evaluator {
            gpu,
            compiler,
            renderer,
            compiled: HashMap::new(),
            loaded: HashMap::new(),
            phases: Phases::default(),
        }
    }

    /// Compiles `variants` in the background, on all but one CPU core, and calls `ready` with
    /// each kernel name as soon as its compile lands (at once for those compiled before or
    /// that fail to render), on this thread, which owns the CUDA context: measuring overlaps
    /// compiling. A `ready` error stops the measuring (the compiles in flight finish).
    pub fn compile_streaming(
        &mut self,
        variants: &[Variant],
        mut ready: impl FnMut(&mut Self, &str) -> Result<(), String>,
    ) -> Result<(), String> {
        let started = Instant::now();
        let mut in_ready = std::time::Duration::ZERO;
        let mut sources: Vec<(&Family, Source)> = Vec::new();
        let mut at_once: Vec<String> = Vec::new();
        for v in variants {
            let name = v.kernel_name();
            if at_once.contains(&name) || sources.iter().any(|(_, s)| s.kernel_name == name) {
                continue;
            }
            if self.compiled.contains_key(&name) {
                at_once.push(name);
                continue;
            }
            match self.renderer.render(v) {
                Ok(s) => sources.push((&v.family, s)),
                Err(e) => {
                    self.compiled.insert(name.clone(), Err(e.to_string()));
                    at_once.push(name);
                }
            }
        }
        let outcome = (|| {
            for name in &at_once {
                let t = Instant::now();
                ready(self, name)?;
                in_ready += t.elapsed();
            }
            if sources.is_empty() {
                return Ok(());
            }
            let compiler = self.compiler;
            let threads = std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
                .saturating_sub(1);
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::scope(|scope| {
                let jobs: Vec<(&Family, &Source)> = sources.iter().map(|(f, s)| (*f, s)).collect();
                scope.spawn(move || {
                    compiler.compile_each(&jobs, threads, |source, result| {
                        // The receiver is gone only when measuring stopped on an error.
                        let _ = tx.send((source.kernel_name.clone(), result));
                    })
                });
                for (name, result) in rx {
                    match &result {
                        Ok(c) if c.cached => self.phases.cached += 1,
                        _ => self.phases.compiled += 1,
                    }
                    self.compiled.insert(name.clone(), result.map_err(|e| e.to_string()));
                    let t = Instant::now();
                    ready(self, &name)?;
                    in_ready += t.elapsed();
                }
                Ok(())
            })
        })();
        self.phases.compile_s += started.elapsed().saturating_sub(in_ready).as_secs_f64();
        outcome
    }

    fn load(&mut self, v: &Variant) -> Result<&LoadedVariant, String> {
        let name = v.kernel_name();
        if !self.loaded.contains_key(&name) {
            let compiled = self
                .compiled
                .get(&name)
                .ok_or("not compiled")?
                .as_ref()
                .map_err(|e| e.clone())?;
            let loaded = LoadedVariant::load(self.gpu, v, compiled).map_err(|e| e.to_string())?;
            self.loaded.insert(name.clone(), loaded);
        }
        Ok(&self.loaded[&name])
    }

    /// Registers, static shared memory and spills of `v`'s kernels, once it is loaded.
    pub fn resources(&self, v: &Variant) -> Vec<Resources> {
        self.loaded
            .get(&v.kernel_name())
            .and_then(|l| l.resources().ok())
            .map(|r| r.iter().map(Resources::from).collect())
            .unwrap_or_default()
    }

    /// Loads `v` and refuses it from what ptxas made of it, before it runs: a kernel that
    /// spills registers (ptxas's `spill stores`; a stack frame alone is fine), slower than a
    /// neighbouring point that does not and the climb will find, or one of which no block fits
    /// on an SM at `shape`'s launch geometry (registers x threads or shared memory over the
    /// SM's).
    pub fn screen(&mut self, v: &Variant, shape: &Shape) -> Result<(), String> {
        self.clocked(|p| &mut p.verify_s, |eval| eval.screen_now(v, shape))
    }

    fn screen_now(&mut self, v: &Variant, shape: &Shape) -> Result<(), String> {
        let gpu = self.gpu;
        let spills = self
            .compiled
            .get(&v.kernel_name())
            .and_then(|c| c.as_ref().ok())
            .and_then(|c| c.spill_stores);
        if let Some(bytes @ 1..) = spills {
            return Err(format!(
                "pruned: ptxas spills {bytes} bytes of registers to local memory"
            ));
        }
        let loaded = self.load(v)?;
        let resources = loaded.resources().map_err(|e| e.to_string())?;
        let launches = loaded.plan(gpu, shape).map_err(|e| e.to_string())?;
        loaded.allow_shared_memory(&launches).map_err(|e| e.to_string())?;
        for launch in &launches {
            let function = loaded.function(launch).map_err(|e| e.to_string())?;
            let r = resources
                .iter()
                .find(|r| r.kernel == v.family.kernels[launch.kernel].name)
                .ok_or_else(|| format!("no resources of {}", launch.function))?;
            let threads = launch.block.iter().product::<u32>();
            let per_sm = gpu
                .blocks_per_sm(function, threads, launch.smem_bytes)
                .map_err(|e| format!("occupancy query of {}: {e}", r.kernel))?;
            if per_sm == 0 {
                return Err(format!(
                    "pruned: no block of kernel {} fits on an SM ({} threads x {} registers, {} + {} bytes of shared memory)",
                    r.kernel, threads, r.registers, r.static_smem_bytes, launch.smem_bytes
                ));
            }
        }
        Ok(())
    }

    /// Runs `v` on the verification problem; `Ok` is its relative L2 error, `Err` says why it
    /// is excluded (a message starting `kernel fault` means the context is lost).
    pub fn verify(
        &mut self,
        v: &Variant,
        problem: &Problem,
        device: &mut DeviceProblem,
        reference: &[(usize, Vec<f64>)],
    ) -> Result<f64, String> {
        self.clocked(
            |p| &mut p.verify_s,
            |eval| {
                let gpu = eval.gpu;
                let loaded = eval.load(v)?;
                match run_and_compare(gpu, loaded, problem, device, reference) {
                    Ok(err) if err < tolerance(v.dtype) => Ok(err),
                    Ok(err) => Err(format!("wrong result: {}", error_text(v, err))),
                    Err(RunFailure::Soft(why)) => Err(why),
                    Err(RunFailure::Fault(why)) => Err(format!("kernel fault: {why}")),
                }
            },
        )
    }

    /// Times `v` on the real problem, rotating through `copies`.
    pub fn time(
        &mut self,
        v: &Variant,
        problem: &Problem,
        copies: &mut [DeviceProblem],
        plan: &TimingPlan,
    ) -> Result<Timing, String> {
        self.clocked(|p| &mut p.time_s, |eval| eval.time_now(v, problem, copies, plan))
    }

    /// Runs `work`, adding its wall time to the phase `phase` picks.
    fn clocked<T>(&mut self, phase: fn(&mut Phases) -> &mut f64, work: impl FnOnce(&mut Self) -> T) -> T {
        let started = Instant::now();
        let outcome = work(self);
        *phase(&mut self.phases) += started.elapsed().as_secs_f64();
        outcome
    }

    /// Times `variants` in turns on `problem`'s `copies` (see [`time_in_turns`]), with `extra`
    /// (the vendor peer) as one more contestant. Returns the variants' timings, in order, and
    /// `extra`'s.
    pub fn time_in_turns(
        &mut self,
        variants: &[Variant],
        problem: &Problem,
        copies: &mut [DeviceProblem],
        plan: &TimingPlan,
        rounds: usize,
        extra: Option<Contestant<'_>>,
    ) -> Result<(Vec<Timing>, Option<Timing>), String> {
        self.clocked(
            |p| &mut p.time_s,
            |eval| eval.time_in_turns_now(variants, problem, copies, plan, rounds, extra),
        )
    }

    fn time_in_turns_now(
        &mut self,
        variants: &[Variant],
        problem: &Problem,
        copies: &mut [DeviceProblem],
        plan: &TimingPlan,
        rounds: usize,
        extra: Option<Contestant<'_>>,
    ) -> Result<(Vec<Timing>, Option<Timing>), String> {
        let gpu = self.gpu;
        for v in variants {
            let elems = v
                .workspace_elems(&problem.shape, &gpu.info.limits)
                .map_err(|e| e.to_string())?;
            for c in copies.iter_mut() {
                c.ensure_workspace(gpu, elems).map_err(|e| e.to_string())?;
            }
            self.load(v)?;
        }
        let copies: &[DeviceProblem] = copies;
        let mut contestants = Vec::with_capacity(variants.len() + 1);
        for v in variants {
            let loaded = &self.loaded[&v.kernel_name()];
            let launches = loaded.plan(gpu, &problem.shape).map_err(|e| e.to_string())?;
            loaded.fill_constants(gpu, problem).map_err(|e| e.to_string())?;
            contestants.push(Contestant {
                copies: copies.len(),
                enqueue: Box::new(move |i| loaded.launch(gpu, problem, &copies[i % copies.len()], &launches)),
            });
        }
        let has_extra = extra.is_some();
        contestants.extend(extra);
        let mut times = time_in_turns(gpu, plan, rounds, &mut contestants).map_err(|e| e.to_string())?;
        let extra_time = if has_extra { times.pop() } else { None };
        Ok((times, extra_time))
    }

    fn time_now(
        &mut self,
        v: &Variant,
        problem: &Problem,
        copies: &mut [DeviceProblem],
        plan: &TimingPlan,
    ) -> Result<Timing, String> {
        // One contestant, one round: exactly `plan`'s warm-up and runs.
        let (mut times, _) = self.time_in_turns_now(std::slice::from_ref(v), problem, copies, plan, 1, None)?;
        Ok(times.remove(0))
    }
}
