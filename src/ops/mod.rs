//! Op contracts: for each op a kernel family can implement, the kernel argument list, the
//! shape variables, how to build a test problem with fresh random inputs, and an f64 CPU
//! reference. Everything else (verification, timing, the model) goes through these.

use std::collections::BTreeMap;

use rand::rngs::StdRng;

/// Named problem dimensions (`M`, `N`, `K`, `T`, ...), visible to launch expressions.
pub type Shape = BTreeMap<String, i64>;

/// Host data of one kernel tensor argument.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl HostData {
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether the kernel reads or writes a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Input,
    Output,
}

/// One tensor argument: inputs carry their data, outputs carry a buffer of the right length
/// (its contents are ignored: the runner poisons outputs with NaN before every launch).
#[derive(Clone, Debug)]
pub struct TensorArg {
    pub name: &'static str,
    pub role: Role,
    pub data: HostData,
}

/// One kernel argument, in signature order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// Index into [`Problem::tensors`].
    Tensor(usize),
    /// The variant's scratch buffer (`[workspace] elems` in the spec; null when it has none).
    Workspace,
    I32(i32),
    F32(f32),
}

/// Fused epilogue of a matmul (`none` for other ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Epilogue {
    None,
    Bias,
    BiasGelu,
    BiasResidual,
    Qkv,
}

/// Attention mask (`none` for other ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mask {
    None,
    Causal,
    Full,
    Window,
}

/// A concrete problem: tensors with fresh inputs, and the kernel argument list.
#[derive(Clone, Debug)]
pub struct Problem {
    pub op: &'static str,
    pub shape: Shape,
    pub epilogue: Epilogue,
    pub mask: Mask,
    pub tensors: Vec<TensorArg>,
    pub args: Vec<Arg>,
}

// ---- interim declarations (replaced by the op contracts branch) ----
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("{0}")]
    Invalid(String),
}

pub trait OpContract: Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn summary(&self) -> &'static str;
    fn dims(&self) -> &'static [&'static str];
    fn epilogues(&self) -> &'static [Epilogue];
    fn masks(&self) -> &'static [Mask];
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError>;
    fn test_shapes(&self, epilogue: Epilogue, mask: Mask) -> Vec<Shape>;
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError>;
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)>;
}

pub fn all_ops() -> &'static [&'static dyn OpContract] {
    &[]
}
pub fn op_by_name(name: &str) -> Option<&'static dyn OpContract> {
    all_ops().iter().copied().find(|o| o.name() == name)
}
pub fn op_names() -> Vec<&'static str> {
    all_ops().iter().map(|o| o.name()).collect()
}
pub fn parse_shape(_op: &dyn OpContract, _text: &str) -> Result<Shape, OpError> {
    unimplemented!()
}
pub fn relative_l2_error(_got: &[f32], _want: &[f64]) -> f64 {
    unimplemented!()
}
