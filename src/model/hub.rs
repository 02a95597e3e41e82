//! Size names (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`) to a local checkpoint folder:
//! the Hugging Face hub cache first, then a download from the hub into that same cache.
//!
//! The order, and why:
//! 1. **The local cache** (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`), in the
//!    layout the Python `huggingface_hub` uses (`models--ORG--NAME/{refs/main, snapshots/REV,
//!    blobs}`), so a model fetched by either tool serves both. No network is touched on a hit.
//! 2. **`HF_HUB_OFFLINE`** set (1/true/yes/on, as in Python): never touch the network; a miss
//!    says so and points to `--model PATH`.
//! 3. **The hub** (`$HF_ENDPOINT`, default <https://huggingface.co>): `config.json` and
//!    `model.safetensors` of `openai-community/NAME`, through the `hf-hub` crate's blocking
//!    (ureq + rustls) API, with a progress bar. A failure is one line: which model, what went
//!    wrong (the underlying reason), and that `--model PATH` takes a local folder or file.
//!
//! Half-written files are never taken as complete: `hf-hub` downloads into `blobs/ETAG.part`
//! (under an exclusive `flock` on `blobs/ETAG.lock`), renames it to `blobs/ETAG` only after the
//! body has been read in full (ureq reports a body shorter than its Content-Length as an error),
//! and only then links `snapshots/REV/FILE` and writes `refs/main`. An interrupted download
//! leaves just the `.part`, which the next run resumes with a `Range` request. On top of that,
//! each finished file's size is checked against the size the hub announced (blob and link are
//! deleted when they differ), and [`cached_snapshot`] only accepts a snapshot folder that
//! has both `config.json` and the weights.
//!
//! `hf-hub` 0.5's blocking API sets no network timeout (nor lets one be set), so each file is
//! fetched on a worker thread watched by a stall timer: no progress (connecting, or no bytes)
//! for [`HubSettings::stall_timeout`] ends the wait with [`HubError::Stalled`]. The abandoned
//! worker only holds its `.part` file, which a later run resumes.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};

use super::config::{GPT2Config, PRESET_NAMES};

/// The hub organisation that holds the released GPT-2 checkpoints (`gpt2` alone is an alias of
/// `openai-community/gpt2` on the hub; the canonical id is used for downloads).
pub const HUB_ORG: &str = "openai-community";

/// The default hub address when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where to look and whether and how to download. [`HubSettings::from_env`] reads the
/// environment; tests build one explicitly so they never race on environment variables.
#[derive(Clone, Debug)]
pub struct HubSettings {
    /// The hub cache folder (`.../huggingface/hub`); `None` when there is no home folder and
    /// neither `HF_HUB_CACHE` nor `HF_HOME` is set.
    pub cache: Option<PathBuf>,
    /// The hub's base URL, without a trailing slash.
    pub endpoint: String,
    /// Never touch the network (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Show a progress bar on stderr while downloading (off with `HF_HUB_DISABLE_PROGRESS_BARS`).
    pub progress: bool,
    /// Give up when a download makes no progress (connecting, or no bytes) for this long.
    pub stall_timeout: Duration,
}

impl HubSettings {
    /// How long a download may go without progress before it is given up.
    pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);

    /// Settings from the process environment (`HF_HUB_CACHE`, `HF_HOME`, `HF_ENDPOINT`,
    /// `HF_HUB_OFFLINE`, `HF_HUB_DISABLE_PROGRESS_BARS`), as the Python tools read them.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var_os(k), dirs::home_dir())
    }

    /// [`HubSettings::from_env`] over any variable lookup and home folder.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>, home: Option<PathBuf>) -> Self {
        let nonempty = |k: &str| var(k).filter(|v| !v.is_empty());
        let cache = match (nonempty("HF_HUB_CACHE"), nonempty("HF_HOME")) {
            (Some(c), _) => Some(PathBuf::from(c)),
            (None, Some(h)) => Some(PathBuf::from(h).join("hub")),
            (None, None) => home.map(|h| h.join(".cache").join("huggingface").join("hub")),
        };
        let endpoint = nonempty("HF_ENDPOINT")
            .map(|e| e.to_string_lossy().trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let truthy = |k: &str| {
            var(k).is_some_and(|v| {
                matches!(
                    v.to_string_lossy().trim().to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes" | "on"
                )
            })
        };
        HubSettings {
            cache,
            endpoint,
            offline: truthy("HF_HUB_OFFLINE"),
            progress: !truthy("HF_HUB_DISABLE_PROGRESS_BARS"),
            stall_timeout: Self::DEFAULT_STALL_TIMEOUT,
        }
    }
}

/// Why a `--model` name could not be turned into a local checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "model `{spec}` not found: pass a Hugging Face folder, an llm.c .bin file, or one of {}",
        PRESET_NAMES.join(", ")
    )]
    UnknownModel { spec: String },
    #[error(
        "model `{name}`: no Hugging Face cache folder (no home folder; set HF_HUB_CACHE or HF_HOME), \
         or pass --model PATH (a folder with config.json + model.safetensors, or an llm.c checkpoint)"
    )]
    NoCache { name: String },
    #[error(
        "model `{name}` is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set, so it is not downloaded; \
         unset HF_HUB_OFFLINE to download it, or pass --model PATH (a folder with config.json + model.safetensors, \
         or an llm.c checkpoint)",
        cache.display()
    )]
    Offline { name: String, cache: PathBuf },
    #[error(
        "model `{name}`: could not reach the Hugging Face hub at {endpoint} to download {HUB_ORG}/{name} ({reason}); \
         check the network or HF_ENDPOINT, or pass --model PATH (a local folder with config.json + \
         model.safetensors, or an llm.c checkpoint)"
    )]
    Unreachable {
        name: String,
        endpoint: String,
        reason: String,
    },
    #[error(
        "model `{name}`: the Hugging Face hub at {endpoint} made no progress on {HUB_ORG}/{name}/{file} for {}s; \
         check the network or HF_ENDPOINT, or pass --model PATH (a local folder with config.json + \
         model.safetensors, or an llm.c checkpoint)",
        timeout.as_secs_f32()
    )]
    Stalled {
        name: String,
        file: String,
        endpoint: String,
        timeout: Duration,
    },
    #[error(
        "model `{name}`: downloading {HUB_ORG}/{name}/{file} from {endpoint} into {} failed: {reason}; \
         pass --model PATH (a local folder with config.json + model.safetensors, or an llm.c checkpoint)",
        cache.display()
    )]
    Download {
        name: String,
        file: String,
        endpoint: String,
        cache: PathBuf,
        reason: String,
    },
}

/// Turn `--model` into a path: an existing path as is; a size name (optionally prefixed with
/// `openai-community/`) from the Hugging Face cache, else downloaded from the hub (see the
/// module docs for the order).
pub fn resolve_model(spec: &str, settings: &HubSettings) -> Result<PathBuf, HubError> {
    let p = PathBuf::from(spec);
    if p.exists() {
        return Ok(p);
    }
    let name = spec.strip_prefix(&format!("{HUB_ORG}/")).unwrap_or(spec);
    if !PRESET_NAMES.contains(&name) {
        return Err(HubError::UnknownModel { spec: spec.to_string() });
    }
    let Some(cache) = &settings.cache else {
        return Err(HubError::NoCache { name: name.to_string() });
    };
    if let Some(d) = cached_snapshot(cache, name) {
        return Ok(d);
    }
    if settings.offline {
        return Err(HubError::Offline {
            name: name.to_string(),
            cache: cache.clone(),
        });
    }
    download(name, cache, settings)
}

/// The snapshot folder of size name `name` in hub cache `cache` (as `models--NAME` or
/// `models--openai-community--NAME`) that has `config.json` and the weights, if any.
pub fn cached_snapshot(cache: &Path, name: &str) -> Option<PathBuf> {
    [format!("models--{name}"), format!("models--{HUB_ORG}--{name}")]
        .iter()
        .find_map(|repo| snapshot_in(&cache.join(repo)))
}

/// A complete snapshot of one cached repo: the one `refs/main` names, else the first complete
/// one in name order.
fn snapshot_in(repo: &Path) -> Option<PathBuf> {
    let snaps = repo.join("snapshots");
    // A snapshot entry only exists once its blob is complete (see the module docs), so "both
    // files present" means "usable".
    let has_model = |d: &Path| {
        d.join("config.json").is_file()
            && (d.join("model.safetensors").is_file() || d.join("model.safetensors.index.json").is_file())
    };
    if let Ok(main) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let d = snaps.join(main.trim());
        if has_model(&d) {
            return Some(d);
        }
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&snaps)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    dirs.sort();
    dirs.into_iter().find(|d| has_model(d))
}

/// Download `config.json` and `model.safetensors` of `openai-community/NAME` into hub cache
/// `cache` and return the snapshot folder that holds both.
///
/// `config.json` (a few hundred bytes) is always fetched: it pins the hub's current revision
/// (`refs/main`) and is checked to describe a GPT-2 of that size before the weights are
/// fetched. The weights are reused when that revision's snapshot already has them.
pub fn download(name: &str, cache: &Path, settings: &HubSettings) -> Result<PathBuf, HubError> {
    let repo_id = format!("{HUB_ORG}/{name}");
    // hf-hub links snapshot files to blobs by relative path, computed from absolute paths.
    let cache = std::path::absolute(cache).unwrap_or_else(|_| cache.to_path_buf());
    let ctx = Ctx {
        name,
        repo: &repo_id,
        settings,
        cache: &cache,
    };
    let api = ApiBuilder::from_cache(Cache::new(cache.clone()))
        .with_endpoint(settings.endpoint.clone())
        .with_progress(false)
        // A body that breaks off mid-way is resumed from where it stopped, twice at most.
        .with_retries(2)
        .build()
        .map_err(|e| ctx.error(CONFIG, e))?;
    let config = fetch(&ctx, &api, CONFIG)?;
    check_config(&ctx, &config)?;
    let snapshot = parent(&config);
    if snapshot.join(WEIGHTS).is_file() {
        return Ok(snapshot);
    }
    let weights = fetch(&ctx, &api, WEIGHTS)?;
    let snapshot = parent(&weights);
    // The hub moved to a new revision between the two files: link config.json there too.
    if !snapshot.join(CONFIG).is_file() {
        fetch(&ctx, &api, CONFIG)?;
    }
    Ok(snapshot)
}

const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";

/// The snapshot folder of a file hf-hub returned (`.../snapshots/REV/FILE`).
fn parent(path: &Path) -> PathBuf {
    path.parent().map_or_else(|| path.to_path_buf(), Path::to_path_buf)
}

/// What one download is about, for error messages.
struct Ctx<'a> {
    name: &'a str,
    repo: &'a str,
    settings: &'a HubSettings,
    cache: &'a Path,
}

impl Ctx<'_> {
    fn download_error(&self, file: &str, reason: String) -> HubError {
        HubError::Download {
            name: self.name.to_string(),
            file: file.to_string(),
            endpoint: self.settings.endpoint.clone(),
            cache: self.cache.to_path_buf(),
            reason,
        }
    }

    /// Sort an hf-hub error into "could not reach the hub" (a transport error of the first
    /// request: DNS, connect, TLS, proxy) and everything else (an HTTP status such as 404 or
    /// 401, a transfer that kept breaking off, a local I/O error, a lock held by another
    /// download).
    fn error(&self, file: &str, e: ApiError) -> HubError {
        match &e {
            // Only the transfer itself is retried (resuming the `.part`), so this is a body
            // that kept breaking off, not a hub that cannot be reached.
            ApiError::TooManyRetries(inner) => self.download_error(
                file,
                format!("the transfer kept breaking off ({inner}); run again to resume it"),
            ),
            ApiError::RequestError(re) => match re.as_ref() {
                ureq::Error::StatusCode(code) => self.download_error(file, format!("the hub answered HTTP {code}")),
                other => HubError::Unreachable {
                    name: self.name.to_string(),
                    endpoint: self.settings.endpoint.clone(),
                    reason: other.to_string(),
                },
            },
            _ => self.download_error(file, e.to_string()),
        }
    }
}

/// Progress of one file: drives the bar and the stall timer.
struct Watch {
    bar: Option<indicatif::ProgressBar>,
    /// A line for stderr at the first `init` (when the progress bar is on).
    announce: Option<String>,
    label: String,
    /// When progress was last made.
    beat: Arc<Mutex<Instant>>,
    /// The size the hub announced and the bytes counted so far (including a resumed prefix).
    counts: Arc<Mutex<(u64, u64)>>,
}

impl Watch {
    fn touch(&self) {
        *self.beat.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }
}

impl Progress for Watch {
    fn init(&mut self, size: usize, _filename: &str) {
        self.touch();
        *self.counts.lock().unwrap_or_else(|p| p.into_inner()) = (size as u64, 0);
        if let Some(line) = self.announce.take() {
            match &self.bar {
                Some(bar) if !bar.is_hidden() => bar.println(line),
                _ => eprintln!("{line}"),
            }
        }
        if let Some(bar) = &self.bar {
            bar.set_length(size as u64);
            bar.set_position(0);
            bar.set_message(self.label.clone());
        }
    }

    fn update(&mut self, size: usize) {
        self.touch();
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).1 += size as u64;
        if let Some(bar) = &self.bar {
            bar.inc(size as u64);
        }
    }

    fn finish(&mut self) {
        self.touch();
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// Download one file on a worker thread, waiting while it makes progress.
fn fetch(ctx: &Ctx, api: &hf_hub::api::sync::Api, file: &str) -> Result<PathBuf, HubError> {
    let beat = Arc::new(Mutex::new(Instant::now()));
    let counts = Arc::new(Mutex::new((0u64, 0u64)));
    let bar = ctx.settings.progress.then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
            )
            .expect("valid progress template")
            .progress_chars("=> "),
        );
        bar
    });
    let watch = Watch {
        bar: bar.clone(),
        // Said once the hub has answered, so a failure to reach it stays a one-line error.
        announce: ctx.settings.progress.then(|| {
            format!(
                "downloading {}/{file} from {} into {}",
                ctx.repo,
                ctx.settings.endpoint,
                ctx.cache.display()
            )
        }),
        label: format!("{} {file}", ctx.name),
        beat: beat.clone(),
        counts: counts.clone(),
    };
    let repo = api.repo(Repo::new(ctx.repo.to_string(), RepoType::Model));
    let (tx, rx) = mpsc::channel();
    let owned_file = file.to_string();
    std::thread::Builder::new()
        .name(format!("hf-hub {file}"))
        .spawn(move || {
            let _ = tx.send(repo.download_with_progress(&owned_file, watch));
        })
        .map_err(|e| ctx.download_error(file, format!("cannot start the download thread: {e}")))?;
    let tick = (ctx.settings.stall_timeout / 4).clamp(Duration::from_millis(10), Duration::from_millis(250));
    let result = loop {
        match rx.recv_timeout(tick) {
            Ok(r) => break r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let idle = beat.lock().unwrap_or_else(|p| p.into_inner()).elapsed();
                if idle >= ctx.settings.stall_timeout {
                    if let Some(bar) = &bar {
                        bar.abandon();
                    }
                    return Err(HubError::Stalled {
                        name: ctx.name.to_string(),
                        file: file.to_string(),
                        endpoint: ctx.settings.endpoint.clone(),
                        timeout: ctx.settings.stall_timeout,
                    });
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(ctx.download_error(file, "the download thread panicked".to_string()));
            }
        }
    };
    if let Some(bar) = &bar {
        bar.abandon();
    }
    let path = result.map_err(|e| ctx.error(file, e))?;
    // Belt and braces over hf-hub's own checks: the finished file must have the announced size.
    let (size, _) = *counts.lock().unwrap_or_else(|p| p.into_inner());
    let blob = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
    let len = std::fs::metadata(&blob).map(|m| m.len()).unwrap_or(0);
    if size > 0 && len != size {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&blob);
        return Err(ctx.download_error(
            file,
            format!("got {len} bytes, the hub announced {size}; the partial file was removed, run again"),
        ));
    }
    Ok(path)
}

/// The downloaded `config.json` must describe the GPT-2 size that was asked for.
fn check_config(ctx: &Ctx, path: &Path) -> Result<(), HubError> {
    let cfg = GPT2Config::from_hf_json(path).map_err(|e| ctx.download_error("config.json", e.to_string()))?;
    let want = GPT2Config::preset(ctx.name).expect("a preset name");
    if (cfg.n_layer, cfg.n_head, cfg.n_embd) != (want.n_layer, want.n_head, want.n_embd) {
        return Err(ctx.download_error(
            "config.json",
            format!(
                "it describes {} layers, {} heads, {} channels, not {} ({} layers, {} heads, {} channels)",
                cfg.n_layer, cfg.n_head, cfg.n_embd, ctx.name, want.n_layer, want.n_head, want.n_embd
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
