//! The generation loop over a scripted [`Backend`] (no model): end-of-text stops, batch
//! bookkeeping, and input checks. Also shows a backend can be implemented outside the crate.

use kernelforge::model::config::GPT2Config;
use kernelforge::model::generate::{generate, timed_greedy_decode, Backend, GenerateOptions, Logits, StopReason};
use kernelforge::model::sampling::SamplingParams;
use kernelforge::model::tokenizer::EOT_TOKEN;
use kernelforge::model::Result;

/// Predicts token `(last + 1) % 10`, except that sequence b predicts EOT once it has seen
/// `eot_after[b]` tokens.
struct Scripted {
    cfg: GPT2Config,
    seen: Vec<Vec<u32>>,
    eot_after: Vec<usize>,
    decode_calls: usize,
}

impl Scripted {
    fn new(eot_after: Vec<usize>) -> Self {
        Scripted {
            cfg: GPT2Config::new(1, 1, 8, 32, 50257).unwrap(),
            seen: Vec::new(),
            eot_after,
            decode_calls: 0,
        }
    }
    fn logits(&self) -> Logits {
        let v = self.cfg.vocab_size;
        let mut data = vec![0.0f32; self.seen.len() * v];
        for (b, s) in self.seen.iter().enumerate() {
            let next = if s.len() >= self.eot_after[b] {
                EOT_TOKEN
            } else {
                (s.last().unwrap() + 1) % 10
            };
            data[b * v + next as usize] = 10.0;
        }
        Logits::new(self.seen.len(), 1, v, data).unwrap()
    }
}

impl Backend for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn config(&self) -> &GPT2Config {
        &self.cfg
    }
    fn prefill(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
        self.seen = tokens.to_vec();
        Ok(self.logits())
    }
    fn decode(&mut self, last: &[u32]) -> Result<Logits> {
        self.decode_calls += 1;
        for (s, &t) in self.seen.iter_mut().zip(last) {
            s.push(t);
        }
        Ok(self.logits())
    }
}

fn greedy(n: usize, stop_at_eot: bool) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        seed: 0,
        stop_at_eot,
    }
}

#[test]
fn stops_at_end_of_text_per_sequence() {
    let mut be = Scripted::new(vec![4, 6]);
    let out = generate(&mut be, &[vec![1], vec![5]], &greedy(20, true), &mut |_, _| Ok(())).unwrap();
    assert_eq!(out.tokens[0], vec![2, 3, 4, EOT_TOKEN]);
    assert_eq!(out.tokens[1], vec![6, 7, 8, 9, 0, EOT_TOKEN]);
    assert_eq!(out.stop, StopReason::EndOfText);
    assert_eq!(out.stats.generated_tokens, 10);
    assert_eq!(be.decode_calls, 5);
    assert!(out.stats.summary().contains("scripted"));

    let mut be = Scripted::new(vec![3, 100]);
    let out = generate(&mut be, &[vec![1], vec![1]], &greedy(5, true), &mut |_, _| Ok(())).unwrap();
    assert_eq!(out.tokens[0], vec![2, 3, EOT_TOKEN]);
    assert_eq!(out.tokens[1].len(), 5);
    assert_eq!(out.stop, StopReason::MaxNewTokens);

    let mut be = Scripted::new(vec![2]);
    let out = generate(&mut be, &[vec![1]], &greedy(5, false), &mut |_, _| Ok(())).unwrap();
    assert_eq!(out.tokens[0].len(), 5, "--ignore-eot keeps going");
}

#[test]
fn ragged_prompts_are_fed_not_sampled() {
    let mut be = Scripted::new(vec![100, 100]);
    let mut seen = Vec::new();
    let out = generate(&mut be, &[vec![1, 7, 7, 7], vec![3]], &greedy(3, true), &mut |b, t| {
        seen.push((b, t));
        Ok(())
    })
    .unwrap();
    assert_eq!(out.tokens, vec![vec![8, 9, 0], vec![4, 5, 6]]);
    assert_eq!(be.seen[0][..4], [1, 7, 7, 7]);
    assert_eq!(
        seen[0],
        (1, 4),
        "sequence 1 starts producing while 0 is still in its prompt"
    );
}

#[test]
fn input_checks() {
    let mut be = Scripted::new(vec![100]);
    let o = greedy(3, true);
    assert!(generate(&mut be, &[], &o, &mut |_, _| Ok(())).is_err());
    let msg = generate(&mut be, &[vec![]], &o, &mut |_, _| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("empty"), "{msg}");
    let msg = generate(&mut be, &[vec![60000]], &o, &mut |_, _| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("60000"), "{msg}");
    let zero = generate(&mut be, &[vec![1]], &greedy(0, true), &mut |_, _| Ok(())).unwrap();
    assert!(zero.tokens[0].is_empty());
    // A callback error aborts generation.
    let err = generate(&mut be, &[vec![1]], &o, &mut |_, _| {
        Err(kernelforge::model::ModelError::Backend {
            backend: "sink".into(),
            message: "closed".into(),
        })
    });
    assert!(err.is_err());
}

/// `timed_greedy_decode` (what `bench` and `tune --decode-step` time): a prefill, then exactly
/// `steps` decode steps, each fed the previous step's greedy tokens; the last step's tokens
/// come back.
#[test]
fn timed_greedy_decode_runs_the_steps_asked_for_on_the_greedy_tokens() {
    let mut backend = Scripted::new(vec![100, 100]);
    let (ms, last) = timed_greedy_decode(&mut backend, &[vec![3], vec![7, 8]], 4).unwrap();
    assert!(ms >= 0.0);
    assert_eq!(backend.decode_calls, 4);
    // prefill predicts 4 and 9; each step adds one (mod 10)
    assert_eq!(backend.seen, vec![vec![3, 4, 5, 6, 7], vec![7, 8, 9, 0, 1, 2]]);
    assert_eq!(last, vec![8, 3]);
}

/// A broken checkpoint's NaN or +inf logits stop sampled generation with one line naming the
/// sequence and the decode step, not a panic; the start-up is timed apart from the prefill.
#[test]
fn broken_logits_stop_generation_naming_the_sequence_and_step() {
    struct Broken(Scripted, usize);
    impl Backend for Broken {
        fn name(&self) -> &str {
            "broken"
        }
        fn config(&self) -> &GPT2Config {
            &self.0.cfg
        }
        fn prefill(&mut self, tokens: &[Vec<u32>]) -> Result<Logits> {
            self.0.prefill(tokens)
        }
        fn decode(&mut self, last: &[u32]) -> Result<Logits> {
            let mut logits = self.0.decode(last)?;
            if self.0.decode_calls == 3 {
                let v = logits.vocab;
                logits.data[v + self.1] = if self.1.is_multiple_of(2) {
                    f32::NAN
                } else {
                    f32::INFINITY
                };
            }
            Ok(logits)
        }
    }
    let sampled = GenerateOptions {
        max_new_tokens: 10,
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.9,
        },
        seed: 5,
        stop_at_eot: false,
    };
    for bad_token in [4, 7] {
        let mut be = Broken(Scripted::new(vec![100, 100]), bad_token);
        let err = generate(&mut be, &[vec![1], vec![5]], &sampled, &mut |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("decode step 3") && err.contains("sequence 1") && err.contains(&format!("token {bad_token}")),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let mut be = Scripted::new(vec![100]);
    let mut out = generate(&mut be, &[vec![1]], &sampled, &mut |_, _| Ok(())).unwrap();
    assert!(out.stats.startup_ms >= 0.0 && out.stats.summary().contains("start-up"));
    // What the caller timed before generate (the CLI: the checkpoint, the backend) leads the line.
    assert!(!out.stats.summary().contains("checkpoint"));
    (out.stats.load_ms, out.stats.open_ms) = (312.5, 401.0);
    let line = out.stats.summary();
    assert!(
        line.contains("checkpoint 312.5 ms, backend opened in 401.0 ms, start-up"),
        "{line}"
    );
}
