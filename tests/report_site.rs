//! `kernelforge report` without a GPU: renders the site from the fixture database and bench
//! files in `tests/fixtures/report/` and checks its structure (every workload and family has a
//! page, every link resolves to a file inside the folder, every SVG parses, nothing points
//! outside), its error messages, its atomic replacement of an earlier site, and its size and
//! speed for a fully tuned GPT-2 (synthetic timings). `report_browser.rs` loads it in Chromium.

mod report_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kernelforge::model::GPT2Config;
use kernelforge::report::data::{slugify, workloads};
use kernelforge::report::{render_site, ReportInput};
use kernelforge::spec::{expand, DeviceLimits, Dtype, Points, Variant};
use kernelforge::tune::db::{Candidate, Ceilings, DbHeader, Entry, Resources, TuneKey, TuningDb, FORMAT_VERSION};
use kernelforge::tune::registry::variant_kind;
use kernelforge::tune::tuner::workload_flops;
use kernelforge::tune::workloads::model_workloads;
use report_support::*;

#[test]
fn the_fixture_site_has_every_page_and_every_link_resolves() {
    let benches = [fixtures().join("bench-b8.json"), fixtures().join("bench-b1.json")];
    let input = ReportInput::load(&root(), Some(&fixtures().join("db.json")), &benches).expect("fixtures load");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    let summary = render_site(&input, &out).unwrap();
    let all = files(&out);
    for page in [
        "index.html",
        "families.html",
        "model.html",
        "assets/style.css",
        "kernelforge-report.json",
    ] {
        assert!(all.contains(&PathBuf::from(page)), "{page} missing from {all:?}");
    }
    let db = input.db.as_ref().unwrap();
    assert!(db.len() >= 4, "the fixture has several workloads");
    for w in workloads(db) {
        assert!(out.join(format!("workloads/{}.html", w.slug)).is_file(), "{}", w.key);
        assert_eq!(w.slug, slugify(&w.key));
    }
    for f in &input.catalog.families {
        assert!(out.join(format!("families/{}.html", f.name)).is_file(), "{}", f.name);
    }
    assert!(summary.winners >= 3, "{summary:?}");
    let svgs = check_site(&out);
    assert!(svgs >= 10, "roofline, strip plots, small plots, bars: {svgs}");

    let index = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(
        index.contains("Roofline") && index.contains("class=\"roof\""),
        "roofs drawn"
    );
    assert!(index.contains("not measured"), "the fixture lacks the BF16 ceiling");
    assert!(index.contains("cuBLAS TF32") && index.contains("copy"));
    let model = std::fs::read_to_string(out.join("model.html")).unwrap();
    assert!(
        model.contains("src=\"assets/timeline-1.svg\""),
        "the recorded timeline is shown"
    );
    assert!(model.contains("beside the floor") && model.contains("megakernel"));
    assert!(model.contains("Forward: GPU time per op") && model.contains("Decode: GPU time per op"));
    // The old-format entry (no candidates) renders with a note, not an error.
    let old = workloads(db)
        .into_iter()
        .find(|w| w.entry.candidates.is_empty())
        .unwrap();
    let page = std::fs::read_to_string(out.join(format!("workloads/{}.html", old.slug))).unwrap();
    assert!(page.contains("before candidates were kept"));
    // A winner page has its diff and listing.
    let winner = all
        .iter()
        .find(|p| p.starts_with("families") && p.components().count() == 3)
        .unwrap();
    let page = std::fs::read_to_string(out.join(winner)).unwrap();
    assert!(page.contains("<table class=\"diff\">") && page.contains("<ol class=\"src\">"));
}

#[test]
fn bad_inputs_name_the_file_and_leave_no_half_site() {
    let tmp = tempfile::tempdir().unwrap();
    let bad_db = tmp.path().join("broken-db.json");
    std::fs::write(&bad_db, "{\"header\": 3").unwrap();
    let e = ReportInput::load(&root(), Some(&bad_db), &[])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("broken-db.json") && e.contains("not a kernelforge tuning database"),
        "{e}"
    );
    assert!(bad_db.exists(), "never moved aside");
    let bad_bench = tmp.path().join("broken-bench.json");
    std::fs::write(&bad_bench, "{\"forward\": {\"median_ms\": \"fast\"}}").unwrap();
    let e = ReportInput::load(&root(), Some(&fixtures().join("db.json")), &[bad_bench])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("broken-bench.json") && e.contains("bench --json"), "{e}");

    // A folder that is not a report is never replaced.
    let precious = tmp.path().join("precious");
    std::fs::create_dir(&precious).unwrap();
    std::fs::write(precious.join("thesis.txt"), "keep me").unwrap();
    let e = render_site(&fixture_input(), &precious).unwrap_err().to_string();
    assert!(e.contains("precious") && e.contains("not a kernelforge report"), "{e}");
    assert_eq!(std::fs::read_to_string(precious.join("thesis.txt")).unwrap(), "keep me");
    // An earlier report is replaced whole, and no temporary folder is left behind.
    let site = tmp.path().join("site");
    render_site(&fixture_input(), &site).unwrap();
    std::fs::write(site.join("stale.html"), "old").unwrap();
    render_site(&fixture_input(), &site).unwrap();
    assert!(!site.join("stale.html").exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kernelforge-report"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// The fixture database with its entries changed by `edit`, written to a fresh temporary folder
/// and rendered there (without bench files): the folder (alive as long as the caller keeps it),
/// the site's path and the summary.
fn render_edited_fixture(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> (tempfile::TempDir, PathBuf, kernelforge::report::SiteSummary) {
    let text = std::fs::read_to_string(fixtures().join("db.json")).unwrap();
    let mut db: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(db["entries"].as_object_mut().unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("edited.json");
    std::fs::write(&path, db.to_string()).unwrap();
    let input = ReportInput {
        catalog: catalog(),
        db: Some(TuningDb::read_only(&path).unwrap()),
        benches: Vec::new(),
    };
    let out = tmp.path().join("site");
    let summary = render_site(&input, &out).unwrap();
    (tmp, out, summary)
}

/// Odd values a hand-edited or future database may hold render as "-" or a note, never a panic
/// or a broken page: a zero time, a negative candidate time, a family the specs no longer have,
/// params outside the space, an unknown dtype, a key without a shape.
#[test]
fn odd_database_values_render_without_panic() {
    let mut keys: Vec<String> = Vec::new();
    let (_tmp, out, summary) = render_edited_fixture(|entries| {
        keys = entries.keys().cloned().collect();
        let first = entries.get_mut(&keys[0]).unwrap();
        first["median_ms"] = 0.0.into();
        first["baseline_ms"] = 0.0.into();
        first["candidates"][0]["median_ms"] = (-1.0).into();
        let mut gone = entries[&keys[1]].clone();
        gone["family"] = "matmul_gone".into();
        entries.insert("matmul|fp8|none|M=1".into(), gone);
        let mut bad_params = entries[&keys[2]].clone();
        bad_params["params"]["block_m"] = 7777.into();
        entries.insert("matmul|f32|bias_gelu|odd".into(), bad_params);
        entries.insert("weird".into(), entries[&keys[3]].clone());
    });
    assert_eq!(summary.workloads, keys.len() + 3);
    check_site(&out);
    let index = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(index.contains("matmul_gone") && !index.contains("NaN") && !index.contains("inf"));
}

/// A decode step tuned by `tune --decode-step` (the megakernel's points against the graph
/// engine) gets its workload page, which says what its times are and names the graph as peer.
#[test]
fn a_tuned_decode_step_gets_a_page_with_the_graph_engine_as_peer() {
    let point = |slot: i64| {
        serde_json::json!({"threads": 512, "blocks_per_sm": 1, "slot_kib": slot, "slots": 3, "cols_per_warp": 1,
                           "max_rows": 1, "head_dim": 64, "min_chunk_keys": 64, "bulk_copy": 1})
    };
    let shape =
        serde_json::json!({"B": 1, "C": 768, "HS": 64, "L": 12, "NH": 12, "Vp": 50304, "elem_bytes": 2, "max_T": 1024});
    let entry = serde_json::json!({
        "family": "decode_megakernel", "params": point(48), "shape": shape, "median_ms": 0.3593, "spread_ms": 0.0,
        "baseline_ms": 0.4133, "baseline": "graph engine (the kernel-by-kernel step replayed as a CUDA graph)",
        "variants_tried": 3, "tuned_at": 0, "role": "decode_step", "flops": 0.0, "bytes": 0.0,
        "candidates": [
            {"family": "decode_megakernel", "params": point(48), "median_ms": 0.3593},
            {"family": "decode_megakernel", "params": point(64), "median_ms": 0.3692},
            {"family": "decode_megakernel", "params": point(16), "rejected": "2 blocks per SM do not fit"}
        ]
    });
    let (_tmp, out, _) = render_edited_fixture(|entries| {
        entries.insert(
            "decode_step|bf16|none|B=1 C=768 HS=64 L=12 NH=12 Vp=50304 elem_bytes=2 max_T=1024".into(),
            entry,
        );
    });
    check_site(&out);
    let page = std::fs::read_dir(out.join("workloads"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("decode_step"))
        .expect("a page for the decode step");
    let html = std::fs::read_to_string(page).unwrap();
    assert!(
        html.contains("per greedy step") && html.contains("graph engine"),
        "{html}"
    );
    // The strip plot speaks of steps, not kernels.
    assert!(html.contains("per greedy decode step, ms") && html.contains("0.3593 ms per step"));
    assert!(!html.contains("after re-timing") && !html.contains("kernel time"));
    assert!(
        html.contains("1.15") && html.contains("1 rejected"),
        "the speed vs the graph and the refused point"
    );
    assert!(!html.contains("NaN") && !html.contains("inf"));
}

#[test]
fn without_a_database_the_site_shows_the_specs() {
    let tmp = tempfile::tempdir().unwrap();
    let input = ReportInput {
        catalog: catalog(),
        db: None,
        benches: Vec::new(),
    };
    render_site(&input, &tmp.path().join("s")).unwrap();
    check_site(&tmp.path().join("s"));
    let index = std::fs::read_to_string(tmp.path().join("s/index.html")).unwrap();
    assert!(index.contains("No tuning database"));
}

/// A small deterministic hash for synthetic timings.
fn mix(text: &str, seed: u64) -> u64 {
    text.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A database as a full tuning of GPT-2 124M would leave it: every workload of `batches` ×
/// `dtypes` (prefill at 1024 and the decode step), up to `per_family` real variants of each
/// family that supports it, synthetic times and resources.
fn synthetic_db(batches: &[i64], dtypes: &[Dtype], per_family: usize) -> serde_json::Value {
    let catalog = catalog();
    let limits = DeviceLimits::default();
    let cfg = GPT2Config::preset("gpt2").unwrap();
    let mut samples: BTreeMap<String, Vec<Variant>> = BTreeMap::new();
    let mut entries = BTreeMap::new();
    for &dtype in dtypes {
        for w in model_workloads(&cfg.dims(), batches, &[1024], dtype) {
            let kind = variant_kind(w.epilogue, w.mask).to_string();
            let key = TuneKey {
                op: w.op.to_string(),
                dtype: w.dtype.to_string(),
                variant_kind: kind.clone(),
                shape: w.shape.clone(),
            };
            let flops = workload_flops(&w);
            let elem = if matches!(w.dtype, Dtype::F16 | Dtype::Bf16) {
                2.0
            } else {
                4.0
            };
            let s = |k: &str| w.shape.get(k).copied().unwrap_or(1) as f64;
            let bytes = match w.op {
                "matmul" => elem * (s("M") * s("K") + s("N") * s("K") + s("M") * s("N")),
                "attention" => elem * 4.0 * s("B") * s("NH") * s("T") * s("HS"),
                _ => elem * 2.0 * s("N") * s("C").max(s("B") * s("T")),
            };
            // Winners near 60% of the FP32 or tensor-core peak, or 70% of the copy bandwidth.
            let peak = if w.dtype == Dtype::F32 { 66.9e12 } else { 378e12 };
            let base_ms = (flops / (0.6 * peak)).max(bytes / (0.7 * 2.95e12)).max(3e-6) * 1e3;
            let mut candidates = Vec::new();
            for f in catalog.for_op(w.op) {
                if !f.dtypes.contains(&w.dtype) || !f.epilogues.contains(&w.epilogue) || !f.masks.contains(&w.mask) {
                    continue;
                }
                let pool = samples
                    .entry(f.name.clone())
                    .or_insert_with(|| expand(f, Points::Sample { count: 60, seed: 7 }, &limits).unwrap());
                let picked = pool
                    .iter()
                    .filter(|v| v.dtype == w.dtype && v.epilogue == w.epilogue && v.mask == w.mask)
                    .filter(|v| v.check_shape(&w.shape, &limits).is_ok())
                    .take(per_family);
                for v in picked {
                    let h = mix(&format!("{}{}", v.kernel_name(), key.text()), 1);
                    let registers = 32 + (h % 224) as i32;
                    let rejected = h.is_multiple_of(13);
                    // Slower with the family's rank and with the first parameter's value.
                    let knob = v
                        .params
                        .values()
                        .next()
                        .map(|p| (*p as f64).max(1.0).log2())
                        .unwrap_or(0.0);
                    let ms =
                        base_ms * (1.0 + (h % 1000) as f64 / 400.0) * (1.0 + f.rank as f64 / 8.0) * (1.0 + knob / 6.0);
                    candidates.push(Candidate {
                        family: f.name.clone(),
                        params: v.params.clone(),
                        median_ms: (!rejected).then_some(ms),
                        spread_ms: (!rejected).then_some(ms * 0.02),
                        error: Some(1e-7 * (1 + h % 50) as f64),
                        rejected: rejected.then(|| "wrong result: relative L2 error 3.1e-2 (bar 1e-2)".to_string()),
                        // The kernels the variant launches (a conditional one only where it runs).
                        resources: v
                            .launches(&w.shape, &limits)
                            .unwrap()
                            .iter()
                            .map(|l| Resources {
                                kernel: f.kernels[l.kernel].name.clone(),
                                registers,
                                static_smem_bytes: v.derived.get("smem_bytes").copied().unwrap_or(0) as i32,
                                local_bytes: if registers > 240 { 16 } else { 0 },
                            })
                            .collect(),
                        step_ms: None,
                    });
                }
            }
            let Some(best) = candidates
                .iter()
                .filter(|c| c.median_ms.is_some())
                .min_by(|a, b| a.median_ms.partial_cmp(&b.median_ms).unwrap())
                .cloned()
            else {
                continue;
            };
            let ms = best.median_ms.unwrap() * 0.98;
            let entry = Entry {
                family: best.family.clone(),
                params: best.params.clone(),
                shape: w.shape.clone(),
                median_ms: ms,
                spread_ms: ms * 0.01,
                baseline_ms: (w.op == "matmul").then_some(ms * 1.03),
                baseline: (w.op == "matmul").then(|| "cuBLASLt bias (fused)".to_string()),
                baseline_unavailable: None,
                variants_tried: candidates.len(),
                tuned_at: 1_700_000_000,
                role: Some(w.role.clone()),
                flops,
                bytes,
                candidates,
            };
            entries.insert(key.text(), entry);
        }
    }
    let header = DbHeader {
        gpu: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: (9, 0),
        driver_version: 13000,
        nvrtc_version: (13, 0),
        format: FORMAT_VERSION,
    };
    let ceilings = Ceilings {
        fp32_tflops: Some(66.9),
        tf32_tflops: Some(378.0),
        bf16_tflops: Some(712.0),
        copy_gb_per_s: Some(2950.0),
        measured_at: 1_700_000_000,
    };
    serde_json::json!({ "header": header, "ceilings": ceilings, "entries": entries })
}

/// The bar: the site of a fully tuned GPT-2 (two batches, two dtypes) is under 10 MB
/// and renders in under 2 s (checked in release builds; debug builds print the time).
#[test]
fn a_fully_tuned_gpt2_site_is_small_and_fast() {
    let tmp = tempfile::tempdir().unwrap();
    let db_path = tmp.path().join("gpt2.json");
    let db = synthetic_db(&[8, 1], &[Dtype::F32, Dtype::Bf16], 12);
    std::fs::write(&db_path, serde_json::to_string(&db).unwrap()).unwrap();
    let catalog = catalog();
    // Timed: reading the database and bench files, then rendering. The catalog is loaded
    // before (validating the specs costs every command the same; `report` adds nothing to it).
    let started = Instant::now();
    let input = ReportInput {
        catalog,
        db: Some(TuningDb::read_only(&db_path).unwrap()),
        benches: benches(),
    };
    let summary = render_site(&input, &tmp.path().join("site")).unwrap();
    let took = started.elapsed();
    // KERNELFORGE_REPORT_KEEP=DIR keeps a copy of this site for a look (screenshots), and its
    // database as DIR.db.json (to time `kernelforge report` on it).
    if let Some(keep) = std::env::var_os("KERNELFORGE_REPORT_KEEP") {
        render_site(&input, Path::new(&keep)).unwrap();
        std::fs::copy(&db_path, format!("{}.db.json", Path::new(&keep).display())).unwrap();
    }
    println!(
        "fully tuned GPT-2: {} workloads, {} winners, {} files, {:.2} MB in {:.2} s",
        summary.workloads,
        summary.winners,
        summary.files,
        summary.bytes as f64 / 1e6,
        took.as_secs_f64()
    );
    assert!(summary.workloads >= 30, "{summary:?}");
    // 80 workloads since decode attention is tuned per cache-length bucket (four a batch and
    // dtype): about 128 KB a workload
    assert!(summary.bytes < 12_000_000, "{summary:?}");
    if !cfg!(debug_assertions) {
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
    check_site(&tmp.path().join("site"));
}
