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

use crate::ops::Shape;

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
mod tests {
    use super::*;

    fn header() -> DbHeader {
        DbHeader {
            gpu: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            driver_version: 13000,
            nvrtc_version: (13, 0),
            format: FORMAT_VERSION,
        }
    }

    fn key(m: i64) -> TuneKey {
        TuneKey {
            op: "matmul".into(),
            dtype: "f32".into(),
            variant_kind: "bias".into(),
            shape: [("M", m), ("N", 768), ("K", 768)]
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
        }
    }

    fn entry(m: i64, family: &str) -> Entry {
        Entry {
            family: family.into(),
            params: [("block_m".to_string(), 64)].into_iter().collect(),
            shape: key(m).shape,
            median_ms: 0.5,
            spread_ms: 0.01,
            baseline_ms: Some(0.45),
            baseline: Some("cuBLASLt bias (fused)".into()),
            baseline_unavailable: None,
            variants_tried: 10,
            tuned_at: 1,
            role: None,
            flops: 0.0,
            bytes: 0.0,
            candidates: Vec::new(),
        }
    }

    #[test]
    fn round_trip_and_default_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let mut db = TuningDb::open(&path, header()).unwrap();
        assert!(db.is_empty());
        db.insert(&key(1024), entry(1024, "matmul_regtile"));
        db.save().unwrap();
        let again = TuningDb::open(&path, header()).unwrap();
        assert_eq!(again.get(&key(1024)), Some(&entry(1024, "matmul_regtile")));
        assert!(again.warning.is_none());
        assert!(default_path(&header()).ends_with("tuning/nvidia-h100-80gb-hbm3-sm90.json"));
    }

    #[test]
    fn corrupt_file_is_set_aside_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        std::fs::write(&path, "{ this is not json").unwrap();
        let db = TuningDb::open(&path, header()).unwrap();
        assert!(db.is_empty());
        let warning = db.warning.unwrap();
        assert!(warning.contains("not a valid tuning database"), "{warning}");
        assert!(!path.exists());
        let aside: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(
            aside.iter().any(|n| n.to_string_lossy().contains("corrupt")),
            "{aside:?}"
        );
    }

    #[test]
    fn another_gpu_is_refused_with_a_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        TuningDb::open(&path, header()).unwrap().save().unwrap();
        let mut other = header();
        other.gpu = "NVIDIA A100".into();
        other.compute_capability = (8, 0);
        let e = TuningDb::open(&path, other).unwrap_err().to_string();
        assert!(
            e.contains("NVIDIA H100 80GB HBM3 (sm_90)") && e.contains("pass another --db"),
            "{e}"
        );
    }

    #[test]
    fn concurrent_writers_both_keep_their_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let mut a = TuningDb::open(&path, header()).unwrap();
        let mut b = TuningDb::open(&path, header()).unwrap();
        a.insert(&key(1024), entry(1024, "a"));
        b.insert(&key(8192), entry(8192, "b"));
        let (pa, pb) = (path.clone(), path.clone());
        let ta = std::thread::spawn(move || a.save().unwrap());
        let tb = std::thread::spawn(move || b.save().unwrap());
        ta.join().unwrap();
        tb.join().unwrap();
        let merged = TuningDb::open(&pa, header()).unwrap();
        assert_eq!(merged.len(), 2, "{:?}", std::fs::read_to_string(&pb));
    }

    /// Two handles opened on the same file, each re-tuning a different key: neither save
    /// rolls the other's key back to the copy it loaded at open.
    #[test]
    fn a_handle_never_overwrites_keys_it_did_not_insert() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let mut first = TuningDb::open(&path, header()).unwrap();
        first.insert(&key(1024), entry(1024, "old_1024"));
        first.insert(&key(8192), entry(8192, "old_8192"));
        first.save().unwrap();

        let mut a = TuningDb::open(&path, header()).unwrap();
        let mut b = TuningDb::open(&path, header()).unwrap();
        a.insert(&key(1024), entry(1024, "new_1024"));
        b.insert(&key(8192), entry(8192, "new_8192"));
        a.save().unwrap();
        b.save().unwrap();
        let merged = TuningDb::open(&path, header()).unwrap();
        assert_eq!(merged.len(), 2);
        assert_eq!(merged.get(&key(1024)).unwrap().family, "new_1024");
        assert_eq!(merged.get(&key(8192)).unwrap().family, "new_8192");
        // Each handle now holds the merged file too.
        assert_eq!(b.get(&key(1024)).unwrap().family, "new_1024");

        // A later save of `a` (a new key) keeps b's newer entry for the key `a` re-tuned before
        // its previous save, once b re-tunes it again.
        b.insert(&key(1024), entry(1024, "newest_1024"));
        b.save().unwrap();
        a.insert(&key(2048), entry(2048, "new_2048"));
        a.save().unwrap();
        let merged = TuningDb::open(&path, header()).unwrap();
        assert_eq!(merged.len(), 3);
        assert_eq!(merged.get(&key(1024)).unwrap().family, "newest_1024");
        assert_eq!(merged.get(&key(8192)).unwrap().family, "new_8192");

        // Ceilings a handle left as loaded do not roll back another's newer figures.
        let mut c = TuningDb::open(&path, header()).unwrap();
        let mut d = TuningDb::open(&path, header()).unwrap();
        c.ceilings = Ceilings {
            fp32_tflops: Some(60.0),
            measured_at: 9,
            ..Ceilings::default()
        };
        c.save().unwrap();
        d.insert(&key(4096), entry(4096, "d"));
        d.save().unwrap();
        let c = TuningDb::read_only(&path).unwrap().ceilings;
        assert_eq!((c.fp32_tflops, c.measured_at), (Some(60.0), 9));
    }

    #[test]
    fn nearest_uses_the_closest_tuned_rows_in_log_scale() {
        let dir = tempfile::tempdir().unwrap();
        let mut db = TuningDb::open(&dir.path().join("db.json"), header()).unwrap();
        db.insert(&key(1024), entry(1024, "small"));
        db.insert(&key(8192), entry(8192, "large"));
        assert_eq!(db.nearest(&key(2000), &["M"]).unwrap().family, "small");
        assert_eq!(db.nearest(&key(5000), &["M"]).unwrap().family, "large");
        assert_eq!(db.nearest(&key(8192), &["M"]).unwrap().family, "large");
        let mut other_n = key(1024);
        other_n.shape.insert("N".into(), 3072);
        assert!(db.nearest(&other_n, &["M"]).is_none(), "N must match exactly");
        // Row variables that move together (matmul's M and T) are all free.
        let with_t = |m: i64| {
            let mut k = key(m);
            k.shape.insert("T".into(), m);
            k
        };
        let mut coupled = entry(1024, "coupled");
        coupled.shape = with_t(1024).shape;
        db.insert(&with_t(1024), coupled);
        assert_eq!(db.nearest(&with_t(900), &["M", "T"]).unwrap().family, "coupled");
        assert!(db.nearest(&with_t(900), &["M"]).is_none(), "T differs and is not free");
        let mut other_epilogue = key(1024);
        other_epilogue.variant_kind = "none".into();
        assert!(db.nearest(&other_epilogue, &["M"]).is_none());
    }

    #[test]
    fn dtype_is_part_of_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let mut db = TuningDb::open(&path, header()).unwrap();
        let tf32 = |m: i64| TuneKey {
            dtype: "tf32".into(),
            ..key(m)
        };
        db.insert(&key(1024), entry(1024, "f32_winner"));
        db.insert(&tf32(1024), entry(1024, "tf32_winner"));
        db.save().unwrap();
        let db = TuningDb::open(&path, header()).unwrap();
        assert_eq!(db.get(&key(1024)).unwrap().family, "f32_winner");
        assert_eq!(db.get(&tf32(1024)).unwrap().family, "tf32_winner");
        // The nearest row count never crosses dtypes.
        assert_eq!(db.nearest(&tf32(2000), &["M"]).unwrap().family, "tf32_winner");
        let bf16 = TuneKey {
            dtype: "bf16".into(),
            ..key(1024)
        };
        assert!(db.nearest(&bf16, &["M"]).is_none());
        assert!(tf32(1024).text().starts_with("matmul|tf32|bias|"));
    }

    /// A file written before candidates and ceilings were kept still loads, with none of them.
    #[test]
    fn a_format_1_file_without_candidates_still_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let old = r#"{"header":{"gpu":"NVIDIA H100 80GB HBM3","compute_capability":[9,0],"driver_version":13000,
            "nvrtc_version":[13,0],"format":1},"entries":{"matmul|f32|bias|K=768 M=1024 N=768":{"family":"matmul_simt",
            "params":{"block_m":64},"shape":{"K":768,"M":1024,"N":768},"median_ms":0.5,"spread_ms":0.01,
            "baseline_ms":null,"variants_tried":3,"tuned_at":1}}}"#;
        std::fs::write(&path, old).unwrap();
        let db = TuningDb::open(&path, header()).unwrap();
        assert!(db.warning.is_none());
        let e = db.get(&key(1024)).unwrap();
        assert_eq!(e.family, "matmul_simt");
        assert!(e.candidates.is_empty() && e.role.is_none() && e.flops == 0.0);
        assert!(db.ceilings.is_empty());
        assert_eq!(TuningDb::read_only(&path).unwrap().len(), 1);
    }

    #[test]
    fn candidates_and_ceilings_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        let mut db = TuningDb::open(&path, header()).unwrap();
        let mut e = entry(1024, "matmul_simt");
        e.role = Some("attn.proj".into());
        e.flops = 2.0 * 1024.0 * 768.0 * 768.0;
        e.bytes = 4.0 * 3.0 * 1024.0 * 768.0;
        e.candidates = vec![
            Candidate {
                family: "matmul_simt".into(),
                params: [("block_m".to_string(), 64)].into_iter().collect(),
                median_ms: Some(0.5),
                spread_ms: Some(0.02),
                error: Some(3e-7),
                rejected: None,
                resources: vec![Resources {
                    kernel: "main".into(),
                    registers: 128,
                    static_smem_bytes: 16384,
                    local_bytes: 0,
                }],
            },
            Candidate {
                family: "matmul_tiled".into(),
                params: [("tile".to_string(), 32)].into_iter().collect(),
                median_ms: None,
                spread_ms: None,
                error: None,
                rejected: Some("wrong result".into()),
                resources: Vec::new(),
            },
        ];
        db.insert(&key(1024), e.clone());
        db.ceilings = Ceilings {
            fp32_tflops: Some(67.0),
            copy_gb_per_s: Some(3000.0),
            measured_at: 5,
            ..Ceilings::default()
        };
        db.save().unwrap();
        // A later run that measured only the TF32 peak keeps the others.
        let mut later = TuningDb::open(&path, header()).unwrap();
        assert_eq!(later.get(&key(1024)), Some(&e));
        later.ceilings = Ceilings {
            tf32_tflops: Some(400.0),
            measured_at: 6,
            ..Ceilings::default()
        };
        later.save().unwrap();
        let c = TuningDb::read_only(&path).unwrap().ceilings;
        assert_eq!(
            (
                c.fp32_tflops,
                c.tf32_tflops,
                c.bf16_tflops,
                c.copy_gb_per_s,
                c.measured_at
            ),
            (Some(67.0), Some(400.0), None, Some(3000.0), 6)
        );
    }

    #[test]
    fn read_only_names_the_bad_file_and_leaves_it_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.json");
        std::fs::write(&path, "{ nope").unwrap();
        let e = TuningDb::read_only(&path).unwrap_err().to_string();
        assert!(
            e.contains("db.json") && e.contains("not a kernelforge tuning database"),
            "{e}"
        );
        assert!(path.exists(), "the report never moves a file");
    }
}
