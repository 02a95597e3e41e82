//! The generation loop, independent of where the forward pass runs. A [`Backend`] (the CPU
//! reference here, the GPU later) owns the weights and the KV cache and turns tokens into
//! [`Logits`]; [`generate`] prefills B prompts, then samples and feeds one token per sequence per
//! step, streaming each produced token through a callback, until `max_new_tokens`, end-of-text or
//! the context length, and reports timing stats.

use std::time::Instant;

use super::config::GPT2Config;
use super::engine::DecodeEngine;
use super::error::{ModelError, Result};
use super::sampling::{argmax, sample, DrawKey, SamplingParams};
use super::tokenizer::EOT_TOKEN;

/// Logits `[batch, seq_len, vocab]`, row-major, over the real vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    pub batch: usize,
    pub seq_len: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    /// Wrap a buffer, checking its length is `batch * seq_len * vocab`.
    pub fn new(batch: usize, seq_len: usize, vocab: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != batch * seq_len * vocab {
            return Err(ModelError::Batch(format!(
                "logits buffer has {} values, expected [{batch}, {seq_len}, {vocab}] = {}",
                data.len(),
                batch * seq_len * vocab
            )));
        }
        Ok(Logits {
            batch,
            seq_len,
            vocab,
            data,
        })
    }

    /// The logits of sequence `b` at position `t` (panics when out of range, like indexing).
    pub fn row(&self, b: usize, t: usize) -> &[f32] {
        assert!(b < self.batch && t < self.seq_len, "logits row ({b}, {t}) out of range");
        let start = (b * self.seq_len + t) * self.vocab;
        &self.data[start..start + self.vocab]
    }

    /// The logits of the last position of sequence `b`.
    pub fn last(&self, b: usize) -> &[f32] {
        self.row(b, self.seq_len - 1)
    }

    /// Keep only the last position of each sequence: `[batch, 1, vocab]`.
    pub fn into_last(self) -> Logits {
        if self.seq_len == 1 {
            return self;
        }
        let data = (0..self.batch).flat_map(|b| self.last(b).to_vec()).collect();
        Logits {
            batch: self.batch,
            seq_len: 1,
            vocab: self.vocab,
            data,
        }
    }
}

/// How the next token of every sequence is drawn: the sampling parameters, the seed, and the
/// index in the whole batch of the backend's first sequence (a replica running a slice of the
/// batch draws for sequences `first_sequence..`). The draw of sequence `first_sequence + b` at
/// position `p` is keyed by (seed, first_sequence + b, p) (see [`crate::ops::draw`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub params: SamplingParams,
    pub seed: u64,
    pub first_sequence: u32,
}

impl Draw {
    /// The argmax (no randomness).
    pub fn greedy() -> Self {
        Draw {
            params: SamplingParams::greedy(),
            seed: 0,
            first_sequence: 0,
        }
    }

    /// The key of row `b`'s draw of the token at `position`.
    pub fn key(&self, b: usize, position: usize) -> DrawKey {
        DrawKey {
            seed: self.seed,
            sequence: self.first_sequence + b as u32,
            position: position as u32,
        }
    }

    /// The same draw for the rows from `offset` on (a slice of the batch).
    pub fn from_row(&self, offset: usize) -> Draw {
        Draw {
            first_sequence: self.first_sequence + offset as u32,
            ..*self
        }
    }

    /// Row `b`'s token from its logits: the CPU draw (the reference of the GPU's).
    pub fn on_host(&self, logits: &[f32], b: usize, position: usize) -> Result<u32> {
        sample(logits, &self.params, self.key(b, position))
            .map_err(|e| with_sequence(e, self.first_sequence as usize + b))
    }
}

/// A sampling error with the sequence it happened in.
fn with_sequence(e: ModelError, sequence: usize) -> ModelError {
    match e {
        ModelError::Sampling(m) => ModelError::Sampling(format!("sequence {sequence}: {m}")),
        e => e,
    }
}

/// Where a GPT-2 forward pass runs. A backend holds the weights and one KV cache for a batch of
/// B sequences of equal length.
pub trait Backend {
    /// Short name for messages and stats (`cpu`, `cuda:0`, ...).
    fn name(&self) -> &str;

    /// The model's shape (context length, vocabulary).
    fn config(&self) -> &GPT2Config;

    /// Start B new sequences (dropping any previous cache) from `tokens` (B prompts, all the
    /// same non-zero length T), filling the KV cache, and return logits for every position,
    /// `[B, T, V]`.
    fn prefill(&mut self, tokens: &[Vec<u32>]) -> Result<Logits>;

    /// Like [`Backend::prefill`] but only the last position's logits are needed, `[B, 1, V]`.
    /// Backends may override it to skip the LM head for earlier positions.
    fn prefill_last(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        Ok(self.prefill(tokens)?.into_last())
    }

    /// Append one token to each of the B sequences and return their logits `[B, 1, V]`.
    fn decode(&mut self, last: &[u32]) -> Result<Logits>;

    /// [`Backend::decode`] for greedy decoding: the most likely next token of each sequence
    /// (the first on ties) instead of its logits. Backends may override it to choose on the
    /// device, so that no logits travel back to the host.
    fn decode_argmax(&mut self, last: &[u32]) -> Result<Vec<u32>> {
        let logits = self.decode(last)?;
        (0..last.len()).map(|b| argmax(logits.last(b))).collect()
    }

    /// Everything a first call would otherwise do on the way (choosing and loading kernels,
    /// allocating buffers, setting up the decode engine) for a prefill of `batch` prompts of
    /// `prompt_len` tokens and the decode steps after it, so that the prefill's time is the
    /// prefill's. Optional: a backend that skips it does the same work in its first calls.
    fn prepare(&mut self, batch: usize, prompt_len: usize) -> Result<()> {
        let _ = (batch, prompt_len);
        Ok(())
    }

    /// [`Backend::decode`] followed by a draw of each sequence's next token at `position` (the
    /// position of the token drawn: the sequences' length after this step). Backends may
    /// override it to draw on the device, so that no logits travel back to the host.
    fn decode_draw(&mut self, last: &[u32], draw: &Draw, position: usize) -> Result<Vec<u32>> {
        if draw.params.is_greedy() {
            return self.decode_argmax(last);
        }
        let logits = self.decode(last)?;
        (0..last.len())
            .map(|b| draw.on_host(logits.last(b), b, position))
            .collect()
    }

    /// A short note for the stats line (the GPU backend: how many kernels were tuned).
    fn stats_note(&self) -> Option<String> {
        None
    }

    /// The GPU time of the last prefill in ms (from its input's upload to its last kernel), once
    /// after each prefill; `None` where the backend does not time it (the CPU).
    fn prefill_gpu_ms(&mut self) -> Result<Option<f64>> {
        Ok(None)
    }

    /// How decode steps run (GPU backends; `None` for the CPU, which has one way).
    fn decode_engine(&self) -> Option<DecodeEngine> {
        None
    }
}

/// A prefill of `prompts`, then `steps` greedy decode steps (each sequence continues with its
/// most likely token): the wall time of the decode steps in milliseconds, and the tokens the
/// last step chose. What `bench` and decode-step tuning time.
pub fn timed_greedy_decode(backend: &mut dyn Backend, prompts: &[Vec<u32>], steps: usize) -> Result<(f64, Vec<u32>)> {
    timed_decode(backend, prompts, steps, &Draw::greedy())
}

/// [`timed_greedy_decode`] for any draw: `steps` decode steps after a prefill, each sequence
/// continuing with the token `draw` picks (on the device where the backend can; a greedy draw
/// through [`Backend::decode_argmax`]). What `bench` times.
pub fn timed_decode(
    backend: &mut dyn Backend,
    prompts: &[Vec<u32>],
    steps: usize,
    draw: &Draw,
) -> Result<(f64, Vec<u32>)> {
    let logits = backend.prefill_last(prompts)?;
    let mut position = prompts[0].len();
    let mut next: Vec<u32> = (0..prompts.len())
        .map(|b| draw.on_host(logits.last(b), b, position))
        .collect::<Result<_>>()?;
    let started = Instant::now();
    for _ in 0..steps {
        position += 1;
        next = backend.decode_draw(&next, draw, position)?;
    }
    Ok((started.elapsed().as_secs_f64() * 1e3, next))
}

/// Options of [`generate`].
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// The draw of sequence `b` at position `p` is keyed by (seed, b, p).
    pub seed: u64,
    /// A sequence stops after producing `<|endoftext|>`.
    pub stop_at_eot: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 64,
            sampling: SamplingParams::default(),
            seed: 0,
            stop_at_eot: true,
        }
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Every sequence produced `max_new_tokens` (or some ended with end-of-text first).
    MaxNewTokens,
    /// Every sequence ended with `<|endoftext|>`.
    EndOfText,
    /// The sequences reached the model's context length.
    ContextFull,
}

/// Timing and counts of one [`generate`] call.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenerateStats {
    pub backend: String,
    pub batch: usize,
    /// Prompt tokens over the whole batch.
    pub prompt_tokens: usize,
    /// Wall time of reading the checkpoint, when the caller timed it (0: not timed).
    pub load_ms: f64,
    /// Wall time of opening the backend (on a GPU: the context, the weights converted and
    /// uploaded), when the caller timed it (0: not timed).
    pub open_ms: f64,
    /// Wall time of setting the backend up for this batch before the prefill (kernel choice
    /// and loading, buffers, the decode engine: [`Backend::prepare`]).
    pub startup_ms: f64,
    /// Wall time of the prefill call.
    pub prefill_ms: f64,
    /// GPU time of the prefill (its upload and kernels), where the backend times it.
    pub prefill_gpu_ms: Option<f64>,
    /// Number of decode calls (each feeds one token per sequence).
    pub decode_steps: usize,
    /// Wall time of the decode steps, sampling included.
    pub decode_ms: f64,
    /// Tokens produced over the whole batch.
    pub generated_tokens: usize,
}

impl GenerateStats {
    /// Tokens fed through decode steps per second, over the batch.
    pub fn decode_tokens_per_s(&self) -> f64 {
        if self.decode_ms <= 0.0 {
            return 0.0;
        }
        (self.decode_steps * self.batch) as f64 / (self.decode_ms / 1e3)
    }

    /// One human-readable line.
    pub fn summary(&self) -> String {
        let loading = if self.load_ms > 0.0 || self.open_ms > 0.0 {
            format!(
                "checkpoint {:.1} ms, backend opened in {:.1} ms, ",
                self.load_ms, self.open_ms
            )
        } else {
            String::new()
        };
        let prefill_gpu = self
            .prefill_gpu_ms
            .map_or(String::new(), |g| format!(" ({g:.2} ms GPU)"));
        format!(
            "{}: batch {}, prompt {} tokens, {loading}start-up {:.1} ms, prefill {:.1} ms{prefill_gpu}, generated {} tokens, decode {} steps in {:.1} ms ({:.1} tok/s)",
            self.backend,
            self.batch,
            self.prompt_tokens,
            self.startup_ms,
            self.prefill_ms,
            self.generated_tokens,
            self.decode_steps,
            self.decode_ms,
            self.decode_tokens_per_s()
        )
    }
}

/// Result of [`generate`]: the new tokens of each sequence (prompts excluded).
#[derive(Clone, Debug, serde::Serialize)]
pub struct GenerateOutput {
    pub tokens: Vec<Vec<u32>>,
    pub stop: StopReason,
    /// A note for the user when the stop was not the one asked for (context full).
    pub message: Option<String>,
    pub stats: GenerateStats,
}

/// Generate up to `opts.max_new_tokens` tokens after each prompt. Prompts may have different
/// lengths: the common prefix is prefilled and the rest of each prompt is fed (not sampled)
/// during the first decode steps. `on_token(b, id)` is called for every produced token, in order.
/// The total length of a sequence never exceeds the model's context length: generation stops
/// there with [`StopReason::ContextFull`] and a message.
pub fn generate(
    backend: &mut dyn Backend,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(usize, u32) -> Result<()>,
) -> Result<GenerateOutput> {
    let cfg = backend.config().clone();
    let batch = prompts.len();
    if batch == 0 {
        return Err(ModelError::Batch("no prompts given".into()));
    }
    if let Some(b) = prompts.iter().position(|p| p.is_empty()) {
        return Err(ModelError::Batch(format!(
            "prompt {b} is empty (GPT-2 needs at least one token; use <|endoftext|> = {EOT_TOKEN} to start from nothing)"
        )));
    }
    for p in prompts {
        if let Some((position, &token)) = p.iter().enumerate().find(|(_, &t)| t as usize >= cfg.vocab_size) {
            return Err(ModelError::InvalidToken {
                token,
                position,
                vocab_size: cfg.vocab_size,
            });
        }
    }
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if max_len > cfg.n_ctx {
        return Err(ModelError::ContextOverflow {
            needed: max_len,
            n_ctx: cfg.n_ctx,
        });
    }
    opts.sampling.validate()?;
    let draw = Draw {
        params: opts.sampling,
        seed: opts.seed,
        first_sequence: 0,
    };
    let mut stats = GenerateStats {
        backend: backend.name().to_string(),
        batch,
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        ..Default::default()
    };
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); batch];
    if opts.max_new_tokens == 0 {
        return Ok(GenerateOutput {
            tokens: out,
            stop: StopReason::MaxNewTokens,
            message: None,
            stats,
        });
    }

    let common = prompts.iter().map(Vec::len).min().unwrap_or(0);
    let prefix: Vec<Vec<u32>> = prompts.iter().map(|p| p[..common].to_vec()).collect();
    let started = Instant::now();
    backend.prepare(batch, common)?;
    stats.startup_ms = started.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let logits = backend.prefill_last(&prefix)?;
    stats.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
    stats.prefill_gpu_ms = backend.prefill_gpu_ms()?;
    check_logits(&logits, batch, backend.name())?;

    // The first tokens are drawn on the host from the prefill's logits; every later one by the
    // backend's decode step (on the device where it can), by the same draw.
    let mut drawn: Vec<u32> = (0..batch)
        .map(|b| draw.on_host(logits.last(b), b, common))
        .collect::<Result<_>>()?;
    let mut pos = common; // tokens fed so far, per sequence
    let mut done = vec![false; batch];
    let mut ended_by_eot = vec![false; batch];
    let t1 = Instant::now();
    let stop = loop {
        if pos >= cfg.n_ctx {
            break StopReason::ContextFull;
        }
        // Finished sequences keep being fed a token (ignored) so the batch stays rectangular.
        let mut next: Vec<u32> = (0..batch)
            .map(|b| *out[b].last().unwrap_or(&prompts[b][pos.min(prompts[b].len()) - 1]))
            .collect();
        for b in 0..batch {
            if pos < prompts[b].len() {
                next[b] = prompts[b][pos];
            } else if !done[b] {
                let tok = drawn[b];
                out[b].push(tok);
                stats.generated_tokens += 1;
                on_token(b, tok)?;
                if opts.stop_at_eot && tok == EOT_TOKEN {
                    done[b] = true;
                    ended_by_eot[b] = true;
                } else if out[b].len() >= opts.max_new_tokens {
                    done[b] = true;
                }
                next[b] = tok;
            } else {
                // A finished sequence's outputs are ignored, so it may be fed anything: the
                // backend's own choice, which keeps the chain of a backend that runs steps
                // ahead (the GPU's megakernel) unbroken.
                next[b] = drawn[b];
            }
        }
        if done.iter().all(|&d| d) {
            break if ended_by_eot.iter().all(|&e| e) {
                StopReason::EndOfText
            } else {
                StopReason::MaxNewTokens
            };
        }
        if pos + 1 >= cfg.n_ctx {
            break StopReason::ContextFull;
        }
        drawn = backend.decode_draw(&next, &draw, pos + 1).map_err(|e| match e {
            ModelError::Sampling(m) => ModelError::Sampling(format!("decode step {}: {m}", stats.decode_steps + 1)),
            e => e,
        })?;
        if drawn.len() != batch {
            return Err(ModelError::Backend {
                backend: backend.name().to_string(),
                message: format!("returned {} tokens for a batch of {batch}", drawn.len()),
            });
        }
        stats.decode_steps += 1;
        pos += 1;
    };
    stats.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
    let message = (stop == StopReason::ContextFull).then(|| {
        format!(
            "stopped at the model's context length ({} tokens) after {} new tokens per sequence at most",
            cfg.n_ctx,
            out.iter().map(Vec::len).max().unwrap_or(0)
        )
    });
    Ok(GenerateOutput {
        tokens: out,
        stop,
        message,
        stats,
    })
}

fn check_logits(l: &Logits, batch: usize, backend: &str) -> Result<()> {
    if l.batch != batch || l.seq_len == 0 || l.data.len() != l.batch * l.seq_len * l.vocab {
        return Err(ModelError::Backend {
            backend: backend.to_string(),
            message: format!(
                "returned logits [{}, {}, {}] with {} values for a batch of {batch}",
                l.batch,
                l.seq_len,
                l.vocab,
                l.data.len()
            ),
        });
    }
    Ok(())
}
