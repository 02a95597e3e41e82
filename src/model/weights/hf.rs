//! Hugging Face GPT-2 folders: `config.json` with `model.safetensors` (or the shards of
//! `model.safetensors.index.json`), read in f32, f16 or bf16 and written in any of them. HF's
//! `Conv1D` weights are `[in, out]`: transposed to the canonical `[out, in]` here.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, View};
use safetensors::SafeTensors;

use super::{atomic_write, transpose, GPT2Model, GPT2Weights, LayerWeights};
use crate::model::config::GPT2Config;
use crate::model::error::{ModelError, Result};

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

pub(super) fn load_hf_files(cfg: &GPT2Config, files: &[PathBuf], dir: &Path) -> Result<GPT2Model> {
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

/// Reads one little-endian element as f32.
type ElementReader = fn(&[u8]) -> f32;

/// One little-endian element of `dtype` as f32, and its width in bytes (f32, f16, bf16 only).
fn element_reader(dtype: Dtype) -> Option<(usize, ElementReader)> {
    Some(match dtype {
        Dtype::F32 => (4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F16 => (2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::BF16 => (2, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => return None,
    })
}

/// A tensor's little-endian bytes as f32 (f32, f16 or bf16; `None` for another dtype), in
/// parallel pieces (the first touch of a mapped checkpoint's pages is much of a load's time).
pub(super) fn bytes_to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 16; // elements per parallel piece
    let (width, read) = element_reader(dtype)?;
    let mut out = vec![0.0f32; bytes.len() / width];
    out.par_chunks_mut(PIECE)
        .zip(bytes.par_chunks(PIECE * width))
        .for_each(|(out, bytes)| {
            out.iter_mut()
                .zip(bytes.chunks_exact(width))
                .for_each(|(o, b)| *o = read(b))
        });
    Some(out)
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
