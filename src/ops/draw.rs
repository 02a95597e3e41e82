//! The exact token draw every sampler of kernelforge makes, on the CPU: the reference the GPU's
//! `sample` kernels are checked against, and the sampler of the CPU backend.
//!
//! A draw is a pure function of a logits row, the [`SamplingParams`] and a [`DrawKey`]
//! (seed, sequence, position), so that one seed gives the same tokens on every engine, batch
//! slicing and GPU:
//! 1. the kept set: top-k (by logit, then by lower id on ties), then top-p over the
//!    temperature-scaled probabilities of those (the shortest most-likely prefix whose
//!    probability reaches `top_p`);
//! 2. the Gumbel-max draw over the kept set: the token with the largest
//!    `logit / temperature + g(token)`, where `g` is Gumbel noise from a counter-based
//!    generator (Philox4x32-10) keyed by the seed and counted by (token, position, sequence).
//!    The largest of `log p + Gumbel` is distributed exactly as `p` (the Gumbel-max trick), so
//!    the draw needs no normalization, no cumulative sums and no sort: an argmax.
//!
//! Greedy (`temperature == 0`, or `top_k == 1`) is the plain argmax.

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

/// Why sampling parameters or a logits row cannot be drawn from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DrawError {
    #[error("temperature must be a finite number >= 0 (0 = greedy), got {0}")]
    Temperature(f32),
    #[error("top-p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("empty logits row")]
    Empty,
    #[error("the logits contain {what} (first at token {token}): the checkpoint or the forward pass is broken")]
    NotFinite { what: &'static str, token: usize },
    #[error("every logit is -inf: no token can be drawn")]
    AllMinusInfinity,
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

    /// Whether the draw is an argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Temperature must be finite and >= 0; top_p in (0, 1].
    pub fn validate(&self) -> Result<(), DrawError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(DrawError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(DrawError::TopP(self.top_p));
        }
        Ok(())
    }

    /// Whether top-k cuts a row of `vocab` tokens.
    pub fn cuts_top_k(&self, vocab: usize) -> bool {
        self.top_k > 0 && self.top_k < vocab
    }

    /// Whether neither top-k nor top-p cuts a row of `vocab` tokens: the draw is then an argmax
    /// over the whole row (of the logits, or of their Gumbel scores), which the decode
    /// megakernel takes inside its LM head.
    pub fn keeps_every_token(&self, vocab: usize) -> bool {
        !self.cuts_top_k(vocab) && self.top_p >= 1.0
    }
}

/// What the random draw of one token is keyed by: the user's seed, the sequence's index in the
/// whole batch (not in a GPU's slice of it) and the position of the token being drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrawKey {
    pub seed: u64,
    pub sequence: u32,
    pub position: u32,
}

/// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
/// SC 2011): four 32-bit words from a 128-bit counter and a 64-bit key. The CUDA twin is
/// `templates/common/random.cu.tera`; both must stay bit-identical.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u32 = 0xD251_1F53;
    const M1: u32 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The Gumbel noise of `token` under `key`: `-ln(-ln(u))` with `u = (w >> 9 + 1/2) / 2^23`
/// strictly inside (0, 1) (the sum is exact in f32), `w` the Philox word `token % 4` at counter
/// `(token / 4, position, sequence, 0)`, in f32 as the GPU computes it.
pub fn gumbel(key: DrawKey, token: u32) -> f32 {
    let words = philox4x32_10(
        [token / 4, key.position, key.sequence, 0],
        [key.seed as u32, (key.seed >> 32) as u32],
    );
    let u = ((words[(token % 4) as usize] >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0);
    -(-u.ln()).ln()
}

/// A token's score in the Gumbel-max draw, `logit * (1 / temperature) + g` with one rounding
/// (the GPU's fused multiply-add).
pub fn gumbel_score(logit: f32, inv_temperature: f32, key: DrawKey, token: u32) -> f32 {
    logit.mul_add(inv_temperature, gumbel(key, token))
}

/// Checks a row: NaN and +inf are errors naming the first bad token; a row of -inf only too.
fn check_row(logits: &[f32]) -> Result<(), DrawError> {
    if logits.is_empty() {
        return Err(DrawError::Empty);
    }
    if let Some(token) = logits.iter().position(|x| x.is_nan()) {
        return Err(DrawError::NotFinite { what: "NaN", token });
    }
    if let Some(token) = logits.iter().position(|&x| x == f32::INFINITY) {
        return Err(DrawError::NotFinite {
            what: "+infinity",
            token,
        });
    }
    if logits.iter().all(|&x| x == f32::NEG_INFINITY) {
        return Err(DrawError::AllMinusInfinity);
    }
    Ok(())
}

/// Index of the largest logit (the first one on ties). NaN and +inf are errors.
pub fn argmax(logits: &[f32]) -> Result<u32, DrawError> {
    check_row(logits)?;
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate().skip(1) {
        if x > logits[best] {
            best = i;
        }
    }
    Ok(best as u32)
}

/// The kept tokens and their probabilities after top-k, temperature and top-p, most likely
/// first (ties: lower id first), renormalized to sum to 1. Without top-k or top-p: every token
/// in id order. Greedy: the argmax alone.
pub fn kept(logits: &[f32], params: &SamplingParams) -> Result<Vec<(u32, f64)>, DrawError> {
    params.validate()?;
    check_row(logits)?;
    if params.is_greedy() {
        return Ok(vec![(argmax(logits)?, 1.0)]);
    }
    let inv_t = 1.0 / params.temperature as f64;
    let filtered = params.cuts_top_k(logits.len()) || params.top_p < 1.0;
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    if filtered {
        // most likely first, the lower id first on ties: the order the GPU's 64-bit keys sort in
        ids.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    }
    if params.cuts_top_k(logits.len()) {
        ids.truncate(params.top_k);
    }
    let max = ids
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(u32, f64)> = ids
        .into_iter()
        .map(|i| (i, ((logits[i as usize] as f64 - max) * inv_t).exp()))
        .collect();
    normalize(&mut probs);
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                cum += p.1;
                cum >= params.top_p as f64
            })
            .map_or(probs.len(), |k| k + 1);
        probs.truncate(keep.max(1));
        normalize(&mut probs);
    }
    Ok(probs)
}

fn normalize(probs: &mut [(u32, f64)]) {
    let total: f64 = probs.iter().map(|p| p.1).sum();
    for p in probs {
        p.1 /= total;
    }
}

/// The token drawn from `logits` under `params` and `key` (see the module docs): greedy is the
/// argmax; otherwise the kept token with the largest Gumbel score (the first on ties).
pub fn draw(logits: &[f32], params: &SamplingParams, key: DrawKey) -> Result<u32, DrawError> {
    let kept = kept(logits, params)?;
    if params.is_greedy() {
        return Ok(kept[0].0);
    }
    let inv_t = 1.0 / params.temperature;
    let score = |id: u32| gumbel_score(logits[id as usize], inv_t, key, id);
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for &(id, p) in &kept {
        let s = score(id);
        if p > 0.0 && (s > best.0 || (s == best.0 && id < best.1)) {
            best = (s, id);
        }
    }
    Ok(if best.1 == u32::MAX { kept[0].0 } else { best.1 })
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

    fn key(position: u32) -> DrawKey {
        DrawKey {
            seed: 0x1234_5678_9abc,
            sequence: 3,
            position,
        }
    }

    #[test]
    fn philox_matches_the_random123_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn greedy_picks_first_max_and_bad_rows_are_named() {
        assert_eq!(argmax(&ROW).unwrap(), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1.0]).unwrap(), 1);
        assert_eq!(argmax(&[]), Err(DrawError::Empty));
        let nan = argmax(&[0.0, f32::NAN]).unwrap_err().to_string();
        assert!(nan.contains("NaN") && nan.contains("token 1"), "{nan}");
        let inf = draw(&[0.0, 1.0, f32::INFINITY], &p(1.0, 0, 1.0), key(0)).unwrap_err();
        assert_eq!(
            inf,
            DrawError::NotFinite {
                what: "+infinity",
                token: 2
            }
        );
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), Err(DrawError::AllMinusInfinity));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        for pos in 0..50 {
            assert_eq!(draw(&ROW, &p(1.0, 1, 1.0), key(pos)).unwrap(), 3);
            assert_eq!(draw(&ROW, &p(1.7, 0, 1e-6), key(pos)).unwrap(), 3);
            assert_eq!(draw(&ROW, &p(0.0, 5, 0.5), key(pos)).unwrap(), 3);
        }
    }

    #[test]
    fn kept_sets_follow_top_k_then_top_p() {
        let c = kept(&ROW, &p(1.0, 3, 1.0)).unwrap();
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 6, 4]);
        assert!((c.iter().map(|x| x.1).sum::<f64>() - 1.0).abs() < 1e-12);
        // probs of [ln 0.5, ln 0.3, ln 0.2]: p=0.6 keeps the top two; p=0.5 keeps only one.
        let row = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let c = kept(&row, &p(1.0, 0, 0.6)).unwrap();
        assert_eq!(c.len(), 2);
        assert!((c[0].1 - 0.625).abs() < 1e-6);
        assert_eq!(kept(&row, &p(1.0, 0, 0.5)).unwrap().len(), 1);
        for pos in 0..300 {
            let t = draw(&ROW, &p(5.0, 3, 1.0), key(pos)).unwrap();
            assert!([3, 4, 6].contains(&t), "{t}");
        }
    }

    #[test]
    fn same_key_same_token_and_frequencies_follow_the_probabilities() {
        let row: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let params = p(0.9, 20, 0.95);
        let run = |seed| {
            (0..100)
                .map(|pos| {
                    draw(
                        &row,
                        &params,
                        DrawKey {
                            seed,
                            sequence: 0,
                            position: pos,
                        },
                    )
                    .unwrap()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // Every sequence and position draws afresh: frequencies track the probabilities.
        let row = [0.0f32, 1.0, -0.5, 0.25];
        let probs = kept(&row, &p(1.0, 0, 1.0)).unwrap();
        let n = 40_000;
        let mut counts = [0usize; 4];
        for i in 0..n {
            let k = DrawKey {
                seed: 7,
                sequence: i % 200,
                position: i / 200,
            };
            counts[draw(&row, &p(1.0, 0, 1.0), k).unwrap() as usize] += 1;
        }
        for (id, prob) in probs {
            let freq = counts[id as usize] as f64 / n as f64;
            // five standard deviations of a binomial frequency
            let sd = (prob * (1.0 - prob) / n as f64).sqrt();
            assert!((freq - prob).abs() < 5.0 * sd, "token {id}: {freq} vs {prob}");
        }
    }

    #[test]
    fn gumbel_noise_is_in_range_and_differs_by_every_part_of_the_key() {
        let base = key(9);
        let g = gumbel(base, 5);
        assert!(g.is_finite() && g > -3.0 && g < 18.0, "{g}");
        assert_ne!(g, gumbel(base, 6));
        assert_ne!(g, gumbel(DrawKey { position: 10, ..base }, 5));
        assert_ne!(g, gumbel(DrawKey { sequence: 4, ..base }, 5));
        assert_ne!(
            g,
            gumbel(
                DrawKey {
                    seed: base.seed + (1 << 32),
                    ..base
                },
                5
            )
        );
    }

    #[test]
    fn bad_params_are_errors() {
        assert_eq!(p(-1.0, 0, 1.0).validate(), Err(DrawError::Temperature(-1.0)));
        assert_eq!(p(1.0, 0, 0.0).validate(), Err(DrawError::TopP(0.0)));
        assert!(p(f32::NAN, 0, 1.0).validate().is_err());
        assert!(p(1.0, 0, 1.5).validate().is_err());
    }
}
