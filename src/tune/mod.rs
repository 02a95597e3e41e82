//! Checking and measuring variants on the GPU: [`verify`] runs variants against the ops' f64
//! CPU references.

pub mod baseline;
pub mod candidates;
pub mod climb;
pub mod cublaslt;
pub mod cublaslt_layout;
pub mod db;
pub mod decode_search;
pub mod evaluate;
pub mod peaks;
pub mod peer;
pub mod records;
pub mod registry;
pub mod search;
pub mod share;
pub mod spread;
pub mod time;
pub mod tuner;
pub mod verify;
pub mod workloads;
