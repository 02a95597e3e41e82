//! gelu: `out[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` with `x = inp[i]`.
//!
//! Kernel arguments: `float* out, const float* inp, int N`. Shape: `N` (elements).
//! Tensors: `out [N]` (output), `inp [N]` with inputs uniform in about `[-4, 4]`.
//! No epilogue, no mask.

use rand::rngs::StdRng;

use super::*;

#[derive(Debug)]
pub struct Gelu;

impl OpContract for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }
    fn summary(&self) -> &'static str {
        "elementwise GELU (tanh approximation): out = gelu(inp)"
    }
    fn signature(&self) -> &'static str {
        "float* out, const float* inp, int N"
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
            vec![TensorArg::input_f32("inp", uniform(rng, n, -4.0, 4.0))]
        })
    }
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)> {
        let out = problem.f32s("inp").iter().map(|&x| gelu_f64(x as f64)).collect();
        vec![(problem.tensor_index("out").unwrap(), out)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn gelu_by_hand() {
        assert!((gelu_f64(1.0) - 0.8411919906).abs() < 1e-9);
        assert_eq!(gelu_f64(0.0), 0.0);
        assert!((gelu_f64(-1.0) - (-0.1588080094)).abs() < 1e-9);
        let mut p = Gelu
            .problem(
                &shape_of(&[("N", 3)]),
                Epilogue::None,
                Mask::None,
                &mut StdRng::seed_from_u64(1),
            )
            .unwrap();
        p.tensors[1].data = HostData::F32(vec![1.0, 0.0, 2.0]);
        let r = Gelu.reference(&p);
        assert_eq!(r[0].0, 0);
        let want = [0.8411919906, 0.0, 1.9545976940];
        for (g, w) in r[0].1.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{g} vs {w}");
        }
    }

    #[test]
    fn inputs_in_range() {
        let p = Gelu
            .problem(
                &shape_of(&[("N", 1001)]),
                Epilogue::None,
                Mask::None,
                &mut StdRng::seed_from_u64(2),
            )
            .unwrap();
        assert!(p.f32s("inp").iter().all(|x| (-4.0..=4.0).contains(x)));
        assert!(p.f32s("inp").iter().any(|x| x.abs() > 2.0));
    }
}
