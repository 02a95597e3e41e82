//! The decode parts of `kernelforge bench` beyond tokens/s: the floor of a step (the larger of
//! its memory bound and its compute bound) and the share of it the timed steps reached
//! ([`FloorReport`], [`ComputePeak`]), and the megakernel's blocks × time picture
//! (`--timeline FILE.svg`).

use std::io::Write;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};

use crate::gpu::Gpu;
use crate::model::engine::{DecodeEngine, Timeline};
use crate::model::floor::{DecodeBytes, DecodeFlops};
use crate::model::generate::Draw;
use crate::model::gpu::GpuBackend;
use crate::spec::Dtype;

/// The bytes a decode step must read, the copy bandwidth, and how close the steps came; with
/// [`FloorReport::with_compute`] also the FLOPs it must do over the compute peak.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct FloorReport {
    pub bytes: DecodeBytes,
    /// Measured device-to-device copy bandwidth (read + written), GB/s; `None` on the CPU or
    /// when it could not be measured.
    pub copy_gb_per_s: Option<f64>,
    /// `bytes.total` at that bandwidth: the memory bound.
    pub floor_ms: Option<f64>,
    /// `floor_ms` over the wall time of a step (what tokens/s sees).
    pub share: Option<f64>,
    /// `floor_ms` over the GPU time of a step, when the backend reports it.
    pub share_gpu: Option<f64>,
    /// The FLOPs of the step, when the compute bound is asked for.
    pub flops: Option<DecodeFlops>,
    /// `flops.total` at the measured compute peak: the compute bound.
    pub compute_floor_ms: Option<f64>,
}

/// Which bound sets a decode step's floor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum FloorBound {
    /// The weights and the live KV cache over the copy bandwidth.
    Memory,
    /// The step's FLOPs over the compute peak.
    Compute,
}

impl FloorBound {
    pub fn as_str(self) -> &'static str {
        match self {
            FloorBound::Memory => "memory",
            FloorBound::Compute => "compute",
        }
    }
}

/// The arithmetic peak a decode step's FLOPs are divided by, for its dtype: the 16-bit
/// tensor-core rate (cuBLAS BF16) for f16 and bf16, the TF32 one (cuBLAS TF32) for tf32, the
/// FP32 FMA peak for f32, measured as `kernelforge tune` measures its "% peak"
/// ([`crate::tune::peaks`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub(crate) struct ComputePeak {
    /// FLOP/s.
    pub flops_per_s: f64,
    /// What it is: `cuBLAS BF16 on 8192x8192x8192`, `FP32 FMA (SMs x 128 lanes x 2 x clock)`.
    pub source: String,
}

impl ComputePeak {
    /// Measures (or, for f32, computes from the clock and SM count) the peak for `dtype` on `gpu`.
    pub fn measure(gpu: &Gpu, dtype: Dtype) -> Result<ComputePeak> {
        use crate::tune::peaks::{fp32_peak_flops, measure_half_peak, measure_tf32_peak, TF32_PEAK_SIZE};
        let n = TF32_PEAK_SIZE;
        let (flops_per_s, source) = match dtype {
            Dtype::F16 | Dtype::Bf16 => (measure_half_peak(gpu)?, format!("cuBLAS BF16 on {n}x{n}x{n}")),
            Dtype::Tf32 => (measure_tf32_peak(gpu)?, format!("cuBLAS TF32 on {n}x{n}x{n}")),
            Dtype::F32 => (
                fp32_peak_flops(gpu)?,
                "FP32 FMA (SMs x 128 lanes x 2 x clock)".to_string(),
            ),
        };
        Ok(ComputePeak { flops_per_s, source })
    }

    /// `{"tflops": 800.1, "source": "cuBLAS BF16 on 8192x8192x8192"}` (`bench --json`'s
    /// `compute_peak`).
    pub fn json(peak: Option<&ComputePeak>) -> Value {
        match peak {
            Some(p) => json!({ "tflops": p.flops_per_s / 1e12, "source": p.source }),
            None => Value::Null,
        }
    }
}

impl FloorReport {
    pub fn new(bytes: DecodeBytes, copy_gb_per_s: Option<f64>, ms_per_step: f64, gpu_ms_per_step: Option<f64>) -> Self {
        let floor_ms = copy_gb_per_s
            .filter(|&bw| bw > 0.0)
            .map(|bw| bytes.total as f64 / (bw * 1e9) * 1e3);
        let share_of = |ms: f64| floor_ms.filter(|_| ms > 0.0).map(|f| f / ms);
        FloorReport {
            bytes,
            copy_gb_per_s,
            floor_ms,
            share: share_of(ms_per_step),
            share_gpu: gpu_ms_per_step.and_then(share_of),
            flops: None,
            compute_floor_ms: None,
        }
    }

    /// The report with the compute bound: `flops` at `peak_flops_per_s` (`None`: the peak was not
    /// measured; the bound is then unknown).
    pub fn with_compute(self, flops: DecodeFlops, peak_flops_per_s: Option<f64>) -> Self {
        let compute_floor_ms = peak_flops_per_s
            .filter(|&p| p > 0.0)
            .map(|p| flops.total as f64 / p * 1e3);
        FloorReport {
            flops: Some(flops),
            compute_floor_ms,
            ..self
        }
    }

    /// The floor and the bound that sets it: the larger of the memory and the compute bound,
    /// or the one known when the other is not (`None` when neither is).
    pub fn bound(&self) -> Option<(FloorBound, f64)> {
        match (self.floor_ms, self.compute_floor_ms) {
            (Some(m), Some(c)) if c > m => Some((FloorBound::Compute, c)),
            (Some(m), _) => Some((FloorBound::Memory, m)),
            (None, Some(c)) => Some((FloorBound::Compute, c)),
            (None, None) => None,
        }
    }

    /// The fields of `bench --json`'s "decode" object (a report page reads these names).
    pub fn json_fields(report: Option<&FloorReport>) -> Map<String, Value> {
        let r = report;
        [
            ("floor_bytes", json!(r.map(|r| r.bytes.total))),
            ("weights_bytes", json!(r.map(|r| r.bytes.weights))),
            ("kv_bytes", json!(r.map(|r| r.bytes.kv_cache))),
            ("copy_gb_per_s", json!(r.and_then(|r| r.copy_gb_per_s))),
            ("floor_ms", json!(r.and_then(|r| r.floor_ms))),
            ("floor_share", json!(r.and_then(|r| r.share))),
            ("floor_share_gpu", json!(r.and_then(|r| r.share_gpu))),
            ("floor_bound", json!(r.and_then(FloorReport::bound).map(|(b, _)| b))),
            ("compute_floor_ms", json!(r.and_then(|r| r.compute_floor_ms))),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// `decode floor: 249.3 MB a step (weights 248.1 + KV cache 1.2) / 2,950 GB/s copy =
    /// 0.085 ms; reached 21% (wall), 23% (GPU)`.
    pub fn line(&self) -> String {
        let mb = |b: usize| grouped(b as f64 / 1e6, 1);
        let mut line = format!(
            "decode floor: {} MB a step (weights {} + KV cache {})",
            mb(self.bytes.total),
            mb(self.bytes.weights),
            mb(self.bytes.kv_cache)
        );
        match (self.copy_gb_per_s, self.floor_ms) {
            (Some(bw), Some(ms)) => {
                line += &format!(" / {} GB/s copy = {ms:.3} ms", grouped(bw, 0));
                let shares: Vec<String> = [(self.share, "wall"), (self.share_gpu, "GPU")]
                    .into_iter()
                    .filter_map(|(s, what)| s.map(|s| format!("{:.0}% ({what})", 100.0 * s)))
                    .collect();
                if !shares.is_empty() {
                    line += &format!("; reached {}", shares.join(", "));
                }
            }
            _ => line += "; copy bandwidth not measured",
        }
        line
    }
}

/// `x` with `decimals` decimals and commas between thousands: `grouped(2950.4, 0)` = `2,950`.
pub(crate) fn grouped(x: f64, decimals: usize) -> String {
    let text = format!("{:.*}", decimals, x.abs());
    let (int, frac) = text.split_once('.').map_or((text.as_str(), ""), |(i, f)| (i, f));
    let mut out = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if !frac.is_empty() {
        out = format!("{out}.{frac}");
    }
    if x < 0.0 && text.chars().any(|c| c.is_ascii_digit() && c != '0') {
        out.insert(0, '-');
    }
    out
}

/// Check a `--timeline PATH` request before any work: it needs the megakernel, a decode step,
/// and an existing folder to write into.
pub(crate) fn check_timeline_request(path: &Path, engine: Option<DecodeEngine>, generate: usize) -> Result<()> {
    if engine != Some(DecodeEngine::Megakernel) {
        bail!(
            "--timeline needs --decode-engine megakernel (only the megakernel stamps its tasks; this run uses {}); \
             add --decode-engine megakernel or drop --timeline",
            engine.map_or("the cpu".to_string(), |e| format!("the {e} engine"))
        );
    }
    if generate == 0 {
        bail!("--timeline draws a decode step but --generate 0 runs none; pass --generate N with N >= 1");
    }
    let dir = folder_of(path);
    if !dir.is_dir() {
        bail!(
            "--timeline {}: the folder {} does not exist; create it or choose another path",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// One more decode step after `next` with the megakernel's stamps on, drawing as the timed
/// steps drew (`draw`, the token at `position`); its timeline.
pub(crate) fn timeline_step(gpu: &mut GpuBackend, next: &[u32], draw: &Draw, position: usize) -> Result<Timeline> {
    gpu.set_timeline(true);
    let stepped = crate::model::generate::Backend::decode_draw(gpu, next, draw, position);
    let timeline = gpu.take_timeline();
    gpu.set_timeline(false);
    stepped?;
    timeline.ok_or_else(|| {
        anyhow!(
            "--timeline: the megakernel step came back without task stamps (the backend recorded no timeline); \
             rerun without --timeline"
        )
    })
}

/// Write `text` to `path` through a temporary file in the same folder and a rename, so that a
/// reader never sees half a file.
pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let dir = folder_of(path);
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    tmp.write_all(text.as_bytes())
        .and_then(|()| tmp.flush())
        .with_context(|| format!("writing {}", tmp.path().display()))?;
    tmp.persist(path)
        .map_err(|e| anyhow!("writing {}: {}", path.display(), e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::floor::decode_step_bytes;

    #[test]
    fn the_floor_line_and_json_fields() {
        let bytes = DecodeBytes {
            weights: 248_100_000,
            kv_cache: 1_200_000,
            total: 249_300_000,
        };
        let r = FloorReport::new(bytes, Some(2950.0), 0.4, Some(0.37));
        let floor = 249.3e6 / 2950e9 * 1e3;
        assert!((r.floor_ms.unwrap() - floor).abs() < 1e-12);
        assert_eq!(
            r.line(),
            "decode floor: 249.3 MB a step (weights 248.1 + KV cache 1.2) / 2,950 GB/s copy = 0.085 ms; \
             reached 21% (wall), 23% (GPU)"
        );
        let j = FloorReport::json_fields(Some(&r));
        let keys: Vec<&str> = j.keys().map(String::as_str).collect();
        for k in [
            "floor_bytes",
            "weights_bytes",
            "kv_bytes",
            "copy_gb_per_s",
            "floor_ms",
            "floor_share",
            "floor_share_gpu",
            "floor_bound",
            "compute_floor_ms",
        ] {
            assert!(keys.contains(&k), "{k} missing from {keys:?}");
        }
        assert_eq!(j["floor_bytes"], 249_300_000);
        assert!((j["floor_share"].as_f64().unwrap() - floor / 0.4).abs() < 1e-12);
        // No bandwidth (the CPU, or too little memory): the bytes, nulls for the rest.
        let r = FloorReport::new(bytes, None, 0.4, None);
        assert!(r.line().ends_with("copy bandwidth not measured"), "{}", r.line());
        assert!(FloorReport::json_fields(Some(&r))["floor_share"].is_null());
        assert!(FloorReport::json_fields(None).values().all(Value::is_null));
        // A real size: 124M bf16 at batch 1 after a 128-token prefill and 32 steps.
        let cfg = GPT2Config::preset("gpt2").unwrap();
        let r = FloorReport::new(decode_step_bytes(&cfg, 2, 1, 128 + 16), Some(3000.0), 1.0, None);
        assert!(
            r.line()
                .starts_with("decode floor: 252.7 MB a step (weights 247.4 + KV cache 5.3)"),
            "{}",
            r.line()
        );
        assert!(!r.line().contains("GPU"));
    }

    #[test]
    fn the_floor_is_the_larger_of_the_memory_and_the_compute_bound() {
        use crate::model::floor::decode_step_flops;
        let cfg = GPT2Config::preset("gpt2").unwrap();
        // 124M bf16 at batch 1 after 144 cached tokens: 252.7 MB over 4,000 GB/s = 0.0632 ms
        // against 252.4 MFLOP over 800 TFLOP/s = 0.000316 ms: memory-bound.
        let (bytes, flops) = (decode_step_bytes(&cfg, 2, 1, 144), decode_step_flops(&cfg, 1, 144));
        let r = FloorReport::new(bytes, Some(4000.0), 0.3, Some(0.2)).with_compute(flops, Some(800e12));
        let memory_ms = bytes.total as f64 / 4000e9 * 1e3;
        assert!((r.compute_floor_ms.unwrap() - 252_444_672.0 / 800e12 * 1e3).abs() < 1e-15);
        assert_eq!(r.bound(), Some((FloorBound::Memory, memory_ms)));
        let j = FloorReport::json_fields(Some(&r));
        assert_eq!(j["floor_bound"], "memory");
        assert!((j["compute_floor_ms"].as_f64().unwrap() - r.compute_floor_ms.unwrap()).abs() < 1e-18);
        // f32 at batch 256 with an empty cache against a 60 TFLOP/s FP32 peak: 0.49 GB of
        // weights (0.12 ms) against 63.3 GFLOP (1.05 ms): compute-bound.
        let (bytes, flops) = (decode_step_bytes(&cfg, 4, 256, 0), decode_step_flops(&cfg, 256, 0));
        let r = FloorReport::new(bytes, Some(4000.0), 2.0, Some(1.5)).with_compute(flops, Some(60e12));
        let (bound, ms) = r.bound().unwrap();
        assert_eq!(bound, FloorBound::Compute);
        assert!((ms - 256.0 * 247_136_256.0 / 60e12 * 1e3).abs() < 1e-12, "{ms}");
        assert_eq!(FloorReport::json_fields(Some(&r))["floor_bound"], "compute");
        // The memory bound's fields keep their meaning.
        assert!((r.floor_ms.unwrap() - bytes.total as f64 / 4000e9 * 1e3).abs() < 1e-12);
        // One bound unknown: the other sets the floor; neither: none.
        let no_peak = FloorReport::new(bytes, Some(4000.0), 2.0, None).with_compute(flops, None);
        assert_eq!(no_peak.bound().map(|b| b.0), Some(FloorBound::Memory));
        assert!(FloorReport::json_fields(Some(&no_peak))["compute_floor_ms"].is_null());
        let no_copy = FloorReport::new(bytes, None, 2.0, None).with_compute(flops, Some(60e12));
        assert_eq!(no_copy.bound().map(|b| b.0), Some(FloorBound::Compute));
        let neither = FloorReport::new(bytes, None, 2.0, None);
        assert_eq!(neither.bound(), None);
        assert!(FloorReport::json_fields(Some(&neither))["floor_bound"].is_null());
        // The line of a single-batch run does not change.
        assert_eq!(r.line(), FloorReport::new(bytes, Some(4000.0), 2.0, Some(1.5)).line());
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(grouped(2950.4, 0), "2,950");
        assert_eq!(grouped(3112.0992, 1), "3,112.1");
        assert_eq!(grouped(999.96, 1), "1,000.0");
        assert_eq!(grouped(12.0, 0), "12");
        assert_eq!(grouped(1_234_567.0, 0), "1,234,567");
        assert_eq!(grouped(-1234.0, 0), "-1,234");
        assert_eq!(grouped(0.0, 2), "0.00");
    }

    #[test]
    fn timeline_requests_are_checked_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("t.svg");
        let mk = Some(DecodeEngine::Megakernel);
        assert!(check_timeline_request(&svg, mk, 4).is_ok());
        assert!(check_timeline_request(Path::new("t.svg"), mk, 4).is_ok());
        for engine in [None, Some(DecodeEngine::Graph), Some(DecodeEngine::Launches)] {
            let e = check_timeline_request(&svg, engine, 4).unwrap_err().to_string();
            assert!(
                e.contains("--decode-engine megakernel") && e.contains("drop --timeline"),
                "{e}"
            );
        }
        let e = check_timeline_request(&svg, mk, 0).unwrap_err().to_string();
        assert!(e.contains("--generate"), "{e}");
        let e = check_timeline_request(&dir.path().join("no/such/t.svg"), mk, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
    }

    #[test]
    fn files_are_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.svg");
        write_atomically(&path, "<svg/>").unwrap();
        write_atomically(&path, "<svg></svg>").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "<svg></svg>");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
        assert!(write_atomically(&dir.path().join("missing/t.svg"), "x").is_err());
    }
}
