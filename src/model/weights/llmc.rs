//! llm.c checkpoints: a 256 x i32 header (magic, version 3 = f32 / 5 = bf16, then maxT, V, L,
//! NH, C, Vp) followed by every parameter in llm.c's order, `wte` padded to Vp rows.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use half::bf16;
use safetensors::tensor::Dtype;

use super::hf::bytes_to_f32;
use super::{atomic_write, GPT2Model, GPT2Weights, LayerWeights, LAYER_TENSOR_NAMES};
use crate::model::config::GPT2Config;
use crate::model::error::{ModelError, Result};

/// llm.c checkpoint magic number (`header[0]`).
pub const LLMC_MAGIC: i32 = 20240326;
/// llm.c header length in i32 words.
pub const LLMC_HEADER_INTS: usize = 256;

/// llm.c checkpoint versions: 3 stores f32 parameters, 5 stores bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlmcVersion {
    F32 = 3,
    Bf16 = 5,
}

impl LlmcVersion {
    /// From the header's version word.
    pub fn from_i32(v: i32) -> Option<Self> {
        match v {
            3 => Some(LlmcVersion::F32),
            5 => Some(LlmcVersion::Bf16),
            _ => None,
        }
    }
    fn bytes_per_param(self) -> u64 {
        match self {
            LlmcVersion::F32 => 4,
            LlmcVersion::Bf16 => 2,
        }
    }
}

/// The llm.c parameter tensors in file order with their shapes.
pub fn llmc_tensor_shapes(cfg: &GPT2Config) -> Vec<(&'static str, Vec<usize>)> {
    let (c, l) = (cfg.n_embd, cfg.n_layer);
    vec![
        ("wte", vec![cfg.padded_vocab_size, c]),
        ("wpe", vec![cfg.n_ctx, c]),
        ("ln1w", vec![l, c]),
        ("ln1b", vec![l, c]),
        ("qkvw", vec![l, 3 * c, c]),
        ("qkvb", vec![l, 3 * c]),
        ("attprojw", vec![l, c, c]),
        ("attprojb", vec![l, c]),
        ("ln2w", vec![l, c]),
        ("ln2b", vec![l, c]),
        ("fcw", vec![l, 4 * c, c]),
        ("fcb", vec![l, 4 * c]),
        ("fcprojw", vec![l, c, 4 * c]),
        ("fcprojb", vec![l, c]),
        ("lnfw", vec![c]),
        ("lnfb", vec![c]),
    ]
}

/// Load an llm.c checkpoint (version 3 f32 or 5 bf16). The file size must match the header
/// exactly; a truncated file names the first tensor that is cut short.
pub fn load_llmc(path: &Path) -> Result<GPT2Model> {
    let f = File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: read-only map of a file we just opened; see load_hf_files.
    let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ModelError::io(path, e))?;
    let bytes: &[u8] = &m;
    let header_bytes = LLMC_HEADER_INTS * 4;
    if bytes.len() < header_bytes {
        return Err(ModelError::BadHeader {
            path: path.to_path_buf(),
            message: format!(
                "file is {} bytes, shorter than the {header_bytes}-byte header",
                bytes.len()
            ),
        });
    }
    let h: Vec<i32> = bytes[..header_bytes]
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if h[0] != LLMC_MAGIC {
        return Err(ModelError::BadMagic {
            path: path.to_path_buf(),
            found: h[0] as i64,
        });
    }
    let version = LlmcVersion::from_i32(h[1]).ok_or(ModelError::BadVersion {
        path: path.to_path_buf(),
        version: h[1],
    })?;
    let field = |i: usize, name: &str| -> Result<usize> {
        if h[i] <= 0 {
            return Err(ModelError::BadHeader {
                path: path.to_path_buf(),
                message: format!("header[{i}] ({name}) = {}, must be positive", h[i]),
            });
        }
        Ok(h[i] as usize)
    };
    let cfg = GPT2Config {
        n_ctx: field(2, "maxT")?,
        vocab_size: field(3, "V")?,
        n_layer: field(4, "L")?,
        n_head: field(5, "NH")?,
        n_embd: field(6, "C")?,
        padded_vocab_size: field(7, "Vp")?,
    };
    cfg.validate(&path.display().to_string())?;

    let bpp = version.bytes_per_param();
    let shapes = llmc_tensor_shapes(&cfg);
    let file_len = bytes.len() as u64;
    let mut offset = header_bytes as u64;
    let mut ranges = Vec::with_capacity(shapes.len());
    for (name, shape) in &shapes {
        let n: u64 = shape.iter().map(|&d| d as u64).product();
        let end = offset + n * bpp;
        if end > file_len {
            return Err(ModelError::Truncated {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                shape: shape.clone(),
                start: offset,
                end,
                file_len,
            });
        }
        ranges.push((offset as usize, end as usize));
        offset = end;
    }
    if offset != file_len {
        return Err(ModelError::TrailingBytes {
            path: path.to_path_buf(),
            extra: file_len - offset,
            file_len,
            expected: offset,
        });
    }
    let dtype = match version {
        LlmcVersion::F32 => Dtype::F32,
        LlmcVersion::Bf16 => Dtype::BF16,
    };
    let mut t: Vec<Vec<f32>> = ranges
        .iter()
        .map(|&(a, b)| bytes_to_f32(&bytes[a..b], dtype).expect("f32/bf16 always convert"))
        .collect();

    let (c, l) = (cfg.n_embd, cfg.n_layer);
    let mut wte = std::mem::take(&mut t[0]);
    wte.truncate(cfg.vocab_size * c); // drop llm.c's padding rows
    let mut w = GPT2Weights {
        wte,
        wpe: std::mem::take(&mut t[1]),
        layers: Vec::with_capacity(l),
        lnf_w: std::mem::take(&mut t[14]),
        lnf_b: std::mem::take(&mut t[15]),
    };
    let per_layer = |k: usize, i: usize| -> Vec<f32> {
        let n = t[k].len() / l;
        t[k][i * n..(i + 1) * n].to_vec()
    };
    for i in 0..l {
        let mut lw = LayerWeights::default();
        for (j, dst) in lw.tensors_mut().into_iter().enumerate() {
            *dst = per_layer(2 + j, i);
        }
        w.layers.push(lw);
    }
    w.validate(&cfg)?;
    let vname = match version {
        LlmcVersion::F32 => "v3 f32",
        LlmcVersion::Bf16 => "v5 bf16",
    };
    Ok(GPT2Model {
        config: cfg,
        weights: w,
        source: format!("llm.c checkpoint ({vname}) {}", path.display()),
    })
}

/// Write an llm.c checkpoint (`version` 3 = f32, 5 = bf16), `wte` padded with zero rows to Vp.
pub fn write_llmc(path: &Path, cfg: &GPT2Config, weights: &GPT2Weights, version: LlmcVersion) -> Result<()> {
    cfg.validate("write_llmc")?;
    weights.validate(cfg)?;
    let mut header = [0i32; LLMC_HEADER_INTS];
    let dims = [
        cfg.n_ctx,
        cfg.vocab_size,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.padded_vocab_size,
    ];
    header[0] = LLMC_MAGIC;
    header[1] = version as i32;
    for (k, d) in dims.iter().enumerate() {
        header[2 + k] = i32::try_from(*d).map_err(|_| ModelError::Config {
            context: "write_llmc".into(),
            message: format!("dimension {d} does not fit the i32 header"),
        })?;
    }
    atomic_write(path, |out| {
        for x in header {
            out.write_all(&x.to_le_bytes())?;
        }
        let mut put = |data: &[f32]| -> std::io::Result<()> {
            let mut buf = Vec::with_capacity(data.len() * 4);
            match version {
                LlmcVersion::F32 => data.iter().for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
                LlmcVersion::Bf16 => data
                    .iter()
                    .for_each(|x| buf.extend_from_slice(&bf16::from_f32(*x).to_le_bytes())),
            }
            out.write_all(&buf)
        };
        put(&weights.wte_padded(cfg))?;
        put(&weights.wpe)?;
        for j in 0..LAYER_TENSOR_NAMES.len() {
            for l in &weights.layers {
                put(l.tensors()[j])?;
            }
        }
        put(&weights.lnf_w)?;
        put(&weights.lnf_b)
    })
}
