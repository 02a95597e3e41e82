//! The data of a test problem: its tensors (host values, role, storage on the device) and the
//! kernel argument list, and the conversions between host f32 values and device storage.

use super::{Epilogue, Mask, Shape};

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

/// How a problem's floating-point tensors live in device memory. The host side always holds
/// f32 (already rounded to the storage precision, so the f64 reference sees exactly the values
/// the kernel reads); the runner converts at upload and download.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Storage {
    #[default]
    F32,
    /// IEEE binary16: 11-bit significand, range +-65504.
    F16,
    /// bfloat16: f32's range with an 8-bit significand.
    Bf16,
}

impl Storage {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Storage::F32 => 4,
            Storage::F16 | Storage::Bf16 => 2,
        }
    }

    /// `x` rounded (to nearest even) to this storage precision.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Storage::F32 => x,
            Storage::F16 => half::f16::from_f32(x).to_f32(),
            Storage::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// The 2-byte encoding of `x` (f16 / bf16 only).
    pub fn to_bits(self, x: f32) -> u16 {
        match self {
            Storage::F32 => panic!("f32 storage has no 16-bit encoding"),
            Storage::F16 => half::f16::from_f32(x).to_bits(),
            Storage::Bf16 => half::bf16::from_f32(x).to_bits(),
        }
    }

    /// `values` in this storage, as the little-endian bytes a device buffer holds.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        use rayon::prelude::*;
        // In parallel chunks: the LM head's tensors hold hundreds of millions of values.
        const CHUNK: usize = 1 << 16;
        let width = self.bytes();
        let mut out = vec![0u8; values.len() * width];
        out.par_chunks_mut(CHUNK * width)
            .zip(values.par_chunks(CHUNK))
            .for_each(|(dst, src)| {
                for (d, &x) in dst.chunks_exact_mut(width).zip(src) {
                    match self {
                        Storage::F32 => d.copy_from_slice(&x.to_le_bytes()),
                        _ => d.copy_from_slice(&self.to_bits(x).to_le_bytes()),
                    }
                }
            });
        out
    }

    /// Device bytes of this storage back to f32 values.
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Storage::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|b| self.from_bits(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
        }
    }

    /// The value of a 2-byte encoding (f16 / bf16 only).
    pub fn from_bits(self, bits: u16) -> f32 {
        match self {
            Storage::F32 => panic!("f32 storage has no 16-bit encoding"),
            Storage::F16 => half::f16::from_bits(bits).to_f32(),
            Storage::Bf16 => half::bf16::from_bits(bits).to_f32(),
        }
    }
}

/// Whether the kernel reads or writes a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Input,
    /// Written by the kernel; allocated on the device without its host values, and poisoned
    /// with NaN before every checked run.
    Output,
    /// Read and partly overwritten (a KV cache the kernel appends to): uploaded with its data,
    /// not poisoned, and compared in full, so untouched parts must stay as they were.
    InOut,
}

/// One tensor argument: inputs carry their data, outputs carry a buffer of the right length
/// (its contents are ignored: the runner poisons outputs with NaN before every checked run).
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

/// A concrete problem: tensors with fresh inputs, and the kernel argument list.
#[derive(Clone, Debug)]
pub struct Problem {
    pub op: &'static str,
    pub shape: Shape,
    pub epilogue: Epilogue,
    pub mask: Mask,
    pub tensors: Vec<TensorArg>,
    pub args: Vec<Arg>,
    /// How the f32 tensors are stored on the device (see [`Problem::stored_as`]).
    pub storage: Storage,
}

impl TensorArg {
    pub fn input_f32(name: &'static str, data: Vec<f32>) -> Self {
        TensorArg {
            name,
            role: Role::Input,
            data: HostData::F32(data),
        }
    }
    pub fn input_i32(name: &'static str, data: Vec<i32>) -> Self {
        TensorArg {
            name,
            role: Role::Input,
            data: HostData::I32(data),
        }
    }
    /// A tensor the kernel reads and partly overwrites (see [`Role::InOut`]).
    pub fn inout_f32(name: &'static str, data: Vec<f32>) -> Self {
        TensorArg {
            name,
            role: Role::InOut,
            data: HostData::F32(data),
        }
    }
    /// An output buffer of `len` int32 (the runner poisons it with `i32::MIN`).
    pub fn output_i32(name: &'static str, len: usize) -> Self {
        TensorArg {
            name,
            role: Role::Output,
            data: HostData::I32(vec![i32::MIN; len]),
        }
    }
    /// An output buffer of `len` floats. Its host values are never read: the runner allocates
    /// outputs on the device without copying them and poisons them with NaN before every
    /// checked run. Zeros, so that the allocation stays untouched (the LM head's output at
    /// batch 8 x 1024 is 1.6 GB).
    pub fn output_f32(name: &'static str, len: usize) -> Self {
        TensorArg {
            name,
            role: Role::Output,
            data: HostData::F32(vec![0.0; len]),
        }
    }
}

impl Problem {
    /// A problem whose floating-point tensors are stored as f32 on the device (see
    /// [`Problem::stored_as`] for 16-bit storage).
    pub fn new(
        op: &'static str,
        shape: Shape,
        epilogue: Epilogue,
        mask: Mask,
        tensors: Vec<TensorArg>,
        args: Vec<Arg>,
    ) -> Problem {
        Problem {
            op,
            shape,
            epilogue,
            mask,
            tensors,
            args,
            storage: Storage::F32,
        }
    }
    /// The same problem with every floating-point tensor stored as `storage` on the device: the
    /// host values are rounded to that precision so the reference computes from exactly what
    /// the kernel reads. Integer tensors (token ids, argmax outputs) are unchanged.
    pub fn stored_as(mut self, storage: Storage) -> Problem {
        use rayon::prelude::*;
        for t in &mut self.tensors {
            // Outputs hold NaN until a kernel writes them: nothing to round.
            if t.role == Role::Output || storage == Storage::F32 {
                continue;
            }
            if let HostData::F32(values) = &mut t.data {
                values.par_iter_mut().for_each(|v| *v = storage.round(*v));
            }
        }
        self.storage = storage;
        self
    }
    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorArg> {
        self.tensors.iter().find(|t| t.name == name)
    }
    /// Index into [`Problem::tensors`] of the tensor called `name`.
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }
    /// The f32 data of the tensor called `name` (panics when absent or not f32: a contract bug).
    pub fn f32s(&self, name: &str) -> &[f32] {
        match self.tensor(name).map(|t| &t.data) {
            Some(HostData::F32(v)) => v,
            _ => panic!("{}: no f32 tensor named {name}", self.op),
        }
    }
    /// The i32 data of the tensor called `name` (panics when absent or not i32).
    pub fn i32s(&self, name: &str) -> &[i32] {
        match self.tensor(name).map(|t| &t.data) {
            Some(HostData::I32(v)) => v,
            _ => panic!("{}: no i32 tensor named {name}", self.op),
        }
    }
    /// A shape variable (panics when absent: problems are built from complete shapes).
    pub fn dim(&self, name: &str) -> usize {
        match self.shape.get(name) {
            Some(&v) if v >= 0 => v as usize,
            _ => panic!("{}: shape has no variable {name}", self.op),
        }
    }
    /// Indices of the output tensors.
    pub fn outputs(&self) -> Vec<usize> {
        (0..self.tensors.len())
            .filter(|&i| self.tensors[i].role != Role::Input)
            .collect()
    }
}
