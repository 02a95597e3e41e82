//! What the elementwise ops (gelu, residual) share in their contracts: one dimension `N`, the
//! awkward sizes they are verified at, and a problem laid out as `out [N]`, the inputs, then `N`.

use super::*;

/// [`OpContract::complete_shape`] of an elementwise op: `N` given and within `i32`.
pub(crate) fn complete_shape(
    op: &dyn OpContract,
    shape: &Shape,
    epilogue: Epilogue,
    mask: Mask,
) -> Result<(), OpError> {
    check_variant(op, epilogue, mask)?;
    get_dim(op, shape, "N")?;
    check_i32(op, shape, &[])
}

/// [`OpContract::test_shapes`] of an elementwise op: one element, sizes that are no multiple
/// of a warp or a block, and one past a grid-stride loop's first sweep.
pub(crate) fn test_shapes() -> Vec<Shape> {
    [1, 3, 37, 1001, 4099, 100_003]
        .iter()
        .map(|&n| shape_of(&[("N", n)]))
        .collect()
}

/// [`OpContract::problem`] of an elementwise op: the output `out [N]` first, then the inputs
/// `inputs(N)` makes, as the kernel arguments in that order followed by `N`.
pub(crate) fn problem(
    op: &dyn OpContract,
    shape: &Shape,
    epilogue: Epilogue,
    mask: Mask,
    inputs: impl FnOnce(usize) -> Vec<TensorArg>,
) -> Result<Problem, OpError> {
    let mut shape = shape.clone();
    op.complete_shape(&mut shape, epilogue, mask)?;
    let n = shape["N"];
    let mut tensors = vec![TensorArg::output_f32("out", n as usize)];
    tensors.extend(inputs(n as usize));
    let mut args: Vec<Arg> = (0..tensors.len()).map(Arg::Tensor).collect();
    args.push(Arg::I32(n as i32));
    Ok(Problem::new(op.name(), shape, epilogue, mask, tensors, args))
}
