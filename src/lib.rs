//! kernelforge: declarative kernel specs → tera templates → NVRTC → verified, autotuned GPU
//! kernels, and a GPT-2 pipeline that runs on them.
//!
//! The modules follow the data flow, one direction:
//! [`spec`] (parse, validate, expand) → [`codegen`] (render CUDA source) → [`gpu`] (compile with
//! NVRTC, load, launch) → [`tune`] (verify against [`ops`]' CPU references, time, tuning database)
//! → [`model`] (GPT-2 forward and generation). [`cli`] is a thin layer over all of them.

pub mod cli;
pub mod codegen;
pub mod gpu;
pub mod model;
pub mod ops;
pub mod project;
pub mod report;
pub mod spec;
pub mod stats;
pub mod tune;
