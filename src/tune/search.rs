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

/// Whether a family whose best screen time is `family_ms` can still win against `best_ms`
/// (within [`CLIMB_WITHIN`]): the one test of that rule, for the climb's leaders and for the
/// siblings' points it takes.
pub fn in_reach(family_ms: f64, best_ms: f64) -> bool {
    family_ms <= best_ms * CLIMB_WITHIN
}
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
mod tests;
