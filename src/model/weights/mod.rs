//! GPT-2 weights in one canonical f32 layout, and loaders/writers for the two checkpoint formats.
//!
//! Canonical layout (row-major, PyTorch `Linear` convention `W[out, in]`, the layout every
//! kernel and the CPU reference use):
//! `wte [V, C]` (real vocabulary, no padding rows), `wpe [maxT, C]`, per layer
//! `ln1_w/ln1_b [C]`, `qkv_w [3C, C]`, `qkv_b [3C]`, `attn_proj_w [C, C]`, `attn_proj_b [C]`,
//! `ln2_w/ln2_b [C]`, `fc_w [4C, C]`, `fc_b [4C]`, `fc_proj_w [C, 4C]`, `fc_proj_b [C]`, and
//! `lnf_w/lnf_b [C]`. The LM head is tied to `wte`.
//!
//! Formats:
//! - Hugging Face folder: `config.json` + `model.safetensors` (or sharded
//!   `model.safetensors.index.json`), tensor names like `h.0.attn.c_attn.weight`, optionally
//!   prefixed `transformer.`; f32, f16 or bf16. HF GPT-2 uses `Conv1D`, which stores weights
//!   `[in, out]`: they are transposed to `[out, in]` once, here, at load time (and back at write
//!   time). `attn.bias` / `attn.masked_bias` buffers and `lm_head.weight` are ignored.
//! - llm.c checkpoint: a 256 x i32 header (magic 20240326, version 3 = f32 / 5 = bf16, then
//!   maxT, V, L, NH, C, Vp) followed by all parameters in llm.c order, `wte` padded to Vp rows.
//!
//! Writers are atomic (temporary file in the same folder, then rename). The Hugging Face format
//! lives in `hf.rs`, llm.c's in `llmc.rs`; this file holds the layout, random weights, the
//! format detection and the atomic write.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::GPT2Config;
use super::error::{ModelError, Result};

mod hf;
mod llmc;

pub use hf::{load_hf_folder, write_hf_folder, write_hf_folder_with, HfDtype, HfWriteOptions};
pub use llmc::{llmc_tensor_shapes, load_llmc, write_llmc, LlmcVersion, LLMC_HEADER_INTS, LLMC_MAGIC};

/// Parameters of one transformer block, canonical layout (see the module docs).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct LayerWeights {
    pub ln1_w: Vec<f32>,
    pub ln1_b: Vec<f32>,
    pub qkv_w: Vec<f32>,
    pub qkv_b: Vec<f32>,
    pub attn_proj_w: Vec<f32>,
    pub attn_proj_b: Vec<f32>,
    pub ln2_w: Vec<f32>,
    pub ln2_b: Vec<f32>,
    pub fc_w: Vec<f32>,
    pub fc_b: Vec<f32>,
    pub fc_proj_w: Vec<f32>,
    pub fc_proj_b: Vec<f32>,
}

/// Names of the per-layer tensors in canonical (and llm.c) order.
pub const LAYER_TENSOR_NAMES: [&str; 12] = [
    "ln1_w",
    "ln1_b",
    "qkv_w",
    "qkv_b",
    "attn_proj_w",
    "attn_proj_b",
    "ln2_w",
    "ln2_b",
    "fc_w",
    "fc_b",
    "fc_proj_w",
    "fc_proj_b",
];

impl LayerWeights {
    /// Canonical shapes, in [`LAYER_TENSOR_NAMES`] order.
    pub fn shapes(cfg: &GPT2Config) -> [Vec<usize>; 12] {
        let c = cfg.n_embd;
        [
            vec![c],
            vec![c],
            vec![3 * c, c],
            vec![3 * c],
            vec![c, c],
            vec![c],
            vec![c],
            vec![c],
            vec![4 * c, c],
            vec![4 * c],
            vec![c, 4 * c],
            vec![c],
        ]
    }

    /// The tensors, in [`LAYER_TENSOR_NAMES`] order.
    pub fn tensors(&self) -> [&Vec<f32>; 12] {
        [
            &self.ln1_w,
            &self.ln1_b,
            &self.qkv_w,
            &self.qkv_b,
            &self.attn_proj_w,
            &self.attn_proj_b,
            &self.ln2_w,
            &self.ln2_b,
            &self.fc_w,
            &self.fc_b,
            &self.fc_proj_w,
            &self.fc_proj_b,
        ]
    }

    /// Mutable tensors, in [`LAYER_TENSOR_NAMES`] order.
    pub fn tensors_mut(&mut self) -> [&mut Vec<f32>; 12] {
        [
            &mut self.ln1_w,
            &mut self.ln1_b,
            &mut self.qkv_w,
            &mut self.qkv_b,
            &mut self.attn_proj_w,
            &mut self.attn_proj_b,
            &mut self.ln2_w,
            &mut self.ln2_b,
            &mut self.fc_w,
            &mut self.fc_b,
            &mut self.fc_proj_w,
            &mut self.fc_proj_b,
        ]
    }
}

/// All GPT-2 parameters in the canonical f32 layout.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct GPT2Weights {
    /// Token embeddings `[V, C]` (real vocabulary); also the tied LM head.
    pub wte: Vec<f32>,
    /// Position embeddings `[maxT, C]`.
    pub wpe: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    pub lnf_w: Vec<f32>,
    pub lnf_b: Vec<f32>,
}

impl GPT2Weights {
    /// All-zero weights of the right shapes.
    pub fn zeros(cfg: &GPT2Config) -> Self {
        let mut w = GPT2Weights {
            wte: vec![0.0; cfg.vocab_size * cfg.n_embd],
            wpe: vec![0.0; cfg.n_ctx * cfg.n_embd],
            layers: Vec::with_capacity(cfg.n_layer),
            lnf_w: vec![0.0; cfg.n_embd],
            lnf_b: vec![0.0; cfg.n_embd],
        };
        let shapes = LayerWeights::shapes(cfg);
        for _ in 0..cfg.n_layer {
            let mut l = LayerWeights::default();
            for (t, s) in l.tensors_mut().into_iter().zip(shapes.iter()) {
                *t = vec![0.0; s.iter().product()];
            }
            w.layers.push(l);
        }
        w
    }

    /// Random weights for tests and parity checks: matrices and embeddings uniform in
    /// ±0.1 (±0.02 for the two projections back into the residual stream), biases ±0.05,
    /// layernorm gains 1 ± 0.2 and shifts ±0.1: no parameter is a trivial 0 or 1.
    pub fn random(cfg: &GPT2Config, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut fill = |v: &mut Vec<f32>, center: f32, scale: f32| {
            for x in v.iter_mut() {
                *x = center + scale * rng.random_range(-1.0f32..1.0);
            }
        };
        let mut w = Self::zeros(cfg);
        fill(&mut w.wte, 0.0, 0.1);
        fill(&mut w.wpe, 0.0, 0.05);
        for l in &mut w.layers {
            fill(&mut l.ln1_w, 1.0, 0.2);
            fill(&mut l.ln1_b, 0.0, 0.1);
            fill(&mut l.qkv_w, 0.0, 0.1);
            fill(&mut l.qkv_b, 0.0, 0.05);
            fill(&mut l.attn_proj_w, 0.0, 0.02 * 3.0);
            fill(&mut l.attn_proj_b, 0.0, 0.05);
            fill(&mut l.ln2_w, 1.0, 0.2);
            fill(&mut l.ln2_b, 0.0, 0.1);
            fill(&mut l.fc_w, 0.0, 0.1);
            fill(&mut l.fc_b, 0.0, 0.05);
            fill(&mut l.fc_proj_w, 0.0, 0.02 * 3.0);
            fill(&mut l.fc_proj_b, 0.0, 0.05);
        }
        fill(&mut w.lnf_w, 1.0, 0.2);
        fill(&mut w.lnf_b, 0.0, 0.1);
        w
    }

    /// Every tensor with its canonical name (`wte`, `wpe`, `h.{i}.qkv_w`, ..., `lnf_b`) and shape.
    pub fn named_tensors(&self, cfg: &GPT2Config) -> Vec<(String, Vec<usize>, &[f32])> {
        let c = cfg.n_embd;
        let mut out: Vec<(String, Vec<usize>, &[f32])> = vec![
            ("wte".into(), vec![cfg.vocab_size, c], &self.wte),
            ("wpe".into(), vec![cfg.n_ctx, c], &self.wpe),
        ];
        let shapes = LayerWeights::shapes(cfg);
        for (i, l) in self.layers.iter().enumerate() {
            for ((name, shape), t) in LAYER_TENSOR_NAMES.iter().zip(shapes.iter()).zip(l.tensors()) {
                out.push((format!("h.{i}.{name}"), shape.clone(), t));
            }
        }
        out.push(("lnf_w".into(), vec![c], &self.lnf_w));
        out.push(("lnf_b".into(), vec![c], &self.lnf_b));
        out
    }

    /// Check every tensor has the length `cfg` implies; the error names the tensor.
    pub fn validate(&self, cfg: &GPT2Config) -> Result<()> {
        if self.layers.len() != cfg.n_layer {
            return Err(ModelError::WeightLen {
                tensor: "layers".into(),
                shape: vec![cfg.n_layer],
                expected: cfg.n_layer,
                found: self.layers.len(),
            });
        }
        for (name, shape, t) in self.named_tensors(cfg) {
            let expected: usize = shape.iter().product();
            if t.len() != expected {
                return Err(ModelError::WeightLen {
                    tensor: name,
                    shape,
                    expected,
                    found: t.len(),
                });
            }
        }
        Ok(())
    }

    /// `wte` padded with zero rows to `[Vp, C]` (the LM head's N = `padded_vocab_size`).
    pub fn wte_padded(&self, cfg: &GPT2Config) -> Vec<f32> {
        let mut v = self.wte.clone();
        v.resize(cfg.padded_vocab_size * cfg.n_embd, 0.0);
        v
    }
}

/// A loaded model: its shape and its weights, plus a note of where it came from.
#[derive(Clone, Debug)]
pub struct GPT2Model {
    pub config: GPT2Config,
    pub weights: GPT2Weights,
    /// Human-readable source, e.g. `llm.c v3 (f32) gpt2_124M.bin`.
    pub source: String,
}

/// Transpose a row-major `[rows, cols]` matrix into `[cols, rows]`: bands of output rows in
/// parallel, each filled tile by tile, so that both the reads (along a source row) and the
/// writes (along an output row) stay within a few cache lines per row of the tile. (Element by
/// element down the source's columns, GPT-2 124M's Conv1D weights took 0.35 s of a 0.65 s load.)
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const TILE: usize = 32;
    debug_assert_eq!(src.len(), rows * cols);
    let mut out = vec![0.0f32; src.len()];
    if rows == 0 || cols == 0 {
        return out;
    }
    // A band: TILE output rows (source columns c0 .. c0 + TILE), all `rows` long.
    out.par_chunks_mut(TILE * rows).enumerate().for_each(|(band, block)| {
        let c0 = band * TILE;
        let width = block.len() / rows;
        for r0 in (0..rows).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                let source = &src[r * cols + c0..r * cols + c0 + width];
                for (c, &x) in source.iter().enumerate() {
                    block[c * rows + r] = x;
                }
            }
        }
    });
    out
}

// ---------------------------------------------------------------------------------------------
// Format detection
// ---------------------------------------------------------------------------------------------

/// Load a model: a directory is a Hugging Face folder; a `*.safetensors` file is read with the
/// `config.json` beside it; any other file must be an llm.c checkpoint (checked by its magic).
pub fn load_model(path: &Path) -> Result<GPT2Model> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if meta.is_dir() {
        return load_hf_folder(path);
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let cfg = GPT2Config::from_hf_json(&dir.join("config.json"))?;
        return hf::load_hf_files(&cfg, &[path.to_path_buf()], dir);
    }
    let mut magic = [0u8; 4];
    let mut f = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let n = read_up_to(&mut f, &mut magic).map_err(|e| ModelError::io(path, e))?;
    if n == 4 && i32::from_le_bytes(magic) == LLMC_MAGIC {
        return load_llmc(path);
    }
    Err(ModelError::NotAModel {
        path: path.to_path_buf(),
        message: "neither a Hugging Face GPT-2 folder (config.json + model.safetensors) nor an llm.c \
                  checkpoint (magic 20240326)"
            .into(),
    })
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read(&mut buf[n..])?;
        if k == 0 {
            break;
        }
        n += k;
    }
    Ok(n)
}

// Atomic writes

fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Write `path` atomically: fill a temporary file beside it, sync, then rename over `path`.
pub fn atomic_write(path: &Path, fill: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) -> Result<()> {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    }
    let tmp = temp_path(path);
    let result = (|| -> std::io::Result<()> {
        let mut w = BufWriter::new(File::create(&tmp)?);
        fill(&mut w)?;
        w.flush()?;
        w.get_ref().sync_all()?;
        drop(w);
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::io(path, e)
    })
}

#[cfg(test)]
mod tests {
    use super::transpose;

    /// Against the definition, on shapes that are not multiples of the tile (and degenerate ones).
    #[test]
    fn transpose_matches_the_definition_on_awkward_shapes() {
        for (rows, cols) in [(37, 70), (1, 5), (5, 1), (64, 33), (33, 64), (96, 300), (0, 4)] {
            let src: Vec<f32> = (0..rows * cols).map(|i| (i as f32).sin() * 1e3 + i as f32).collect();
            let out = transpose(&src, rows, cols);
            assert_eq!(out.len(), src.len());
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        out[c * rows + r].to_bits(),
                        src[r * cols + c].to_bits(),
                        "{rows}x{cols} at ({r}, {c})"
                    );
                }
            }
        }
    }
}
