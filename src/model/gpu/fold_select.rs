//! Where the prefill folds a layernorm into the matmul after it (`ln_1` into qkv, `ln_2` into
//! fc, `ln_f` into the LM head; the operands in `fold.rs`): where the tuning database says it
//! pays. The `ln_` kernel must be tuned for the shape (the exact row count or the nearest one,
//! as the registry picks its kernel) and time less than the plain matmul and the layernorm it
//! replaces, all three at the row count the `ln_` entry was measured on (`tune --model` tunes
//! them side by side); when any of the three times is missing nothing changes.
//!
//! `KERNELFORGE_FOLD_LAYERNORMS` (read when the backend opens) or
//! [`GpuBackend::set_layernorm_folding`] overrides that: `always` folds wherever the registry
//! has an `ln_` kernel for the shape, tuned or not (tests; comparing the two paths), `never`
//! keeps every layernorm, `tuned` (the default) decides from the database.

use anyhow::Result as AnyResult;

use super::fold::FoldRole;
use super::select::Kernel;
use super::GpuBackend;
use crate::ops::{self, Epilogue, Mask, Shape};
use crate::spec::Dtype;
use crate::tune::db::{TuneKey, TuningDb};
use crate::tune::registry::Choice;
use crate::tune::workloads::kernel_dtype;

/// The environment variable that sets the backend's [`LayernormFolding`] when it opens.
pub const FOLD_LAYERNORMS_ENV: &str = "KERNELFORGE_FOLD_LAYERNORMS";

/// When the prefill folds a layernorm into the matmul after it (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayernormFolding {
    /// Where the tuning database says the `ln_` kernel beats the matmul and the layernorm.
    #[default]
    WherePays,
    /// Wherever an `ln_` kernel exists for the shape, tuned or not.
    Always,
    /// Never: every layernorm runs on its own.
    Never,
}

impl LayernormFolding {
    /// The mode a value of [`FOLD_LAYERNORMS_ENV`] names (`tuned`, `always`, `never`; unset or
    /// empty: `tuned`), or why the value is not one.
    pub fn from_env_value(value: Option<&str>) -> Result<LayernormFolding, String> {
        match value.map(str::trim) {
            None | Some("") | Some("tuned") => Ok(LayernormFolding::WherePays),
            Some("always") => Ok(LayernormFolding::Always),
            Some("never") => Ok(LayernormFolding::Never),
            Some(other) => Err(format!(
                "{FOLD_LAYERNORMS_ENV}={other} is not one of tuned, always, never; folding where the tuning database says it pays"
            )),
        }
    }
}

/// Whether folding a layernorm into the matmul after it pays, from the database's times (ms,
/// per call, at the shape): the `ln_` kernel must beat the plain matmul plus the layernorm.
/// Any time missing: no (nothing measured says it pays).
pub(super) fn folding_pays(folded_ms: Option<f64>, plain_ms: Option<f64>, layernorm_ms: Option<f64>) -> bool {
    match (folded_ms, plain_ms, layernorm_ms) {
        (Some(folded), Some(plain), Some(layernorm)) => folded < plain + layernorm,
        _ => false,
    }
}

/// A time measured on `measured_rows` rows, scaled linearly to `rows` (an entry of the nearest
/// tuned row count standing in for the one the comparison is at).
fn time_at_rows(ms: f64, measured_rows: i64, rows: i64) -> f64 {
    if measured_rows <= 0 || rows <= 0 || measured_rows == rows {
        ms
    } else {
        ms * rows as f64 / measured_rows as f64
    }
}

/// The database's entry for (op, dtype, epilogue) at `shape` (complete, in the space kernels are
/// chosen in), as the registry finds it: the shape's own, else the nearest tuned row count's.
/// Its time (ms) and the shape it was measured on.
fn tuned_entry(db: &TuningDb, op: &str, dtype: Dtype, epilogue: Epilogue, shape: &Shape) -> Option<(f64, Shape)> {
    let contract = ops::op_by_name(op)?;
    let key = TuneKey::of(op, dtype, epilogue, Mask::None, shape.clone());
    db.nearest(&key, contract.row_dims())
        .map(|e| (e.median_ms, e.shape.clone()))
}

/// The times in `db` that decide whether folding a layernorm into the matmul at `shape` (complete,
/// in the space kernels are chosen in; `dtype` the matmul's, `layernorm_dtype` the layernorm's)
/// pays, all at the row count the `ln_` epilogue `folded` was tuned on (ms): (its time, the plain
/// matmul's with `plain`, the layernorm's over those rows), and that row count. `None` when the
/// `ln_` kernel is not tuned; the other two `None` when they are not. An entry of another row
/// count than the `ln_` one stands in scaled linearly.
fn fold_times(
    db: &TuningDb,
    dtype: Dtype,
    layernorm_dtype: Dtype,
    shape: &Shape,
    plain: Epilogue,
    folded: Epilogue,
) -> Option<(f64, Option<f64>, Option<f64>, i64)> {
    let (folded_ms, at) = tuned_entry(db, "matmul", dtype, folded, shape)?;
    let rows = at.get("M").copied().unwrap_or(0);
    let plain_ms = tuned_entry(db, "matmul", dtype, plain, &at)
        .map(|(ms, s)| time_at_rows(ms, s.get("M").copied().unwrap_or(0), rows));
    let mut ln_shape = Shape::new();
    ln_shape.insert("N".into(), rows);
    ln_shape.insert("C".into(), at.get("K").copied().unwrap_or(0));
    let layernorm_ms = tuned_entry(db, "layernorm", layernorm_dtype, Epilogue::None, &ln_shape)
        .map(|(ms, s)| time_at_rows(ms, s.get("N").copied().unwrap_or(0), rows));
    Some((folded_ms, plain_ms, layernorm_ms, rows))
}

/// `0.0123 ms`, or `untuned`.
fn ms_text(ms: Option<f64>) -> String {
    ms.map_or_else(|| "untuned".to_string(), |ms| format!("{ms:.4} ms"))
}

impl GpuBackend {
    /// Choose when the prefill folds layernorms into matmuls (the default comes from
    /// [`FOLD_LAYERNORMS_ENV`], else [`LayernormFolding::WherePays`]). Prefill kernel sets are
    /// chosen again on the next call; decode steps never fold.
    pub fn set_layernorm_folding(&mut self, mode: LayernormFolding) {
        if mode != self.ln_folding {
            self.ln_folding = mode;
            self.sets.retain(|&(_, _, decode, _, _), _| decode);
        }
    }

    /// When the prefill folds layernorms into matmuls.
    pub fn layernorm_folding(&self) -> LayernormFolding {
        self.ln_folding
    }

    /// The kernel of `role`'s matmul on `shape`, after its layernorm: the `ln_` one with the
    /// layernorm folded in (its operands uploaded) when `foldable` and the folding mode says
    /// so, else the plain one with `plain` as its epilogue. Returns it and whether the
    /// layernorm is folded; adds what decided it, when there was something to decide, to
    /// `report`.
    pub(super) fn matmul_after_layernorm(
        &mut self,
        role: FoldRole,
        plain: Epilogue,
        shape: Shape,
        foldable: bool,
        report: &mut Vec<String>,
    ) -> AnyResult<(Kernel, bool)> {
        let (_, folded_epilogue) = role.epilogues();
        let (ln, mm) = (role.layernorm(), role.matmul());
        let why = match self.ln_folding {
            _ if !foldable => None,
            LayernormFolding::Never => None,
            // Where no ln_ kernel runs the shape, loading it below fails and says why.
            LayernormFolding::Always => Some("folding forced: always".to_string()),
            LayernormFolding::WherePays => {
                let chosen = self.selection_of("matmul", folded_epilogue, Mask::None, shape.clone())?;
                let layernorm_dtype = kernel_dtype("layernorm", None, self.dtype);
                let times = self.registry.db.as_ref().and_then(|db| {
                    fold_times(
                        db,
                        chosen.dtype,
                        layernorm_dtype,
                        &chosen.select_shape,
                        plain,
                        folded_epilogue,
                    )
                });
                match times {
                    None => None, // the ln_ kernel is not tuned: the layernorm stays, as before
                    Some((folded_ms, plain_ms, layernorm_ms, rows)) => {
                        let pays = folding_pays(Some(folded_ms), plain_ms, layernorm_ms);
                        let at = if chosen.select_shape.get("M") == Some(&rows) {
                            String::new()
                        } else {
                            format!(" at M={rows}")
                        };
                        let times = format!(
                            "{folded_epilogue} {} {} {plain} {} + layernorm {}{at}",
                            ms_text(Some(folded_ms)),
                            if pays { "<" } else { "vs" },
                            ms_text(plain_ms),
                            ms_text(layernorm_ms)
                        );
                        if pays {
                            Some(times)
                        } else {
                            report.push(format!("{ln} kept before {mm} ({times})"));
                            None
                        }
                    }
                }
            }
        };
        if let Some(why) = why {
            // The kernel first (compiling it can fail), then the copies it reads.
            match self.kernel(mm, "matmul", folded_epilogue, Mask::None, shape.clone(), None) {
                // Timed from the database, the kernel must be the tuned one those times are of.
                Ok(k)
                    if self.ln_folding == LayernormFolding::WherePays
                        && !matches!(k.choice, Choice::Tuned | Choice::Nearest) =>
                {
                    // the registry set the tuned entry aside (its note says why)
                    report.push(format!(
                        "{ln} kept before {mm}: its tuned {folded_epilogue} kernel is not usable ({why})"
                    ));
                }
                Ok(k) => match self.ensure_folded(role) {
                    Ok(()) => {
                        report.push(format!("{ln} folded into {mm} ({why})"));
                        return Ok((k, true));
                    }
                    Err(e) => report.push(format!("{ln} kept before {mm}: {e:#}")),
                },
                Err(e) => report.push(format!("{ln} kept before {mm}: {e:#}")),
            }
        }
        Ok((self.kernel(mm, "matmul", plain, Mask::None, shape, None)?, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folding_pays_only_when_the_folded_kernel_beats_matmul_plus_layernorm() {
        assert!(folding_pays(Some(0.25), Some(0.25), Some(0.125)));
        assert!(
            !folding_pays(Some(0.375), Some(0.25), Some(0.125)),
            "a tie does not pay"
        );
        assert!(!folding_pays(Some(0.5), Some(0.25), Some(0.125)));
        // Anything untuned: no.
        assert!(!folding_pays(None, Some(0.09), Some(0.02)));
        assert!(!folding_pays(Some(0.01), None, Some(0.02)));
        assert!(!folding_pays(Some(0.01), Some(0.09), None));
        assert!(!folding_pays(None, None, None));
        assert!(!folding_pays(Some(f64::NAN), Some(0.09), Some(0.02)));
    }

    fn entry(shape: &Shape, median_ms: f64) -> crate::tune::db::Entry {
        crate::tune::db::Entry::timed("f", Default::default(), shape.clone(), median_ms)
    }

    fn insert(db: &mut TuningDb, op: &str, dtype: Dtype, epilogue: Epilogue, dims: &[(&str, i64)], ms: f64) {
        let shape: Shape = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let key = TuneKey {
            op: op.into(),
            dtype: dtype.to_string(),
            variant_kind: epilogue.as_str().into(),
            shape: shape.clone(),
        };
        db.insert(&key, entry(&shape, ms));
    }

    fn qkv(m: i64) -> Vec<(&'static str, i64)> {
        vec![("M", m), ("N", 2304), ("K", 768), ("T", 1024), ("n_head", 12)]
    }

    /// The three times come from the database at the row count the `ln_` kernel was tuned on:
    /// its own for the shape, the nearest one else (the other two then at that row count too).
    #[test]
    fn the_deciding_times_are_read_at_the_ln_kernels_row_count() {
        let dir = tempfile::tempdir().unwrap();
        let header = crate::tune::db::DbHeader::new("H100", (9, 0), 13000, (13, 0));
        let mut db = TuningDb::open(&dir.path().join("db.json"), header).unwrap();
        let (bf16, plain, folded) = (Dtype::Bf16, Epilogue::Qkv, Epilogue::LnQkv);
        let at = |m: i64| -> Shape { qkv(m).into_iter().map(|(k, v)| (k.to_string(), v)).collect() };
        assert_eq!(
            fold_times(&db, bf16, bf16, &at(8192), plain, folded),
            None,
            "nothing tuned"
        );
        insert(&mut db, "matmul", bf16, folded, &qkv(8192), 0.060);
        assert_eq!(
            fold_times(&db, bf16, bf16, &at(8192), plain, folded),
            Some((0.060, None, None, 8192)),
            "only the ln_ kernel tuned: no decision"
        );
        insert(&mut db, "matmul", bf16, plain, &qkv(8192), 0.055);
        insert(
            &mut db,
            "layernorm",
            bf16,
            Epilogue::None,
            &[("N", 8192), ("C", 768)],
            0.012,
        );
        let times = fold_times(&db, bf16, bf16, &at(8192), plain, folded).unwrap();
        assert_eq!(times, (0.060, Some(0.055), Some(0.012), 8192));
        assert!(folding_pays(Some(times.0), times.1, times.2));
        // M = 3000 uses the M = 8192 entries (nearest), even with a plain entry at M = 1024.
        insert(&mut db, "matmul", bf16, plain, &qkv(1024), 0.001);
        assert_eq!(
            fold_times(&db, bf16, bf16, &at(3000), plain, folded),
            Some((0.060, Some(0.055), Some(0.012), 8192))
        );
        // The layernorm tuned at another row count only: scaled to the ln_ kernel's.
        insert(&mut db, "matmul", bf16, folded, &qkv(2048), 0.020);
        insert(&mut db, "matmul", bf16, plain, &qkv(2048), 0.016);
        let times = fold_times(&db, bf16, bf16, &at(2048), plain, folded).unwrap();
        assert_eq!((times.0, times.1, times.3), (0.020, Some(0.016), 2048));
        assert!((times.2.unwrap() - 0.003).abs() < 1e-12, "{times:?}");
        assert!(!folding_pays(Some(times.0), times.1, times.2));
        // Another dtype has none of it.
        assert_eq!(fold_times(&db, Dtype::F16, Dtype::F16, &at(8192), plain, folded), None);
    }

    #[test]
    fn a_nearest_row_count_time_is_scaled_to_these_rows() {
        assert_eq!(time_at_rows(0.5, 8192, 8192), 0.5);
        assert_eq!(time_at_rows(0.5, 8192, 4096), 0.25);
        assert_eq!(time_at_rows(0.5, 0, 4096), 0.5, "no row count: as measured");
    }

    #[test]
    fn the_environment_value_names_the_mode() {
        assert_eq!(LayernormFolding::from_env_value(None), Ok(LayernormFolding::WherePays));
        assert_eq!(
            LayernormFolding::from_env_value(Some("")),
            Ok(LayernormFolding::WherePays)
        );
        assert_eq!(
            LayernormFolding::from_env_value(Some("tuned")),
            Ok(LayernormFolding::WherePays)
        );
        assert_eq!(
            LayernormFolding::from_env_value(Some("always")),
            Ok(LayernormFolding::Always)
        );
        assert_eq!(
            LayernormFolding::from_env_value(Some(" never ")),
            Ok(LayernormFolding::Never)
        );
        let e = LayernormFolding::from_env_value(Some("yes")).unwrap_err();
        assert!(e.starts_with("KERNELFORGE_FOLD_LAYERNORMS=yes is not one of"), "{e}");
    }

    #[test]
    fn times_read_as_milliseconds_or_untuned() {
        assert_eq!(ms_text(Some(0.01234)), "0.0123 ms");
        assert_eq!(ms_text(None), "untuned");
    }
}
