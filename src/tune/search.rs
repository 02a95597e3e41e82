//! What the tuner measures, and in what order: the pool of valid variants of a workload, the
//! first round (every family's default, the winners of neighbouring shapes already in the
//! database, a seeded sample of each family), the steps of the climb that follows (one
//! parameter moved to the next value up or down from the best points so far), and the timing
//! rounds of successive halving (a short run for every candidate, longer runs for the best).
//!
//! Compiling a candidate costs far more than timing it (NVRTC + ptxas take 0.5 to 2 s per
//! tensor-core kernel; a timed run takes milliseconds), so the search is shaped to compile
//! few: a climb from good starting points converges after a few dozen kernels where sampling
//! the space needs hundreds. `--exhaustive` keeps the whole pool.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use indexmap::IndexMap;

use super::db::{Entry, TuneKey, TuningDb};
use super::time::TimingPlan;
use super::workloads::Workload;
use crate::ops::{Epilogue, Mask};
use crate::spec::{expand, variant_with, Catalog, DeviceLimits, Dtype, Family, Points, Variant};

/// What a workload draws its variants from: op, dtype, epilogue, mask.
type Kind = (&'static str, Dtype, Epilogue, Mask);

fn kind_of(w: &Workload) -> Kind {
    (w.op, w.dtype, w.epilogue, w.mask)
}

/// The variants of each (op, dtype, epilogue, mask) the workloads need. Every family that
/// serves one of them is expanded once, in parallel (expanding a tensor-core family's space
/// evaluates its constraints on tens of thousands of points, and one family serves several
/// epilogues); the shape check stays per workload.
pub struct Pools {
    by_kind: HashMap<Kind, Vec<Variant>>,
}

impl Pools {
    pub fn new(catalog: &Catalog, workloads: &[&Workload], limits: &DeviceLimits) -> Result<Pools, String> {
        use rayon::prelude::*;
        let mut by_kind: HashMap<Kind, Vec<Variant>> = workloads.iter().map(|w| (kind_of(w), Vec::new())).collect();
        // Candidates compute in the workload's dtype: tf32 workloads get the tf32 variants, f32
        // workloads the f32 ones.
        let serves = |f: &Family| {
            by_kind.keys().any(|(op, dtype, epilogue, mask)| {
                f.op.name() == *op
                    && f.dtypes.contains(dtype)
                    && f.epilogues.contains(epilogue)
                    && f.masks.contains(mask)
            })
        };
        let families: Vec<&Arc<Family>> = catalog.families.iter().filter(|f| serves(f)).collect();
        let expanded = families
            .par_iter()
            .map(|f| expand(f, Points::All, limits).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        // Catalog order within each kind.
        for v in expanded.into_iter().flatten() {
            if let Some(list) = by_kind.get_mut(&(v.family.op.name(), v.dtype, v.epilogue, v.mask)) {
                list.push(v);
            }
        }
        Ok(Pools { by_kind })
    }

    /// The variants of every family of the workload's op that compute in its dtype, have its
    /// epilogue and mask, and can run its shape on this device (`w` must be one of the
    /// workloads given to [`Pools::new`]).
    pub fn candidates<'a>(
        &'a self,
        w: &'a Workload,
        limits: &'a DeviceLimits,
    ) -> impl Iterator<Item = &'a Variant> + 'a {
        self.by_kind
            .get(&kind_of(w))
            .into_iter()
            .flatten()
            .filter(move |v| v.check_shape(&w.shape, limits).is_ok())
    }

    /// [`Pools::candidates`], owned: a workload's pool.
    pub fn pool(&self, w: &Workload, limits: &DeviceLimits) -> Vec<Variant> {
        self.candidates(w, limits).cloned().collect()
    }
}

/// How many of a family's `n` valid variants the first round samples besides its default:
/// grows with the square root, so a family of 1,700 points gets 3 and one of 100 gets 1 (the
/// climb does the rest).
pub fn sample_size(n: usize) -> usize {
    (1 + (n as f64).sqrt() as usize / 16).min(n)
}

/// Starting points taken from the database: for the tuned shapes of the same op, dtype and
/// epilogue/mask nearest to `key` (log distance over the shape's sizes; the key's own shape
/// first when `--force` re-tunes it), their winner and their next best timed candidates, when
/// the pool has them (same family and parameters).
pub fn seeds_from_db(db: &TuningDb, key: &TuneKey, pool: &[Variant]) -> Vec<Variant> {
    const SHAPES: usize = 4;
    const PER_SHAPE: usize = 3;
    let distance = |e: &Entry| -> f64 {
        key.shape
            .iter()
            .map(|(name, want)| {
                let have = e.shape.get(name).copied().unwrap_or(1).max(1) as f64;
                ((*want).max(1) as f64).ln() - have.ln()
            })
            .map(f64::abs)
            .sum()
    };
    let mut near: Vec<&Entry> = db.same_group(key).collect();
    near.sort_by(|a, b| distance(a).total_cmp(&distance(b)));
    let mut out: Vec<Variant> = Vec::new();
    for e in near.into_iter().take(SHAPES) {
        let mut timed: Vec<(&str, &IndexMap<String, i64>, f64)> = e
            .candidates
            .iter()
            .filter_map(|c| c.median_ms.map(|ms| (c.family.as_str(), &c.params, ms)))
            .collect();
        timed.sort_by(|a, b| a.2.total_cmp(&b.2));
        let points = std::iter::once((e.family.as_str(), &e.params)).chain(timed.into_iter().map(|(f, p, _)| (f, p)));
        let mut taken = 0;
        for (family, params) in points {
            if taken == PER_SHAPE {
                break;
            }
            if let Some(v) = pool.iter().find(|v| v.family.name == family && &v.params == params) {
                if !out.iter().any(|o| o.kernel_name() == v.kernel_name()) {
                    out.push(v.clone());
                }
                taken += 1;
            }
        }
    }
    out
}

/// The first round: the seeds, every family's default and start points (`[[start]]` in its
/// spec; each when valid for the shape), and a seeded sample of each family of [`sample_size`]
/// variants. Each variant once, seeds first.
///
/// The sample is the variants with the smallest hash of (seed, kernel name), not a shuffle:
/// workloads of one op, dtype and epilogue then sample the same kernels wherever they are
/// valid, and a model's workloads share their compiles.
pub fn first_round(pool: &[Variant], seeds: &[Variant], seed: u64) -> Vec<Variant> {
    let rank = |v: &Variant| {
        let mut h = std::hash::DefaultHasher::new();
        (seed, v.kernel_name()).hash(&mut h);
        h.finish()
    };
    let mut chosen: Vec<Variant> = seeds.to_vec();
    let mut families: Vec<&str> = Vec::new();
    for v in pool {
        if !families.contains(&v.family.name.as_str()) {
            families.push(&v.family.name);
        }
    }
    for family in families {
        let members: Vec<&Variant> = pool.iter().filter(|v| v.family.name == family).collect();
        let starting = |v: &Variant| v.params == v.family.default || v.family.starts.contains(&v.params);
        chosen.extend(members.iter().filter(|v| starting(v)).map(|v| (*v).clone()));
        let mut rest: Vec<&Variant> = members.into_iter().filter(|v| !starting(v)).collect();
        rest.sort_by_cached_key(|v| rank(v));
        let n = sample_size(rest.len() + 1);
        chosen.extend(rest.into_iter().take(n).cloned());
    }
    let mut seen = HashSet::new();
    chosen.retain(|v| seen.insert(v.kernel_name()));
    chosen
}

/// The variant of `family` in `pool` that shares the most parameter values with `params`
/// (the first such in pool order): where another workload's best point lands in this one's
/// pool when its exact point is not valid here (another epilogue, another shape).
pub fn nearest_in_pool<'p>(pool: &'p [Variant], family: &str, params: &IndexMap<String, i64>) -> Option<&'p Variant> {
    nearest(pool.iter().filter(|v| v.family.name == family), params)
}

/// Of `candidates`, the one that shares the most parameter values with `params`, i.e. the
/// fewest [`moves_apart`] (the first such).
fn nearest<'p>(candidates: impl Iterator<Item = &'p Variant>, params: &IndexMap<String, i64>) -> Option<&'p Variant> {
    candidates
        .fold(None, |best: Option<(&Variant, usize)>, v| {
            let n = moves_apart(params, &v.params);
            match best {
                Some((_, m)) if m <= n => best,
                _ => Some((v, n)),
            }
        })
        .map(|(v, _)| v)
}

/// One step of the climb from `v`: each parameter moved to the next listed value below or
/// above its own. Where the constraints forbid that move alone (split-K needs the staged
/// epilogue, a wider tile fewer stages, ...), the step is the point of `pool` (the workload's
/// valid variants) that has the new value and keeps the most of `v`'s other values: otherwise
/// the climb could never cross such a coupling one parameter at a time.
pub fn steps(v: &Variant, pool: &[Variant], limits: &DeviceLimits) -> Vec<Variant> {
    let mut out = Vec::new();
    for (name, values) in &v.family.params {
        let Some(at) = values.iter().position(|x| *x == v.params[name]) else {
            continue;
        };
        let next = [at.checked_sub(1), Some(at + 1).filter(|i| *i < values.len())];
        for i in next.into_iter().flatten() {
            let overrides: Vec<_> = v
                .params
                .iter()
                .map(|(k, x)| (k.clone(), if k == name { values[i] } else { *x }))
                .collect();
            match variant_with(&v.family, &overrides, v.dtype, v.epilogue, v.mask, limits) {
                Ok(n) => out.push(n),
                Err(_) => {
                    let with_value = pool
                        .iter()
                        .filter(|p| p.family.name == v.family.name && p.params.get(name) == Some(&values[i]));
                    if let Some(n) = nearest(with_value, &v.params) {
                        out.push(n.clone());
                    }
                }
            }
        }
    }
    out
}

/// The climb's next candidates from the unseen steps of each leader (the best first), taken in
/// turn (the first of each, then the second, ...) so that the [`MAX_STEPS`] cut leaves every
/// leader some. Once a round gained less than [`MIN_GAIN`] (`stalled`), only the first
/// `stalled_leaders` leaders' steps are taken (the best point's, and a lone workload's distant
/// leader: see [`distant_from`]); none left ends the climb.
pub fn next_steps(mut per_leader: Vec<Vec<Variant>>, stalled: bool, stalled_leaders: usize) -> Vec<Variant> {
    if stalled {
        per_leader.truncate(stalled_leaders.max(1));
    }
    let longest = per_leader.iter().map(Vec::len).max().unwrap_or(0);
    let mut fresh: Vec<Variant> = (0..longest)
        .flat_map(|k| per_leader.iter().filter_map(move |steps| steps.get(k).cloned()))
        .collect();
    fresh.truncate(MAX_STEPS);
    fresh
}

/// Parameters of point `a` whose value point `b` does not share (for two points of one
/// family: the parameters in which they differ).
pub fn moves_apart(a: &IndexMap<String, i64>, b: &IndexMap<String, i64>) -> usize {
    a.iter().filter(|(name, x)| b.get(*name) != Some(x)).count()
}

/// The fastest of `timed` (point, screen ms) in `best`'s family at least [`DISTANT_PARAMS`]
/// parameters away from it: the best of another basin of that family (another start point's),
/// which one-parameter steps from `best` would reach only through slower points, if at all.
/// `tune --op` has no sibling workloads to bring such a point in, so it climbs from this one
/// too (H100: the fc projection at M = 1024 stalled 10% short of the point `tune --model` found
/// there from a sibling's best).
pub fn distant_from<'v>(timed: impl Iterator<Item = (&'v Variant, f64)>, best: &Variant) -> Option<&'v Variant> {
    timed
        .filter(|(v, _)| v.family.name == best.family.name && moves_apart(&v.params, &best.params) >= DISTANT_PARAMS)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(v, _)| v)
}

/// How many of the best points the climb steps from each round, how many of their steps a
/// workload takes per round at most (the best point's first), and when it stops: after a
/// round that improved the best time by less than [`MIN_GAIN`], or after [`MAX_ROUNDS`].
pub const CLIMB_FROM: usize = 2;
/// A family climbs only while its best point is within this factor of the workload's best. A
/// family twice as slow did not catch up in the rounds a climb has: on an H100's cold `tune
/// --model gpt2 --batch 1,8 --dtype f32`, the second families (`matmul_simt` at 1.8-2.2x the
/// best, `matmul_splitk` at 1.3-2.9x, the 3xTF32 GEMM at 1.4-3.5x where `matmul_gemv` won)
/// took 400 of the 1,100 matmul candidates and won none.
pub const CLIMB_WITHIN: f64 = 1.25;
pub const MAX_STEPS: usize = 16;
/// Sibling workloads' best points a workload tries per round at most (see `climb::climb_steps`).
pub const MAX_SIBLINGS: usize = 4;
pub const MAX_ROUNDS: usize = 6;
pub const MIN_GAIN: f64 = 0.005;
/// How far a point must lie from its family's best to lead a climb of its own (see
/// [`distant_from`]).
pub const DISTANT_PARAMS: usize = 3;

/// The short run every verified candidate gets.
pub const SCREEN: TimingPlan = TimingPlan {
    warmup: 1,
    min_runs: 5,
    max_runs: 20,
    target_ms: 2.0,
};

/// Successive halving after the screen: the best [`HALVING_KEEP`] by screen time are timed
/// again with [`HALVING`]; the best [`FINAL_KEEP`] of those, and the vendor peer where the op
/// has one, are then timed in turns ([`FINAL_ROUNDS`] rounds of [`FINAL`] each, see
/// [`super::time::time_in_turns`]): the fastest finalist wins, and the peer's time comes from
/// the same turns, at the same clocks.
pub const HALVING_KEEP: usize = 8;
pub const HALVING: TimingPlan = TimingPlan {
    warmup: 2,
    min_runs: 10,
    max_runs: 50,
    target_ms: 10.0,
};
pub const FINAL_KEEP: usize = 3;
pub const FINAL_ROUNDS: usize = 4;
pub const FINAL: TimingPlan = TimingPlan {
    warmup: 1,
    min_runs: 5,
    max_runs: 50,
    target_ms: 15.0,
};

#[cfg(test)]
mod tests {
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
}
