//! The search's pieces on the project's own specs: pools, the first round, steps, the climb's
//! rules (the climb itself is replayed on recorded times in `tests/search_replay.rs`).

use super::*;

fn catalog() -> Catalog {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    Catalog::load(&root.join("specs"), &root.join("templates")).unwrap()
}

fn workload(dtype: Dtype, m: i64) -> Workload {
    let shape = [("M", m), ("N", 2304), ("K", 768), ("T", m.min(1024)), ("n_head", 12)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    Workload {
        role: "attn.qkv".into(),
        op: "matmul",
        dtype,
        epilogue: Epilogue::Bias,
        mask: Mask::None,
        shape,
        calls: 1,
    }
}

fn pool_of(w: &Workload) -> Vec<Variant> {
    let limits = DeviceLimits::default();
    Pools::new(&catalog(), &[w], &limits).unwrap().pool(w, &limits)
}

/// A second family climbs while its best is within CLIMB_WITHIN of the best, and not when
/// it is twice as slow: on times made up for matmul_wgmma_tma (the best family) and
/// matmul_wgmma (1.1x or 2x as slow), the replayed search measures the second family
/// beyond its first-round points only in the first case.
#[test]
fn only_a_family_close_to_the_best_climbs() {
    use std::cell::RefCell;
    use std::hash::{Hash, Hasher};
    let w = workload(Dtype::Bf16, 1024);
    let pool = pool_of(&w);
    let limits = DeviceLimits::default();
    let first_round_of = |family: &str| {
        first_round(&pool, &[], 0)
            .iter()
            .filter(|v| v.family.name == family)
            .count()
    };
    for (slower, climbs) in [(1.1, true), (2.0, false)] {
        let measured = RefCell::new(Vec::new());
        let times = |v: &Variant| {
            measured.borrow_mut().push(v.family.name.clone());
            let mut h = std::hash::DefaultHasher::new();
            v.kernel_name().hash(&mut h);
            let spread = 1.0 + (h.finish() % 100) as f64 / 1000.0;
            let family = match v.family.name.as_str() {
                "matmul_wgmma_tma" => 1.0,
                "matmul_wgmma" => slower,
                _ => 5.0,
            };
            Some(family * spread)
        };
        super::super::climb::Replay::new("matmul", w.shape.clone(), pool.clone(), &times).run(0, &limits);
        let second = measured.borrow().iter().filter(|f| *f == "matmul_wgmma").count();
        assert_eq!(
            second > first_round_of("matmul_wgmma"),
            climbs,
            "{slower}x as slow: {second} points of matmul_wgmma measured"
        );
    }
}

#[test]
fn sample_sizes_grow_slowly() {
    assert_eq!(sample_size(1), 1);
    assert_eq!(sample_size(12), 1);
    assert_eq!(sample_size(105), 1);
    assert_eq!(sample_size(400), 2);
    assert_eq!(sample_size(1708), 3);
}

/// The first round holds every family once by its default (where valid), a few samples of
/// each, no repeats, and is the same for the same seed.
#[test]
fn first_round_covers_every_family_without_repeats() {
    let pool = pool_of(&workload(Dtype::Bf16, 1024));
    assert!(pool.len() > 1000, "{}", pool.len());
    let round = first_round(&pool, &[], 7);
    let families: HashSet<&str> = pool.iter().map(|v| v.family.name.as_str()).collect();
    for f in &families {
        assert!(round.iter().any(|v| v.family.name == *f), "{f} missing");
    }
    let names: HashSet<String> = round.iter().map(Variant::kernel_name).collect();
    assert_eq!(names.len(), round.len(), "no variant twice");
    assert!(round.len() < 60, "a small first round: {}", round.len());
    // Every family's default and start points ([[start]] in its spec) are in it.
    for v in &pool {
        if v.params == v.family.default || v.family.starts.contains(&v.params) {
            assert!(names.contains(&v.kernel_name()), "{} missing", v.key());
        }
    }
    assert!(
        pool.iter().any(|v| v.family.starts.contains(&v.params)),
        "some family has start points"
    );
    let again: Vec<String> = first_round(&pool, &[], 7).iter().map(Variant::kernel_name).collect();
    assert_eq!(again, round.iter().map(Variant::kernel_name).collect::<Vec<_>>());
    let other: Vec<String> = first_round(&pool, &[], 8).iter().map(Variant::kernel_name).collect();
    assert_ne!(other, again, "another seed samples other points");
    // Another M of the same epilogue samples the same kernels (their compiles are shared).
    let decode = pool_of(&workload(Dtype::Bf16, 8192));
    let names = |r: Vec<Variant>| r.iter().map(Variant::kernel_name).collect::<HashSet<_>>();
    assert_eq!(names(first_round(&decode, &[], 7)), names(round));
}

/// A step moves one parameter to a neighbouring listed value, and nothing else unless the
/// constraints forbid that move alone; then it lands on the valid point with the new value
/// that keeps the most of the others (split-K from a point without the staged epilogue
/// turns the staged epilogue on).
#[test]
fn steps_move_one_parameter_to_an_adjacent_value() {
    let limits = DeviceLimits::default();
    let w = workload(Dtype::Bf16, 1024);
    let pool = pool_of(&w);
    let start = pool
        .iter()
        .find(|v| {
            v.family.name == "matmul_wgmma_tma"
                && v.params
                    .iter()
                    .all(|(k, x)| *x == if k == "staged_epilogue" { 0 } else { v.family.default[k] })
        })
        .unwrap();
    let steps = steps(start, &pool, &limits);
    assert!(!steps.is_empty());
    for s in &steps {
        let moved: Vec<&String> = s.params.keys().filter(|k| s.params[*k] != start.params[*k]).collect();
        let adjacent = |name: &String| {
            let values = &start.family.params[name];
            let a = values.iter().position(|x| *x == start.params[name]).unwrap();
            let b = values.iter().position(|x| *x == s.params[name]).unwrap();
            a.abs_diff(b) == 1
        };
        assert!(moved.iter().any(|n| adjacent(n)), "{}", s.key());
        if moved.len() > 1 {
            assert!(
                pool.iter().any(|p| p.key() == s.key()),
                "a compound step is a pool point"
            );
        }
    }
    let split = steps.iter().find(|s| s.params["split_k"] == 2).expect("a split-K step");
    assert_eq!(split.params["staged_epilogue"], 1, "{}", split.key());
    let moved = split
        .params
        .keys()
        .filter(|k| split.params[*k] != start.params[*k])
        .count();
    assert_eq!(moved, 2, "only what split-K needs changes: {}", split.key());
}

/// The leaders' steps are taken in turn and cut at MAX_STEPS; a stalled climb keeps only
/// the best leader's.
#[test]
fn next_steps_interleave_the_leaders_and_a_stall_keeps_the_best_ones() {
    let pool = pool_of(&workload(Dtype::Bf16, 1024));
    let of = |family: &str, n: usize| -> Vec<Variant> {
        pool.iter()
            .filter(|v| v.family.name == family)
            .take(n)
            .cloned()
            .collect()
    };
    let (tma, mma) = (of("matmul_wgmma_tma", 20), of("matmul_mma", 3));
    assert_eq!((tma.len(), mma.len()), (20, 3));
    let fresh = next_steps(vec![tma.clone(), mma.clone()], false, 1);
    assert_eq!(fresh.len(), MAX_STEPS);
    let names: Vec<String> = fresh.iter().map(|v| v.kernel_name()).collect();
    let want: Vec<String> = [&tma[0], &mma[0], &tma[1], &mma[1], &tma[2], &mma[2], &tma[3]]
        .iter()
        .map(|v| v.kernel_name())
        .collect();
    assert_eq!(names[..7], want[..], "in turn, then the longer list alone");
    assert!(fresh[7..].iter().all(|v| v.family.name == "matmul_wgmma_tma"));
    let stalled = next_steps(vec![tma[..5].to_vec(), mma.clone()], true, 1);
    assert_eq!(
        stalled.iter().map(|v| v.kernel_name()).collect::<Vec<_>>(),
        tma[..5].iter().map(|v| v.kernel_name()).collect::<Vec<_>>()
    );
    assert!(
        next_steps(vec![Vec::new(), mma.clone()], true, 1).is_empty(),
        "the best has nothing left: the climb ends"
    );
    let lone = next_steps(vec![Vec::new(), tma[..2].to_vec(), mma], true, 2);
    assert_eq!(
        lone.iter().map(|v| v.kernel_name()).collect::<Vec<_>>(),
        tma[..2].iter().map(|v| v.kernel_name()).collect::<Vec<_>>(),
        "a stalled lone climb goes on from its distant leader, not from the other family"
    );
}

/// The distant leader: the fastest point of the best's family that is DISTANT_PARAMS or
/// more moves away; nearer points and other families do not count, however fast.
#[test]
fn the_distant_leader_is_the_fastest_point_of_another_basin() {
    let pool = pool_of(&workload(Dtype::Bf16, 1024));
    let tma: Vec<&Variant> = pool.iter().filter(|v| v.family.name == "matmul_wgmma_tma").collect();
    let best = tma[0];
    let near = tma
        .iter()
        .find(|v| (1..DISTANT_PARAMS).contains(&moves_apart(&v.params, &best.params)))
        .unwrap();
    let mut far = tma
        .iter()
        .filter(|v| moves_apart(&v.params, &best.params) >= DISTANT_PARAMS);
    let (far_slow, far_fast) = (far.next().unwrap(), far.next().unwrap());
    let other = pool.iter().find(|v| v.family.name == "matmul_mma").unwrap();
    let timed = [
        (best, 1.0),
        (*near, 1.1),
        (other, 1.2),
        (*far_slow, 3.0),
        (*far_fast, 2.0),
    ];
    let got = distant_from(timed.iter().map(|(v, t)| (*v, *t)), best).unwrap();
    assert_eq!(got.kernel_name(), far_fast.kernel_name());
    assert!(moves_apart(&got.params, &best.params) >= DISTANT_PARAMS);
    assert_eq!(moves_apart(&best.params, &best.params), 0);
    assert!(
        distant_from([(best, 1.0), (*near, 1.1)].into_iter(), best).is_none(),
        "no point far enough: no distant leader"
    );
}

/// A point lands on itself when the pool has it, else on the member sharing most values.
#[test]
fn nearest_in_pool_prefers_the_exact_point_then_the_most_shared_values() {
    let pool = pool_of(&workload(Dtype::Bf16, 1024));
    let v = &pool[pool.len() / 2];
    let found = nearest_in_pool(&pool, &v.family.name, &v.params).unwrap();
    assert_eq!(found.kernel_name(), v.kernel_name());
    let others: Vec<Variant> = pool
        .iter()
        .filter(|x| x.kernel_name() != v.kernel_name())
        .cloned()
        .collect();
    let near = nearest_in_pool(&others, &v.family.name, &v.params).unwrap();
    let shared = |x: &Variant| v.params.iter().filter(|(k, y)| x.params.get(*k) == Some(y)).count();
    let best = others
        .iter()
        .filter(|x| x.family.name == v.family.name)
        .map(shared)
        .max()
        .unwrap();
    assert_eq!(shared(near), best);
    assert!(best < v.params.len());
    assert!(nearest_in_pool(&pool, "no_such_family", &v.params).is_none());
}

/// Seeds come from the nearest tuned shapes of the same group, winner first, and only
/// variants the pool holds.
#[test]
fn seeds_come_from_the_nearest_tuned_shapes() {
    let w = workload(Dtype::Bf16, 1024);
    let pool = pool_of(&w);
    let dir = tempfile::tempdir().unwrap();
    let header = crate::tune::db::DbHeader {
        gpu: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: (9, 0),
        driver_version: 13000,
        nvrtc_version: (13, 0),
        format: crate::tune::db::FORMAT_VERSION,
    };
    let mut db = TuningDb::open(&dir.path().join("db.json"), header).unwrap();
    let key = |m: i64| TuneKey {
        op: "matmul".into(),
        dtype: "bf16".into(),
        variant_kind: "bias".into(),
        shape: workload(Dtype::Bf16, m).shape,
    };
    let pick = |i: usize| &pool[i * 97 % pool.len()];
    let entry = |m: i64, winner: &Variant, runner_up: &Variant| Entry {
        family: winner.family.name.clone(),
        params: winner.params.clone(),
        shape: key(m).shape,
        median_ms: 1.0,
        spread_ms: 0.0,
        baseline_ms: None,
        baseline: None,
        baseline_unavailable: None,
        variants_tried: 2,
        tuned_at: 0,
        role: None,
        flops: 0.0,
        bytes: 0.0,
        candidates: [(winner, 1.0), (runner_up, 1.5)]
            .iter()
            .map(|(v, ms)| crate::tune::records::Candidate {
                family: v.family.name.clone(),
                params: v.params.clone(),
                median_ms: Some(*ms),
                spread_ms: Some(0.0),
                error: Some(0.0),
                rejected: None,
                resources: Vec::new(),
                step_ms: None,
            })
            .collect(),
    };
    db.insert(&key(8192), entry(8192, pick(1), pick(2)));
    db.insert(&key(2048), entry(2048, pick(3), pick(4)));
    db.insert(&key(512), entry(512, pick(5), pick(5)));
    let seeds: Vec<String> = seeds_from_db(&db, &key(1024), &pool)
        .iter()
        .map(Variant::kernel_name)
        .collect();
    let want: Vec<String> = [3, 4, 5, 1, 2].iter().map(|i| pick(*i).kernel_name()).collect();
    assert_eq!(
        seeds, want,
        "nearest shapes first (2048, then 512, then 8192), winner before runner-up, no repeats"
    );
    // The key's own earlier winner (a --force re-tune) comes first.
    db.insert(&key(1024), entry(1024, pick(6), pick(7)));
    let seeds = seeds_from_db(&db, &key(1024), &pool);
    assert_eq!(seeds[0].kernel_name(), pick(6).kernel_name());
}
