//! GPT-2 on several GPUs of one host, as one [`Backend`]: a [`GpuBackend`] replica per GPU
//! (weights converted and uploaded once per device, its own buffers, KV cache, CUDA graphs and
//! kernel registry from the shared tuning database), each driven by its own host thread. A batch
//! is sliced across the replicas in proportion to what each GPU can take (its SM count: equal
//! slices on equal GPUs), every replica runs its slice at once, and the results are gathered in
//! sequence order. Nothing is allocated or uploaded per call once a batch size has been seen.
//!
//! The first replica lives on the calling thread (one device costs nothing over a plain
//! [`GpuBackend`]); the others each on a worker thread that owns its replica from construction
//! to drop, so CUDA state never crosses threads. Every replica chooses its kernels as one GPU
//! would for the whole batch ([`GpuBackend::set_selection_batch`]), so each sequence's logits
//! are bit-identical to a one-GPU run.

use std::ops::Range;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{anyhow, Context, Result as AnyResult};

use super::config::GPT2Config;
use super::engine::DecodeEngine;
use super::error::{ModelError, Result};
use super::generate::{Backend, Draw, Logits};
use super::gpu::GpuBackend;
use super::weights::GPT2Model;
use crate::gpu::devices::sm_count;
use crate::gpu::slice_batch;
use crate::spec::Dtype;

/// What one replica is built from (everything but the device).
#[derive(Clone, Debug)]
pub struct ReplicaOptions {
    /// Sequences the whole set is sized for; each replica gets buffers for its slice of them.
    pub max_batch: usize,
    pub unfused: bool,
    pub dtype: Dtype,
    /// How decode steps run (`None`: the backend's default).
    pub decode_engine: Option<DecodeEngine>,
}

/// A unit of work for one replica, run on its thread.
type Job = Box<dyn FnOnce(&mut GpuBackend) + Send>;

/// A replica on its own thread.
struct Worker {
    device: usize,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// A pending result of a job sent to a worker.
enum Pending<R> {
    Idle,
    Sent(usize, mpsc::Receiver<R>),
}

/// GPT-2 replicated over GPUs; see the module docs.
pub struct Replicas {
    /// CUDA ordinal of each replica, in slicing order (the first runs on this thread).
    devices: Vec<usize>,
    /// What each GPU can take (its SM count).
    weights: Vec<f64>,
    first: GpuBackend,
    /// Replicas 1.. (index i + 1 in `devices`).
    workers: Vec<Worker>,
    /// The slice of the current batch each replica holds (empty: idle since the last prefill).
    slices: Vec<Range<usize>>,
    name: String,
}

impl Replicas {
    /// One replica on each of `devices` (CUDA ordinals; the same GPU may appear twice, which
    /// tests use to exercise the replica path on one GPU), built in parallel. The error of a
    /// replica that cannot be built names its device.
    pub fn open(root: &Path, devices: &[usize], model: Arc<GPT2Model>, opts: &ReplicaOptions) -> AnyResult<Replicas> {
        let (&primary, others) = devices
            .split_first()
            .ok_or_else(|| anyhow!("no GPU to run on (the device list is empty)"))?;
        let mut weights = Vec::with_capacity(devices.len());
        for &d in devices {
            weights.push(sm_count(d).with_context(|| format!("opening cuda:{d}"))? as f64);
        }
        let max_slices = slice_batch(opts.max_batch.max(devices.len()), &weights);
        let build = {
            let root = root.to_path_buf();
            let model = model.clone();
            let opts = opts.clone();
            move |device: usize, max_batch: usize| -> AnyResult<GpuBackend> {
                let mut g = GpuBackend::on_device(&root, device, model.clone(), max_batch, opts.unfused, opts.dtype)?;
                // Unasked, every replica runs the engine one GPU would for the whole batch (the
                // database's choice for its own slice could differ, and with it the logits).
                let engine = match opts.decode_engine {
                    Some(engine) => Some(engine),
                    None if !opts.unfused => Some(g.tuned_decode_engine(opts.max_batch)),
                    None => None,
                };
                if let Some(engine) = engine {
                    g.set_decode_engine(engine).with_context(|| format!("cuda:{device}"))?;
                }
                Ok(g)
            }
        };
        let mut workers = Vec::with_capacity(others.len());
        let mut ready = Vec::with_capacity(others.len());
        for (i, &device) in others.iter().enumerate() {
            let (jobs, inbox) = mpsc::channel::<Job>();
            let (done, started) = mpsc::channel::<std::result::Result<(), String>>();
            let build = build.clone();
            let max_batch = max_slices[i + 1].len().max(1);
            let thread = std::thread::Builder::new()
                .name(format!("kernelforge cuda:{device}"))
                .spawn(move || {
                    let mut replica = match build(device, max_batch) {
                        Ok(r) => {
                            let _ = done.send(Ok(()));
                            r
                        }
                        Err(e) => {
                            let _ = done.send(Err(format!("{e:#}")));
                            return;
                        }
                    };
                    for job in inbox {
                        job(&mut replica);
                    }
                })
                .with_context(|| format!("starting the host thread of cuda:{device}"))?;
            workers.push(Worker {
                device,
                jobs: Some(jobs),
                thread: Some(thread),
            });
            ready.push(started);
        }
        // The first replica builds here while the others build on their threads.
        let first = build(primary, max_slices[0].len().max(1));
        for (worker, started) in workers.iter().zip(ready) {
            match started.recv() {
                Ok(Ok(())) => {}
                Ok(Err(why)) => return Err(anyhow!(why)),
                Err(_) => {
                    return Err(anyhow!(
                        "cuda:{}: the replica's thread stopped while loading",
                        worker.device
                    ))
                }
            }
        }
        let first = first?;
        let name = Self::name_for(devices, &first);
        Ok(Replicas {
            devices: devices.to_vec(),
            weights,
            first,
            workers,
            slices: Vec::new(),
            name,
        })
    }

    /// `cuda:0` for one replica, `cuda:0,1 bf16` for several.
    fn name_for(devices: &[usize], first: &GpuBackend) -> String {
        let own = first.name();
        if devices.len() == 1 {
            return own.to_string();
        }
        let list: Vec<String> = devices.iter().map(usize::to_string).collect();
        let rest = own.split_once(' ').map_or("", |(_, r)| r);
        format!(
            "cuda:{}{}{rest}",
            list.join(","),
            if rest.is_empty() { "" } else { " " }
        )
    }

    /// The CUDA ordinals, in slicing order.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// The replica on the first device (the one whose profile, kernels and notes `bench`
    /// reports).
    pub fn primary(&self) -> &GpuBackend {
        &self.first
    }

    /// See [`Replicas::primary`].
    pub fn primary_mut(&mut self) -> &mut GpuBackend {
        &mut self.first
    }

    /// The slice of the current batch each replica holds (from the last prefill).
    pub fn slices(&self) -> &[Range<usize>] {
        &self.slices
    }

    /// Runs `f` on every replica at once (the first on this thread) and returns what each
    /// returned, in device order.
    pub fn for_each<R, F>(&mut self, f: F) -> Result<Vec<R>>
    where
        R: Send + 'static,
        F: Fn(&mut GpuBackend) -> R + Clone + Send + 'static,
    {
        let jobs = (0..self.devices.len()).map(|_| Some(f.clone())).collect();
        Ok(self
            .run(jobs)?
            .into_iter()
            .map(|r| r.expect("every replica ran"))
            .collect())
    }

    /// Runs `jobs[i]` on replica i (none where `None`), all at once, and gathers the results.
    fn run<R, F>(&mut self, mut jobs: Vec<Option<F>>) -> Result<Vec<Option<R>>>
    where
        R: Send + 'static,
        F: FnOnce(&mut GpuBackend) -> R + Send + 'static,
    {
        let mut pending = Vec::with_capacity(self.workers.len());
        for (i, worker) in self.workers.iter().enumerate() {
            let Some(job) = jobs[i + 1].take() else {
                pending.push(Pending::Idle);
                continue;
            };
            let (reply, result) = mpsc::channel();
            let sent = worker.jobs.as_ref().is_some_and(|tx| {
                tx.send(Box::new(move |g: &mut GpuBackend| {
                    let _ = reply.send(job(g));
                }))
                .is_ok()
            });
            if !sent {
                return Err(stopped(worker.device));
            }
            pending.push(Pending::Sent(worker.device, result));
        }
        let mut out = Vec::with_capacity(self.devices.len());
        out.push(jobs[0].take().map(|job| job(&mut self.first)));
        for p in pending {
            out.push(match p {
                Pending::Idle => None,
                Pending::Sent(device, rx) => Some(rx.recv().map_err(|_| stopped(device))?),
            });
        }
        Ok(out)
    }

    /// Slices `tokens` across the replicas and runs `call` on each non-empty slice; remembers
    /// the slices for the decode steps that follow.
    fn prefill_with<F>(&mut self, tokens: &[Vec<u32>], call: F) -> Result<Vec<Option<Result<Option<Logits>>>>>
    where
        F: Fn(&mut GpuBackend, &[Vec<u32>]) -> Result<Option<Logits>> + Clone + Send + 'static,
    {
        let slices = slice_batch(tokens.len(), &self.weights);
        let whole = tokens.len();
        let jobs = slices
            .iter()
            .map(|r| {
                (!r.is_empty()).then(|| {
                    let part = tokens[r.clone()].to_vec();
                    let call = call.clone();
                    move |g: &mut GpuBackend| {
                        g.set_selection_batch(Some(whole));
                        call(g, &part)
                    }
                })
            })
            .collect();
        self.slices = slices;
        self.run(jobs)
    }

    /// The per-sequence inputs of a decode step, cut along the current slices.
    fn split_last(&self, last: &[u32]) -> Result<Vec<Option<Vec<u32>>>> {
        let batch = self.slices.last().map_or(0, |r| r.end);
        if batch == 0 {
            return Err(ModelError::Batch("decode called before prefill".into()));
        }
        if last.len() != batch {
            return Err(ModelError::Batch(format!(
                "decode got {} tokens for a batch of {batch} sequences",
                last.len()
            )));
        }
        Ok(self
            .slices
            .iter()
            .map(|r| (!r.is_empty()).then(|| last[r.clone()].to_vec()))
            .collect())
    }

    /// A full forward pass on every replica's slice, logits left on the devices (what `bench`
    /// times).
    pub fn forward_on_device(&mut self, tokens: &[Vec<u32>]) -> Result<()> {
        for r in self.prefill_with(tokens, |g, part| g.forward_on_device(part).map(|()| None))? {
            r.transpose()?;
        }
        Ok(())
    }

    /// (GPU ms, steps) of the decode steps since the last call, of the replica that spent the
    /// most GPU time (the replicas step together, so the slowest sets the pace); clears them.
    pub fn take_decode_gpu_time(&mut self) -> Result<(f64, usize)> {
        let all = self.for_each(|g| g.take_decode_gpu_time())?;
        Ok(all.into_iter().fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a }))
    }

    /// Messages worth showing once, from every replica, without repeats.
    pub fn notes(&mut self) -> Result<Vec<String>> {
        let mut notes: Vec<String> = Vec::new();
        for n in self.for_each(|g| g.notes())?.into_iter().flatten() {
            if !notes.contains(&n) {
                notes.push(n);
            }
        }
        Ok(notes)
    }
}

fn stopped(device: usize) -> ModelError {
    ModelError::Backend {
        backend: format!("cuda:{device}"),
        message: "the replica's host thread stopped (a panic on that thread; see the message above)".into(),
    }
}

/// Concatenates the replicas' logits in sequence order.
fn gather(parts: Vec<Option<Result<Option<Logits>>>>) -> Result<Logits> {
    let mut logits: Option<Logits> = None;
    for part in parts.into_iter().flatten() {
        let part = part?.expect("prefill and decode read their logits back");
        logits = Some(match logits {
            None => part,
            Some(mut all) => {
                all.batch += part.batch;
                all.data.extend_from_slice(&part.data);
                all
            }
        });
    }
    logits.ok_or_else(|| ModelError::Batch("no sequences given".into()))
}

/// Every slice's token ids, in sequence order.
fn gather_ids(parts: Vec<Option<Result<Vec<u32>>>>) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for part in parts.into_iter().flatten() {
        ids.extend(part?);
    }
    Ok(ids)
}

impl Backend for Replicas {
    fn name(&self) -> &str {
        &self.name
    }

    fn decode_engine(&self) -> Option<DecodeEngine> {
        Some(self.first.decode_engine())
    }

    /// The first GPU's (the slices run side by side).
    fn prefill_gpu_ms(&mut self) -> Result<Option<f64>> {
        self.first.prefill_gpu_ms()
    }

    fn config(&self) -> &GPT2Config {
        self.first.config()
    }

    fn prefill(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        if self.workers.is_empty() {
            self.slices = slice_batch(tokens.len(), &self.weights);
            return self.first.prefill(tokens);
        }
        gather(self.prefill_with(tokens, |g, part| g.prefill(part).map(Some))?)
    }

    fn prefill_last(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        if self.workers.is_empty() {
            self.slices = slice_batch(tokens.len(), &self.weights);
            return self.first.prefill_last(tokens);
        }
        gather(self.prefill_with(tokens, |g, part| g.prefill_last(part).map(Some))?)
    }

    fn prepare(&mut self, batch: usize, prompt_len: usize) -> Result<()> {
        if self.workers.is_empty() {
            return self.first.prepare(batch, prompt_len);
        }
        let jobs = slice_batch(batch, &self.weights)
            .into_iter()
            .map(|r| {
                (!r.is_empty()).then_some(move |g: &mut GpuBackend| {
                    g.set_selection_batch(Some(batch));
                    g.prepare(r.len(), prompt_len)
                })
            })
            .collect();
        for part in self.run(jobs)?.into_iter().flatten() {
            part?;
        }
        Ok(())
    }

    fn decode(&mut self, last: &[u32]) -> Result<Logits> {
        if self.workers.is_empty() {
            return self.first.decode(last);
        }
        let jobs = self
            .split_last(last)?
            .into_iter()
            .map(|part| part.map(|p| move |g: &mut GpuBackend| g.decode(&p).map(Some)))
            .collect();
        gather(self.run(jobs)?)
    }

    fn decode_argmax(&mut self, last: &[u32]) -> Result<Vec<u32>> {
        if self.workers.is_empty() {
            return self.first.decode_argmax(last);
        }
        let jobs = self
            .split_last(last)?
            .into_iter()
            .map(|part| part.map(|p| move |g: &mut GpuBackend| g.decode_argmax(&p)))
            .collect();
        gather_ids(self.run(jobs)?)
    }

    /// Each replica draws for its slice, keyed by the sequences' indices in the whole batch, so
    /// the ids do not depend on how the batch is sliced.
    fn decode_draw(&mut self, last: &[u32], draw: &Draw, position: usize) -> Result<Vec<u32>> {
        if self.workers.is_empty() {
            return self.first.decode_draw(last, draw, position);
        }
        if draw.params.is_greedy() {
            return self.decode_argmax(last);
        }
        let offsets: Vec<usize> = self.slices.iter().map(|r| r.start).collect();
        let jobs = self
            .split_last(last)?
            .into_iter()
            .zip(offsets)
            .map(|(part, offset)| {
                let draw = draw.from_row(offset);
                part.map(|p| move |g: &mut GpuBackend| g.decode_draw(&p, &draw, position))
            })
            .collect();
        gather_ids(self.run(jobs)?)
    }

    fn stats_note(&self) -> Option<String> {
        let note = self.first.stats_note()?;
        Some(if self.devices.len() > 1 {
            format!("{note} (on {}; {} GPUs)", self.first.name(), self.devices.len())
        } else {
            note
        })
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        // Closing the job channels ends the worker loops; each replica is dropped on its thread.
        for w in &mut self.workers {
            w.jobs = None;
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}
