//! kv_append: write the new tokens' keys and values into the KV cache,
//! `k_cache[b,h,pos+t,:] = k[b,h,t,:]` and the same for `v`, for `t < T`; the rest of the
//! caches is left as it was.
//!
//! Kernel arguments: `float* k_cache, float* v_cache, const float* k, const float* v, int B,
//! int NH, int T, int max_T, int HS, int pos`.
//! Shape: `B, NH, T, HS`; optional `pos` (default 0) and `max_T` (default `pos + T`, at least
//! that). Tensors: `k_cache`, `v_cache [B,NH,max_T,HS]` (in-out: random initial contents that
//! must survive outside the written slice), `k`, `v [B,NH,T,HS]` (as the QKV epilogue writes).

use rand::rngs::StdRng;

use super::*;

#[derive(Debug)]
pub struct KvAppend;

impl OpContract for KvAppend {
    fn name(&self) -> &'static str {
        "kv_append"
    }
    fn summary(&self) -> &'static str {
        "append k, v [B,NH,T,HS] to the KV cache [B,NH,max_T,HS] at position pos"
    }
    fn signature(&self) -> &'static str {
        "float* k_cache, float* v_cache, const float* k, const float* v, int B, int NH, int T, int max_T, int HS, int pos"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "NH", "T", "HS"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["pos", "max_T"]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let (b, nh, t, hs) = (
            get_dim(self, shape, "B")?,
            get_dim(self, shape, "NH")?,
            get_dim(self, shape, "T")?,
            get_dim(self, shape, "HS")?,
        );
        let pos = *shape.entry("pos".into()).or_insert(0);
        let max_t = *shape.entry("max_T".into()).or_insert(pos + t);
        if pos < 0 || pos + t > max_t {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!(
                    "positions pos={pos}..pos+T={} do not fit a cache of max_T={max_t}; give max_T >= pos + T",
                    pos + t
                ),
            });
        }
        check_i32(self, shape, &[("k_cache", b * nh * max_t * hs)])
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        [
            (2, 3, 1, 64, 17, 40),
            (1, 2, 5, 64, 0, 5),
            (2, 2, 129, 64, 3, 140),
            (1, 3, 7, 48, 2, 11),
        ]
        .iter()
        .map(|&(b, nh, t, hs, pos, max_t)| {
            shape_of(&[
                ("B", b),
                ("NH", nh),
                ("T", t),
                ("HS", hs),
                ("pos", pos),
                ("max_T", max_t),
            ])
        })
        .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (b, nh, t, hs, pos, max_t) = (
            shape["B"],
            shape["NH"],
            shape["T"],
            shape["HS"],
            shape["pos"],
            shape["max_T"],
        );
        let cache_len = (b * nh * max_t * hs) as usize;
        let new_len = (b * nh * t * hs) as usize;
        let tensors = vec![
            TensorArg::inout_f32("k_cache", uniform(rng, cache_len, -1.0, 1.0)),
            TensorArg::inout_f32("v_cache", uniform(rng, cache_len, -1.0, 1.0)),
            TensorArg::input_f32("k", uniform(rng, new_len, 2.0, 3.0)),
            TensorArg::input_f32("v", uniform(rng, new_len, -3.0, -2.0)),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(1),
            Arg::Tensor(2),
            Arg::Tensor(3),
            Arg::I32(b as i32),
            Arg::I32(nh as i32),
            Arg::I32(t as i32),
            Arg::I32(max_t as i32),
            Arg::I32(hs as i32),
            Arg::I32(pos as i32),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let (t, hs, pos, max_t) = (
            problem.dim("T"),
            problem.dim("HS"),
            problem.dim("pos"),
            problem.dim("max_T"),
        );
        let rows = problem.dim("B") * problem.dim("NH");
        let appended = |cache: &str, new: &str| {
            let mut out = to_f64(problem.f32s(cache));
            let new = problem.f32s(new);
            for row in 0..rows {
                for i in 0..t {
                    let dst = (row * max_t + pos + i) * hs;
                    let src = (row * t + i) * hs;
                    for d in 0..hs {
                        out[dst + d] = new[src + d] as f64;
                    }
                }
            }
            out
        };
        vec![
            (problem.tensor_index("k_cache").unwrap(), appended("k_cache", "k")),
            (problem.tensor_index("v_cache").unwrap(), appended("v_cache", "v")),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn writes_only_the_slice() {
        let op = KvAppend;
        let mut rng = StdRng::seed_from_u64(3);
        let shape = shape_of(&[("B", 1), ("NH", 2), ("T", 2), ("HS", 3), ("pos", 1), ("max_T", 4)]);
        let p = op.problem(&shape, Epilogue::None, Mask::None, &mut rng).unwrap();
        let (before, k) = (p.f32s("k_cache"), p.f32s("k"));
        let after = &op.reference(&p)[0].1;
        for row in 0..2 {
            for slot in 0..4 {
                for d in 0..3 {
                    let i = (row * 4 + slot) * 3 + d;
                    let want = if (1..3).contains(&slot) {
                        k[(row * 2 + slot - 1) * 3 + d]
                    } else {
                        before[i]
                    };
                    assert_eq!(after[i], want as f64, "row {row} slot {slot} d {d}");
                }
            }
        }
        let mut bad = shape_of(&[("B", 1), ("NH", 1), ("T", 3), ("HS", 4), ("pos", 2), ("max_T", 4)]);
        let e = op
            .complete_shape(&mut bad, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("kv_append") && e.contains("max_T >= pos + T"), "{e}");
    }
}
