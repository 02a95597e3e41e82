//! encoder: token + position embedding, `out[b,t,:] = wte[tokens[b,t],:] + wpe[t + pos_offset,:]`.
//!
//! Kernel arguments: `float* out, const int* tokens, const float* wte, const float* wpe, int B,
//! int T, int C, int pos_offset`. Shape: `B, T, C`; optional `pos_offset` (default 0: the first
//! position of the sequence, nonzero when generating with a cache), `V` (vocabulary rows of
//! `wte`, default 50257 like GPT-2) and `max_T` (rows of `wpe`, default `T + pos_offset`, must be
//! at least that).
//! Tensors: `out [B,T,C]` (output), `tokens [B*T]` i32 uniform in `0..V`, `wte [V,C]`,
//! `wpe [max_T,C]` uniform in `[-1, 1]`. No epilogue, no mask.

use rand::rngs::StdRng;

use super::*;

#[derive(Debug)]
pub struct Encoder;

/// Default vocabulary size (GPT-2).
pub const DEFAULT_VOCAB: i64 = 50257;

impl OpContract for Encoder {
    fn name(&self) -> &'static str {
        "encoder"
    }
    fn summary(&self) -> &'static str {
        "token + position embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t+pos_offset,:]"
    }
    fn signature(&self) -> &'static str {
        "float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C, int pos_offset"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "T", "C"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["pos_offset", "V", "max_T"]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let b = get_dim(self, shape, "B")?;
        let t = get_dim(self, shape, "T")?;
        let c = get_dim(self, shape, "C")?;
        let pos = *shape.entry("pos_offset".into()).or_insert(0);
        if pos < 0 {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!("pos_offset must not be negative (got {pos})"),
            });
        }
        let v = *shape.entry("V".into()).or_insert(DEFAULT_VOCAB);
        if v <= 0 {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!("V (vocabulary size) must be positive (got {v})"),
            });
        }
        let max_t = *shape.entry("max_T".into()).or_insert(t + pos);
        if max_t < t + pos {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!(
                    "wpe needs max_T >= T + pos_offset rows (max_T={max_t}, T={t}, pos_offset={pos}); raise max_T or lower pos_offset"
                ),
            });
        }
        check_i32(
            self,
            shape,
            &[
                ("out [B,T,C]", b * t * c),
                ("wte [V,C]", v * c),
                ("wpe [max_T,C]", max_t * c),
            ],
        )
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        let s = |b, t, c, pos, max_t| {
            shape_of(&[
                ("B", b),
                ("T", t),
                ("C", c),
                ("pos_offset", pos),
                ("V", 50),
                ("max_T", max_t),
            ])
        };
        vec![
            s(1, 1, 1, 0, 1),
            s(2, 5, 37, 0, 5),
            s(3, 33, 100, 7, 45),
            s(4, 64, 72, 0, 64),
            s(1, 129, 768, 0, 1024),
            s(2, 1, 768, 1000, 1024),
        ]
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        use rand::Rng;
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (b, t, c) = (shape["B"] as usize, shape["T"] as usize, shape["C"] as usize);
        let (v, max_t, pos) = (shape["V"], shape["max_T"] as usize, shape["pos_offset"]);
        let tokens: Vec<i32> = (0..b * t).map(|_| rng.random_range(0..v as i32)).collect();
        let tensors = vec![
            TensorArg::output_f32("out", b * t * c),
            TensorArg::input_i32("tokens", tokens),
            TensorArg::input_f32("wte", uniform(rng, v as usize * c, -1.0, 1.0)),
            TensorArg::input_f32("wpe", uniform(rng, max_t * c, -1.0, 1.0)),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(1),
            Arg::Tensor(2),
            Arg::Tensor(3),
            Arg::I32(b as i32),
            Arg::I32(t as i32),
            Arg::I32(c as i32),
            Arg::I32(pos as i32),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let (t_len, c, pos) = (problem.dim("T"), problem.dim("C"), problem.dim("pos_offset"));
        let (wte, wpe) = (problem.f32s("wte"), problem.f32s("wpe"));
        let mut out = Vec::with_capacity(problem.i32s("tokens").len() * c);
        for (i, &tok) in problem.i32s("tokens").iter().enumerate() {
            let t = i % t_len;
            let e = &wte[tok as usize * c..][..c];
            let p = &wpe[(t + pos) * c..][..c];
            out.extend(e.iter().zip(p).map(|(&x, &y)| x as f64 + y as f64));
        }
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn encoder_by_hand() {
        // B=1, T=2, C=2, V=3, pos_offset=1, max_T=3.
        let shape = shape_of(&[("B", 1), ("T", 2), ("C", 2), ("V", 3), ("pos_offset", 1)]);
        let mut p = Encoder
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        assert_eq!(p.shape["max_T"], 3);
        p.tensors[1].data = HostData::I32(vec![2, 0]);
        p.tensors[2].data = HostData::F32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        p.tensors[3].data = HostData::F32(vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0]);
        // out[0] = wte[2] + wpe[1] = [5+30, 6+40]; out[1] = wte[0] + wpe[2] = [1+50, 2+60].
        assert_eq!(Encoder.reference(&p), vec![(0, vec![35.0, 46.0, 51.0, 62.0])]);
    }

    #[test]
    fn defaults_and_errors() {
        let mut s = shape_of(&[("B", 2), ("T", 8), ("C", 4)]);
        Encoder.complete_shape(&mut s, Epilogue::None, Mask::None).unwrap();
        assert_eq!((s["pos_offset"], s["V"], s["max_T"]), (0, DEFAULT_VOCAB, 8));
        let mut s = shape_of(&[("B", 2), ("T", 8), ("C", 4), ("pos_offset", 4), ("max_T", 10)]);
        let e = Encoder
            .complete_shape(&mut s, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("encoder") && e.contains("max_T"), "{e}");
        let mut s = shape_of(&[("B", 2), ("T", 8)]);
        let e = Encoder
            .complete_shape(&mut s, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("C"), "{e}");
    }

    #[test]
    fn tokens_in_range() {
        for shape in Encoder.test_shapes(Epilogue::None, Mask::None) {
            let p = Encoder
                .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(5))
                .unwrap();
            let v = shape["V"] as i32;
            assert!(p.i32s("tokens").iter().all(|&t| (0..v).contains(&t)));
            assert!(p.f32s("wpe").len() >= ((shape["T"] + shape["pos_offset"]) * shape["C"]) as usize);
        }
    }
}
