//! argmax: `out[b] = the first v < V with logits[b, v] = max_v logits[b, v]` for each row `b`
//! (greedy decoding on the device, so that only B token ids, not B x V logits, travel back to
//! the host); `-1` for a row that contains NaN.
//!
//! Kernel arguments: `int* out, int* out_copy, const float* logits, int B, int V, int stride`.
//! Shape: `B` (rows), `V` (entries per row); optional `stride` (floats between row starts,
//! default `V`, at least `V`: the model's logits rows are padded to a multiple of 64).
//! `out_copy [B]` gets the same ids (the model keeps one copy in host memory for the host and one
//! in device memory for the next decode step).
//! Tensors: `out [B]` and `out_copy [B]` (int32 outputs), `logits [B, stride]` uniform in `[-4, 4]` with the row
//! maximum planted twice in each row of more than one entry (the first must win), a NaN in
//! row 2 (its answer is -1) and large values in the padding (which must not win).
//! Outputs are integers and must match exactly: see [`OpContract::exact`].

use rand::rngs::StdRng;
use rand::Rng;

use super::*;

#[derive(Debug)]
pub struct Argmax;

/// `B` rows of `V` logits `stride` apart (`stride` defaults to `V` and may not be shorter),
/// checked to fit 32-bit indexing: the shape of the ops that read the LM head's logits.
pub(crate) fn logits_rows(op: &dyn OpContract, shape: &mut Shape) -> Result<(i64, i64, i64), OpError> {
    let b = get_dim(op, shape, "B")?;
    let v = get_dim(op, shape, "V")?;
    let stride = *shape.entry("stride".into()).or_insert(v);
    if stride < v {
        return Err(OpError::Shape {
            op: op.name(),
            msg: format!("stride={stride} is shorter than a row (V={v}); give stride >= V"),
        });
    }
    check_i32(op, shape, &[("logits [B,stride]", b * stride)])?;
    Ok((b, v, stride))
}

impl OpContract for Argmax {
    fn name(&self) -> &'static str {
        "argmax"
    }
    fn summary(&self) -> &'static str {
        "index of the largest entry of each row (first on ties, -1 for NaN): greedy decoding"
    }
    fn signature(&self) -> &'static str {
        "int* out, int* out_copy, const float* logits, int B, int V, int stride"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["B", "V"]
    }
    fn optional_vars(&self) -> &'static [&'static str] {
        &["stride"]
    }
    fn exact(&self) -> bool {
        true
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        check_variant(self, epilogue, mask)?;
        logits_rows(self, shape).map(|_| ())
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        [
            (1, 1, 1),
            (3, 5, 8),
            (2, 1001, 1001),
            (8, 50257, 50304),
            (5, 4099, 4100),
        ]
        .iter()
        .map(|&(b, v, stride)| shape_of(&[("B", b), ("V", v), ("stride", stride)]))
        .collect()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        let mut shape = shape.clone();
        self.complete_shape(&mut shape, epilogue, mask)?;
        let (b, v, stride) = (shape["B"] as usize, shape["V"] as usize, shape["stride"] as usize);
        let mut logits = uniform(rng, b * stride, -4.0, 4.0);
        for (r, row) in logits.chunks_mut(stride).enumerate() {
            // A tie for the maximum: the earlier index must win.
            if v > 1 {
                let first = rng.random_range(0..v - 1);
                let second = rng.random_range(first + 1..v);
                row[first] = 5.0;
                row[second] = 5.0;
                if r == 2 && v > 2 {
                    let nan_at = (0..v)
                        .cycle()
                        .skip(rng.random_range(0..v))
                        .find(|&i| i != first && i != second);
                    row[nan_at.expect("v > 2 leaves a free position")] = f32::NAN;
                }
            }
            // Padding larger than any real entry: reading past V would be caught.
            row[v..].iter_mut().for_each(|x| *x = 100.0);
        }
        let tensors = vec![
            TensorArg::output_i32("out", b),
            TensorArg::input_f32("logits", logits),
            TensorArg::output_i32("out_copy", b),
        ];
        let args = vec![
            Arg::Tensor(0),
            Arg::Tensor(2),
            Arg::Tensor(1),
            Arg::I32(b as i32),
            Arg::I32(v as i32),
            Arg::I32(stride as i32),
        ];
        Ok(Problem::new(self.name(), shape, epilogue, mask, tensors, args))
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let (v, stride) = (problem.shape["V"] as usize, problem.shape["stride"] as usize);
        let out: Vec<f64> = problem
            .f32s("logits")
            .chunks(stride)
            .map(|row| {
                let row = &row[..v];
                if row.iter().any(|x| x.is_nan()) {
                    return -1.0;
                }
                let mut best = 0;
                for (i, &x) in row.iter().enumerate() {
                    if x > row[best] {
                        best = i;
                    }
                }
                best as f64
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
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn argmax_by_hand() {
        let shape = shape_of(&[("B", 3), ("V", 3), ("stride", 4)]);
        let mut p = Argmax
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(1))
            .unwrap();
        p.tensors[1].data = HostData::F32(vec![
            1.0,
            3.0,
            3.0,
            9.0, // tie: the first wins; the padding 9 is not part of the row
            -2.0,
            -1.0,
            -5.0,
            0.0, //
            0.0,
            f32::NAN,
            1.0,
            0.0, // NaN
        ]);
        let want = vec![1.0, 1.0, -1.0];
        assert_eq!(Argmax.reference(&p), vec![(0, want.clone()), (2, want)]);
    }

    #[test]
    fn planted_ties_and_padding() {
        let shape = shape_of(&[("B", 4), ("V", 37), ("stride", 40)]);
        let p = Argmax
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(2))
            .unwrap();
        let logits = p.f32s("logits");
        for (r, row) in logits.chunks(40).enumerate() {
            assert_eq!(row[..37].iter().filter(|&&x| x == 5.0).count(), 2);
            assert_eq!(row[..37].iter().filter(|x| x.is_nan()).count(), usize::from(r == 2));
            assert!(row[37..].iter().all(|&x| x == 100.0));
        }
        let (_, want) = &Argmax.reference(&p)[0];
        assert_eq!(want[2], -1.0);
        assert!(want
            .iter()
            .enumerate()
            .all(|(r, &i)| r == 2 || logits[r * 40 + i as usize] == 5.0));
    }

    #[test]
    fn stride_shorter_than_a_row_is_refused() {
        let mut shape = shape_of(&[("B", 1), ("V", 10), ("stride", 9)]);
        let e = Argmax
            .complete_shape(&mut shape, Epilogue::None, Mask::None)
            .unwrap_err();
        assert!(e.to_string().contains("stride=9"), "{e}");
    }
}
