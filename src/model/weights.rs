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
//! Writers are atomic (temporary file in the same folder, then rename).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, View};
use safetensors::SafeTensors;

use super::config::GPT2Config;
use super::error::{ModelError, Result};

/// llm.c checkpoint magic number (`header[0]`).
pub const LLMC_MAGIC: i32 = 20240326;
/// llm.c header length in i32 words.
pub const LLMC_HEADER_INTS: usize = 256;

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

/// Transpose a row-major `[rows, cols]` matrix into `[cols, rows]`.
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    debug_assert_eq!(src.len(), rows * cols);
    let mut out = vec![0.0f32; src.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = src[r * cols + c];
        }
    }
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
        return load_hf_files(&cfg, &[path.to_path_buf()], dir);
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

// ---------------------------------------------------------------------------------------------
// Hugging Face safetensors
// ---------------------------------------------------------------------------------------------

/// Load a Hugging Face GPT-2 folder: `config.json` and `model.safetensors`, or the shards listed
/// in `model.safetensors.index.json`.
pub fn load_hf_folder(dir: &Path) -> Result<GPT2Model> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        return Err(ModelError::NotAModel {
            path: dir.to_path_buf(),
            message: "no config.json: not a Hugging Face model folder".into(),
        });
    }
    let cfg = GPT2Config::from_hf_json(&cfg_path)?;
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files = if single.is_file() {
        vec![single]
    } else if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: index.clone(),
            source: e,
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::NotAModel {
                path: index.clone(),
                message: "no `weight_map` object".into(),
            })?;
        let mut names: Vec<&str> = map.values().filter_map(|x| x.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        return Err(ModelError::NotAModel {
            path: dir.to_path_buf(),
            message: "no model.safetensors (nor model.safetensors.index.json); pytorch_model.bin is not \
                      supported, re-save with safe_serialization=True"
                .into(),
        });
    };
    load_hf_files(&cfg, &files, dir)
}

fn load_hf_files(cfg: &GPT2Config, files: &[PathBuf], dir: &Path) -> Result<GPT2Model> {
    let mut maps = Vec::with_capacity(files.len());
    for p in files {
        let f = File::open(p).map_err(|e| ModelError::io(p, e))?;
        // SAFETY: the file is opened read-only and we only read through the map; a concurrent
        // writer truncating the file would be a misuse outside this program's control.
        let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ModelError::io(p, e))?;
        maps.push((p.clone(), m));
    }
    let mut parsed = Vec::with_capacity(maps.len());
    for (p, m) in &maps {
        let st = SafeTensors::deserialize(m).map_err(|e| ModelError::Safetensors {
            path: p.clone(),
            message: e.to_string(),
        })?;
        parsed.push((p.as_path(), st));
    }
    let first = files.first().cloned().unwrap_or_else(|| dir.join("model.safetensors"));
    let reader = HfReader {
        files: &parsed,
        display: if files.len() == 1 {
            first
        } else {
            dir.join("model.safetensors.index.json")
        },
    };

    let c = cfg.n_embd;
    let mut w = GPT2Weights {
        wte: reader.get("wte.weight", &[cfg.vocab_size, c], false)?,
        wpe: reader.get("wpe.weight", &[cfg.n_ctx, c], false)?,
        layers: Vec::with_capacity(cfg.n_layer),
        lnf_w: reader.get("ln_f.weight", &[c], false)?,
        lnf_b: reader.get("ln_f.bias", &[c], false)?,
    };
    for i in 0..cfg.n_layer {
        let h = |s: &str| format!("h.{i}.{s}");
        // Conv1D weights are stored [in, out]: `get(.., true)` transposes them to [out, in].
        w.layers.push(LayerWeights {
            ln1_w: reader.get(&h("ln_1.weight"), &[c], false)?,
            ln1_b: reader.get(&h("ln_1.bias"), &[c], false)?,
            qkv_w: reader.get(&h("attn.c_attn.weight"), &[c, 3 * c], true)?,
            qkv_b: reader.get(&h("attn.c_attn.bias"), &[3 * c], false)?,
            attn_proj_w: reader.get(&h("attn.c_proj.weight"), &[c, c], true)?,
            attn_proj_b: reader.get(&h("attn.c_proj.bias"), &[c], false)?,
            ln2_w: reader.get(&h("ln_2.weight"), &[c], false)?,
            ln2_b: reader.get(&h("ln_2.bias"), &[c], false)?,
            fc_w: reader.get(&h("mlp.c_fc.weight"), &[c, 4 * c], true)?,
            fc_b: reader.get(&h("mlp.c_fc.bias"), &[4 * c], false)?,
            fc_proj_w: reader.get(&h("mlp.c_proj.weight"), &[4 * c, c], true)?,
            fc_proj_b: reader.get(&h("mlp.c_proj.bias"), &[c], false)?,
        });
    }
    w.validate(cfg)?;
    let dtype = parsed
        .first()
        .and_then(|(_, st)| st.iter().next().map(|(_, v)| format!("{:?}", v.dtype()).to_lowercase()))
        .unwrap_or_else(|| "?".into());
    Ok(GPT2Model {
        config: cfg.clone(),
        weights: w,
        source: format!("Hugging Face folder ({dtype}) {}", dir.display()),
    })
}

struct HfReader<'a, 'd> {
    files: &'a [(&'a Path, SafeTensors<'d>)],
    display: PathBuf,
}

impl HfReader<'_, '_> {
    /// Read tensor `name` (or `transformer.{name}`), check its shape `[r, c]` / `[n]`, convert to
    /// f32, and transpose `[in, out]` → `[out, in]` when `conv1d` is set.
    fn get(&self, name: &str, shape: &[usize], conv1d: bool) -> Result<Vec<f32>> {
        let prefixed = format!("transformer.{name}");
        for (path, st) in self.files {
            for candidate in [name, prefixed.as_str()] {
                let Ok(view) = st.tensor(candidate) else {
                    continue;
                };
                if view.shape() != shape {
                    return Err(ModelError::TensorShape {
                        path: path.to_path_buf(),
                        tensor: candidate.to_string(),
                        expected: shape.to_vec(),
                        found: view.shape().to_vec(),
                    });
                }
                let data = bytes_to_f32(view.data(), view.dtype()).ok_or_else(|| ModelError::TensorDtype {
                    path: path.to_path_buf(),
                    tensor: candidate.to_string(),
                    dtype: format!("{:?}", view.dtype()),
                })?;
                return Ok(if conv1d {
                    transpose(&data, shape[0], shape[1])
                } else {
                    data
                });
            }
        }
        Err(ModelError::MissingTensor {
            path: self.display.clone(),
            tensor: name.to_string(),
        })
    }
}

fn bytes_to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Storage dtype of a written Hugging Face checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfDtype {
    F32,
    F16,
    BF16,
}

/// Options of [`write_hf_folder_with`].
#[derive(Clone, Copy, Debug)]
pub struct HfWriteOptions {
    pub dtype: HfDtype,
    /// Prefix names with `transformer.` as `GPT2LMHeadModel.save_pretrained` does (true), or
    /// write bare `h.0...` names as the hub's original `gpt2` checkpoint has them (false).
    pub transformer_prefix: bool,
    /// Also write the `h.{i}.attn.bias` causal-mask buffer older transformers versions saved
    /// (the loader must ignore it).
    pub attn_bias_buffer: bool,
}

impl Default for HfWriteOptions {
    fn default() -> Self {
        HfWriteOptions {
            dtype: HfDtype::F32,
            transformer_prefix: true,
            attn_bias_buffer: false,
        }
    }
}

struct OwnedTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn encode_tensor(data: &[f32], shape: Vec<usize>, dtype: HfDtype) -> OwnedTensor {
    let (dt, bytes) = match dtype {
        HfDtype::F32 => (Dtype::F32, data.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HfDtype::F16 => (
            Dtype::F16,
            data.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        ),
        HfDtype::BF16 => (
            Dtype::BF16,
            data.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        ),
    };
    OwnedTensor {
        dtype: dt,
        shape,
        data: bytes,
    }
}

/// Write a Hugging Face folder (`config.json` + f32 `model.safetensors`, `transformer.` names,
/// Conv1D `[in, out]` weights) as `save_pretrained` would. Creates `dir` if needed.
pub fn write_hf_folder(dir: &Path, cfg: &GPT2Config, weights: &GPT2Weights) -> Result<()> {
    write_hf_folder_with(dir, cfg, weights, &HfWriteOptions::default())
}

/// [`write_hf_folder`] with a choice of dtype and naming.
pub fn write_hf_folder_with(dir: &Path, cfg: &GPT2Config, weights: &GPT2Weights, opts: &HfWriteOptions) -> Result<()> {
    cfg.validate("write_hf_folder")?;
    weights.validate(cfg)?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let c = cfg.n_embd;
    let p = if opts.transformer_prefix { "transformer." } else { "" };
    let mut tensors: BTreeMap<String, OwnedTensor> = BTreeMap::new();
    let mut put = |name: String, data: &[f32], shape: Vec<usize>| {
        tensors.insert(format!("{p}{name}"), encode_tensor(data, shape, opts.dtype));
    };
    put("wte.weight".into(), &weights.wte, vec![cfg.vocab_size, c]);
    put("wpe.weight".into(), &weights.wpe, vec![cfg.n_ctx, c]);
    for (i, l) in weights.layers.iter().enumerate() {
        let h = |s: &str| format!("h.{i}.{s}");
        put(h("ln_1.weight"), &l.ln1_w, vec![c]);
        put(h("ln_1.bias"), &l.ln1_b, vec![c]);
        // Back to Conv1D's [in, out] layout.
        put(h("attn.c_attn.weight"), &transpose(&l.qkv_w, 3 * c, c), vec![c, 3 * c]);
        put(h("attn.c_attn.bias"), &l.qkv_b, vec![3 * c]);
        put(h("attn.c_proj.weight"), &transpose(&l.attn_proj_w, c, c), vec![c, c]);
        put(h("attn.c_proj.bias"), &l.attn_proj_b, vec![c]);
        put(h("ln_2.weight"), &l.ln2_w, vec![c]);
        put(h("ln_2.bias"), &l.ln2_b, vec![c]);
        put(h("mlp.c_fc.weight"), &transpose(&l.fc_w, 4 * c, c), vec![c, 4 * c]);
        put(h("mlp.c_fc.bias"), &l.fc_b, vec![4 * c]);
        put(
            h("mlp.c_proj.weight"),
            &transpose(&l.fc_proj_w, c, 4 * c),
            vec![4 * c, c],
        );
        put(h("mlp.c_proj.bias"), &l.fc_proj_b, vec![c]);
        if opts.attn_bias_buffer {
            let t = cfg.n_ctx;
            let mask: Vec<f32> = (0..t * t).map(|k| if k % t <= k / t { 1.0 } else { 0.0 }).collect();
            put(h("attn.bias"), &mask, vec![1, 1, t, t]);
        }
    }
    put("ln_f.weight".into(), &weights.lnf_w, vec![c]);
    put("ln_f.bias".into(), &weights.lnf_b, vec![c]);

    let cfg_path = dir.join("config.json");
    let mut cfg_json = cfg.to_hf_json();
    cfg_json["torch_dtype"] = match opts.dtype {
        HfDtype::F32 => "float32",
        HfDtype::F16 => "float16",
        HfDtype::BF16 => "bfloat16",
    }
    .into();
    let text = serde_json::to_string_pretty(&cfg_json).expect("a json Value always serializes");
    atomic_write(&cfg_path, |w| w.write_all(text.as_bytes()))?;

    let st_path = dir.join("model.safetensors");
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(tensors.iter().map(|(k, v)| (k.clone(), v)), Some(metadata)).map_err(|e| {
        ModelError::Safetensors {
            path: st_path.clone(),
            message: format!("serializing failed: {e}"),
        }
    })?;
    atomic_write(&st_path, |w| w.write_all(&bytes))
}

// ---------------------------------------------------------------------------------------------
// llm.c checkpoints
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Atomic writes
// ---------------------------------------------------------------------------------------------

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
