//! Choosing the next token from a row of logits: greedy (argmax), temperature, top-k and top-p
//! (nucleus) sampling, seeded with `rand`'s `StdRng`. The functions are pure over one logits row
//! (plus, for sampling, one uniform number or an RNG), so the GPU path can reuse them on rows it
//! copies back.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::error::{ModelError, Result};

/// How to pick a token. `temperature == 0` means greedy; `top_k == 0` and `top_p >= 1` disable
/// those filters.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
}

impl Default for SamplingParams {
    /// Plain sampling from the model's distribution (temperature 1, no filters).
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl SamplingParams {
    /// Always take the most likely token.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// Whether this is greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Temperature must be finite and >= 0; top_p in (0, 1].
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::Sampling(format!(
                "temperature must be a finite number >= 0 (0 = greedy), got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Sampling(format!(
                "top-p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

fn check_row(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(ModelError::Sampling("empty logits row".into()));
    }
    if let Some(i) = logits.iter().position(|x| x.is_nan()) {
        return Err(ModelError::Sampling(format!("logits contain NaN (first at token {i})")));
    }
    Ok(())
}

/// Index of the largest logit (the first one on ties). NaN is an error.
pub fn argmax(logits: &[f32]) -> Result<u32> {
    check_row(logits)?;
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate().skip(1) {
        if x > logits[best] {
            best = i;
        }
    }
    Ok(best as u32)
}

/// Greedy choice; alias of [`argmax`].
pub fn greedy(logits: &[f32]) -> Result<u32> {
    argmax(logits)
}

/// The candidate tokens and their probabilities after temperature, top-k and top-p, most
/// likely first (ties: lower id first), renormalized to sum to 1. Without top-k/top-p the
/// candidates are all tokens in id order.
pub fn candidates(logits: &[f32], params: &SamplingParams) -> Result<Vec<(u32, f64)>> {
    params.validate()?;
    check_row(logits)?;
    if params.is_greedy() {
        return Ok(vec![(argmax(logits)?, 1.0)]);
    }
    let inv_t = 1.0 / params.temperature as f64;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit_desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let filtered = params.top_k > 0 && params.top_k < logits.len() || params.top_p < 1.0;
    if params.top_k > 0 && params.top_k < logits.len() {
        idx.select_nth_unstable_by(params.top_k - 1, by_logit_desc);
        idx.truncate(params.top_k);
    }
    if filtered {
        idx.sort_unstable_by(by_logit_desc);
    }
    let max = idx
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    if max == f64::NEG_INFINITY {
        return Err(ModelError::Sampling("every logit is -inf".into()));
    }
    let mut probs: Vec<(u32, f64)> = idx
        .into_iter()
        .map(|i| (i, ((logits[i as usize] as f64 - max) * inv_t).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    for p in &mut probs {
        p.1 /= total;
    }
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (k, p) in probs.iter().enumerate() {
            cum += p.1;
            if cum >= params.top_p as f64 {
                keep = k + 1;
                break;
            }
        }
        probs.truncate(keep.max(1));
        let total: f64 = probs.iter().map(|p| p.1).sum();
        for p in &mut probs {
            p.1 /= total;
        }
    }
    Ok(probs)
}

/// Sample with a given uniform number `u` in [0, 1): deterministic, for tests and for backends
/// that draw their random numbers elsewhere.
pub fn sample_with_uniform(logits: &[f32], params: &SamplingParams, u: f64) -> Result<u32> {
    let probs = candidates(logits, params)?;
    let mut cum = 0.0;
    for &(id, p) in &probs {
        cum += p;
        if u < cum {
            return Ok(id);
        }
    }
    // Rounding left u just above the total: take the last token with non-zero probability.
    Ok(probs.iter().rev().find(|p| p.1 > 0.0).map_or(probs[0].0, |p| p.0))
}

/// Sample one token (greedy when `params.temperature == 0`, drawing nothing from `rng` then).
pub fn sample<R: Rng + ?Sized>(logits: &[f32], params: &SamplingParams, rng: &mut R) -> Result<u32> {
    if params.is_greedy() {
        params.validate()?;
        return argmax(logits);
    }
    let u: f64 = rng.random();
    sample_with_uniform(logits, params, u)
}

/// A seeded sampler for one sequence.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// Validates `params`; the same seed gives the same tokens.
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            params,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// Pick the next token from a logits row.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        sample(logits, &self.params, &mut self.rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: [f32; 8] = [0.5, 2.0, -1.0, 3.5, 3.0, 0.0, 3.5, -4.0];

    fn p(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(greedy(&ROW).unwrap(), 3);
        assert_eq!(greedy(&[f32::NEG_INFINITY, -1.0]).unwrap(), 1);
        assert!(greedy(&[]).is_err());
        assert!(greedy(&[0.0, f32::NAN]).unwrap_err().to_string().contains("NaN"));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..50 {
            assert_eq!(sample(&ROW, &p(1.0, 1, 1.0), &mut rng).unwrap(), 3);
            assert_eq!(sample(&ROW, &p(1.7, 0, 1e-6), &mut rng).unwrap(), 3);
            assert_eq!(sample(&ROW, &p(0.0, 5, 0.5), &mut rng).unwrap(), 3);
        }
    }

    #[test]
    fn top_k_restricts_support() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..300 {
            let t = sample(&ROW, &p(5.0, 3, 1.0), &mut rng).unwrap();
            assert!([3, 4, 6].contains(&t), "{t}");
        }
        let c = candidates(&ROW, &p(1.0, 3, 1.0)).unwrap();
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 6, 4]);
        assert!((c.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn top_p_keeps_smallest_nucleus() {
        // probs of [ln 0.5, ln 0.3, ln 0.2]: p=0.6 keeps the top two; p=0.5 keeps only one.
        let row = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let c = candidates(&row, &p(1.0, 0, 0.6)).unwrap();
        assert_eq!(c.len(), 2);
        assert!((c[0].1 - 0.625).abs() < 1e-6);
        assert_eq!(candidates(&row, &p(1.0, 0, 0.5)).unwrap().len(), 1);
        assert_eq!(sample_with_uniform(&row, &p(1.0, 0, 1.0), 0.0).unwrap(), 0);
        assert_eq!(sample_with_uniform(&row, &p(1.0, 0, 1.0), 0.6).unwrap(), 1);
        assert_eq!(sample_with_uniform(&row, &p(1.0, 0, 1.0), 0.85).unwrap(), 2);
        assert_eq!(sample_with_uniform(&row, &p(1.0, 0, 1.0), 0.999_999_9).unwrap(), 2);
    }

    #[test]
    fn same_seed_same_tokens_and_distribution() {
        let row: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let params = p(0.9, 20, 0.95);
        let run = |seed| {
            let mut s = Sampler::new(params, seed).unwrap();
            (0..100).map(|_| s.sample(&row).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // Empirical frequency tracks the probabilities at temperature 1.
        let two = [0.0f32, 1.0f32];
        let mut s = Sampler::new(SamplingParams::default(), 3).unwrap();
        let ones = (0..20000).filter(|_| s.sample(&two).unwrap() == 1).count() as f64 / 20000.0;
        let expect = 1.0f64.exp() / (1.0 + 1.0f64.exp());
        assert!((ones - expect).abs() < 0.02, "{ones} vs {expect}");
    }

    #[test]
    fn bad_params_are_errors() {
        assert!(Sampler::new(p(-1.0, 0, 1.0), 0).is_err());
        assert!(Sampler::new(p(1.0, 0, 0.0), 0).is_err());
        assert!(Sampler::new(p(f32::NAN, 0, 1.0), 0).is_err());
        assert!(candidates(&[f32::NEG_INFINITY; 3], &p(1.0, 0, 1.0)).is_err());
    }
}
