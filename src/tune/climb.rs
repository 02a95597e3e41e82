//! The search's rounds, apart from the GPU: after the first round, which variants each
//! workload measures next, decided from what it has measured so far, and when the climb ends.
//! The tuner (`tuner.rs`) drives it with real measurements; [`Replay`] drives it with times
//! recorded by an earlier `--exhaustive` run, so that the search can be set against the
//! exhaustive winner without a GPU (`tests/search_replay.rs`).

use std::collections::{HashMap, HashSet};

use super::search;
use crate::ops::Shape;
use crate::spec::{DeviceLimits, Variant};

/// Where one workload's climb stands.
#[derive(Debug, Clone)]
pub struct ClimbState {
    /// Still climbing.
    pub climbing: bool,
    /// The best screen time before the last round.
    pub best_before: f64,
}

impl Default for ClimbState {
    fn default() -> Self {
        ClimbState {
            climbing: true,
            best_before: f64::INFINITY,
        }
    }
}

/// What the climb needs to know of a workload under search.
pub trait Climber {
    /// The workload's op (workloads of one op share their best points).
    fn op(&self) -> &str;
    fn shape(&self) -> &Shape;
    /// Every valid variant (see `search::Pools`).
    fn pool(&self) -> &[Variant];
    /// Every candidate timed so far, with its screen time in ms.
    fn timed(&self) -> Vec<(&Variant, f64)>;
    /// Those of `variants` not measured on this workload yet (each kept once).
    fn unseen(&self, variants: Vec<Variant>) -> Vec<Variant>;
    fn climb(&mut self) -> &mut ClimbState;

    /// The best screen time so far (infinite before any).
    fn best_ms(&self) -> f64 {
        self.timed().into_iter().map(|(_, ms)| ms).fold(f64::INFINITY, f64::min)
    }

    /// The fastest timed candidate of each of the `n` fastest families, fastest first: the
    /// climb starts from different families rather than from two neighbours in one. A family
    /// whose best takes more than [`search::CLIMB_WITHIN`] times the best time is left out.
    fn leaders(&self, n: usize) -> Vec<&Variant> {
        let mut timed = self.timed();
        timed.sort_by(|a, b| a.1.total_cmp(&b.1));
        let best = timed.first().map_or(f64::INFINITY, |(_, ms)| *ms);
        let mut leaders: Vec<&Variant> = Vec::with_capacity(n);
        for (v, ms) in timed {
            if leaders.len() == n || !search::in_reach(ms, best) {
                break;
            }
            if leaders.iter().all(|l| l.family.name != v.family.name) {
                leaders.push(v);
            }
        }
        leaders
    }
}

/// The search's rounds over `states`: `first` (each workload's first round, see
/// [`search::first_round`]), then the climb's rounds ([`climb_steps`]), each handed to
/// `measure` with its index (0 for the first round). `measure` returns false to stop (the
/// budget is spent). The rounds end when no workload climbs any more, or after
/// [`search::MAX_ROUNDS`] climbs.
pub fn run_rounds<C: Climber, E>(
    states: &mut [C],
    first: Vec<Vec<Variant>>,
    limits: &DeviceLimits,
    mut measure: impl FnMut(&mut [C], usize, Vec<Vec<Variant>>) -> Result<bool, E>,
) -> Result<(), E> {
    let mut next = first;
    for round in 0..=search::MAX_ROUNDS {
        let go_on = measure(states, round, std::mem::take(&mut next))?;
        if round == search::MAX_ROUNDS || !go_on {
            break;
        }
        next = climb_steps(states, limits);
        if next.iter().all(Vec::is_empty) {
            break;
        }
    }
    Ok(())
}

/// The next round of the climb for each workload still climbing: one-parameter steps from its
/// best point in each of its [`search::CLIMB_FROM`] fastest families (those within
/// [`search::CLIMB_WITHIN`] of its best), taken in turn from each (at most
/// [`search::MAX_STEPS`]), then the best point of each sibling workload (same op; its nearest
/// point in this pool, in a family within [`search::CLIMB_WITHIN`] here; at most
/// [`search::MAX_SIBLINGS`]), those not measured yet. A
/// round that gained less than [`search::MIN_GAIN`] ends the climb only once every step from
/// the best point has been measured (a local optimum for one-parameter moves); until then the
/// climb goes on with those steps alone. A lone workload (`tune --op`: no siblings) also steps
/// from its best family's distant leader ([`search::distant_from`]), and a stall ends its climb
/// only once that leader's steps are measured too. It also ends when there is nothing new to
/// try.
pub fn climb_steps<C: Climber>(states: &mut [C], limits: &DeviceLimits) -> Vec<Vec<Variant>> {
    // Each workload's best point: (op, family, params).
    type Leader = (String, String, indexmap::IndexMap<String, i64>);
    let leaders: Vec<Option<Leader>> = states
        .iter()
        .map(|s| {
            s.leaders(1)
                .first()
                .map(|v| (s.op().to_string(), v.family.name.clone(), v.params.clone()))
        })
        .collect();
    let states_len = states.len();
    let mut next = Vec::with_capacity(states_len);
    for (i, s) in states.iter_mut().enumerate() {
        let best = s.best_ms();
        let before = s.climb().best_before;
        let stalled = best.is_finite() && best > before * (1.0 - search::MIN_GAIN);
        s.climb().best_before = best;
        if !s.climb().climbing {
            next.push(Vec::new());
            continue;
        }
        // Steps from this workload's best point per family (see search::next_steps); a lone
        // workload (tune --op) also steps from its best family's distant leader, in second
        // place, and goes on with it once the best has stalled.
        let mut climb_from = s.leaders(search::CLIMB_FROM);
        let distant = match (states_len == 1, climb_from.first()) {
            (true, Some(best)) => search::distant_from(s.timed().into_iter(), best),
            _ => None,
        };
        let stalled_leaders = 1 + usize::from(distant.is_some());
        if let Some(d) = distant {
            climb_from.insert(1, d);
        }
        let per_leader: Vec<Vec<Variant>> = climb_from
            .into_iter()
            .map(|v| {
                let steps = search::steps(v, s.pool(), limits)
                    .into_iter()
                    .filter(|v| v.check_shape(s.shape(), limits).is_ok())
                    .collect();
                s.unseen(steps)
            })
            .collect();
        let mut fresh = search::next_steps(per_leader, stalled, stalled_leaders);
        if !stalled {
            // A sibling's point is tried only in a family that could still win here.
            let mut family_best: HashMap<&str, f64> = HashMap::new();
            for (v, ms) in s.timed() {
                let at = family_best.entry(v.family.name.as_str()).or_insert(f64::INFINITY);
                *at = at.min(ms);
            }
            let promising = |family: &str| family_best.get(family).is_none_or(|ms| search::in_reach(*ms, best));
            let siblings: Vec<Variant> = leaders
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .filter_map(|(_, leader)| leader.as_ref())
                .filter(|(op, family, _)| op == s.op() && promising(family))
                .filter_map(|(_, family, params)| search::nearest_in_pool(s.pool(), family, params))
                .filter(|v| !fresh.iter().any(|f| f.kernel_name() == v.kernel_name()))
                .cloned()
                .collect();
            let mut siblings = s.unseen(siblings);
            siblings.truncate(search::MAX_SIBLINGS);
            fresh.extend(siblings);
        }
        if fresh.is_empty() {
            s.climb().climbing = false;
        }
        next.push(fresh);
    }
    next
}

/// A workload's search replayed on recorded times: measuring a variant looks its time up
/// (`None`: rejected, as a variant that failed to verify or was pruned), so the search's
/// rounds run exactly as on the GPU that recorded them, minus the noise of timing them again.
pub struct Replay<'t> {
    op: String,
    shape: Shape,
    pool: Vec<Variant>,
    times: &'t dyn Fn(&Variant) -> Option<f64>,
    seen: HashSet<String>,
    timed: Vec<(Variant, f64)>,
    climb: ClimbState,
}

/// Where a replayed search ended.
#[derive(Debug, Clone)]
pub struct ReplayOutcome {
    /// The fastest variant measured, and its recorded time.
    pub best: Option<(Variant, f64)>,
    /// Variants measured (looked up), rejected ones included.
    pub measured: usize,
    /// Rounds run, the first one included.
    pub rounds: usize,
}

impl<'t> Replay<'t> {
    pub fn new(op: &str, shape: Shape, pool: Vec<Variant>, times: &'t dyn Fn(&Variant) -> Option<f64>) -> Self {
        Replay {
            op: op.to_string(),
            shape,
            pool,
            times,
            seen: HashSet::new(),
            timed: Vec::new(),
            climb: ClimbState::default(),
        }
    }

    fn measure(&mut self, variants: Vec<Variant>) {
        for v in variants {
            if self.seen.insert(v.kernel_name()) {
                if let Some(ms) = (self.times)(&v) {
                    self.timed.push((v, ms));
                }
            }
        }
    }

    /// Runs the search as `tune --op` does for one workload with an empty database: the first
    /// round from `seed`, then the climb, with no time budget.
    pub fn run(self, seed: u64, limits: &DeviceLimits) -> ReplayOutcome {
        let [outcome] = Self::run_together([self], seed, limits);
        outcome
    }

    /// Runs the searches of several workloads together, as `tune --model` does for the
    /// workloads it derives (with an empty database, no time budget): each climbs from its own
    /// best points and tries its siblings' (the workloads of the same op).
    pub fn run_together<const N: usize>(
        mut replays: [Self; N],
        seed: u64,
        limits: &DeviceLimits,
    ) -> [ReplayOutcome; N] {
        let first = replays
            .iter()
            .map(|r| search::first_round(&r.pool, &[], seed))
            .collect();
        let mut rounds = 0;
        let Ok(()) = run_rounds(&mut replays, first, limits, |states, _, lists| {
            rounds += 1;
            for (state, list) in states.iter_mut().zip(lists) {
                state.measure(list);
            }
            Ok::<bool, std::convert::Infallible>(true)
        });
        replays.map(|replay| ReplayOutcome {
            best: replay
                .timed
                .iter()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(v, ms)| (v.clone(), *ms)),
            measured: replay.seen.len(),
            rounds,
        })
    }
}

impl Climber for Replay<'_> {
    fn op(&self) -> &str {
        &self.op
    }
    fn shape(&self) -> &Shape {
        &self.shape
    }
    fn pool(&self) -> &[Variant] {
        &self.pool
    }
    fn timed(&self) -> Vec<(&Variant, f64)> {
        self.timed.iter().map(|(v, ms)| (v, *ms)).collect()
    }
    fn unseen(&self, variants: Vec<Variant>) -> Vec<Variant> {
        unseen_by_name(&self.seen, variants)
    }
    fn climb(&mut self) -> &mut ClimbState {
        &mut self.climb
    }
}

/// Those of `variants` whose kernel is not in `seen`, each kept once.
pub fn unseen_by_name(seen: &HashSet<String>, variants: Vec<Variant>) -> Vec<Variant> {
    let mut names = HashSet::new();
    variants
        .into_iter()
        .filter(|v| {
            let name = v.kernel_name();
            !seen.contains(&name) && names.insert(name)
        })
        .collect()
}

/// Recorded times keyed by family and point, as [`record_key`] names them.
pub type Recorded = HashMap<String, f64>;

/// `family p1=v1 p2=v2 ...` (the params in the spec's order): how a recorded time is looked up.
pub fn record_key(family: &str, params: &indexmap::IndexMap<String, i64>) -> String {
    let mut key = family.to_string();
    for (name, value) in params {
        key.push_str(&format!(" {name}={value}"));
    }
    key
}
