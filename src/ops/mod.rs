//! Op contracts: for each op a kernel family can implement, the kernel argument list, the
//! shape variables, how to build a test problem with fresh random inputs, and an f64 CPU
//! reference. Everything else (verification, timing, the model) goes through these.
//! `problem` holds the data of a problem (tensors, arguments, device storage), `shape` reads
//! and checks shapes, `numeric` draws random inputs and measures errors; one file per op holds
//! its contract.

use std::collections::BTreeMap;

use rand::rngs::StdRng;

pub mod argmax;
pub mod attention;
pub mod attention_decode;
pub mod decode_step;
pub mod draw;
mod elementwise;
pub mod encoder;
pub mod gelu;
pub mod kv_append;
pub mod layernorm;
pub mod matmul;
pub mod model_dims;
mod numeric;
mod problem;
pub mod residual;
pub mod sample;
mod shape;
pub mod softmax;

/// Named problem dimensions (`M`, `N`, `K`, `T`, ...), visible to launch expressions.
pub type Shape = BTreeMap<String, i64>;

pub(crate) use numeric::{gelu_f64, to_f64, uniform};
pub use numeric::{mismatch_count, relative_l2_error};
pub use problem::{Arg, HostData, Problem, Role, Storage, TensorArg};
pub use shape::parse_shape;
pub(crate) use shape::{check_i32, get_dim, shape_of};

/// Fused epilogue of a matmul (`none` for other ops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Epilogue {
    None,
    Bias,
    BiasGelu,
    BiasResidual,
    Qkv,
    /// `bias`, `bias_gelu` and `qkv` of the rows of `inp` standardized first (the layernorm
    /// folded into the matmul; see `ops/matmul.rs`).
    LnBias,
    LnBiasGelu,
    LnQkv,
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

impl Epilogue {
    pub const ALL: [Epilogue; 8] = [
        Epilogue::None,
        Epilogue::Bias,
        Epilogue::BiasGelu,
        Epilogue::BiasResidual,
        Epilogue::Qkv,
        Epilogue::LnBias,
        Epilogue::LnBiasGelu,
        Epilogue::LnQkv,
    ];

    /// The spec / CLI spelling (`bias_gelu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Epilogue::None => "none",
            Epilogue::Bias => "bias",
            Epilogue::BiasGelu => "bias_gelu",
            Epilogue::BiasResidual => "bias_residual",
            Epilogue::Qkv => "qkv",
            Epilogue::LnBias => "ln_bias",
            Epilogue::LnBiasGelu => "ln_bias_gelu",
            Epilogue::LnQkv => "ln_qkv",
        }
    }

    /// Whether the rows of the matmul's input are standardized (a layernorm without its
    /// gamma and beta, which the model folds into the weight and bias) before the product.
    pub fn standardizes_input(self) -> bool {
        matches!(self, Epilogue::LnBias | Epilogue::LnBiasGelu | Epilogue::LnQkv)
    }

    /// What is applied to the product: the epilogue itself, or for the `ln_` ones the epilogue
    /// they add standardization to (`ln_qkv` → `qkv`).
    pub fn after_product(self) -> Epilogue {
        match self {
            Epilogue::LnBias => Epilogue::Bias,
            Epilogue::LnBiasGelu => Epilogue::BiasGelu,
            Epilogue::LnQkv => Epilogue::Qkv,
            e => e,
        }
    }
}

/// An epilogue name that is not one of [`Epilogue::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown epilogue `{0}` ({known})", known = Epilogue::ALL.map(Epilogue::as_str).join(", "))]
pub struct UnknownEpilogue(pub String);

impl std::str::FromStr for Epilogue {
    type Err = UnknownEpilogue;
    fn from_str(text: &str) -> Result<Epilogue, UnknownEpilogue> {
        Epilogue::ALL
            .into_iter()
            .find(|e| e.as_str() == text.trim())
            .ok_or_else(|| UnknownEpilogue(text.to_string()))
    }
}

impl std::fmt::Display for Epilogue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Mask {
    /// The spec / CLI spelling (`causal`).
    pub fn as_str(self) -> &'static str {
        match self {
            Mask::None => "none",
            Mask::Causal => "causal",
            Mask::Full => "full",
            Mask::Window => "window",
        }
    }
}

impl std::fmt::Display for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a shape, epilogue or mask does not fit an op.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("{op}: epilogue `{epilogue}` is not supported (supported: {supported})")]
    UnsupportedEpilogue {
        op: &'static str,
        epilogue: Epilogue,
        supported: String,
    },
    #[error("{op}: mask `{mask}` is not supported (supported: {supported})")]
    UnsupportedMask {
        op: &'static str,
        mask: Mask,
        supported: String,
    },
    #[error("{op}: shape variable {var} is missing ({hint})")]
    MissingVar {
        op: &'static str,
        var: String,
        hint: String,
    },
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("{op}: cannot parse shape `{text}`: {msg}")]
    Parse {
        op: &'static str,
        text: String,
        msg: String,
    },
}

/// The contract of one op: kernel arguments, shape variables, test problems and the f64 reference.
pub trait OpContract: Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    /// One line for --help.
    fn summary(&self) -> &'static str;
    /// The kernel parameter list every template of the op implements, as C (`float* out, ...,
    /// int N`), in storage-generic spelling (`float` is the storage type). Also in
    /// templates/README.md, which a test keeps equal.
    fn signature(&self) -> &'static str;
    /// Shape variables `--shape` lists, in order (matmul: ["M","N","K"]).
    fn dims(&self) -> &'static [&'static str];
    /// Further shape variables that `--shape` may name (`T`, `n_head`, `pos_offset`, ...); they
    /// may be zero and [`OpContract::complete_shape`] fills them in when absent.
    fn optional_vars(&self) -> &'static [&'static str] {
        &[]
    }
    /// The row-count variables a tuned winner may be reused across (the first is the one
    /// compared): the tuning database's nearest-shape rule keeps every other variable equal.
    fn row_dims(&self) -> &'static [&'static str] {
        &self.dims()[..1]
    }
    /// Whether outputs are integers that must equal the reference exactly (verification then
    /// reports the number of mismatching elements as the error) instead of floats compared by
    /// relative L2 error.
    fn exact(&self) -> bool {
        false
    }
    /// `Some(why)` for an op that has no stand-alone random problem and is checked end to end
    /// elsewhere (`verify` and `tune` skip its families and say why).
    fn checked_end_to_end(&self) -> Option<&'static str> {
        None
    }
    /// The epilogues / masks it supports ([Epilogue::None] / [Mask::None] when not applicable).
    fn epilogues(&self) -> &'static [Epilogue] {
        &[Epilogue::None]
    }
    fn masks(&self) -> &'static [Mask] {
        &[Mask::None]
    }
    /// Fill in derived/optional shape variables and validate. Every variable a launch
    /// expression may use is present afterwards. Idempotent.
    fn complete_shape(&self, shape: &mut Shape, epilogue: Epilogue, mask: Mask) -> Result<(), OpError>;
    /// Awkward shapes for verification (not multiples of 32/64, tiny ones), already complete.
    fn test_shapes(&self, epilogue: Epilogue, mask: Mask) -> Vec<Shape>;
    /// A problem with fresh random inputs, output buffers sized, args in kernel-signature order.
    /// The shape is completed first (so a partial one is fine).
    fn problem(&self, shape: &Shape, epilogue: Epilogue, mask: Mask, rng: &mut StdRng) -> Result<Problem, OpError>;
    /// f64 reference for every Output tensor: (index into problem.tensors, values).
    fn reference(&self, problem: &Problem) -> Vec<(usize, Vec<f64>)>;
}

static ALL_OPS: [&dyn OpContract; 12] = [
    &encoder::Encoder,
    &layernorm::LayerNorm,
    &matmul::Matmul,
    &attention::Attention,
    &softmax::Softmax,
    &gelu::Gelu,
    &residual::Residual,
    &attention_decode::AttentionDecode,
    &kv_append::KvAppend,
    &argmax::Argmax,
    &sample::Sample,
    &decode_step::DecodeStep,
];

/// The parameter names of `op`'s [`OpContract::signature`], in order (`float* out` -> `out`).
pub fn arg_names(op: &dyn OpContract) -> impl Iterator<Item = &'static str> {
    op.signature()
        .split(", ")
        .map(|param| param.rsplit(' ').next().unwrap_or_default())
}

/// Position of the parameter called `name` in `op`'s [`OpContract::signature`] (a problem's
/// `args` follow it); `None` when there is none.
pub fn arg_index(op: &dyn OpContract, name: &str) -> Option<usize> {
    arg_names(op).position(|param| param == name)
}

/// Position of the tensor parameter (a pointer other than `workspace`) called `name` in `op`'s
/// [`OpContract::signature`]; `None` when there is no such tensor.
pub fn tensor_arg_index(op: &dyn OpContract, name: &str) -> Option<usize> {
    arg_index(op, name).filter(|&i| {
        let param = op.signature().split(", ").nth(i).unwrap_or_default();
        param.contains('*') && name != "workspace"
    })
}

/// Every op contract.
pub fn all_ops() -> &'static [&'static dyn OpContract] {
    &ALL_OPS
}

/// The op called `name` (`matmul`, ...).
pub fn op_by_name(name: &str) -> Option<&'static dyn OpContract> {
    ALL_OPS.iter().copied().find(|op| op.name() == name)
}

/// Names of every op, in [`all_ops`] order.
pub fn op_names() -> Vec<&'static str> {
    ALL_OPS.iter().map(|op| op.name()).collect()
}

// ---------------------------------------------------------------------------------------------
// Helpers shared by the op files.

/// Check that the epilogue and mask are among the op's.
pub(crate) fn check_variant(op: &dyn OpContract, epilogue: Epilogue, mask: Mask) -> Result<(), OpError> {
    if !op.epilogues().contains(&epilogue) {
        let supported = op.epilogues().iter().map(|e| e.as_str()).collect::<Vec<_>>().join(", ");
        return Err(OpError::UnsupportedEpilogue {
            op: op.name(),
            epilogue,
            supported,
        });
    }
    if !op.masks().contains(&mask) {
        let supported = op.masks().iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ");
        return Err(OpError::UnsupportedMask {
            op: op.name(),
            mask,
            supported,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn epilogue_names_parse_back() {
        for e in Epilogue::ALL {
            assert_eq!(e.as_str().parse::<Epilogue>(), Ok(e));
        }
        let err = "gelu".parse::<Epilogue>().unwrap_err().to_string();
        assert!(err.contains("`gelu`") && err.contains("bias_gelu"), "{err}");
    }

    #[test]
    fn half_storage_rounds_float_tensors_and_keeps_integers() {
        let shape: Shape = [("B", 2), ("V", 37), ("stride", 40)]
            .map(|(k, v)| (k.to_string(), v))
            .into();
        let p = argmax::Argmax
            .problem(&shape, Epilogue::None, Mask::None, &mut StdRng::seed_from_u64(9))
            .unwrap();
        let logits = p.f32s("logits").to_vec();
        for storage in [Storage::F16, Storage::Bf16] {
            let h = p.clone().stored_as(storage);
            assert_eq!(h.storage, storage);
            let rounded = h.f32s("logits");
            // Every value is exactly representable now, and the rounding moved something.
            assert!(rounded.iter().all(|&x| storage.from_bits(storage.to_bits(x)) == x));
            assert_ne!(rounded, &logits[..]);
            let max_rel = logits
                .iter()
                .zip(rounded)
                .map(|(a, b)| ((a - b) / a).abs())
                .fold(0.0f32, f32::max);
            let unit = if storage == Storage::F16 {
                2f32.powi(-11)
            } else {
                2f32.powi(-8)
            };
            assert!(max_rel <= unit, "{storage:?}: {max_rel}");
            assert_eq!(
                h.tensor("out").unwrap().data,
                p.tensor("out").unwrap().data,
                "i32 untouched"
            );
            assert_eq!(storage.bytes(), 2);
        }
        let values = [1.0f32, -2.5, 0.1, 65504.0];
        for storage in [Storage::F32, Storage::F16, Storage::Bf16] {
            let bytes = storage.encode(&values);
            assert_eq!(bytes.len(), values.len() * storage.bytes());
            let back = storage.decode(&bytes);
            assert!(
                back.iter().zip(values).all(|(&b, v)| b == storage.round(v)),
                "{storage:?}: {back:?}"
            );
        }
        assert!(Storage::F16.from_bits(Storage::F16.to_bits(f32::NAN)).is_nan());
        assert!(Storage::Bf16.from_bits(Storage::Bf16.to_bits(f32::NAN)).is_nan());
    }

    fn variants(op: &dyn OpContract) -> Vec<(Epilogue, Mask)> {
        op.epilogues()
            .iter()
            .flat_map(|&e| op.masks().iter().map(move |&m| (e, m)))
            .collect()
    }

    #[test]
    fn registry() {
        assert_eq!(
            op_names(),
            [
                "encoder",
                "layernorm",
                "matmul",
                "attention",
                "softmax",
                "gelu",
                "residual",
                "attention_decode",
                "kv_append",
                "argmax",
                "sample",
                "decode_step"
            ]
        );
        for name in op_names() {
            assert_eq!(op_by_name(name).unwrap().name(), name);
        }
        assert!(op_by_name("conv2d").is_none());
        assert_eq!(op_by_name("matmul").unwrap().dims(), ["M", "N", "K"]);
    }

    #[test]
    fn arguments_are_found_by_name() {
        assert_eq!(arg_index(&argmax::Argmax, "out_copy"), Some(1));
        assert_eq!(arg_index(&sample::Sample, "temperature"), Some(8));
        assert_eq!(tensor_arg_index(&sample::Sample, "temperature"), None, "not a tensor");
        assert_eq!(tensor_arg_index(&sample::Sample, "workspace"), None);
        assert_eq!(arg_index(&argmax::Argmax, "logit"), None, "whole names only");
    }

    #[test]
    fn args_match_readme_signatures() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/templates/README.md")).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        for &op in all_ops() {
            let (name, sig) = (op.name(), op.signature());
            assert!(
                readme.contains(&format!("| {name} | `{sig}` |")),
                "templates/README.md must list `{name}` as `{sig}`"
            );
            assert_eq!(
                tensor_arg_index(op, "out").is_some(),
                !["kv_append", "decode_step"].contains(&name),
                "{name}"
            );
            assert_eq!(tensor_arg_index(op, "workspace"), None, "{name}");
            if op.checked_end_to_end().is_some() {
                continue; // no stand-alone problem to compare the signature with
            }
            for (e, m) in variants(op) {
                let shape = &op.test_shapes(e, m)[1];
                let p = op.problem(shape, e, m, &mut rng).unwrap();
                let params: Vec<&str> = sig.split(", ").collect();
                assert_eq!(p.args.len(), params.len(), "{name}: arg count");
                for (param, arg) in params.iter().zip(&p.args) {
                    let pname = param.rsplit(' ').next().unwrap();
                    match (param.contains('*'), arg) {
                        (true, Arg::Workspace) => assert_eq!(pname, "workspace", "{name}"),
                        (true, &Arg::Tensor(i)) => {
                            let t = &p.tensors[i];
                            assert_eq!(t.name, pname, "{name}");
                            assert!(!t.data.is_empty(), "{name}.{pname} empty");
                            if param.starts_with("const ") {
                                assert_eq!(t.role, Role::Input, "{name}.{pname}");
                            } else {
                                assert_ne!(t.role, Role::Input, "{name}.{pname}");
                            }
                            match &t.data {
                                HostData::F32(_) => {
                                    assert!(param.contains("float*"), "{name}.{pname}")
                                }
                                HostData::I32(_) => {
                                    assert!(param.contains("int*"), "{name}.{pname}")
                                }
                            }
                        }
                        (false, &Arg::I32(v)) => {
                            assert!(param.starts_with("int "), "{name}.{pname}");
                            assert_eq!(p.shape[pname], v as i64, "{name}.{pname}");
                        }
                        (false, &Arg::F32(v)) => {
                            assert!(param.starts_with("float "), "{name}.{pname}");
                            let want = match pname {
                                "scale" => 1.0 / (p.shape["HS"] as f32).sqrt(),
                                "temperature" | "top_p" => p.shape[&format!("{pname}_milli")] as f32 / 1000.0,
                                _ => panic!("{name}: no rule for float argument {pname}"),
                            };
                            assert_eq!(v, want, "{name}.{pname}");
                        }
                        _ => panic!("{name}: {param} got {arg:?}"),
                    }
                }
                // Every tensor is an argument exactly once.
                let mut used: Vec<usize> = p
                    .args
                    .iter()
                    .filter_map(|a| if let Arg::Tensor(i) = a { Some(*i) } else { None })
                    .collect();
                used.sort();
                assert_eq!(used, (0..p.tensors.len()).collect::<Vec<_>>(), "{name}");
            }
        }
    }

    #[test]
    fn test_shapes_complete_and_references_sized() {
        let mut rng = StdRng::seed_from_u64(11);
        for &op in all_ops().iter().filter(|op| op.checked_end_to_end().is_none()) {
            for (e, m) in variants(op) {
                let shapes = op.test_shapes(e, m);
                assert!(shapes.len() >= 3, "{}", op.name());
                let awkward = shapes.iter().any(|s| op.dims().iter().any(|d| s[*d] % 4 != 0));
                assert!(awkward, "{}: needs a shape that is not a multiple of 4", op.name());
                for shape in shapes {
                    let mut again = shape.clone();
                    op.complete_shape(&mut again, e, m).unwrap();
                    assert_eq!(again, shape, "{} {e} {m}: test shape not complete", op.name());
                    let p = op.problem(&shape, e, m, &mut rng).unwrap();
                    assert_eq!(p.shape, shape);
                    let refs = op.reference(&p);
                    assert_eq!(refs.iter().map(|r| r.0).collect::<Vec<_>>(), p.outputs());
                    for (i, want) in refs {
                        assert_eq!(want.len(), p.tensors[i].data.len(), "{} {shape:?}", op.name());
                        assert!(want.iter().all(|x| x.is_finite()), "{} {shape:?}", op.name());
                    }
                }
            }
        }
    }

    #[test]
    fn tiny_shapes_covered() {
        // Every op verifies on a shape with T=1 (encoder, attention, qkv) or a first dim of 1.
        for &op in all_ops() {
            for (e, m) in variants(op) {
                let shapes = op.test_shapes(e, m);
                let tiny = |s: &Shape| s.get("T") == Some(&1) || s[op.dims()[0]] == 1;
                assert!(shapes.iter().any(tiny), "{} {e}: no tiny shape", op.name());
            }
        }
    }

    #[test]
    fn different_seeds_different_inputs() {
        for &op in all_ops().iter().filter(|op| op.checked_end_to_end().is_none()) {
            for (e, m) in variants(op) {
                let shape = op.test_shapes(e, m).pop().unwrap();
                let a = op.problem(&shape, e, m, &mut StdRng::seed_from_u64(1)).unwrap();
                let b = op.problem(&shape, e, m, &mut StdRng::seed_from_u64(2)).unwrap();
                let a2 = op.problem(&shape, e, m, &mut StdRng::seed_from_u64(1)).unwrap();
                for ((ta, tb), ta2) in a.tensors.iter().zip(&b.tensors).zip(&a2.tensors) {
                    if ta.role == Role::Input && ta.data.len() > 1 {
                        // Bit patterns, so that a planted NaN equals itself.
                        let bits = |d: &HostData| match d {
                            HostData::F32(v) => v.iter().map(|x| x.to_bits() as i64).collect::<Vec<_>>(),
                            HostData::I32(v) => v.iter().map(|&x| x as i64).collect(),
                        };
                        assert_ne!(bits(&ta.data), bits(&tb.data), "{} {}", op.name(), ta.name);
                        assert_eq!(bits(&ta.data), bits(&ta2.data), "{} {}: same seed", op.name(), ta.name);
                        if let HostData::F32(v) = &ta.data {
                            // argmax and sample plant a NaN in row 2 on purpose: the answer there is -1.
                            let nans = v.iter().filter(|x| x.is_nan()).count();
                            let allowed = usize::from(["argmax", "sample"].contains(&op.name()));
                            assert!(nans <= allowed && v.iter().all(|x| x.is_finite() || x.is_nan()));
                            assert!(v.iter().any(|&x| x != 0.0), "{} {} all zero", op.name(), ta.name);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn complete_shape_errors() {
        for &op in all_ops() {
            let mut empty = Shape::new();
            let (e, m) = variants(op)[0];
            let err = op.complete_shape(&mut empty, e, m).unwrap_err().to_string();
            assert!(err.starts_with(op.name()) && err.contains(op.dims()[0]), "{err}");
            if op.name() != "matmul" {
                let mut s = op.test_shapes(e, m)[0].clone();
                let err = op.complete_shape(&mut s, Epilogue::Qkv, m).unwrap_err().to_string();
                assert!(err.contains("epilogue `qkv` is not supported"), "{err}");
            }
            let mut s = op.test_shapes(e, m)[0].clone();
            s.insert(op.dims()[0].to_string(), 0);
            assert!(op.complete_shape(&mut s, e, m).is_err(), "{}", op.name());
        }
        let ln = op_by_name("layernorm").unwrap();
        let mut s = shape_of(&[("N", 1 << 20), ("C", 1 << 12)]);
        let err = ln
            .complete_shape(&mut s, Epilogue::None, Mask::None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("32-bit"), "{err}");
        let mm = op_by_name("matmul").unwrap();
        let err = mm.problem(
            &shape_of(&[("M", 4)]),
            Epilogue::Bias,
            Mask::None,
            &mut StdRng::seed_from_u64(0),
        );
        assert!(err.unwrap_err().to_string().contains("N is missing"));
    }

    #[test]
    fn error_messages_name_op_and_fix() {
        let mm = op_by_name("matmul").unwrap();
        let mut s = shape_of(&[("M", 10), ("N", 100), ("K", 8), ("T", 5), ("n_head", 2)]);
        let e = mm.complete_shape(&mut s, Epilogue::Qkv, Mask::None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "matmul: qkv epilogue needs N divisible by 3*n_head (N=100, n_head=2)"
        );
        let sm = op_by_name("softmax").unwrap();
        let mut s = shape_of(&[("N", 3), ("C", 4)]);
        let e = sm
            .complete_shape(&mut s, Epilogue::None, Mask::Causal)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "softmax: mask `causal` is not supported (supported: none)");
    }
}
