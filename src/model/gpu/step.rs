//! Running one step: a prefill of B sequences or a decode step (ids uploaded, the step's
//! plan built or reused and run by the chosen executor, logits or next ids read back), and the
//! errors a step returns. The plan is `plan.rs`'s, the executors are `exec.rs`'s and
//! `megakernel.rs`'s.

use anyhow::{bail, Context, Result as AnyResult};

use super::exec::{record_event, GraphStep};
use super::lm_head_draw::drawn_in_lm_head;
use super::plan::{HeadRows, Pass, Plan};
use super::{GpuBackend, PINNED_LOGITS_ROWS, SYNC_HINT};
use crate::gpu::GpuError;
use crate::model::engine::DecodeEngine;
use crate::model::error::{ModelError, Result};
use crate::model::generate::{Draw, Logits};

impl GpuBackend {
    pub(super) fn upload_ids(&mut self, tokens: &[Vec<u32>]) -> AnyResult<()> {
        let v = self.model.config.vocab_size;
        let mut ids = Vec::with_capacity(tokens.len() * tokens[0].len());
        for s in tokens {
            for (i, &tok) in s.iter().enumerate() {
                if tok as usize >= v {
                    return Err(ModelError::InvalidToken {
                        token: tok,
                        position: self.len + i,
                        vocab_size: v,
                    }
                    .into());
                }
                ids.push(tok as i32);
            }
        }
        let mut dst = self.act.ids.slice_mut(0..ids.len());
        self.gpu
            .stream
            .memcpy_htod(&ids, &mut dst)
            .map_err(GpuError::cuda(format!("uploading {} token ids", ids.len())))?;
        Ok(())
    }

    /// Copy `rows` logits rows back, keeping the real vocabulary, and finish the call.
    pub(super) fn read_logits(&mut self, b: usize, seq: usize, rows: usize) -> AnyResult<Logits> {
        let cfg = &self.model.config;
        let (v, vp) = (cfg.vocab_size, cfg.padded_vocab_size);
        let e = self.dtype.storage().bytes();
        let n = rows * vp * e; // bytes
        let src = self.act.logits.bytes.slice(0..n);
        let copy_err = || GpuError::cuda(format!("copying {rows} x {vp} logits back"));
        // A decode step's few rows go through pinned memory; a prefill's many rows (up to GBs)
        // through an ordinary buffer.
        let pinned = rows <= PINNED_LOGITS_ROWS.max(self.kv_batch);
        if pinned && self.pinned_logits.as_ref().is_none_or(|p| p.len() < n) {
            let len = PINNED_LOGITS_ROWS.max(self.kv_batch) * vp * e;
            // SAFETY: the buffer is only read after a device copy has filled the part read.
            // Flags 0: cached host memory (write-combined memory is slow for the CPU to read).
            self.pinned_logits = Some(
                unsafe { self.gpu.ctx.alloc_pinned_with_flags::<u8>(len, 0) }
                    .map_err(GpuError::cuda(format!("allocating {len} bytes of pinned host memory")))?,
            );
        }
        let host: &[u8] = match (pinned, self.pinned_logits.as_mut()) {
            (true, Some(p)) => {
                self.gpu.stream.memcpy_dtoh(&src, p).map_err(copy_err())?;
                self.gpu.synchronize().context(SYNC_HINT)?;
                p.as_slice().map_err(copy_err())?
            }
            _ => {
                if self.host_logits.len() < n {
                    self.host_logits.resize(n, 0);
                }
                self.gpu
                    .stream
                    .memcpy_dtoh(&src, &mut self.host_logits[..n])
                    .map_err(copy_err())?;
                self.gpu.synchronize().context(SYNC_HINT)?;
                &self.host_logits
            }
        };
        let mut data = Vec::with_capacity(rows * v);
        for r in 0..rows {
            data.extend(self.dtype.storage().decode(&host[r * vp * e..(r * vp + v) * e]));
        }
        self.finish_step_timing()?;
        self.flush_profile()?;
        Ok(Logits::new(b, seq, v, data)?)
    }

    /// Adds the finished decode step's GPU time (its events) to the total.
    pub(super) fn finish_step_timing(&mut self) -> AnyResult<()> {
        if let Some((start, end)) = self.step_events.take() {
            let ms = start
                .elapsed_ms(&end)
                .map_err(GpuError::cuda("reading the decode step events"))?;
            self.decode_gpu_ms.0 += ms as f64;
            self.decode_gpu_ms.1 += 1;
        }
        self.read_timeline()
    }

    /// The last prefill's GPU time in ms (its events; waits for them), once.
    pub(super) fn take_prefill_gpu_ms(&mut self) -> AnyResult<Option<f64>> {
        let Some((start, end)) = self.prefill_events.take() else {
            return Ok(None);
        };
        end.synchronize()
            .map_err(GpuError::cuda("waiting for the prefill's end event"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(GpuError::cuda("reading the prefill events"))?;
        Ok(Some(ms as f64))
    }

    /// (total GPU ms, steps) of the decode steps since the last call: the time from the first
    /// kernel of a step to its last, without the host's share (copies, sampling); clears it.
    pub fn take_decode_gpu_time(&mut self) -> (f64, usize) {
        std::mem::take(&mut self.decode_gpu_ms)
    }

    pub(super) fn prefill_impl(&mut self, tokens: &[Vec<u32>], head: HeadRows) -> AnyResult<Option<Logits>> {
        self.discard_ahead();
        self.returned.clear();
        let cfg = self.model.config.clone();
        let b = tokens.len();
        if b == 0 {
            return Err(ModelError::Batch("no sequences given".into()).into());
        }
        let t = tokens[0].len();
        if t == 0 {
            return Err(ModelError::Batch("sequences must have at least one token".into()).into());
        }
        if let Some(i) = tokens.iter().position(|s| s.len() != t) {
            return Err(ModelError::Batch(format!(
                "sequence {i} has {} tokens but sequence 0 has {t}; a batch must be rectangular",
                tokens[i].len()
            ))
            .into());
        }
        if t > cfg.n_ctx {
            return Err(ModelError::ContextOverflow {
                needed: t,
                n_ctx: cfg.n_ctx,
            }
            .into());
        }
        self.batch = 0;
        self.len = 0;
        self.ensure_capacity(b, t)?;
        let ks = self.kernels(b, t, false, head == HeadRows::Last)?;
        let plan = self.build_plan(&ks, b, t, 0, Pass::Prefill, head)?;
        // The prefill's GPU time: the ids' upload and every kernel, not the logits' copy back.
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        record_event(&start, &self.gpu)?;
        self.upload_ids(tokens)?;
        self.execute(&plan)?;
        record_event(&end, &self.gpu)?;
        self.prefill_events = Some((start, end));
        let rows = plan.head_rows;
        if ks.kv_append.is_some() {
            self.batch = b;
            self.len = t;
        }
        match head {
            HeadRows::AllOnDevice => {
                self.gpu.synchronize().context(SYNC_HINT)?;
                self.flush_profile()?;
                Ok(None)
            }
            HeadRows::Last => Ok(Some(self.read_logits(b, 1, rows)?)),
            HeadRows::All => Ok(Some(self.read_logits(b, t, rows)?)),
            HeadRows::Greedy => bail!("a prefill does not choose tokens on the device"),
        }
    }

    /// See [`crate::model::Backend::prepare`]: the buffers, the kernels of the prefill (last
    /// rows only, as `generate` asks) and of the decode steps, and the megakernel's table.
    pub(super) fn prepare_impl(&mut self, b: usize, t: usize) -> AnyResult<()> {
        self.discard_ahead();
        self.ensure_capacity(b, t.max(1))?;
        self.kernels(b, t.max(1), false, true)?;
        if self.decode_missing.is_none() {
            let ks = self.kernels(b, 1, true, false)?;
            if self.engine_for(b) == DecodeEngine::Megakernel {
                self.prepare_megakernel(&ks, b)?;
            }
        }
        Ok(())
    }

    /// One decode step up to the LM head (and, when `choose` is given, the argmax or sampling
    /// kernel into its slot of `act.next_ids`), launched but not waited for. Returns the batch
    /// size. `last`: the tokens to feed; `None`: the previous step's chosen ids, in the other
    /// slot of `act.next_ids`, where this step reads them (see `run_ahead.rs`).
    pub(super) fn decode_step(&mut self, last: Option<&[u32]>, choose: Option<&Draw>) -> AnyResult<usize> {
        self.discard_ahead();
        if let Some(why) = &self.decode_missing {
            bail!("{why}");
        }
        let cfg = self.model.config.clone();
        if self.len == 0 {
            bail!("decode called before prefill");
        }
        let b = self.batch;
        if last.is_some_and(|last| last.len() != b) {
            let n = last.map_or(0, <[u32]>::len);
            return Err(ModelError::Batch(format!("decode got {n} tokens for a batch of {b} sequences")).into());
        }
        if self.len + 1 > cfg.n_ctx {
            return Err(ModelError::ContextOverflow {
                needed: self.len + 1,
                n_ctx: cfg.n_ctx,
            }
            .into());
        }
        let megakernel = self.step_engine() == DecodeEngine::Megakernel;
        match last {
            Some(last) => self.upload_ids(&last.iter().map(|&t| vec![t]).collect::<Vec<_>>())?,
            // Every engine reads the ids where the previous step's choice wrote them.
            None if choose.is_some() => {}
            None => bail!("a decode step from the previous step's ids needs the ids drawn on the device"),
        }
        let ks = self.kernels(b, 1, true, false)?;
        let pos = self.len;
        // The kernel that chooses this step's tokens (at position pos + 1) after the step's own;
        // none where the megakernel's LM head stage draws them itself (which its table decides:
        // prepared here, once per batch size, before megakernel_step launches it), and inside
        // the graph on the graph engine.
        if megakernel {
            self.prepare_megakernel(&ks, b)?;
        }
        let head = self.megakernel_lm_head();
        let in_lm_head =
            choose.filter(|draw| megakernel && drawn_in_lm_head(&draw.params, cfg.vocab_size, head.as_ref()));
        let graphs = self.decode_graphs();
        let slot = self.draw_slot;
        let pass = Pass::Decode {
            from_draw: last.is_none(),
            slot,
        };
        // The graph engine's chooser is a node of its graph; the others launch it after the step.
        let chooser = match choose {
            Some(draw) if in_lm_head.is_none() && !graphs => Some(Plan {
                steps: vec![self.choose_step(&ks, b, draw, pos + 1, slot)?],
                head_rows: b,
            }),
            _ => None,
        };
        let graph_step = GraphStep {
            b,
            pos,
            pass,
            draw: choose.copied(),
        };
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        if megakernel {
            record_event(&start, &self.gpu)?;
            self.megakernel_step(b, pos, last.is_none(), in_lm_head)?;
        } else if graphs {
            if self.prepared != Some((graph_step, self.buffers_generation)) {
                self.prepare_decode_graph(&ks, graph_step)?;
            }
            record_event(&start, &self.gpu)?;
            self.decode_graphs[&graph_step.key()].launch(&self.gpu.stream)?;
        } else {
            record_event(&start, &self.gpu)?;
            let plan = self.build_plan(&ks, b, 1, pos, pass, HeadRows::All)?;
            self.execute(&plan)?;
        }
        if let Some(plan) = &chooser {
            self.execute(plan)?;
        }
        record_event(&end, &self.gpu)?;
        self.step_events = Some((start, end));
        self.len += 1;
        if graphs {
            // While the GPU runs this step, set the graph up for the next one: the next position,
            // and, when this step chooses its tokens, ids read from that choice (a chain).
            // Updates do not touch a launched graph.
            self.prepared = None;
            if pos + 1 < cfg.n_ctx {
                let next = GraphStep {
                    pos: pos + 1,
                    // (a chained step writes the other slot: run_ahead.rs)
                    pass: Pass::Decode {
                        from_draw: choose.is_some(),
                        slot: slot ^ usize::from(choose.is_some()),
                    },
                    ..graph_step
                };
                self.prepare_decode_graph(&ks, next)?;
            }
        }
        Ok(b)
    }

    pub(super) fn decode_impl(&mut self, last: &[u32]) -> AnyResult<Logits> {
        let b = self.decode_step(Some(last), None)?;
        self.read_logits(b, 1, b)
    }

    /// A decode step whose next tokens are drawn on the device when this build has the kernel
    /// for `draw` (the argmax or the sampler), else from logits copied back.
    pub(super) fn decode_draw_impl(&mut self, last: &[u32], draw: &Draw) -> AnyResult<Vec<u32>> {
        let on_device = self.decode_missing.is_none() && {
            let ks = self.kernels(self.batch.max(1), 1, true, false)?;
            if draw.params.is_greedy() {
                ks.argmax.is_some()
            } else {
                ks.sample.is_some()
            }
        };
        if !on_device {
            let position = self.len + 1;
            let logits = self.decode_impl(last)?;
            return (0..last.len())
                .map(|b| draw.on_host(logits.last(b), b, position).map_err(Into::into))
                .collect();
        }
        self.chosen_step_on_device(last, draw)
    }

    /// A full forward pass (LM head on every position) that leaves the logits on the device:
    /// what `bench` times. Fills the KV cache like a prefill.
    pub fn forward_on_device(&mut self, tokens: &[Vec<u32>]) -> Result<()> {
        self.prefill_impl(tokens, HeadRows::AllOnDevice)
            .map(|_| ())
            .map_err(|e| self.model_error(e))
    }

    pub(super) fn model_error(&self, e: anyhow::Error) -> ModelError {
        match e.downcast::<ModelError>() {
            Ok(m) => m,
            Err(e) => ModelError::Backend {
                backend: self.name.clone(),
                message: format!("{e:#}"),
            },
        }
    }
}
