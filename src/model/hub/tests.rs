//! No test touches the real network or the process environment: settings are passed in,
//! and downloads go to a small HTTP server on 127.0.0.1 that this file runs itself.

use super::*;
use crate::model::weights::{load_model, write_hf_folder, GPT2Weights};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn settings(cache: &Path, endpoint: &str) -> HubSettings {
    HubSettings {
        cache: Some(cache.to_path_buf()),
        endpoint: endpoint.to_string(),
        offline: false,
        progress: false,
        stall_timeout: Duration::from_secs(10),
    }
}

/// A port where nothing listens: connections are refused at once.
const REFUSED: &str = "http://127.0.0.1:9";

#[test]
fn cache_hit_needs_no_network() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    // A small random checkpoint in the Python cache layout, under the short repo name.
    let cfg = GPT2Config::new(2, 2, 32, 64, 50257).unwrap();
    let repo = cache.join("models--gpt2-medium");
    let snap = repo.join("snapshots").join("abc123");
    write_hf_folder(&snap, &cfg, &GPT2Weights::random(&cfg, 3)).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "abc123\n").unwrap();
    // The endpoint refuses connections, so reaching it would fail the test.
    let got = resolve_model("gpt2-medium", &settings(&cache, REFUSED)).unwrap();
    assert_eq!(got, snap);
    assert_eq!(
        resolve_model("openai-community/gpt2-medium", &settings(&cache, REFUSED)).unwrap(),
        snap
    );
    assert_eq!(load_model(&got).unwrap().config.n_layer, 2);
    // An existing path is taken as is.
    let p = snap.display().to_string();
    assert_eq!(resolve_model(&p, &settings(&cache, REFUSED)).unwrap(), snap);
}

#[test]
fn incomplete_snapshots_are_not_hits() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models--openai-community--gpt2");
    let snap = repo.join("snapshots").join("abc");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::write(snap.join("config.json"), "{}").unwrap();
    // Weights still downloading (hf-hub's and Python's partial-file names).
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::write(repo.join("blobs").join("e.part"), "x").unwrap();
    std::fs::write(repo.join("blobs").join("e.incomplete"), "x").unwrap();
    assert_eq!(cached_snapshot(dir.path(), "gpt2"), None);
}

#[test]
fn unknown_names_and_no_cache() {
    let dir = tempfile::tempdir().unwrap();
    let msg = resolve_model("gpt5", &settings(dir.path(), REFUSED))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`gpt5` not found") && msg.contains("gpt2-xl"), "{msg}");
    let mut s = settings(dir.path(), REFUSED);
    s.cache = None;
    let msg = resolve_model("gpt2", &s).unwrap_err().to_string();
    assert!(msg.contains("HF_HOME") && msg.contains("--model PATH"), "{msg}");
}

#[test]
fn offline_miss_says_so_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = settings(dir.path(), REFUSED);
    s.offline = true;
    let err = resolve_model("gpt2-xl", &s).unwrap_err();
    assert!(matches!(err, HubError::Offline { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("`gpt2-xl`")
            && msg.contains("HF_HUB_OFFLINE")
            && msg.contains("--model PATH")
            && msg.contains(&dir.path().display().to_string()),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "offline wrote to the cache"
    );
}

#[test]
fn unreachable_hub_fails_fast_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let err = resolve_model("gpt2", &settings(dir.path(), REFUSED)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert!(matches!(err, HubError::Unreachable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("`gpt2`")
            && msg.contains("could not reach the Hugging Face hub at http://127.0.0.1:9")
            && msg.contains("--model PATH")
            && !msg.contains('\n'),
        "{msg}"
    );
    assert_eq!(cached_snapshot(dir.path(), "gpt2"), None);
}

#[test]
fn settings_from_variables() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
    };
    let home = Some(PathBuf::from("/home/u"));
    let s = HubSettings::from_vars(vars(&[]), home.clone());
    assert_eq!(s.cache, Some(PathBuf::from("/home/u/.cache/huggingface/hub")));
    assert_eq!(s.endpoint, DEFAULT_ENDPOINT);
    assert!(!s.offline && s.progress);
    let s = HubSettings::from_vars(
        vars(&[
            ("HF_HOME", "/hf"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_HUB_OFFLINE", "1"),
            ("HF_HUB_DISABLE_PROGRESS_BARS", "true"),
        ]),
        home.clone(),
    );
    assert_eq!(s.cache, Some(PathBuf::from("/hf/hub")));
    assert_eq!(s.endpoint, "http://127.0.0.1:9");
    assert!(s.offline && !s.progress);
    let s = HubSettings::from_vars(
        vars(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/hf"), ("HF_HUB_OFFLINE", "0")]),
        None,
    );
    assert_eq!(s.cache, Some(PathBuf::from("/c")));
    assert!(!s.offline);
    assert_eq!(HubSettings::from_vars(vars(&[]), None).cache, None);
}

/// How the fake hub answers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Like the hub: HEAD-like `Range: bytes=0-0` probes and ranged downloads.
    Serve,
    /// Sends model.safetensors bodies only half-way, then closes the connection.
    Truncate,
    /// Accepts connections and never answers.
    Hang,
}

/// A minimal stand-in for the hub's `resolve` endpoint on 127.0.0.1, enough for hf-hub:
/// `GET /ORG/NAME/resolve/main/FILE` with a `Range` header answers 206 with `etag`,
/// `x-repo-commit` and `Content-Range`. It stops when dropped, or after 30 s on its own.
struct FakeHub {
    url: String,
    stop: Arc<AtomicBool>,
    /// `FILE bytes=A-B` of every request answered.
    requests: Arc<Mutex<Vec<String>>>,
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn etag(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

fn fake_hub(files: HashMap<&'static str, Vec<u8>>, mode: Mode) -> FakeHub {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let log = requests.clone();
    std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(30);
        let mut held = Vec::new();
        while !stop2.load(Ordering::SeqCst) && Instant::now() < end {
            match listener.accept() {
                Ok((stream, _)) if mode == Mode::Hang => held.push(stream),
                Ok((stream, _)) => serve(stream, &files, mode, &log),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    FakeHub { url, stop, requests }
}

fn serve(mut stream: TcpStream, files: &HashMap<&'static str, Vec<u8>>, mode: Mode, log: &Mutex<Vec<String>>) {
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let req = String::from_utf8_lossy(&req).to_string();
    let path = req.split_whitespace().nth(1).unwrap_or("");
    let file = path.rsplit_once("/resolve/main/").map_or("", |(_, f)| f);
    let Some(data) = files.get(file) else {
        let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        return;
    };
    let range = req
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("range: bytes=").map(str::to_string))
        .unwrap_or_else(|| "0-".to_string());
    log.lock().unwrap().push(format!("{file} bytes={}", range.trim()));
    let (a, b) = range.trim().split_once('-').unwrap();
    let start: usize = a.parse().unwrap();
    let end: usize = if b.is_empty() {
        data.len() - 1
    } else {
        b.parse().unwrap()
    };
    let body = &data[start..=end];
    let head = format!(
        "HTTP/1.1 206 Partial Content\r\ncontent-length: {}\r\ncontent-range: bytes {start}-{end}/{}\r\n\
         etag: \"{}\"\r\nx-repo-commit: {COMMIT}\r\nconnection: close\r\n\r\n",
        body.len(),
        data.len(),
        etag(data)
    );
    let _ = stream.write_all(head.as_bytes());
    let cut = if mode == Mode::Truncate && file == "model.safetensors" && body.len() > 1 {
        body.len() / 2
    } else {
        body.len()
    };
    let _ = stream.write_all(&body[..cut]);
}

fn gpt2_files() -> HashMap<&'static str, Vec<u8>> {
    let config = serde_json::to_vec_pretty(&GPT2Config::gpt2().to_hf_json()).unwrap();
    // Stand-in weights: the download path never parses them.
    let weights: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    HashMap::from([("config.json", config), ("model.safetensors", weights)])
}

#[test]
fn downloads_into_the_python_cache_layout() {
    let dir = tempfile::tempdir().unwrap();
    let files = gpt2_files();
    let hub = fake_hub(files.clone(), Mode::Serve);
    let snap = resolve_model("gpt2", &settings(dir.path(), &hub.url)).unwrap();
    let repo = dir.path().join("models--openai-community--gpt2");
    assert_eq!(snap, repo.join("snapshots").join(COMMIT));
    assert_eq!(std::fs::read_to_string(repo.join("refs").join("main")).unwrap(), COMMIT);
    for (name, data) in &files {
        // snapshots/REV/FILE is a relative link to blobs/ETAG, as Python lays it out.
        let link = snap.join(name);
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(
            std::fs::canonicalize(&link).unwrap(),
            std::fs::canonicalize(repo.join("blobs").join(etag(data))).unwrap()
        );
        assert_eq!(&std::fs::read(&link).unwrap(), data, "{name}");
    }
    drop(hub);
    // Now a cache hit: the server is gone and the endpoint refuses.
    assert_eq!(resolve_model("gpt2", &settings(dir.path(), REFUSED)).unwrap(), snap);
}

#[test]
fn a_broken_off_download_is_never_taken_as_complete_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let files = gpt2_files();
    let hub = fake_hub(files.clone(), Mode::Truncate);
    let err = resolve_model("gpt2", &settings(dir.path(), &hub.url)).unwrap_err();
    drop(hub);
    assert!(matches!(err, HubError::Download { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("--model PATH"),
        "{msg}"
    );
    assert_eq!(cached_snapshot(dir.path(), "gpt2"), None);
    let blobs = dir.path().join("models--openai-community--gpt2").join("blobs");
    let weights = &files["model.safetensors"];
    assert!(!blobs.join(etag(weights)).exists(), "a partial blob was published");
    let part = blobs.join(format!("{}.part", etag(weights)));
    let part_len = std::fs::metadata(&part).unwrap().len() as usize;
    assert!(part_len > 0 && part_len < weights.len(), "{part_len}");
    // The next run picks up the .part and completes it.
    let hub = fake_hub(files.clone(), Mode::Serve);
    let snap = resolve_model("gpt2", &settings(dir.path(), &hub.url)).unwrap();
    assert_eq!(&std::fs::read(snap.join("model.safetensors")).unwrap(), weights);
    assert!(!part.exists());
    // Resumed: only the missing tail was asked for.
    let resumed = format!("model.safetensors bytes={part_len}-");
    assert!(
        hub.requests.lock().unwrap().contains(&resumed),
        "{:?}",
        hub.requests.lock().unwrap()
    );
}

#[test]
fn a_silent_hub_ends_in_a_stall_error() {
    let dir = tempfile::tempdir().unwrap();
    let hub = fake_hub(gpt2_files(), Mode::Hang);
    let mut s = settings(dir.path(), &hub.url);
    s.stall_timeout = Duration::from_millis(300);
    let t = Instant::now();
    let err = resolve_model("gpt2", &s).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert!(matches!(err, HubError::Stalled { .. }), "{err:?}");
    assert!(err.to_string().contains("no progress") && err.to_string().contains("--model PATH"));
}

#[test]
fn a_config_of_another_size_is_refused_before_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = gpt2_files();
    files.insert(
        "config.json",
        serde_json::to_vec(&GPT2Config::gpt2_medium().to_hf_json()).unwrap(),
    );
    let hub = fake_hub(files, Mode::Serve);
    let msg = resolve_model("gpt2", &settings(dir.path(), &hub.url))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("24 layers") && msg.contains("not gpt2"), "{msg}");
    let blobs = dir.path().join("models--openai-community--gpt2").join("blobs");
    assert_eq!(
        std::fs::read_dir(blobs).unwrap().count(),
        2,
        "config.json blob + its lock only"
    );
}
