//! residual: `out[i] = a[i] + b[i]`.
//!
//! Kernel arguments: `float* out, const float* a, const float* b, int N`. Shape: `N` (elements).
//! Tensors: `out [N]` (output), `a [N]`, `b [N]`, inputs uniform in `[-1, 1]`.
//! No epilogue, no mask.

use rand::rngs::StdRng;

use super::*;

#[derive(Debug)]
pub struct Residual;

impl OpContract for Residual {
    fn name(&self) -> &'static str {
        "residual"
    }
    fn summary(&self) -> &'static str {
        "elementwise residual add: out = a + b"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* a, const float* b, int N"
    }
    fn dims(&self) -> &'static [&'static str] {
        &["N"]
    }
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
        elementwise::complete_shape(self, shape, epilogue, mask)
    }
    fn test_shapes(&self, _epilogue: Epilogue, _mask: Mask) -> Vec<Shape> {
        elementwise::test_shapes()
    }
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError> {
        elementwise::problem(self, shape, epilogue, mask, |n| {
            vec![
                TensorArg::input_f32("a", uniform(rng, n, -1.0, 1.0)),
                TensorArg::input_f32("b", uniform(rng, n, -1.0, 1.0)),
            ]
        })
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let a = problem.f32s("a");
        let b = problem.f32s("b");
        let out = a.iter().zip(b).map(|(&x, &y)| x as f64 + y as f64).collect();
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn residual_by_hand() {
        let mut p = Residual
            .problem(
                &shape_of(&[("N", 3)]),
                Epilogue::None,
                Mask::None,
                &mut StdRng::seed_from_u64(1),
            )
            .unwrap();
        p.tensors[1].data = HostData::F32(vec![1.0, -2.0, 0.5]);
        p.tensors[2].data = HostData::F32(vec![0.25, 2.0, 3.0]);
        assert_eq!(Residual.reference(&p), vec![(0, vec![1.25, 0.0, 3.5])]);
    }
}
