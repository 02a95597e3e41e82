//! Helpers shared by the GPU decode tests (`gpu_megakernel.rs`, `gpu_decode_engines.rs`): one
//! test at a time on the GPU, random-weight models, a backend on a chosen decode engine, and the
//! near-tie measure greedy ids are compared by.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use kernelforge::model::config::GPT2Config;
use kernelforge::model::gpu::GpuBackend;
use kernelforge::model::weights::{GPT2Model, GPT2Weights};
use kernelforge::model::DecodeEngine;
use kernelforge::spec::Dtype;

static GPU_LOCK: Mutex<()> = Mutex::new(());

pub fn gpu_lock() -> MutexGuard<'static, ()> {
    GPU_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn model(layers: usize, heads: usize, width: usize, n_ctx: usize, vocab: usize, seed: u64) -> Arc<GPT2Model> {
    let config = GPT2Config::new(layers, heads, width, n_ctx, vocab).unwrap();
    let weights = GPT2Weights::random(&config, seed);
    Arc::new(GPT2Model {
        config,
        weights,
        source: "random".into(),
    })
}

pub fn backend(model: &Arc<GPT2Model>, batch: usize, dtype: Dtype, engine: DecodeEngine) -> GpuBackend {
    let mut g = GpuBackend::new(model.clone(), batch, false, dtype).expect("opening the GPU backend");
    g.set_decode_engine(engine).expect("choosing the decode engine");
    g
}

/// How far logit `best` of `row` lies above logit `other`, as a share of the row's largest
/// magnitude (what a near-tie is measured by).
pub fn tie_gap(row: &[f32], best: u32, other: u32) -> f64 {
    let scale = row.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    ((row[best as usize] - row[other as usize]) / scale) as f64
}
