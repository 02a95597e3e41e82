//! Unit tests of `tune_decode_points.rs`: the near-ties, the step's choice, the buckets' runs
//! and reading a batch's choices back from the database (no GPU).

use super::*;
use crate::tune::records::Candidate;

fn params(warps: i64, rows: i64) -> IndexMap<String, i64> {
    [("keys_per_split", 256), ("warps", warps), ("rows_at_once", rows)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn candidate(warps: i64, rows: i64, ms: Option<f64>, rejected: bool) -> Candidate {
    Candidate {
        family: "attention_decode_groups".into(),
        params: params(warps, rows),
        median_ms: ms,
        spread_ms: ms.map(|m| m * 0.01),
        error: Some(1e-3),
        rejected: rejected.then(|| "wrong result".to_string()),
        resources: Vec::new(),
        step_ms: None,
    }
}

fn entry() -> Entry {
    let mut e = Entry::timed("attention_decode_groups", params(1, 4), Default::default(), 0.0314);
    e.candidates = vec![
        candidate(1, 4, Some(0.0314), false),
        candidate(4, 1, Some(0.0400), false), // 27% slower alone: not timed
        candidate(4, 2, Some(0.0315), false),
        candidate(8, 2, Some(0.0320), true), // rejected
        candidate(2, 2, Some(0.0322), false),
        candidate(2, 4, Some(0.0325), false), // a fifth near tie: over MOST
        candidate(8, 8, None, false),         // never timed
    ];
    e
}

#[test]
fn the_near_ties_are_the_winner_then_the_fastest_verified_points_within_reach() {
    let ties = near_ties(&entry());
    let warps_rows: Vec<(i64, i64)> = ties.iter().map(|p| (p.1["warps"], p.1["rows_at_once"])).collect();
    assert_eq!(warps_rows, vec![(1, 4), (4, 2), (2, 2), (2, 4)]);
    let mut alone = entry();
    alone.candidates.truncate(2);
    assert_eq!(near_ties(&alone).len(), 1, "no other point within 5%");
}

#[test]
fn the_step_winner_becomes_the_entry_with_its_own_time_alone_and_every_step_time_recorded() {
    let e = entry();
    let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
    let timed = [(point(1, 4), 0.684), (point(4, 2), 0.668), (point(2, 2), 0.671)];
    let chosen = with_step_times(e, &timed, &point(4, 2));
    assert_eq!(chosen.params, params(4, 2));
    assert_eq!(chosen.median_ms, 0.0315);
    let step = |w, r| {
        chosen
            .candidates
            .iter()
            .find(|c| c.params == params(w, r))
            .unwrap()
            .step_ms
    };
    assert_eq!(step(1, 4), Some(0.684));
    assert_eq!(step(4, 2), Some(0.668));
    assert_eq!(step(4, 1), None);
    // the winner alone kept: nothing moves but the step times
    let kept = with_step_times(entry(), &timed[..1], &point(1, 4));
    assert_eq!((kept.params, kept.median_ms), (params(1, 4), 0.0314));
}

#[test]
fn another_point_replaces_the_winner_alone_only_when_clearly_faster_in_the_step() {
    let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
    let timed = [(point(1, 4), 0.607), (point(4, 2), 0.600), (point(2, 2), 0.603)];
    assert_eq!(step_choice(&timed), (point(4, 2), 0.600), "1.2% faster: switched");
    let close = [(point(4, 2), 0.431), (point(2, 4), 0.430)];
    assert_eq!(step_choice(&close), (point(4, 2), 0.431), "0.2% faster: kept");
    let clear = [(point(4, 2), 0.431), (point(2, 4), 0.428)];
    assert_eq!(step_choice(&clear).0, point(2, 4), "0.7% faster: switched");
    let slower = [(point(4, 2), 0.431), (point(2, 4), 0.450)];
    assert_eq!(step_choice(&slower).0, point(4, 2));
}

#[test]
fn the_step_compares_points_round_by_round_so_a_drift_between_rounds_cancels() {
    let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
    // The clocks drift between rounds (0.56-0.61 ms, as at batch 256); the candidate is 1%
    // faster than the winner alone in every round but one, where it ran after a drift upwards.
    let alone = vec![0.610, 0.560, 0.600, 0.575, 0.590];
    let faster = vec![0.6039, 0.5544, 0.6060, 0.5693, 0.5841];
    // By the medians of the rounds' times, a point slower in every round but one, where it ran
    // at the fastest clocks, would look 1.9% faster (0.579 against 0.590): paired, it loses.
    let noisy = vec![0.6150, 0.5650, 0.6050, 0.5790, 0.5300];
    let rounds = [
        (point(1, 4), alone.clone()),
        (point(2, 2), noisy.clone()),
        (point(4, 2), faster.clone()),
    ];
    let timed = paired_step_times(&rounds);
    // the winner alone at its median; the others at it times their median ratio to it
    let ms: Vec<f64> = timed.iter().map(|(_, ms)| *ms).collect();
    let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert_eq!(ms[0], 0.590);
    assert!(near(ms[1], 0.590 * 0.6150 / 0.610), "{ms:?}");
    assert!(near(ms[2], 0.590 * 0.99), "{ms:?}");
    let (chosen, chosen_ms) = step_choice(&timed);
    assert_eq!(
        (chosen, chosen_ms),
        (point(4, 2), ms[2]),
        "1% faster round by round: switched"
    );
    assert_eq!(
        step_choice(&paired_step_times(&rounds[..2])).0,
        point(1, 4),
        "slower in four rounds of five: kept"
    );
}

#[test]
fn every_timed_step_keeps_its_cache_inside_the_bucket() {
    assert_eq!(bucket_run(0, 128), Some((16, 64)));
    assert_eq!(bucket_run(128, 256), Some((129, 64)));
    assert_eq!(bucket_run(512, 1024), Some((513, 64)));
    // a tiny model's one bucket: the steps the context leaves
    assert_eq!(bucket_run(0, 64), Some((16, 48)));
    assert_eq!(bucket_run(0, 20), None);
    for (below, len) in [(0, 128), (128, 256), (256, 300), (0, 64)] {
        let (prompt, steps) = bucket_run(below, len).unwrap();
        assert!(
            prompt + 1 > below && prompt + steps <= len,
            "{below}..{len}: {prompt} + {steps}"
        );
    }
}

#[test]
fn the_table_says_which_point_the_step_chose_and_what_won_alone() {
    let point = |w, r| ("attention_decode_groups".to_string(), params(w, r));
    let rows = [
        InStep {
            batch: 256,
            role: "attention",
            key: "attention_decode|bf16|none|B=256 HS=64 NH=12 T=128 max_T=128".into(),
            bucket: Some(128),
            prompt: 16,
            steps: 64,
            alone: (point(1, 4), Some(0.684)),
            chosen: (point(4, 2), 0.668),
            timed: 4,
            from_db: false,
        },
        InStep {
            batch: 64,
            role: "attention",
            key: "attention_decode|bf16|none|B=64 HS=64 NH=12 T=256 max_T=256".into(),
            bucket: Some(256),
            prompt: 129,
            steps: 64,
            alone: (point(4, 4), None),
            chosen: (point(4, 4), 0.401),
            timed: 3,
            from_db: true,
        },
    ];
    let t = points_table(&rows);
    let lines: Vec<&str> = t.lines().collect();
    assert!(lines[2].contains("0.684") && lines[2].contains("0.668"), "{t}");
    assert!(
        lines[2].contains("warps=4 rows_at_once=2") && lines[2].contains("the winner alone was"),
        "{t}"
    );
    assert!(
        lines[3].contains("from the database") && lines[3].contains("129+64"),
        "{t}"
    );
    assert_eq!(rows[0].json()["chosen"]["params"]["warps"], 4);
    assert!(rows[0].switched() && !rows[1].switched());
}

#[test]
fn a_matmul_row_names_its_role_epilogue_and_size() {
    let point = |w, r| ("matmul_wgmma_tma".to_string(), params(w, r));
    let mut row = InStep {
        batch: 256,
        role: "qkv",
        key: "matmul|bf16|ln_qkv|K=768 M=256 N=2304 T=1 n_head=12".into(),
        bucket: None,
        prompt: 16,
        steps: 64,
        alone: (point(1, 4), Some(0.669)),
        chosen: (point(4, 2), 0.655),
        timed: 4,
        from_db: false,
    };
    assert_eq!(row.what(), "qkv: ln_qkv 2304x768");
    let json = row.json();
    assert_eq!(
        (json["role"].as_str(), json["cache_up_to"].is_null()),
        (Some("qkv"), true)
    );
    assert!(points_table(std::slice::from_ref(&row)).contains("qkv: ln_qkv 2304x768"));
    row.role = "matmul"; // a shape the model does not multiply
    assert_eq!(row.what(), "ln_qkv 2304x768");
}

#[test]
fn a_decode_matmul_of_a_batch_has_one_row_a_sequence() {
    let shape = |m: i64, t: i64| -> crate::ops::Shape {
        [("M", m), ("N", 2304), ("K", 768), ("T", t), ("n_head", 12)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    };
    let entry = |m, t| Entry::timed("matmul_wgmma_tma", params(1, 1), shape(m, t), 0.01);
    let bf16 = "matmul|bf16|ln_qkv|K=768 M=256 N=2304 T=1 n_head=12";
    assert!(is_decode_matmul_of(bf16, &entry(256, 1), Dtype::Bf16, 256));
    assert!(!is_decode_matmul_of(bf16, &entry(256, 1), Dtype::Bf16, 64));
    assert!(
        !is_decode_matmul_of(bf16, &entry(256, 16), Dtype::Bf16, 256),
        "a prefill of 16 sequences of 16 tokens"
    );
    assert!(
        !is_decode_matmul_of(bf16, &entry(256, 1), Dtype::F16, 256),
        "another dtype's step choices say nothing of this one's"
    );
    assert!(!is_decode_matmul_of(
        "attention_decode|bf16|none|B=256 HS=64 NH=12 T=128 max_T=128",
        &entry(256, 1),
        Dtype::Bf16,
        256
    ));
}
