//! attention_decode: one new query per sequence against the KV cache (generation), with the
//! step's own key and value appended to the cache first:
//! `k_cache[b,h,T-1,:] = k[b,h,:]`, `v_cache[b,h,T-1,:] = v[b,h,:]`, then
//! `out[b, h*HS+d] = sum_{j<T} softmax_j(scale * q[b,h,:] . k_cache[b,h,j,:]) * v_cache[b,h,j,d]`.
//!
//! Kernel arguments: `float* out, const float* q, const float* k, const float* v,
//! float* k_cache, float* v_cache, float* workspace, int B, int NH, int T, int max_T, int HS,
//! float scale`.
//! Shape: `B, NH, T, HS` (`T` = cache length including the new token); optional `max_T` (the
//! cache capacity, default `T`, at least `T`). `scale` is `1/sqrt(HS)`.
//! Tensors: `out [B, NH*HS]` (output), `q`, `k`, `v [B,NH,HS]` (the step's query, key and value,
//! as the QKV projection writes them), `k_cache`, `v_cache [B,NH,max_T,HS]` (read and written:
//! rows `0..T-1` hold the earlier positions, row `T-1` is written). Folding the append into the
//! attention saves the decode step a kernel a layer; a kernel reads row `T-1` from `k` and `v`,
//! never from the cache it is writing. Cache rows at positions `>= T-1` hold huge values (1e4)
//! in the test problems, so a kernel that reads the new row from the cache, or anything past
//! it, fails verification, and the caches are compared in full. The query is the last
//! position: no mask.

use rand::rngs::StdRng;
use rayon::prelude::*;

use super::*;

#[derive(Debug)]
pub struct AttentionDecode;

impl OpContract for AttentionDecode {
    fn name(&self) -> &'static str {
        "attention_decode"
    }
    fn summary(&self) -> &'static str {
        "one query per sequence against the KV cache, the step's key and value appended first: q, k, v [B,NH,HS], caches [B,NH,max_T,HS] -> out [B,NH*HS]"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* q, const float* k, const float* v, float* k_cache, float* v_cache, float* workspace, int B, int NH, int T, int max_T, int HS, float scale"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "NH", "T", "HS"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["max_T"]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        let (b, nh, t, hs) = (
            get_dim(self, shape, "B")?,
            get_dim(self, shape, "NH")?,
            get_dim(self, shape, "T")?,
            get_dim(self, shape, "HS")?,
        );
        let max_t = *shape.entry("max_T".into()).or_insert(t);
        if max_t < t {
            return Err(OpError::Shape {
                op: self.name(),
                msg: format!("the cache holds max_T={max_t} positions but T={t} are attended; give max_T >= T"),
            });
        }
        check_i32(self, shape, &[("k_cache", b * nh * max_t * hs)])
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        // (16, 12, 300): more (sequence, head, split) items than a persistent grid has blocks,
        // so that its blocks walk several each and reuse their ring of shared-memory slots.
        [
            (1, 2, 1),
            (3, 2, 5),
            (1, 3, 129),
            (5, 3, 257),
            (2, 2, 1000),
            (16, 12, 300),
        ]
        .iter()
        .map(|&(b, nh, t)| shape_of(&[("B", b), ("NH", nh), ("T", t), ("HS", 64), ("max_T", t + 7)]))
        .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (b, nh, t, hs, max_t) = (shape["B"], shape["NH"], shape["T"], shape["HS"], shape["max_T"]);
        let cache = |rng: &mut StdRng, lo: f32, hi: f32| {
            let mut c = uniform(rng, (b * nh * max_t * hs) as usize, lo, hi);
            // The new row (T - 1) is not in the cache yet and the positions past it are not part
            // of the sequence: make reading any of them ruinous.
            for row in 0..(b * nh) as usize {
                let start = (row * max_t as usize + t as usize - 1) * hs as usize;
                let end = (row + 1) * (max_t * hs) as usize;
                c[start..end].iter_mut().for_each(|x| *x = 1e4);
            }
            c
        };
        let heads = (b * nh * hs) as usize;
        let tensors = vec![
            TensorArg::output_f32("out", heads),
            TensorArg::input_f32("q", uniform(rng, heads, -2.0, 2.0)),
            TensorArg::input_f32("k", uniform(rng, heads, -2.0, 2.0)),
            TensorArg::input_f32("v", uniform(rng, heads, -1.0, 1.0)),
            TensorArg::inout_f32("k_cache", cache(rng, -2.0, 2.0)),
            TensorArg::inout_f32("v_cache", cache(rng, -1.0, 1.0)),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(1),
            Arg::Tensor(2),
            Arg::Tensor(3),
            Arg::Tensor(4),
            Arg::Tensor(5),
            Arg::Workspace,
            Arg::I32(b as i32),
            Arg::I32(nh as i32),
            Arg::I32(t as i32),
            Arg::I32(max_t as i32),
            Arg::I32(hs as i32),
            Arg::F32(1.0 / (hs as f32).sqrt()),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let (nh, t, hs, max_t) = (
            problem.dim("NH"),
            problem.dim("T"),
            problem.dim("HS"),
            problem.dim("max_T"),
        );
        // The append first: row T - 1 of every head's caches is the step's key and value.
        let append = |cache: &[f32], new: &[f32]| -> Vec<f64> {
            let mut c: Vec<f64> = cache.iter().map(|&x| x as f64).collect();
            for (row, new) in new.chunks(hs).enumerate() {
                let at = (row * max_t + t - 1) * hs;
                c[at..at + hs].iter_mut().zip(new).for_each(|(c, &n)| *c = n as f64);
            }
            c
        };
        let k = append(problem.f32s("k_cache"), problem.f32s("k"));
        let v = append(problem.f32s("v_cache"), problem.f32s("v"));
        let q = problem.f32s("q");
        let scale = 1.0 / (hs as f64).sqrt();
        let out: Vec<f64> = (0..problem.dim("B") * nh)
            .into_par_iter()
            .flat_map_iter(|row| {
                let q = &q[row * hs..(row + 1) * hs];
                let base = row * max_t * hs;
                let scores: Vec<f64> = (0..t)
                    .map(|j| {
                        let key = &k[base + j * hs..base + (j + 1) * hs];
                        scale * q.iter().zip(key).map(|(&a, &b)| a as f64 * b).sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                (0..hs)
                    .map(|d| (0..t).map(|j| weights[j] * v[base + j * hs + d]).sum::<f64>() / total)
                    .collect::<Vec<_>>()
            })
            .collect();
        let index = |name| problem.tensor_index(name).unwrap();
        vec![(index("out"), out), (index("k_cache"), k), (index("v_cache"), v)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn one_key_is_the_new_value_and_two_keys_mix_by_softmax() {
        let op = AttentionDecode;
        let mut rng = StdRng::seed_from_u64(1);
        // T = 1: the only key is the step's own, so the output is its value, and it lands in
        // row 0 of the caches while rows 1.. stay as they were.
        let shape = shape_of(&[("B", 1), ("NH", 1), ("T", 1), ("HS", 2), ("max_T", 3)]);
        let p = op.problem(&shape, Epilogue::None, Mask::None, &mut rng).unwrap();
        let (v, v_cache) = (p.f32s("v"), p.f32s("v_cache"));
        let reference = op.reference(&p);
        let (out, cached) = (&reference[0].1, &reference[2].1);
        assert!((out[0] - v[0] as f64).abs() < 1e-12 && (out[1] - v[1] as f64).abs() < 1e-12);
        assert_eq!(&cached[..2], &[v[0] as f64, v[1] as f64]);
        assert_eq!(
            &cached[2..],
            &v_cache[2..].iter().map(|&x| x as f64).collect::<Vec<_>>()[..]
        );

        // T = 2 by hand: q = (1, 0), keys (1, 0) (cached) and (0, 0) (new), HS = 2 -> scores
        // 1/sqrt2 and 0.
        let mut p = op
            .problem(
                &shape_of(&[("B", 1), ("NH", 1), ("T", 2), ("HS", 2)]),
                Epilogue::None,
                Mask::None,
                &mut rng,
            )
            .unwrap();
        let mut set = |name: &str, values: Vec<f32>| {
            let i = p.tensor_index(name).unwrap();
            p.tensors[i].data = HostData::F32(values);
        };
        set("q", vec![1.0, 0.0]);
        set("k", vec![0.0, 0.0]);
        set("v", vec![6.0, 8.0]);
        set("k_cache", vec![1.0, 0.0, 1e4, 1e4]);
        set("v_cache", vec![2.0, 4.0, 1e4, 1e4]);
        let w0 = (1.0f64 / 2f64.sqrt()).exp();
        let (a, b) = (w0 / (w0 + 1.0), 1.0 / (w0 + 1.0));
        let reference = op.reference(&p);
        let out = &reference[0].1;
        assert!((out[0] - (2.0 * a + 6.0 * b)).abs() < 1e-12);
        assert!((out[1] - (4.0 * a + 8.0 * b)).abs() < 1e-12);
        assert_eq!(reference[1].1, vec![1.0, 0.0, 0.0, 0.0]);
        assert_eq!(reference[2].1, vec![2.0, 4.0, 6.0, 8.0]);
    }

    #[test]
    fn the_new_row_and_positions_past_it_are_poisoned_and_bad_shapes_refused() {
        let op = AttentionDecode;
        let mut rng = StdRng::seed_from_u64(2);
        let p = op
            .problem(
                &op.test_shapes(Epilogue::None, Mask::None)[1],
                Epilogue::None,
                Mask::None,
                &mut rng,
            )
            .unwrap();
        let k = p.f32s("k_cache");
        let (t, hs, max_t) = (p.dim("T"), p.dim("HS"), p.dim("max_T"));
        assert_eq!(k[(t - 1) * hs], 1e4);
        assert_eq!(k[t * hs], 1e4);
        assert!(k[(t - 2) * hs].abs() <= 2.0);
        assert_eq!(k.len(), p.dim("B") * p.dim("NH") * max_t * hs);
        let reference = op.reference(&p);
        assert!(reference[0].1.iter().all(|x| x.abs() <= 1.0));
        assert_eq!(reference[1].1[(t - 1) * hs], p.f32s("k")[0] as f64);
        let mut bad = shape_of(&[("B", 1), ("NH", 1), ("T", 9), ("HS", 64), ("max_T", 4)]);
        let e = op
            .complete_shape(&mut bad, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("attention_decode") && e.contains("max_T >= T"), "{e}");
    }
}
