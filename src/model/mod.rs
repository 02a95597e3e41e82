//! GPT-2: configuration, checkpoint loading and writing (Hugging Face safetensors folders and
//! llm.c `.bin` checkpoints), the GPT-2 BPE tokenizer, the f32 CPU reference forward with a KV
//! cache, sampling, and the generation loop over a [`generate::Backend`]; [`gpu`] runs it on one
//! GPU and [`replicas`] on several; [`hub`] turns a size
//! name into a checkpoint folder (the Hugging Face cache, else a download); [`floor`] counts the
//! bytes a decode step must read and the FLOPs it must do, [`memory_fit`] whether a batch fits
//! in a device's memory, [`timeline_svg`] draws a megakernel step's blocks × time and
//! [`timeline_stats`] sizes where its time goes, per op.
//!
//! Everything here is the CPU side: the oracle GPU tests compare with, and the parts (weights,
//! tokenizer, sampling, generation loop) a GPU backend reuses. All fallible functions return
//! [`ModelError`], whose messages name the file, tensor or shape at fault ([`hub`] returns
//! [`HubError`], which names the model, the hub address and the cache folder).

pub mod config;
pub mod cpu;
pub mod engine;
pub mod error;
pub mod floor;
pub mod generate;
pub mod gpu;
pub mod hub;
pub mod memory_fit;
pub mod npy;
pub mod replicas;
pub mod sampling;
pub mod timeline_stats;
pub mod timeline_svg;
pub mod tokenizer;
pub mod weights;

pub use config::GPT2Config;
pub use cpu::{CpuBackend, KvCache};
pub use engine::{DecodeEngine, TaskStamp, Timeline};
pub use error::{ModelError, Result};
pub use floor::{decode_step_bytes, decode_step_flops, DecodeBytes, DecodeFlops};
pub use generate::{generate, Backend, Draw, GenerateOptions, GenerateOutput, GenerateStats, Logits, StopReason};
pub use gpu::GpuBackend;
pub use hub::{HubError, HubSettings};
pub use replicas::{ReplicaOptions, Replicas};
pub use sampling::{DrawKey, SamplingParams};
pub use timeline_svg::render_timeline_svg;
pub use tokenizer::{Tokenizer, EOT_TOKEN, GPT2_VOCAB_SIZE};
pub use weights::{
    load_model, write_hf_folder, write_llmc, GPT2Model, GPT2Weights, HfDtype, LayerWeights, LlmcVersion,
};
