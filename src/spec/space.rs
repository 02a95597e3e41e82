//! A family's valid points, found by walking its parameter space one parameter at a time and
//! cutting off every subtree that a `require` constraint already rejects.
//!
//! The space is the product of the parameters' value lists: `matmul_wgmma_tma` has 138,240
//! points, of which about 2% are valid. Evaluating every point (its derived values, then its
//! constraints) took about a second, paid at the start of every command (loading the catalog
//! counted each family's valid points; it now checks the default point and walks a space only
//! when that fails, or when the count is asked for) and again by the tuner (its candidate
//! pools). The walk binds the parameters in spec order, so it visits points in the order of the
//! full product.
//! Each derived value is computed, and each constraint tested, at the first level where every
//! parameter it depends on (directly or through derived values) is bound; a constraint that
//! fails there rejects the whole subtree below.

use indexmap::IndexMap;

use super::family::{Point, Vars};
use super::*;

/// At which level of the walk each derived value can be computed and each constraint tested:
/// level `d` has the first `d` parameters bound.
struct Plan {
    derived_at: Vec<Vec<usize>>,
    require_at: Vec<Vec<usize>>,
    /// Whether every derived value and constraint has a level. One that has none (it names an
    /// unknown variable, or a derived value defined after it) is left to the exact evaluation
    /// of each point that survives the walk, which reports it as it always did.
    complete: bool,
}

impl Family {
    fn plan(&self) -> Plan {
        let levels = self.params.len() + 1;
        let mut level_of: IndexMap<&str, usize> = DEVICE_VARS.iter().map(|v| (*v, 0)).collect();
        for (i, name) in self.params.keys().enumerate() {
            level_of.insert(name, i + 1);
        }
        // The deepest level among the expression's variables; None if one has no level yet.
        let level = |e: &Expr, level_of: &IndexMap<&str, usize>| -> Option<usize> {
            e.variables()
                .iter()
                .try_fold(0, |deepest, v| level_of.get(v.as_str()).map(|l| deepest.max(*l)))
        };
        let mut plan = Plan {
            derived_at: vec![Vec::new(); levels],
            require_at: vec![Vec::new(); levels],
            complete: true,
        };
        for (j, (name, e)) in self.derived.iter().enumerate() {
            // Computed after the scan of its own expression: a derived value that names itself
            // or a later one has no level.
            match level(e, &level_of) {
                Some(l) => {
                    plan.derived_at[l].push(j);
                    level_of.insert(name, l);
                }
                None => plan.complete = false,
            }
        }
        for (i, c) in self.require.iter().enumerate() {
            match level(c, &level_of) {
                Some(l) => plan.require_at[l].push(i),
                None => plan.complete = false,
            }
        }
        plan
    }

    /// Valid points (params + derived) under `limits`, in the order of the full product of the
    /// parameters' values (see the module's comment). A surviving point comes out exactly as
    /// evaluating it alone would give it, errors included; a point some constraint rejects is
    /// not evaluated further, so an error in one of its other values goes unreported.
    pub(super) fn points(&self, limits: &DeviceLimits) -> Result<Vec<Point>, SpecError> {
        let plan = self.plan();
        let mut walk = Walk {
            family: self,
            plan: &plan,
            limits,
            point: IndexMap::with_capacity(self.params.len()),
            vars: self.point_scope(&IndexMap::new(), &IndexMap::new(), limits),
            out: Vec::new(),
        };
        walk.level(0, !plan.complete)?;
        Ok(walk.out)
    }
}

/// One walk over a family's space: the point bound so far and its scope.
struct Walk<'a> {
    family: &'a Family,
    plan: &'a Plan,
    limits: &'a DeviceLimits,
    point: IndexMap<String, i64>,
    vars: Vars,
    out: Vec<Point>,
}

impl Walk<'_> {
    /// Computes what becomes computable at `level`, cuts the subtree off if a constraint fails,
    /// else binds the next parameter to each of its values in turn. `unsure`: some value or
    /// constraint on the way could not be evaluated (an arithmetic error, a missing variable);
    /// the points below are then evaluated exactly, one by one.
    fn level(&mut self, level: usize, mut unsure: bool) -> Result<(), SpecError> {
        let f = self.family;
        for &j in &self.plan.derived_at[level] {
            let (name, e) = f.derived.get_index(j).expect("a planned derived value");
            match e.eval(&self.vars) {
                Ok(value) => self.vars.set(name, value),
                Err(_) => {
                    self.vars.unset(name);
                    unsure = true;
                }
            }
        }
        for &i in &self.plan.require_at[level] {
            match f.require[i].holds(&self.vars) {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(_) => unsure = true,
            }
        }
        let Some((name, values)) = f.params.get_index(level) else {
            return self.leaf(unsure);
        };
        for &value in values {
            match self.point.get_mut(name) {
                Some(slot) => *slot = value,
                None => {
                    self.point.insert(name.clone(), value);
                }
            }
            self.vars.set(name, value);
            self.level(level + 1, unsure)?;
        }
        Ok(())
    }

    /// Every parameter is bound and no constraint failed. Where everything was evaluated on
    /// the way, the scope holds the point's derived values; else the point is evaluated alone.
    fn leaf(&mut self, unsure: bool) -> Result<(), SpecError> {
        let f = self.family;
        if unsure {
            let (point, vars) = f.evaluate_in_scope(&self.point, self.limits)?;
            if f.failed_in_scope(&vars)?.is_none() {
                self.out.push(point);
            }
            return Ok(());
        }
        let derived = f
            .derived
            .keys()
            .map(|name| {
                (
                    name.clone(),
                    expr::Scope::get(&self.vars, name).expect("a computed derived value"),
                )
            })
            .collect();
        self.out.push((self.point.clone(), derived));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The valid ones among `points`, each evaluated alone (what `points` did, over the full
    /// product, before the walk).
    fn evaluated_one_by_one(
        f: &Family,
        limits: &DeviceLimits,
        points: impl IntoIterator<Item = IndexMap<String, i64>>,
    ) -> Vec<Point> {
        points
            .into_iter()
            .filter_map(|p| {
                let (point, vars) = f.evaluate_in_scope(&p, limits).unwrap();
                f.failed_in_scope(&vars).unwrap().is_none().then_some(point)
            })
            .collect()
    }

    #[test]
    fn the_walk_finds_exactly_the_points_that_evaluating_each_finds() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
        // The project's limits, and a smaller GPU where other constraints bind.
        let small = DeviceLimits {
            max_smem_dynamic: 101_376,
            num_sms: 46,
            ..DeviceLimits::default()
        };
        for limits in [DeviceLimits::default(), small] {
            for f in &catalog.families {
                let walked = f.points(&limits).unwrap();
                assert_eq!(walked, evaluated_one_by_one(f, &limits, f.all_points()), "{}", f.name);
            }
        }
    }

    /// A spec with values the walk cannot place or compute, in a folder of its own.
    fn family(dir: &Path, derived: &str, require: &str) -> Result<Family, SpecError> {
        let text = format!(
            "[family]\nname = \"t\"\nop = \"gelu\"\ntemplate = \"t.cu.tera\"\ndescription = \"t\"\n\
             dtypes = [\"f32\"]\n[params]\na = [0, 1, 2]\nb = [1, 2, 3, 4]\nc = [0, 1]\n[derived]\n{derived}\n\
             [constraints]\nrequire = [{require}]\n[[kernels]]\nname = \"main\"\n\
             grid = [\"1\", \"1\", \"1\"]\nblock = [\"32\", \"1\", \"1\"]\nsmem = \"0\"\n\
             [default]\na = 1\nb = 1\nc = 1\n"
        );
        std::fs::write(dir.join("t.cu.tera"), "").unwrap();
        Family::parse(&text, &dir.join("t.toml"), dir)
    }

    /// A derived value that cannot be computed where a constraint rejects the point (12 / a at
    /// a = 0, against `a > 0`): the walk skips those points (evaluating each alone stopped at
    /// the division) and finds the others as evaluating each of them alone does.
    #[test]
    fn a_rejected_point_is_not_evaluated_further() {
        let dir = tempfile::tempdir().unwrap();
        let f = family(
            dir.path(),
            "q = \"12 / a\"",
            "\"a > 0\", \"q > 4\", \"b != 3 || c == 1\"",
        )
        .unwrap();
        let limits = DeviceLimits::default();
        let expected = evaluated_one_by_one(&f, &limits, f.all_points().into_iter().filter(|p| p["a"] > 0));
        assert_eq!(expected.len(), 2 * (4 * 2 - 1));
        assert_eq!(f.points(&limits).unwrap(), expected);
    }

    /// What the walk cannot place or compute is evaluated point by point, with the errors that
    /// gives: a derived value that names a later one (the default fails too: loading reports
    /// it), a constraint that divides by zero at points no other constraint rejects (the
    /// default is fine, so loading passes and the walk reports it: the tuner, the report).
    #[test]
    fn errors_of_points_that_survive_the_walk_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let late = family(dir.path(), "late = \"later + 1\"\nlater = \"b * 2\"", "\"late > 0\"").unwrap_err();
        assert!(late.to_string().contains("unknown variable `later`"), "{late}");
        let zero = family(dir.path(), "q = \"b\"", "\"q / c > 0\"").unwrap();
        let e = zero.points(&DeviceLimits::default()).unwrap_err();
        assert!(e.to_string().contains("q / c"), "{e}");
        let e = zero.valid_points().unwrap_err();
        assert!(e.to_string().contains("q / c"), "{e}");
    }
}
