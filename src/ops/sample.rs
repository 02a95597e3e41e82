//! sample: `out[b]` = the token drawn from row `b` of the logits by temperature, top-k and top-p
//! (see [`super::draw`]: the kept set, then the Gumbel-max draw keyed by (seed, sequence
//! `seq0 + b`, position `pos`)); greedy when `temperature == 0` or `top_k == 1`; `-1` for a row
//! that holds NaN or +inf (or only -inf). Sampling on the device, so that only B token ids, not
//! B x V logits, travel back to the host.
//!
//! Kernel arguments: `int* out, int* out_copy, const float* logits, float* workspace, int B, int V,
//! int stride, int top_k, float temperature, float top_p, int seed_lo, int seed_hi, int seq0, int pos`.
//! Shape: `B` (rows), `V` (entries per row); optional `stride` (default `V`), `top_k` (0: off),
//! `temperature_milli` and `top_p_milli` (the float arguments in thousandths, default 1000),
//! `seed_lo`, `seed_hi` (the seed's two 32-bit halves), `seq0` (the first row's sequence index)
//! and `pos` (the position drawn for).
//! `out_copy [B]` gets the same ids, as the argmax op's does.
//! Tensors: `out [B]` and `out_copy [B]` (int32 outputs), `logits [B, stride]` uniform in
//! `[-4, 4]` with ten spikes in `[4, 12]` per row (so that top-p keeps a few tokens at small p and
//! thousands at large p), a NaN in row 2, large values in the padding (which must never be drawn).
//! Outputs are integers and must match the reference exactly: the draw is an argmax of Gumbel
//! scores, so the GPU and the f32 reference differ only where two scores tie within rounding.

use rand::rngs::StdRng;
use rand::Rng;

use super::argmax::logits_rows;
use super::draw::{draw, DrawKey, SamplingParams};
use super::*;

#[derive(Debug)]
pub struct Sample;

/// The optional shape variables of the draw and their values when a shape leaves them out:
/// no top-k, temperature 1 and top-p 1 (in thousandths), seed 0, the first sequence, position 0.
const SETTINGS: [(&str, i64); 7] = [
    ("top_k", 0),
    ("temperature_milli", 1000),
    ("top_p_milli", 1000),
    ("seed_lo", 0),
    ("seed_hi", 0),
    ("seq0", 0),
    ("pos", 0),
];

/// The setting the sampler's kernels are tuned and chosen on: temperature 0.8, top-k 40, top-p
/// 0.95 (in the shape's units). A decode step chooses its sampler once for its batch, whatever
/// the user's setting; the filtered draw is where the points differ most, and its winners are
/// also within 1-5% of the best for a plain temperature (H200, bf16, every point at batch 1-256:
/// 98 against the default's 205 µs filtered at 256 rows, and 57.5 against 87 plain;
/// benches/RESULTS.md, sixteenth pass). Timed on the plain setting instead, near-ties among
/// points that only the filters tell apart (`max_top_k`) are drawn by noise.
pub const TUNED_SETTING: [(&str, i64); 3] = [("temperature_milli", 800), ("top_k", 40), ("top_p_milli", 950)];

/// Setting `name` of `shape`, or its default from [`SETTINGS`].
fn setting(shape: &Shape, name: &str) -> i64 {
    shape
        .get(name)
        .copied()
        .or_else(|| SETTINGS.iter().find(|s| s.0 == name).map(|s| s.1))
        .unwrap_or(0)
}

/// The sampling parameters a shape describes.
pub fn params_of(shape: &Shape) -> SamplingParams {
    SamplingParams {
        temperature: setting(shape, "temperature_milli") as f32 / 1000.0,
        top_k: setting(shape, "top_k") as usize,
        top_p: setting(shape, "top_p_milli") as f32 / 1000.0,
    }
}

/// The seed a shape describes (`seed_hi:seed_lo`).
fn seed_of(shape: &Shape) -> u64 {
    ((setting(shape, "seed_hi") as u32 as u64) << 32) | setting(shape, "seed_lo") as u32 as u64
}

impl OpContract for Sample {
    fn name(&self) -> &'static str {
        "sample"
    }
    fn summary(&self) -> &'static str {
        "one token per row by temperature, top-k and top-p (Gumbel-max, Philox keyed by seed, sequence, position)"
    }
    fn signature(&self) -> &'static str {
        "int* out, int* out_copy, const float* logits, float* workspace, int B, int V, int stride, int top_k, float temperature, float top_p, int seed_lo, int seed_hi, int seq0, int pos"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "V"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &[
            "stride",
            "top_k",
            "temperature_milli",
            "top_p_milli",
            "seed_lo",
            "seed_hi",
            "seq0",
            "pos",
        ]
    }
    fn exact(&self) -> bool {
        true
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        logits_rows(self, shape)?;
        for (name, default) in SETTINGS {
            shape.entry(name.into()).or_insert(default);
        }
        if let Err(e) = params_of(shape).validate() {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!("{e} (temperature_milli and top_p_milli are thousandths)"),
            });
        }
        if shape["top_k"] < 0 || shape["seq0"] < 0 || shape["pos"] < 0 {
            return Err(OpError::Shape {
                op: self.name(),
                msg: "top_k, seq0 and pos must be >= 0".into(),
            });
        }
        Ok(())
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        // (B, V, stride, top_k, temperature, top_p in thousandths): greedy, plain temperature,
        // top-k within and beyond the kernels' candidate lists, top-p with a short and a long
        // nucleus, the combination generate uses, and a one-token vocabulary.
        [
            (1, 1, 1, 0, 1000, 1000),
            (3, 5, 8, 0, 0, 1000),
            (4, 1001, 1001, 0, 1000, 1000),
            (3, 4099, 4100, 0, 500, 1000),
            (2, 4099, 4100, 50, 800, 1000),
            (3, 3001, 3001, 700, 1000, 1000),
            (3, 3001, 3004, 0, 1000, 500),
            (3, 3001, 3004, 0, 2000, 900),
            (3, 50257, 50304, 40, 800, 950),
        ]
        .iter()
        .enumerate()
        .map(|(i, &(b, v, stride, top_k, t, p))| {
            shape_of(&[
                ("B", b),
                ("V", v),
                ("stride", stride),
                ("top_k", top_k),
                ("temperature_milli", t),
                ("top_p_milli", p),
                ("seed_lo", 0x5eed + i as i64),
                ("seed_hi", 7 * i as i64),
                ("seq0", 3 * i as i64),
                ("pos", 17 + i as i64),
            ])
        })
        .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (b, v, stride) = (shape["B"] as usize, shape["V"] as usize, shape["stride"] as usize);
        let mut logits = uniform(rng, b * stride, -4.0, 4.0);
        for (r, row) in logits.chunks_mut(stride).enumerate() {
            for _ in 0..10.min(v) {
                row[rng.random_range(0..v)] = rng.random_range(4.0..12.0);
            }
            if r == 2 && v > 1 {
                row[rng.random_range(0..v)] = f32::NAN;
            }
            // Padding larger than any real entry: reading past V would be caught.
            row[v..].iter_mut().for_each(|x| *x = 100.0);
        }
        let params = params_of(&shape);
        let tensors = vec![
            TensorArg::output_i32("out", b),
            TensorArg::input_f32("logits", logits),
            TensorArg::output_i32("out_copy", b),
        ];
        let i32_of = |name: &str| Arg::I32(shape[name] as i32);
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(2),
            Arg::Tensor(1),
            Arg::Workspace,
            i32_of("B"),
            i32_of("V"),
            i32_of("stride"),
            i32_of("top_k"),
            Arg::F32(params.temperature),
            Arg::F32(params.top_p),
            i32_of("seed_lo"),
            i32_of("seed_hi"),
            i32_of("seq0"),
            i32_of("pos"),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let s = &problem.shape;
        let (v, stride) = (s["V"] as usize, s["stride"] as usize);
        let params = params_of(s);
        let out: Vec<f64> = problem
            .f32s("logits")
            .chunks(stride)
            .enumerate()
            .map(|(row, logits)| {
                let key = DrawKey {
                    seed: seed_of(s),
                    sequence: (s["seq0"] as usize + row) as u32,
                    position: s["pos"] as u32,
                };
                draw(&logits[..v], &params, key).map_or(-1.0, f64::from)
            })
            .collect();
        let copy = out.clone();
        vec![
            (problem.tensor_index("out").unwrap(), out),
            (problem.tensor_index("out_copy").unwrap(), copy),
        ]
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn test_shapes_cover_every_path_and_the_nan_row() {
        let shapes = Sample.test_shapes(Epilogue::None, Mask::None);
        let params: Vec<SamplingParams> = shapes.iter().map(params_of).collect();
        assert!(params.iter().any(|p| p.is_greedy()));
        assert!(params.iter().any(|p| !p.is_greedy() && p.top_k == 0 && p.top_p == 1.0));
        assert!(params.iter().any(|p| p.top_k > 256), "top-k beyond any candidate list");
        assert!(params.iter().any(|p| p.top_k == 0 && p.top_p < 1.0), "top-p alone");
        let p = Sample
            .problem(&shapes[3], Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        let want = &Sample.reference(&p)[0].1;
        assert_eq!(want[2], -1.0, "row 2 holds a NaN");
        assert!(want[..2].iter().all(|t| (0.0..4099.0).contains(t)));
    }

    #[test]
    fn bad_parameters_are_refused_with_the_field() {
        let mut s = shape_of(&[("B", 1), ("V", 10), ("top_p_milli", 0)]);
        let e = Sample
            .complete_shape(&mut s, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("top-p") && e.contains("thousandths"), "{e}");
    }
}
