//! The tuning database: one JSON file per GPU holding the winning variant for every
//! (op, dtype, epilogue or mask, shape) that was tuned, every candidate timed on the way (with
//! its parameters, time, verified error and ptxas resources), and the ceilings the tuner
//! measured (cuBLAS peaks, copy bandwidth). Fields added after format 1 are optional, so older
//! files still load.
//!
//! Writes are atomic (temporary file + rename: a killed tuner never leaves a torn file) and
//! merge under an exclusive lock on a side file, so two tuners writing at once both keep their
//! results. A file that does not parse is renamed aside (`*.corrupt-<unix time>`) and reported,
//! never a crash.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

use crate::ops::{Epilogue, Mask, Shape};
use crate::spec::Dtype;

pub use super::records::{Candidate, Ceilings, Resources};

/// Version of the file layout; bumped when it changes incompatibly.
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a kernelforge tuning database: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path} holds tunings for {theirs}, not for this GPU ({ours}); pass another --db")]
    OtherGpu {
        path: PathBuf,
        theirs: String,
        ours: String,
    },
}

/// What the results were measured on. Entries only transfer between identical headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DbHeader {
    pub gpu: String,
    pub compute_capability: (i32, i32),
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    pub format: u32,
}

impl DbHeader {
    /// The header for results measured on `gpu` with `compiler`'s NVRTC.
    pub fn for_device(gpu: &crate::gpu::Gpu, compiler: &crate::gpu::Compiler) -> DbHeader {
        DbHeader::new(
            &gpu.info.name,
            gpu.info.compute_capability,
            gpu.info.driver_version,
            compiler.nvrtc_version,
        )
    }

    /// The header for a GPU known by its name and compute capability (read without a CUDA
    /// context, as [`crate::tune::spread`] does before it opens any), the driver and NVRTC.
    pub fn new(gpu: &str, compute_capability: (i32, i32), driver_version: i32, nvrtc_version: (i32, i32)) -> DbHeader {
        DbHeader {
            gpu: gpu.to_string(),
            compute_capability,
            driver_version,
            nvrtc_version,
            format: FORMAT_VERSION,
        }
    }

    /// `NVIDIA H100 80GB HBM3 (sm_90)`.
    pub fn describe(&self) -> String {
        format!(
            "{} (sm_{}{})",
            self.gpu, self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// What is tuned: the op, precision, epilogue or mask, and the exact shape.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TuneKey {
    pub op: String,
    pub dtype: String,
    /// The epilogue (matmul) or mask (attention) name; `none` otherwise.
    pub variant_kind: String,
    pub shape: Shape,
}

impl TuneKey {
    /// The key of `op` in `dtype` with this epilogue and mask at `shape`, as the registry looks
    /// kernels up and the tuner stores them.
    pub fn of(op: &str, dtype: Dtype, epilogue: Epilogue, mask: Mask, shape: Shape) -> TuneKey {
        TuneKey {
            op: op.to_string(),
            dtype: dtype.to_string(),
            variant_kind: super::registry::variant_kind(epilogue, mask).to_string(),
            shape,
        }
    }

    /// `matmul|f32|bias_gelu|K=768 M=8192 N=3072 T=1024 n_head=12`.
    pub fn text(&self) -> String {
        format!(
            "{}|{}|{}|{}",
            self.op,
            self.dtype,
            self.variant_kind,
            crate::spec::shape_text(&self.shape)
        )
    }

    fn group(&self) -> String {
        format!("{}|{}|{}", self.op, self.dtype, self.variant_kind)
    }
}

/// The winner for one key, with what it was measured against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub family: String,
    pub params: IndexMap<String, i64>,
    pub shape: Shape,
    /// Median kernel time and the spread (90th minus 10th percentile), in milliseconds.
    pub median_ms: f64,
    pub spread_ms: f64,
    /// The vendor peer on the same shape in the same run, when measured and correct.
    pub baseline_ms: Option<f64>,
    /// Which peer (`baseline::peer_name`); absent in older files (cuBLAS + epilogue kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// Why the peer has no time (unavailable here, or wrong against the f64 reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_unavailable: Option<String>,
    pub variants_tried: usize,
    /// Unix seconds.
    pub tuned_at: u64,
    /// The model role that asked for this shape (`attn.qkv`, `lm_head`, ...), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Floating-point operations and minimum bytes moved by one call (0 when not recorded).
    #[serde(default)]
    pub flops: f64,
    #[serde(default)]
    pub bytes: f64,
    /// Every candidate the tuner tried for this key, timed or rejected (empty in files
    /// written before candidates were kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<Candidate>,
}

impl Entry {
    /// A winner known only by its time: one variant tried, no spread, no peer, no candidates
    /// (a database written by hand, as tests do to steer the model's selection).
    pub fn timed(family: &str, params: IndexMap<String, i64>, shape: Shape, median_ms: f64) -> Entry {
        Entry {
            family: family.into(),
            params,
            shape,
            median_ms,
            spread_ms: 0.0,
            baseline_ms: None,
            baseline: None,
            baseline_unavailable: None,
            variants_tried: 1,
            tuned_at: 0,
            role: None,
            flops: 0.0,
            bytes: 0.0,
            candidates: Vec::new(),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct FileLayout {
    header: DbHeader,
    #[serde(default, skip_serializing_if = "Ceilings::is_empty")]
    ceilings: Ceilings,
    entries: BTreeMap<String, Entry>,
}

/// A loaded database (plus where it saves).
#[derive(Debug)]
pub struct TuningDb {
    pub path: PathBuf,
    pub header: DbHeader,
    entries: BTreeMap<String, Entry>,
    /// What the tuner measured on this GPU (merged field by field on save).
    pub ceilings: Ceilings,
    /// Set when a corrupt file was set aside on open; the caller shows it.
    pub warning: Option<String>,
    /// Keys this handle inserted since it last saved: on save they win over the file's
    /// version; for every other key the file's (possibly newer) version wins.
    inserted: BTreeSet<String>,
    /// The ceilings as loaded or last saved: when they are still unchanged at save time,
    /// another writer's newer figures win.
    saved_ceilings: Ceilings,
}

/// `~/.cache/kernelforge/tuning/<gpu>-sm<XY>.json` (or under `$KERNELFORGE_CACHE`).
pub fn default_path(header: &DbHeader) -> PathBuf {
    tuning_dir().join(file_name(header))
}

/// The folder of the per-GPU databases: `~/.cache/kernelforge/tuning` (or
/// `$KERNELFORGE_CACHE/tuning`).
pub fn tuning_dir() -> PathBuf {
    std::env::var_os("KERNELFORGE_CACHE")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("kernelforge")))
        .unwrap_or_else(|| PathBuf::from(".kernelforge-cache"))
        .join("tuning")
}

fn file_name(header: &DbHeader) -> String {
    let name: String = header
        .gpu
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!(
        "{}-sm{}{}.json",
        name.trim_matches('-'),
        header.compute_capability.0,
        header.compute_capability.1
    )
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the file; `Ok(None)` when it does not exist, `Err(message)` when it does not parse.
fn read(path: &Path) -> Result<Option<FileLayout>, String> {
    match std::fs::read_to_string(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| e.to_string()),
    }
}

impl TuningDb {
    /// Opens (or starts) the database at `path` for the GPU described by `header`.
    pub fn open(path: &Path, header: DbHeader) -> Result<TuningDb, DbError> {
        let mut db = TuningDb {
            path: path.to_path_buf(),
            header,
            entries: BTreeMap::new(),
            ceilings: Ceilings::default(),
            warning: None,
            inserted: BTreeSet::new(),
            saved_ceilings: Ceilings::default(),
        };
        match read(path) {
            Ok(None) => {}
            Ok(Some(file)) => {
                if file.header.gpu != db.header.gpu || file.header.compute_capability != db.header.compute_capability {
                    return Err(DbError::OtherGpu {
                        path: path.to_path_buf(),
                        theirs: file.header.describe(),
                        ours: db.header.describe(),
                    });
                }
                if file.header == db.header {
                    db.entries = file.entries;
                    db.saved_ceilings = file.ceilings.clone();
                    db.ceilings = file.ceilings;
                } else {
                    db.warning = Some(format!(
                        "{}: tuned with another driver/NVRTC/format ({:?}); starting afresh",
                        path.display(),
                        file.header
                    ));
                }
            }
            Err(message) => {
                let aside = path.with_extension(format!("json.corrupt-{}", now()));
                std::fs::rename(path, &aside).map_err(|source| DbError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                db.warning = Some(format!(
                    "{} was not a valid tuning database ({message}); moved it to {} and started afresh",
                    path.display(),
                    aside.display()
                ));
            }
        }
        Ok(db)
    }

    /// Reads a database file as it is, for any GPU (the report): never moves or rewrites it.
    /// A file that does not parse is an error naming it.
    pub fn read_only(path: &Path) -> Result<TuningDb, DbError> {
        let text = std::fs::read_to_string(path).map_err(|source| DbError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let file: FileLayout = serde_json::from_str(&text).map_err(|e| DbError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(TuningDb {
            path: path.to_path_buf(),
            header: file.header,
            entries: file.entries,
            saved_ceilings: file.ceilings.clone(),
            ceilings: file.ceilings,
            warning: None,
            inserted: BTreeSet::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn entries(&self) -> impl Iterator<Item = (&String, &Entry)> {
        self.entries.iter()
    }

    /// The entry tuned for exactly this key.
    pub fn get(&self, key: &TuneKey) -> Option<&Entry> {
        self.entries.get(&key.text())
    }

    /// Every entry of the same op, dtype and epilogue/mask as `key`, whatever its shape (the
    /// tuner starts its search from their winners).
    pub fn same_group<'a>(&'a self, key: &TuneKey) -> impl Iterator<Item = &'a Entry> + 'a {
        let group = key.group();
        self.entries
            .iter()
            .filter(move |(k, _)| k.rsplit_once('|').is_some_and(|(g, _)| g == group))
            .map(|(_, e)| e)
    }

    /// The entry for this key, else the nearest tuned shape of the same op, dtype and
    /// epilogue/mask whose variables all match except the `free` ones, nearest in log scale of
    /// the first (M = 3000 uses the winner for M = 2048 rather than M = 8192).
    pub fn nearest(&self, key: &TuneKey, free: &[&str]) -> Option<&Entry> {
        if let Some(e) = self.get(key) {
            return Some(e);
        }
        let free_dim = *free.first()?;
        let want = *key.shape.get(free_dim)? as f64;
        self.same_group(key)
            .filter(|e| {
                e.shape.len() == key.shape.len()
                    && e.shape
                        .iter()
                        .all(|(name, v)| free.contains(&name.as_str()) || key.shape.get(name) == Some(v))
            })
            .min_by(|a, b| {
                let d = |e: &Entry| ((e.shape[free_dim] as f64).ln() - want.ln()).abs();
                d(a).total_cmp(&d(b))
            })
    }

    pub fn insert(&mut self, key: &TuneKey, entry: Entry) {
        let text = key.text();
        self.inserted.insert(text.clone());
        self.entries.insert(text, entry);
    }

    /// Saves: under an exclusive lock, re-reads the file, merges, and replaces the file
    /// atomically. The keys this handle inserted since its last save keep its entries; every
    /// other key takes the file's version (another handle may have re-tuned it meanwhile: the
    /// copy loaded at open must not overwrite that). Ceilings this handle changed win field by
    /// field; unchanged ones take the file's. Afterwards the handle holds the merged contents.
    pub fn save(&mut self) -> Result<(), DbError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| DbError::Io { path, source }
        };
        let dir = self.path.parent().unwrap_or(Path::new(".")).to_path_buf();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let lock_path = self.path.with_extension("json.lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        if let Ok(Some(theirs)) = read(&self.path) {
            if theirs.header == self.header {
                for (k, e) in theirs.entries {
                    if !self.inserted.contains(&k) {
                        self.entries.insert(k, e);
                    }
                }
                self.ceilings = if self.ceilings == self.saved_ceilings {
                    theirs.ceilings.or(&self.ceilings)
                } else {
                    self.ceilings.or(&theirs.ceilings)
                };
            }
        }
        let layout = FileLayout {
            header: self.header.clone(),
            ceilings: self.ceilings.clone(),
            entries: self.entries.clone(),
        };
        let text = serde_json::to_string_pretty(&layout).expect("plain data serializes");
        let mut tmp = tempfile::NamedTempFile::new_in(&dir).map_err(io(&dir))?;
        tmp.write_all(text.as_bytes()).map_err(io(tmp.path()))?;
        tmp.as_file().sync_all().map_err(io(tmp.path()))?;
        tmp.persist(&self.path).map_err(|e| DbError::Io {
            path: self.path.clone(),
            source: e.error,
        })?;
        drop(lock); // released on close
        self.inserted.clear();
        self.saved_ceilings = self.ceilings.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
