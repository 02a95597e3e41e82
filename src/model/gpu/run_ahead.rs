//! Decode steps that choose their tokens on the device run one ahead, on every engine.
//!
//! A generation loop feeds each step the ids the previous step returned. So once a step is
//! launched, the next one can be launched right behind it, reading those ids straight from the
//! device, before the host has read them back: every engine's step reads its input tokens from
//! the buffer the previous step's draw (the megakernel's LM head, the argmax or the sampler)
//! wrote (`plan::Pass::Decode { from_draw: true }`). A sampled step is as deterministic as
//! a greedy one: its draw is keyed by (seed, sequence, position), not by a host-side state. The
//! GPU then runs steps back to back. Without it, the GPU idles every step while the host wakes
//! up, reads the ids, checks them and launches the next step: about 25 µs a step on the
//! H100, 7% of a GPT-2 small bf16 step on the megakernel, 10% on the graph engine (H200).
//!
//! The step launched ahead is a guess that the caller continues the chain with the same draw. A
//! caller that feeds anything else (the prompt tokens of a ragged batch, ids it changed), draws
//! otherwise, or does anything but such a step next, throws the guess away: the step has written the cache
//! row at the next position, which whatever runs at that position writes again, and nothing
//! reads a cache position at or beyond the cached length.
//!
//! The chosen ids go straight to the host: the draw's kernel writes them into page-locked host
//! memory mapped into the GPU's address space (`buffers::DrawnIds`), so nothing but the steps'
//! graphs and events is on the stream, and writes them again into device memory, where the next
//! step reads them. Two slots alternate in both places: a step writes one, reads its own input
//! tokens from the other's device copy (the step before's choice), and the host reads a step's
//! slot after that step's event, while the step after it (launched ahead) writes the other.
//! The step after that, which writes this slot again, is launched only once the host has read it.

use anyhow::{Context, Result as AnyResult};
use cudarc::driver::CudaEvent;

use super::{GpuBackend, SYNC_HINT};
use crate::gpu::GpuError;
use crate::model::error::ModelError;
use crate::model::generate::Draw;

/// A step choosing its tokens on the device, launched and not read back yet.
pub(super) struct LaunchedStep {
    /// The ids the step reads: what the caller fed, or for a step launched ahead, its
    /// predecessor's choices (filled in once those are back). The caller must feed exactly
    /// these, and ask for the same draw, for the step to count.
    fed: Vec<u32>,
    draw: Draw,
    /// The slot of `act.next_ids` its ids land in.
    slot: usize,
    /// Events around its kernels, the chooser's included (its GPU time; once the second has
    /// passed, its ids are in its slot).
    events: (CudaEvent, CudaEvent),
}

impl GpuBackend {
    /// Whether steps may run one ahead: on every engine, when not profiled kernel by kernel, not
    /// stamped for the timeline, not synchronised after every launch.
    fn may_run_ahead(&self) -> bool {
        self.profiler.is_none() && !self.timeline_on && !self.sync_each
    }

    /// Throws the step launched ahead away, if there is one (see the module docs). Nothing to
    /// wait for: whatever runs next is ordered after it on the stream.
    pub(super) fn discard_ahead(&mut self) {
        if self.ahead.take().is_some() {
            self.len -= 1;
        }
    }

    /// A step choosing its ids by `draw` into the next slot of `act.next_ids` (host memory the
    /// GPU writes: nothing to copy back), from `last` (uploaded), or with `None` from the
    /// previous step's choices in the other slot.
    fn launch_chosen(&mut self, last: Option<&[u32]>, draw: &Draw) -> AnyResult<LaunchedStep> {
        self.draw_slot ^= 1;
        let slot = self.draw_slot;
        self.decode_step(last, Some(draw))?;
        let events = self.step_events.take().context("a decode step left no events behind")?;
        Ok(LaunchedStep {
            fed: last.map(<[u32]>::to_vec).unwrap_or_default(),
            draw: *draw,
            slot,
            events,
        })
    }

    /// A decode step whose tokens are chosen on the device (see [`GpuBackend::decode_draw`]):
    /// the step for `last` is the one already running when the caller continues the chain,
    /// else launched now; when the caller fed what the previous call returned (it is chaining:
    /// not feeding a ragged batch's prompt tokens), the next step is launched ahead where that
    /// is allowed; then this step's ids are read back.
    pub(super) fn chosen_step_on_device(&mut self, last: &[u32], draw: &Draw) -> AnyResult<Vec<u32>> {
        let chaining = self.returned == last;
        // A step ahead that guessed other ids or another draw stays, for launching this one to
        // throw it away.
        let step = match self.ahead.take_if(|ahead| ahead.fed == last && ahead.draw == *draw) {
            Some(ahead) => ahead,
            None => self.launch_chosen(Some(last), draw)?,
        };
        let position = self.len; // of the token this step chose (`len` counts it)
        let ahead = if chaining && self.may_run_ahead() && self.len < self.model.config.n_ctx {
            Some(self.launch_chosen(None, draw)?)
        } else {
            None
        };
        let b = self.batch;
        let landed = step
            .events
            .1
            .synchronize()
            .map_err(|e| anyhow::Error::new(GpuError::cuda("waiting for the decode step's token ids")(e)))
            .and_then(|()| self.act.next_ids.read(step.slot, b));
        let raw: Vec<i32> = match landed {
            Ok(ids) => ids,
            Err(e) => {
                self.ahead = ahead;
                self.discard_ahead();
                return Err(e).context(SYNC_HINT);
            }
        };
        self.step_events = Some(step.events);
        self.finish_step_timing()?;
        self.flush_profile()?;
        let ids = raw
            .iter()
            .enumerate()
            .map(|(s, &id)| {
                u32::try_from(id).map_err(|_| {
                    ModelError::Sampling(format!(
                        "sequence {}: the logits for position {} hold NaN or infinity ({} on the GPU): the checkpoint or the forward pass is broken",
                        draw.first_sequence as usize + s,
                        position,
                        self.name
                    ))
                })
            })
            .collect::<Result<Vec<u32>, _>>();
        match ids {
            Ok(ids) => {
                self.ahead = ahead.map(|a| LaunchedStep { fed: ids.clone(), ..a });
                self.returned.clone_from(&ids);
                Ok(ids)
            }
            Err(e) => {
                // the step ahead read a -1 id (the megakernel reads it as token 0): not a step
                self.ahead = ahead;
                self.discard_ahead();
                Err(e.into())
            }
        }
    }
}

impl Drop for GpuBackend {
    /// A step launched ahead may still be writing its ids into the mapped buffer about to be
    /// freed: let the stream finish first.
    fn drop(&mut self) {
        if self.ahead.is_some() {
            let _ = self.gpu.synchronize();
        }
    }
}
