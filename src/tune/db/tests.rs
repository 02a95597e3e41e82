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
            step_ms: Some(0.41),
        },
        Candidate {
            family: "matmul_tiled".into(),
            params: [("tile".to_string(), 32)].into_iter().collect(),
            median_ms: None,
            spread_ms: None,
            error: None,
            rejected: Some("wrong result".into()),
            resources: Vec::new(),
            step_ms: None,
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

#[test]
fn a_stand_in_tunes_into_a_database_of_its_own() {
    let rtx3090 = crate::gpu::stand_in::parse("sm_86").unwrap();
    let standing_in = DbHeader::new(
        &rtx3090.name_on("NVIDIA H200"),
        rtx3090.compute_capability,
        13000,
        (13, 0),
    );
    assert!(default_path(&standing_in).ends_with("tuning/nvidia-h200-as-rtx-3090-sm86.json"));
    // The H200's own database is not the stand-in's: opening it as the stand-in is refused.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h200.json");
    let own = DbHeader::new("NVIDIA H200", (9, 0), 13000, (13, 0));
    TuningDb::open(&path, own).unwrap().save().unwrap();
    let e = TuningDb::open(&path, standing_in).unwrap_err().to_string();
    assert!(e.contains("NVIDIA H200 as RTX 3090"), "{e}");
}
