//! The search over the points of a family that is timed as a whole (the decode megakernel: a
//! point is timed by running decode steps of a model, not on a random problem): coordinate
//! descent from a starting point. Each pass tries every other value of each parameter with the
//! rest held, moving to a value as soon as it is faster by more than the noise margin; passes
//! repeat until one changes nothing. The winner is the fastest point measured (the margin only
//! keeps the walk from chasing noise, so the walk can end beside a point a little faster than
//! where it stopped). A point is measured at most once; points that cannot run (a constraint, no
//! room on the SM) are kept with the reason.
//!
//! A move that cannot run is repaired before it is given up: some parameters only make sense
//! together (tensor cores need one column per warp; a third slot of the ring needs smaller
//! slots), and one step at a time would never reach such a pair from a point where neither
//! moved alone. So the walk tries the move with one other parameter changed too, nearest values
//! first, and times the first of those that runs (at most [`MAX_REPAIRS`] tries a move).
//!
//! Pure policy over a `measure` callback, so it is tested without a GPU; the callback decides
//! what a point's time is.

use indexmap::IndexMap;

/// A point: every parameter of the family and its value.
pub type Point = IndexMap<String, i64>;

/// A measured (or refused) point, in the order tried.
#[derive(Clone, Debug, PartialEq)]
pub struct Trial {
    pub point: Point,
    /// Milliseconds per unit of work (a decode step), or why the point did not run.
    pub outcome: Result<f64, String>,
}

/// The walk moves to a value only when it is faster than where it stands by more than this
/// share.
pub const MIN_GAIN: f64 = 0.01;
/// At most this many passes over the parameters.
pub const MAX_PASSES: usize = 3;
/// At most this many points tried to repair one move that cannot run.
pub const MAX_REPAIRS: usize = 8;

/// The result of a search: the fastest point and every trial.
#[derive(Clone, Debug)]
pub struct Descent {
    /// The fastest point measured and its time; `None` when no point ran.
    pub best: Option<(Point, f64)>,
    pub trials: Vec<Trial>,
}

/// Coordinate descent over `space` (parameter → the values it may take) from `start` (which
/// must name every parameter of `space`); parameters named in `fixed` keep their start value.
pub fn coordinate_descent(
    space: &IndexMap<String, Vec<i64>>,
    start: &Point,
    fixed: &[&str],
    mut measure: impl FnMut(&Point) -> Result<f64, String>,
) -> Descent {
    let mut trials: Vec<Trial> = Vec::new();
    let mut run = |point: &Point, trials: &mut Vec<Trial>| -> Result<f64, String> {
        if let Some(t) = trials.iter().find(|t| &t.point == point) {
            return t.outcome.clone();
        }
        let outcome = measure(point);
        trials.push(Trial {
            point: point.clone(),
            outcome: outcome.clone(),
        });
        outcome
    };
    // Where the walk stands, and its time.
    let mut current: Option<(Point, f64)> = run(start, &mut trials).ok().map(|ms| (start.clone(), ms));
    for _ in 0..MAX_PASSES {
        let mut changed = false;
        for (name, values) in space.iter().filter(|(name, _)| !fixed.contains(&name.as_str())) {
            let here = current.as_ref().map_or(start, |(p, _)| p).clone();
            for &value in values.iter().filter(|&&v| Some(&v) != here.get(name)) {
                let base = current.as_ref().map_or(start, |(p, _)| p);
                let mut point = base.clone();
                point.insert(name.clone(), value);
                let mut outcome = run(&point, &mut trials);
                if let Err(reason) = &outcome {
                    for repaired in repairs(space, fixed, &point, name, reason)
                        .into_iter()
                        .take(MAX_REPAIRS)
                    {
                        outcome = run(&repaired, &mut trials);
                        if outcome.is_ok() {
                            point = repaired;
                            break;
                        }
                    }
                }
                if let Ok(ms) = outcome {
                    let better = match &current {
                        Some((_, at)) => ms < at * (1.0 - MIN_GAIN),
                        None => true,
                    };
                    if better {
                        current = Some((point, ms));
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    let best = trials
        .iter()
        .filter_map(|t| t.outcome.as_ref().ok().map(|&ms| (t.point.clone(), ms)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    Descent { best, trials }
}

/// The points that repair `point` (a move of `moved` that cannot run, for `reason`): `point`
/// with one other free parameter changed. First the parameters the reason names (a constraint
/// names what it couples), then every parameter's nearest other value before any second-nearest
/// (so that a few tries reach each parameter once), in the order of `space` within a rank.
fn repairs(space: &IndexMap<String, Vec<i64>>, fixed: &[&str], point: &Point, moved: &str, reason: &str) -> Vec<Point> {
    let mut ranked = Vec::new();
    for (order, (name, values)) in space.iter().enumerate() {
        if name == moved || fixed.contains(&name.as_str()) {
            continue;
        }
        let here = point[name];
        let mut others: Vec<i64> = values.iter().copied().filter(|&v| v != here).collect();
        others.sort_by_key(|&v| ((v - here).abs(), v));
        let unnamed = !reason.contains(name.as_str());
        for (rank, v) in others.into_iter().enumerate() {
            let mut repaired = point.clone();
            repaired.insert(name.clone(), v);
            ranked.push(((unnamed, rank, order), repaired));
        }
    }
    ranked.sort_by_key(|(key, _)| *key);
    ranked.into_iter().map(|(_, p)| p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> IndexMap<String, Vec<i64>> {
        [("a", vec![1, 2, 3, 4]), ("b", vec![10, 20, 30]), ("c", vec![0, 1])]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    fn point(a: i64, b: i64, c: i64) -> Point {
        [("a", a), ("b", b), ("c", c)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    #[test]
    fn descends_to_the_minimum_of_a_separable_cost_measuring_each_point_once() {
        // minimum at a = 3, b = 20, c = 1; c is fixed at 0
        let cost = |p: &Point| ((p["a"] - 3).pow(2) + (p["b"] - 20).pow(2) / 100 + p["c"] * 5 + 10) as f64;
        let mut calls = Vec::new();
        let d = coordinate_descent(&space(), &point(1, 30, 0), &["c"], |p| {
            calls.push(p.clone());
            Ok(cost(p))
        });
        let (best, ms) = d.best.unwrap();
        assert_eq!(best, point(3, 20, 0));
        assert_eq!(ms, 10.0);
        assert_eq!(d.trials.len(), calls.len(), "every trial measured once");
        let mut unique = calls.clone();
        unique.sort_by_key(|p| (p["a"], p["b"], p["c"]));
        unique.dedup();
        assert_eq!(unique.len(), calls.len(), "no point measured twice: {calls:?}");
        assert!(calls.iter().all(|p| p["c"] == 0), "a fixed parameter never moves");
    }

    #[test]
    fn points_that_cannot_run_are_kept_with_the_reason_and_skipped() {
        let d = coordinate_descent(&space(), &point(1, 10, 0), &[], |p| {
            if p["a"] >= 3 {
                Err(format!("a = {} does not fit", p["a"]))
            } else {
                Ok((10 - p["a"]) as f64 + p["c"] as f64)
            }
        });
        let (best, _) = d.best.unwrap();
        assert_eq!(best["a"], 2);
        let refused: Vec<&Trial> = d.trials.iter().filter(|t| t.outcome.is_err()).collect();
        // a = 3 and a = 4, then each with b = 20, c = 1 and b = 30 (the repairs, all refused
        // too), once each
        assert_eq!(refused.len(), 2 * 4, "{refused:?}");
        assert!(refused[0].outcome.as_ref().unwrap_err().contains("does not fit"));
        assert_eq!(
            refused[1].point,
            point(3, 20, 0),
            "the nearest value of the first other parameter"
        );
    }

    /// A move that only runs together with another (here a = 4 needs c = 1, and c = 1 alone is
    /// slower) is reached through its repair, with the parameter the refusal names tried first.
    #[test]
    fn a_refused_move_is_repaired_by_the_parameter_its_reason_names() {
        let cost = |p: &Point| -> Result<f64, String> {
            match (p["a"], p["c"]) {
                (4, 0) => Err("a = 4 needs c = 1".into()),
                (4, 1) => Ok(1.0),
                (a, c) => Ok(10.0 + c as f64 - a as f64 / 10.0),
            }
        };
        let d = coordinate_descent(&space(), &point(1, 10, 0), &[], cost);
        assert_eq!(d.best.unwrap(), (point(4, 10, 1), 1.0));
        let after: Vec<&Point> = d
            .trials
            .iter()
            .skip_while(|t| t.point != point(4, 10, 0))
            .map(|t| &t.point)
            .collect();
        assert_eq!(after[1], &point(4, 10, 1), "c is named by the refusal: tried before b");
        // A parameter held fixed is never changed to repair a move: with b and c fixed, a = 4
        // is given up at once.
        let d = coordinate_descent(&space(), &point(1, 10, 0), &["b", "c"], |p| {
            if p["a"] == 4 {
                Err("no".into())
            } else {
                cost(p)
            }
        });
        assert_eq!(d.best.unwrap().0, point(3, 10, 0));
        assert_eq!(d.trials.len(), 4, "a fixed parameter is never changed to repair a move");
    }

    #[test]
    fn a_gain_within_the_noise_margin_does_not_move_the_walk_but_still_wins() {
        // a = 2 is faster by half the margin: the walk stays at a = 1 and tries b and c from
        // there (never b or c with a = 2), and a = 2 is still the fastest point measured.
        let d = coordinate_descent(&space(), &point(1, 10, 0), &[], |p| {
            Ok(if p["a"] == 2 {
                100.0 * (1.0 - MIN_GAIN / 2.0)
            } else {
                100.0
            })
        });
        assert!(d
            .trials
            .iter()
            .all(|t| t.point["a"] == 1 || (t.point["b"], t.point["c"]) == (10, 0)));
        assert_eq!(d.best.unwrap(), (point(2, 10, 0), 100.0 * (1.0 - MIN_GAIN / 2.0)));
        let d = coordinate_descent(&space(), &point(1, 10, 0), &[], |_| Err("no".into()));
        assert!(d.best.is_none());
        // one pass, then stop: the start; a = 2, 3, 4, each with its three repairs (b = 20,
        // c = 1, b = 30); b = 20 and 30, each with the one repair not tried yet (c = 1); c = 1
        assert_eq!(d.trials.len(), 1 + 3 * 4 + 2 * 2 + 1);
        let mut points: Vec<&Point> = d.trials.iter().map(|t| &t.point).collect();
        points.sort_by_key(|p| (p["a"], p["b"], p["c"]));
        points.dedup();
        assert_eq!(points.len(), d.trials.len(), "no point tried twice");
    }
}
