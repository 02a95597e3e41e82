//! The report's inputs and the plain views its pages draw from: the spec catalog, a tuning
//! database read as it is (any GPU, never moved or rewritten), and `bench --json` outputs with
//! their optional decode timeline picture.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ReportError;
use crate::ops::{Epilogue, Mask};
use crate::spec::{variant_with, Catalog, DeviceLimits, Dtype, Variant};
use crate::tune::db::{Candidate, Ceilings, DbHeader, Entry, TuningDb};

/// Everything a report is made from.
pub struct ReportInput {
    pub catalog: Catalog,
    /// `None` when no database was given or found: the site then shows the specs and benches.
    pub db: Option<TuningDb>,
    pub benches: Vec<Bench>,
}

/// One `bench --json` file.
#[derive(Debug, Clone)]
pub struct Bench {
    pub path: PathBuf,
    pub run: BenchRun,
    pub timeline: Timeline,
}

/// The decode timeline picture a bench run recorded (`bench --timeline FILE.svg`).
#[derive(Debug, Clone, PartialEq)]
pub enum Timeline {
    /// None was recorded.
    None,
    /// One was named but cannot be shown; the reason is printed on the page.
    Unusable(String),
    /// The SVG's contents, copied into the site.
    Svg(String),
}

/// The parts of `kernelforge bench --json` the report reads; every field is optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct BenchRun {
    pub device: String,
    pub device_name: String,
    pub model: String,
    pub dtype: Option<String>,
    pub unfused: bool,
    pub batch: u64,
    pub seq: u64,
    pub forward: Option<ForwardRun>,
    pub decode: Option<DecodeRun>,
    pub profile: Profile,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ForwardRun {
    pub median_ms: f64,
    pub tokens: u64,
    pub tokens_per_s: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct DecodeRun {
    pub steps: u64,
    pub prefill_tokens: u64,
    pub total_ms: f64,
    pub ms_per_step: f64,
    pub tokens_per_s: f64,
    pub cuda_graphs: Option<bool>,
    pub gpu_ms_per_step: Option<f64>,
    /// `launches`, `graph` or `megakernel`.
    pub engine: Option<String>,
    /// Bytes one step must read at least, the copy bandwidth it is measured against, the time
    /// that takes, and the share of that floor the step reached (0..1).
    pub floor_bytes: Option<f64>,
    pub copy_gb_per_s: Option<f64>,
    pub floor_ms: Option<f64>,
    pub floor_share: Option<f64>,
    /// An SVG written by `bench --timeline`, relative to the JSON's folder or absolute.
    pub timeline_svg: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Profile {
    pub forward: Vec<ProfileRow>,
    pub decode: Vec<ProfileRow>,
}

/// Time of one (role, kernel) over the profiled run, as `bench` measures it with CUDA events.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ProfileRow {
    pub role: String,
    pub kernel: String,
    pub calls: u64,
    pub total_ms: f64,
}

impl ReportInput {
    /// Loads the catalog from `root` (its `specs/` and `templates/`), the database at `db`
    /// (`None`: the only file in the user's tuning folder, if there is exactly one), and each
    /// bench file.
    pub fn load(root: &Path, db: Option<&Path>, benches: &[PathBuf]) -> Result<ReportInput, ReportError> {
        // The small files first: a bad one is reported before the specs are read.
        let db = match db {
            Some(path) => Some(TuningDb::read_only(path)?),
            None => match default_db()? {
                Some(path) => Some(TuningDb::read_only(&path)?),
                None => None,
            },
        };
        let benches = benches.iter().map(|p| load_bench(p)).collect::<Result<_, _>>()?;
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates"))?;
        Ok(ReportInput { catalog, db, benches })
    }
}

/// The only database in the user's tuning folder; an error when there are several.
fn default_db() -> Result<Option<PathBuf>, ReportError> {
    let dir = crate::tune::db::tuning_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(None);
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    match files.len() {
        0 => Ok(None),
        1 => Ok(files.pop()),
        _ => Err(ReportError::Out {
            path: dir,
            message: format!(
                "holds {} tuning databases ({}); pick one with --db",
                files.len(),
                files
                    .iter()
                    .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// Reads one `bench --json` output; the timeline it names is read too when it exists.
pub fn load_bench(path: &Path) -> Result<Bench, ReportError> {
    let text = std::fs::read_to_string(path).map_err(ReportError::io(path))?;
    let bad = |message: String| ReportError::Bench {
        path: path.to_path_buf(),
        message,
    };
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if !value.is_object() || (value.get("forward").is_none() && value.get("decode").is_none()) {
        return Err(bad("no `forward` or `decode` object".into()));
    }
    let run: BenchRun = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    let timeline = match run.decode.as_ref().and_then(|d| d.timeline_svg.as_deref()) {
        None => Timeline::None,
        Some(name) => {
            let file = path.parent().unwrap_or(Path::new(".")).join(name);
            match std::fs::read_to_string(&file) {
                Err(e) => Timeline::Unusable(format!("{}: {e}", file.display())),
                Ok(svg) if svg.contains("<svg") && svg.trim_end().ends_with("</svg>") => Timeline::Svg(svg),
                Ok(_) => Timeline::Unusable(format!("{}: not an SVG file", file.display())),
            }
        }
    };
    Ok(Bench {
        path: path.to_path_buf(),
        run,
        timeline,
    })
}

/// One tuned key of the database, as the pages show it.
#[derive(Debug, Clone)]
pub struct Workload {
    /// 1-based, the number of its point on the roofline.
    pub number: usize,
    pub key: String,
    /// File stem of its page (`workloads/<slug>.html`).
    pub slug: String,
    pub op: String,
    pub dtype: String,
    /// Epilogue (matmul), mask (attention) or `none`.
    pub kind: String,
    pub shape: String,
    pub entry: Entry,
    /// Work and minimum traffic of one call (0 when unknown).
    pub flops: f64,
    pub bytes: f64,
}

impl Workload {
    /// `attn.qkv` when the role is known, else the op.
    pub fn title(&self) -> String {
        self.entry.role.clone().unwrap_or_else(|| self.op.clone())
    }

    /// Throughput of a call taking `ms`: FLOP/s when the op does arithmetic, else B/s.
    pub fn rate(&self, ms: f64) -> Option<f64> {
        let work = if self.flops > 0.0 { self.flops } else { self.bytes };
        (work > 0.0 && ms > 0.0).then(|| work / (ms * 1e-3))
    }

    /// Candidates that were timed, fastest first.
    pub fn timed(&self) -> Vec<&Candidate> {
        let mut v: Vec<&Candidate> = self.entry.candidates.iter().filter(|c| c.median_ms.is_some()).collect();
        v.sort_by(|a, b| {
            a.median_ms
                .unwrap_or(f64::MAX)
                .total_cmp(&b.median_ms.unwrap_or(f64::MAX))
        });
        v
    }

    /// The ceiling its throughput is compared with (TFLOP/s or GB/s, with its name).
    pub fn ceiling(&self, c: &Ceilings) -> Option<(f64, &'static str)> {
        if self.flops > 0.0 {
            match self.dtype.as_str() {
                "tf32" => c.tf32_tflops.map(|p| (p * 1e12, "cuBLAS TF32")),
                "f16" | "bf16" => c.bf16_tflops.map(|p| (p * 1e12, "cuBLAS BF16")),
                _ => c.fp32_tflops.map(|p| (p * 1e12, "FP32 FMA")),
            }
        } else if self.bytes > 0.0 {
            c.copy_gb_per_s.map(|b| (b * 1e9, "copy bandwidth"))
        } else {
            None
        }
    }
}

/// The database's keys as workloads, in key order (op, dtype, kind, shape).
pub fn workloads(db: &TuningDb) -> Vec<Workload> {
    let mut slugs = std::collections::BTreeSet::new();
    db.entries()
        .enumerate()
        .map(|(i, (key, entry))| {
            let mut parts = key.splitn(4, '|');
            let mut next = || parts.next().unwrap_or("").to_string();
            let (op, dtype, kind, shape) = (next(), next(), next(), next());
            let mut slug = slugify(key);
            while !slugs.insert(slug.clone()) {
                slug.push('_');
            }
            let flops = if entry.flops > 0.0 {
                entry.flops
            } else {
                flops_of(&op, &kind, &entry.shape)
            };
            Workload {
                number: i + 1,
                key: key.clone(),
                slug,
                op,
                dtype,
                kind,
                shape,
                flops,
                bytes: entry.bytes,
                entry: entry.clone(),
            }
        })
        .collect()
}

/// The tuner's count of floating-point work (see `tune::tuner::workload_flops`), for databases
/// written before it was stored.
fn flops_of(op: &str, kind: &str, shape: &crate::ops::Shape) -> f64 {
    let s = |k: &str| shape.get(k).copied().unwrap_or(0) as f64;
    match op {
        "matmul" => 2.0 * s("M") * s("N") * s("K"),
        "attention" => {
            let full = 4.0 * s("B") * s("NH") * s("T") * s("T") * s("HS");
            if kind == "causal" {
                full / 2.0
            } else {
                full
            }
        }
        _ => 0.0,
    }
}

/// A file-name-safe form of `text`: letters, digits, `_` and `-` only.
pub fn slugify(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' => out.push(c),
            '=' => {}
            _ if !out.ends_with('-') => out.push('-'),
            _ => {}
        }
    }
    out.trim_matches('-').to_string()
}

/// The limits a variant is rebuilt under: an H100's, with the database's compute capability.
pub fn limits_for(header: Option<&DbHeader>) -> DeviceLimits {
    let mut limits = DeviceLimits::default();
    if let Some(h) = header {
        limits.compute_capability = h.compute_capability;
    }
    limits
}

/// Rebuilds the variant a database row names (`Err` says why it cannot: a family or param
/// that the specs no longer have).
pub fn variant_of(
    catalog: &Catalog,
    family: &str,
    params: &indexmap::IndexMap<String, i64>,
    dtype: &str,
    kind: &str,
    limits: &DeviceLimits,
) -> Result<Variant, String> {
    let f = catalog.family(family).map_err(|e| e.to_string())?;
    let dtype: Dtype = dtype.parse().map_err(|e: crate::spec::UnknownDtype| e.0)?;
    let epilogue = f
        .epilogues
        .iter()
        .copied()
        .find(|e| e.as_str() == kind)
        .unwrap_or(f.epilogues.first().copied().unwrap_or(Epilogue::None));
    let mask = f
        .masks
        .iter()
        .copied()
        .find(|m| m.as_str() == kind)
        .unwrap_or(f.masks.first().copied().unwrap_or(Mask::None));
    let overrides: Vec<(String, i64)> = params.iter().map(|(k, v)| (k.clone(), *v)).collect();
    variant_with(f, &overrides, dtype, epilogue, mask, limits).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_file_names() {
        assert_eq!(
            slugify("matmul|f32|bias_gelu|K=768 M=8192 N=3072"),
            "matmul-f32-bias_gelu-K768-M8192-N3072"
        );
        assert_eq!(slugify("a//b"), "a-b");
    }

    #[test]
    fn a_bench_file_without_forward_or_decode_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        std::fs::write(&path, r#"{"header": {}}"#).unwrap();
        let e = load_bench(&path).unwrap_err().to_string();
        assert!(e.contains("db.json") && e.contains("no `forward` or `decode`"), "{e}");
        std::fs::write(&path, "[1,").unwrap();
        assert!(load_bench(&path).unwrap_err().to_string().contains("bench --json"));
    }

    #[test]
    fn a_missing_timeline_is_noted_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.json");
        std::fs::write(&path, r#"{"decode": {"timeline_svg": "gone.svg", "tokens_per_s": 5}}"#).unwrap();
        let b = load_bench(&path).unwrap();
        assert!(matches!(b.timeline, Timeline::Unusable(ref why) if why.contains("gone.svg")));
        std::fs::write(dir.path().join("t.svg"), "<svg></svg>\n").unwrap();
        std::fs::write(&path, r#"{"decode": {"timeline_svg": "t.svg"}}"#).unwrap();
        assert_eq!(
            load_bench(&path).unwrap().timeline,
            Timeline::Svg("<svg></svg>\n".into())
        );
    }
}
