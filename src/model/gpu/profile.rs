//! Per-kernel profiling of the GPU backend (off by default): a CUDA event pair around every
//! launch (`exec.rs` records them), read back and summed per (role, kernel).

use std::collections::BTreeMap;

use anyhow::Result as AnyResult;
use cudarc::driver::CudaEvent;

use super::GpuBackend;
use crate::gpu::GpuError;

/// One row of the per-kernel profile.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileRow {
    pub role: String,
    pub kernel: String,
    pub calls: usize,
    pub total_ms: f64,
    pub avg_ms: f64,
    pub percent: f64,
}

#[derive(Default)]
pub(super) struct Profiler {
    pub(super) pending: Vec<(&'static str, String, CudaEvent, CudaEvent)>,
    pub(super) totals: BTreeMap<(String, String), (usize, f64)>,
}

impl GpuBackend {
    /// Turn per-kernel timing on (clearing what was recorded) or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.discard_ahead(); // a step launched ahead would not be profiled
        self.profiler = on.then(Profiler::default);
    }

    /// The per-kernel profile recorded since profiling was turned on (or since the last
    /// call), largest total first; clears it.
    pub fn take_profile(&mut self) -> AnyResult<Vec<ProfileRow>> {
        self.flush_profile()?;
        let Some(p) = &mut self.profiler else {
            return Ok(Vec::new());
        };
        let totals = std::mem::take(&mut p.totals);
        let sum: f64 = totals.values().map(|(_, ms)| ms).sum();
        let mut rows: Vec<ProfileRow> = totals
            .into_iter()
            .map(|((role, kernel), (calls, total_ms))| ProfileRow {
                role,
                kernel,
                calls,
                total_ms,
                avg_ms: total_ms / calls.max(1) as f64,
                percent: if sum > 0.0 { 100.0 * total_ms / sum } else { 0.0 },
            })
            .collect();
        rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        Ok(rows)
    }

    pub(super) fn flush_profile(&mut self) -> AnyResult<()> {
        let Some(p) = &mut self.profiler else {
            return Ok(());
        };
        for (role, label, start, end) in p.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(GpuError::cuda(format!("reading the timing events of {label}")))?;
            let e = p.totals.entry((role.to_string(), label)).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ms as f64;
        }
        Ok(())
    }
}
