//! What the tuner records beside each winner, kept in the tuning database for the report:
//! every candidate it tried (parameters, screening time, verified error, the resources ptxas
//! gave its kernels) and the ceilings it measured on the GPU. All optional on disk: files written
//! before these existed still load.

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

/// One candidate variant of a tuned key and what became of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub family: String,
    pub params: IndexMap<String, i64>,
    /// Median and spread (90th minus 10th percentile) of the screening run, in milliseconds;
    /// `None` when the candidate was rejected before timing.
    #[serde(default)]
    pub median_ms: Option<f64>,
    #[serde(default)]
    pub spread_ms: Option<f64>,
    /// Relative L2 error against the f64 reference on the verification shape.
    #[serde(default)]
    pub error: Option<f64>,
    /// Why it was excluded (compile, launch or verification failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejected: Option<String>,
    /// Per-kernel resources as the driver reports them (empty when unknown).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<Resources>,
    /// Milliseconds of a decode step that ran this candidate (its GPU time, paired by round with
    /// the winner alone's, the times the choice compared; the wall time in databases of earlier
    /// versions), when `tune --decode-step` chose the key's winner among its near-ties by whole
    /// steps (`None`: not timed so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_ms: Option<f64>,
}

impl Candidate {
    /// Whether this is the point `params` of `family`.
    pub fn is_point(&self, family: &str, params: &IndexMap<String, i64>) -> bool {
        self.family == family && &self.params == params
    }
}

/// Registers, static shared memory and local (spill) bytes of one kernel of a variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub kernel: String,
    pub registers: i32,
    pub static_smem_bytes: i32,
    /// Local memory per thread: register spills and local arrays.
    pub local_bytes: i32,
}

impl From<&crate::gpu::run::KernelResources> for Resources {
    fn from(r: &crate::gpu::run::KernelResources) -> Resources {
        Resources {
            kernel: r.kernel.clone(),
            registers: r.registers,
            static_smem_bytes: r.static_smem_bytes,
            local_bytes: r.local_bytes,
        }
    }
}

/// The ceilings the tuner measured on this GPU (each `None` until measured). The FP32 figure
/// is the FMA peak computed from clock × SMs × 128 lanes × 2; the others are measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// FP32 FMA peak, TFLOP/s (computed from the clock and SM count).
    #[serde(default)]
    pub fp32_tflops: Option<f64>,
    /// cuBLAS TF32 on an 8192³ GEMM, TFLOP/s.
    #[serde(default)]
    pub tf32_tflops: Option<f64>,
    /// cuBLAS BF16 on an 8192³ GEMM, TFLOP/s.
    #[serde(default)]
    pub bf16_tflops: Option<f64>,
    /// Device-to-device copy bandwidth, GB/s.
    #[serde(default)]
    pub copy_gb_per_s: Option<f64>,
    /// Unix seconds of the last measurement.
    #[serde(default)]
    pub measured_at: u64,
}

impl Ceilings {
    pub fn is_empty(&self) -> bool {
        self.fp32_tflops.is_none()
            && self.tf32_tflops.is_none()
            && self.bf16_tflops.is_none()
            && self.copy_gb_per_s.is_none()
    }

    /// Keeps `self`'s figures and fills the ones it lacks from `older`.
    pub fn or(&self, older: &Ceilings) -> Ceilings {
        Ceilings {
            fp32_tflops: self.fp32_tflops.or(older.fp32_tflops),
            tf32_tflops: self.tf32_tflops.or(older.tf32_tflops),
            bf16_tflops: self.bf16_tflops.or(older.bf16_tflops),
            copy_gb_per_s: self.copy_gb_per_s.or(older.copy_gb_per_s),
            measured_at: self.measured_at.max(older.measured_at),
        }
    }
}
