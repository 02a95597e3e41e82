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
