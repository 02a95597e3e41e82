//! The one error type of the model module. Every variant names what is at fault: the file, the
//! tensor, the expected and found shapes, the token id, the context length.

use std::path::PathBuf;

/// Result alias for the model module.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Errors of loading, tokenizing, running and sampling a GPT-2 model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid GPT-2 config ({context}): {message}")]
    Config { context: String, message: String },
    #[error("{}: not a valid safetensors file: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    #[error("{}: tensor `{tensor}` is missing", path.display())]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{}: tensor `{tensor}` has shape {found:?}, expected {expected:?}", path.display())]
    TensorShape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{}: tensor `{tensor}` has dtype {dtype}; only F32, F16 and BF16 are supported", path.display())]
    TensorDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{}: not an llm.c GPT-2 checkpoint (magic {found}, expected 20240326)", path.display())]
    BadMagic { path: PathBuf, found: i64 },
    #[error("{}: unsupported llm.c checkpoint version {version} (3 = f32, 5 = bf16)", path.display())]
    BadVersion { path: PathBuf, version: i32 },
    #[error("{}: bad llm.c header: {message}", path.display())]
    BadHeader { path: PathBuf, message: String },
    #[error(
        "{}: file is truncated: tensor `{tensor}` {shape:?} needs bytes {start}..{end} but the file has {file_len} bytes",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        shape: Vec<usize>,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("{}: {extra} unexpected bytes after the last tensor (file has {file_len} bytes, expected {expected})", path.display())]
    TrailingBytes {
        path: PathBuf,
        extra: u64,
        file_len: u64,
        expected: u64,
    },
    #[error("weights: tensor `{tensor}` has {found} elements, expected {expected} (shape {shape:?})")]
    WeightLen {
        tensor: String,
        shape: Vec<usize>,
        expected: usize,
        found: usize,
    },
    #[error("{}: {message}", path.display())]
    NotAModel { path: PathBuf, message: String },
    #[error("token id {token} at position {position} is out of range (vocabulary has {vocab_size} tokens)")]
    InvalidToken {
        token: u32,
        position: usize,
        vocab_size: usize,
    },
    #[error("cannot decode token id {token}: not in the GPT-2 vocabulary (ids are 0..={max})")]
    DecodeToken { token: u32, max: u32 },
    #[error("sequence would be {needed} tokens long but the model's context length is {n_ctx}")]
    ContextOverflow { needed: usize, n_ctx: usize },
    #[error("batch shape error: {0}")]
    Batch(String),
    #[error("sampling: {0}")]
    Sampling(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{backend} backend: {message}")]
    Backend { backend: String, message: String },
}

impl ModelError {
    /// Wrap an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
