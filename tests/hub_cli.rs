//! `--model gpt2` through the built binary, with the Hugging Face variables set on the child
//! process only (no test changes its own environment, so nothing races): a cache hit, an
//! `HF_HUB_OFFLINE=1` miss, and an unreachable `HF_ENDPOINT`. No real network is used.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kernelforge::model::config::GPT2Config;
use kernelforge::model::weights::{write_hf_folder, GPT2Weights};

fn forward_gpt2(cache: &Path, vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kernelforge"));
    cmd.args([
        "forward", "--model", "gpt2", "--device", "cpu", "--ids", "15496,11", "--json",
    ])
    .env("HF_HUB_CACHE", cache)
    .env_remove("HF_HOME")
    .env_remove("HF_ENDPOINT")
    .env_remove("HF_HUB_OFFLINE");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn size_name_from_the_cache_without_network() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = GPT2Config::new(2, 2, 32, 64, 50257).unwrap();
    let repo = dir.path().join("models--openai-community--gpt2");
    write_hf_folder(
        &repo.join("snapshots").join("rev1"),
        &cfg,
        &GPT2Weights::random(&cfg, 9),
    )
    .unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "rev1").unwrap();
    // Online, but the endpoint refuses: a hit must not try it.
    let out = forward_gpt2(dir.path(), &[("HF_ENDPOINT", "http://127.0.0.1:9")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.is_object(), "{v}");
}

#[test]
fn offline_miss_points_to_model_path() {
    let dir = tempfile::tempdir().unwrap();
    let out = forward_gpt2(dir.path(), &[("HF_HUB_OFFLINE", "1")]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("`gpt2`") && err.contains("HF_HUB_OFFLINE") && err.contains("--model PATH"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn unreachable_hub_is_one_line_and_quick() {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let out = forward_gpt2(dir.path(), &[("HF_ENDPOINT", "http://127.0.0.1:9")]);
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("`gpt2`")
            && err.contains("could not reach the Hugging Face hub at http://127.0.0.1:9")
            && err.contains("--model PATH"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
