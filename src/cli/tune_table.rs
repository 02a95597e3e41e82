//! The output of `kernelforge tune`: the peaks the "% peak" column is measured against, the
//! results table (with a `device` column when several GPUs ran), and the JSON document.

use anyhow::Result;

use super::kernels::render_table;
use crate::gpu::Gpu;
use crate::spec::{shape_text, Dtype};
use crate::tune::db::Ceilings;
use crate::tune::peaks::{
    fp32_peak_flops, measure_copy_bandwidth, measure_half_peak, measure_tf32_peak, TF32_PEAK_SIZE,
};
use crate::tune::spread::{KindOutcome, SpreadResult};
use crate::tune::tuner::TuneResult;

fn short_params(params: &indexmap::IndexMap<String, i64>) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The references of the "% peak" column, measured on one GPU of the kind.
pub struct Peaks {
    /// Read back from the database (a run that tuned nothing) rather than measured now.
    stored: bool,
    /// FP32 FMA peak (SMs x 128 lanes x 2 x clock), for f32 compute-bound rows.
    fp32: f64,
    /// cuBLAS TF32 on an 8192³ GEMM, measured in this run, for tf32 rows (marked `tc`).
    tf32: Option<f64>,
    /// cuBLAS BF16 on the same GEMM, measured in this run, for f16 / bf16 rows (marked `tc`).
    half: Option<f64>,
    /// Measured device-to-device copy bandwidth, for memory-bound rows.
    bytes: f64,
}

impl Peaks {
    /// Measures on `gpu` the peaks the results need: the FP32 FMA peak and the copy bandwidth
    /// always, cuBLAS TF32 / BF16 only when a tf32 / f16 / bf16 row has flops.
    pub fn measure<'a>(gpu: &Gpu, results: impl Iterator<Item = &'a TuneResult> + Clone) -> Result<Peaks> {
        let needs = |f: fn(Dtype) -> bool| results.clone().any(|r| f(r.dtype) && r.flops > 0.0);
        Ok(Peaks {
            stored: false,
            fp32: fp32_peak_flops(gpu)?,
            // Tensor-core rows are measured against what cuBLAS TF32 reaches on a large square
            // GEMM in this run (a practical peak), not against the FP32 FMA peak.
            tf32: if needs(|d| d == Dtype::Tf32) {
                Some(measure_tf32_peak(gpu)?)
            } else {
                None
            },
            // f16 / bf16 rows: cuBLAS BF16 on the same square GEMM (16-bit tensor-core rate).
            half: if needs(|d| matches!(d, Dtype::F16 | Dtype::Bf16)) {
                Some(measure_half_peak(gpu)?)
            } else {
                None
            },
            bytes: measure_copy_bandwidth(gpu)?,
        })
    }

    /// The peaks from the ceilings a database kept, when it has every one the rows of
    /// `results` need (a run that tuned nothing does not measure them again).
    pub fn from_ceilings<'a>(c: &Ceilings, results: impl Iterator<Item = &'a TuneResult> + Clone) -> Option<Peaks> {
        let needs = |f: fn(Dtype) -> bool| results.clone().any(|r| f(r.dtype) && r.flops > 0.0);
        let tera = |v: Option<f64>| v.map(|t| t * 1e12);
        Some(Peaks {
            stored: true,
            fp32: tera(c.fp32_tflops)?,
            tf32: match needs(|d| d == Dtype::Tf32) {
                true => Some(tera(c.tf32_tflops)?),
                false => None,
            },
            half: match needs(|d| matches!(d, Dtype::F16 | Dtype::Bf16)) {
                true => Some(tera(c.bf16_tflops)?),
                false => None,
            },
            bytes: c.copy_gb_per_s? * 1e9,
        })
    }

    fn when(&self) -> &'static str {
        if self.stored {
            "measured earlier, from the database"
        } else {
            "measured now"
        }
    }

    /// The ceilings the database keeps (the report draws them); figures not measured in this
    /// run keep their earlier values in `earlier`.
    pub fn ceilings(&self, earlier: &Ceilings) -> Ceilings {
        Ceilings {
            fp32_tflops: Some(self.fp32 / 1e12),
            tf32_tflops: self.tf32.map(|p| p / 1e12),
            bf16_tflops: self.half.map(|p| p / 1e12),
            copy_gb_per_s: Some(self.bytes / 1e9),
            measured_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
        .or(earlier)
    }

    /// The peaks as the JSON document names them.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "fp32_peak_tflops": self.fp32 / 1e12,
            "tf32_cublas_peak_tflops": self.tf32.map(|p| p / 1e12),
            "bf16_cublas_peak_tflops": self.half.map(|p| p / 1e12),
            "copy_bandwidth_gbs": self.bytes / 1e9,
        })
    }

    pub fn legend(&self) -> String {
        let mut text = format!(
            "% peak: f32 rows vs the FP32 FMA peak {:.1} TFLOP/s (clock x SMs; a 3xTF32 winner runs on the tensor cores and can pass it)",
            self.fp32 / 1e12
        );
        for (rows, cublas, peak) in [("tf32", "TF32", self.tf32), ("f16/bf16", "BF16", self.half)] {
            if let Some(tc) = peak {
                text.push_str(&format!(
                    "; {rows} rows (marked tc) vs cuBLAS {cublas} on {n}x{n}x{n}, {:.1} TFLOP/s {when}",
                    tc / 1e12,
                    when = self.when(),
                    n = TF32_PEAK_SIZE
                ));
            }
        }
        text.push_str(&format!(
            "; memory-bound rows vs the copy bandwidth {:.0} GB/s ({})",
            self.bytes / 1e9,
            self.when()
        ));
        text
    }
}

fn throughput(r: &TuneResult, ms: f64, peaks: &Peaks) -> (String, String) {
    if r.flops > 0.0 {
        let f = r.flops / (ms * 1e-3);
        let tensor_peak = match r.dtype {
            Dtype::Tf32 => peaks.tf32,
            Dtype::F16 | Dtype::Bf16 => peaks.half,
            Dtype::F32 => None,
        };
        let pct = match tensor_peak {
            Some(tc) => format!("{:.0}% tc", 100.0 * f / tc),
            None => format!("{:.0}%", 100.0 * f / peaks.fp32),
        };
        (format!("{:.1} TFLOP/s", f / 1e12), pct)
    } else if r.bytes > 0.0 {
        let b = r.bytes / (ms * 1e-3);
        (
            format!("{:.0} GB/s", b / 1e9),
            format!("{:.0}%", 100.0 * b / peaks.bytes),
        )
    } else {
        ("-".into(), "-".into())
    }
}

/// The results as JSON, each with the CUDA ordinal that measured it (`null`: read from the
/// database).
pub fn results_json(results: &[SpreadResult]) -> Result<Vec<serde_json::Value>> {
    results
        .iter()
        .map(|r| {
            let mut value = serde_json::to_value(&r.result)?;
            if let Some(map) = value.as_object_mut() {
                map.insert("device".into(), serde_json::json!(r.device));
            }
            Ok(value)
        })
        .collect()
}

/// The final table, then what the peers are and why any row has none: "peer ms" is the vendor
/// peer of the row's epilogue (cuBLASLt with its own fused epilogue, or cuBLAS + the qkv split
/// kernel) and "speed vs peer" its time over the winner's. `with_device` adds a `device` column
/// (the GPU that measured the row; `db` when read from the database).
pub fn results_table(spread: &[SpreadResult], peaks: &Peaks, with_device: bool) -> String {
    use crate::tune::baseline::{entry_peer, peer_cells, PEER_LEGEND};
    let mut header = vec![
        "workload",
        "dtype",
        "shape",
        "winner",
        "time ms",
        "±",
        "throughput",
        "% peak",
        "peer",
        "peer ms",
        "speed vs peer",
        "tried",
    ];
    if with_device {
        header.insert(0, "device");
    }
    let mut rows = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    let device_cell = |d: Option<usize>| d.map_or_else(|| "db".to_string(), |o| format!("cuda:{o}"));
    let mut notes = Vec::new();
    for SpreadResult { result: r, device } in spread {
        let mut row = Vec::new();
        if with_device {
            row.push(device_cell(*device));
        }
        let Some(w) = &r.winner else {
            row.extend([
                r.role.clone(),
                r.dtype.to_string(),
                shape_text(&r.shape),
                "NO VALID VARIANT".into(),
            ]);
            rows.push(row);
            continue;
        };
        let (tp, pct) = throughput(r, w.median_ms, peaks);
        let (peer_ms, vs_peer) = peer_cells(w);
        if let Some(why) = &w.baseline_unavailable {
            notes.push(format!(
                "no peer time for {} {} {}: {why}",
                r.role,
                r.dtype,
                shape_text(&r.shape)
            ));
        }
        row.extend([
            r.role.clone(),
            r.dtype.to_string(),
            shape_text(&r.shape),
            format!("{} {}", w.family, short_params(&w.params)),
            format!("{:.4}", w.median_ms),
            format!("{:.4}", w.spread_ms),
            tp,
            pct,
            entry_peer(w).unwrap_or("-").to_string(),
            peer_ms,
            vs_peer,
            if r.from_db {
                "(db)".into()
            } else {
                w.variants_tried.to_string()
            },
        ]);
        rows.push(row);
    }
    let mut text = render_table(&rows);
    if spread
        .iter()
        .any(|r| r.result.winner.as_ref().is_some_and(|w| entry_peer(w).is_some()))
    {
        text.push_str(&format!(
            "{PEER_LEGEND}; speed vs peer = peer time / winner time (above 1: the generated kernel is faster)\n"
        ));
    }
    for note in notes {
        text.push_str(&note);
        text.push('\n');
    }
    text
}

/// The `--json` document. One kind: the device the peaks were measured on, its database, the
/// peaks and the results at the top level (as with one GPU), plus `devices`; several kinds:
/// `devices` and `seconds` at the top level and one such document per kind under `kinds`.
/// Every result says which GPU measured it (`device`: its ordinal, `null` from the database);
/// every entry of `devices` has its ordinal, name, workloads tuned and busy seconds.
pub fn json_doc(
    kinds: &[KindOutcome],
    measured: &[(crate::gpu::device::DeviceInfo, Peaks)],
    seconds: f64,
) -> Result<serde_json::Value> {
    let devices: Vec<serde_json::Value> = kinds
        .iter()
        .flat_map(|k| &k.work)
        .map(|w| {
            serde_json::json!({
                "ordinal": w.device.ordinal,
                "name": w.device.name,
                "tuned": w.tuned,
                "busy_seconds": w.busy.as_secs_f64(),
                "phases": w.phases,
            })
        })
        .collect();
    let mut docs = Vec::new();
    for (kind, (info, peaks)) in kinds.iter().zip(measured) {
        let mut doc = serde_json::json!({
            "device": info,
            "database": kind.plan.db_path,
            "seconds": seconds,
            "results": results_json(&kind.results)?,
        });
        if let (Some(map), Some(p)) = (doc.as_object_mut(), peaks.json().as_object()) {
            map.extend(p.clone());
        }
        docs.push(doc);
    }
    let mut doc = if docs.len() == 1 {
        docs.remove(0)
    } else {
        serde_json::json!({ "seconds": seconds, "kinds": docs })
    };
    if let Some(map) = doc.as_object_mut() {
        map.insert("devices".into(), devices.into());
    }
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(dtype: Dtype, flops: f64) -> TuneResult {
        TuneResult {
            role: "fc".into(),
            op: "matmul".into(),
            dtype,
            variant_kind: "none".into(),
            shape: Default::default(),
            winner: None,
            from_db: true,
            tried: Vec::new(),
            flops,
            bytes: 1.0,
        }
    }

    /// Stored ceilings serve a run that tuned nothing only when they hold every figure its rows
    /// need.
    #[test]
    fn peaks_come_from_the_ceilings_only_when_complete() {
        let c = Ceilings {
            fp32_tflops: Some(60.0),
            tf32_tflops: None,
            bf16_tflops: Some(700.0),
            copy_gb_per_s: Some(3000.0),
            measured_at: 1,
        };
        let bf16 = [result(Dtype::Bf16, 1e9)];
        let p = Peaks::from_ceilings(&c, bf16.iter()).expect("bf16 rows have their ceiling");
        assert_eq!((p.fp32, p.half, p.tf32, p.bytes), (60e12, Some(700e12), None, 3000e9));
        let tf32 = [result(Dtype::Tf32, 1e9)];
        assert!(
            Peaks::from_ceilings(&c, tf32.iter()).is_none(),
            "no tf32 ceiling stored"
        );
        assert!(Peaks::from_ceilings(&Ceilings::default(), bf16.iter()).is_none());
    }
}
