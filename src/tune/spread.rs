//! Tuning spread over several GPUs of one host (`tune --devices`).
//!
//! The GPUs are grouped by kind (name and compute capability): every kind tunes every workload
//! into its own database (the default file of that kind, see [`default_path`]), because a
//! winner measured on one kind says nothing about another. Within a kind the workloads are
//! split across its GPUs: those the database already has (without `force`) are only reported
//! from it; the others go longest first to the GPU with the least estimated work so far (LPT
//! scheduling, see `share.rs`: [`assign`] and [`estimated_cost`]). Each GPU then runs the ordinary
//! [`tune`] on its share, on its own host thread with its own CUDA context, compiler, renderer
//! and handle on the kind's database file (which merges under a lock on every save, so the
//! GPUs of a kind never lose each other's winners). The results come back in the order of the
//! workloads, each saying which GPU measured it.
//!
//! The budget: a one-GPU run spends `budget` on all the workloads of a kind; with several GPUs
//! each gets `budget` times its share of the kind's estimated work ([`device_budget`]), so
//! every workload is searched as hard as on one GPU and the run ends sooner.
//!
//! [`SpreadPlan::new`] reads the GPUs (without creating CUDA contexts), opens each kind's
//! database to see what is already tuned, and assigns the workloads; [`SpreadPlan::run`]
//! tunes. The device list is a plain list of CUDA ordinals: the same GPU may appear twice
//! (tests spread over `[0, 0]` on one GPU).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::db::{default_path, DbHeader, TuningDb};
use super::share::{assign, candidate_counts, device_budget, estimated_cost, group_by_kind};
use super::tuner::{tune, Phases, Progress, Quiet, TuneOptions, TuneResult, TuneRun};
use super::workloads::Workload;
use crate::codegen::Renderer;
use crate::gpu::device::driver_version;
use crate::gpu::{device_count, identify, CompileError, Compiler, DeviceIdentity, DeviceListError, Gpu, GpuError};
use crate::spec::Catalog;

/// Why a spread cannot start or did not finish. Every variant names the device or flag at
/// fault and the fix.
#[derive(Debug, thiserror::Error)]
pub enum SpreadError {
    #[error("no GPU to tune on (the device list is empty); pass --devices 0 or --devices all")]
    NoDevices,
    /// An ordinal the machine does not have, or no GPU at all.
    #[error(transparent)]
    Devices(#[from] DeviceListError),
    #[error("cuda:{ordinal}: {source}")]
    Identify { ordinal: usize, source: GpuError },
    #[error("counting the GPUs: {0}")]
    Count(GpuError),
    #[error(transparent)]
    Compiler(#[from] CompileError),
    #[error(
        "--db {}: the GPUs are of {} kinds ({}) and one tuning database holds one kind; \
         drop --db (each kind then gets its own default file) or pick GPUs of one kind with --devices",
        path.display(),
        kinds.len(),
        kinds.join(", ")
    )]
    DbForSeveralKinds { path: PathBuf, kinds: Vec<String> },
    /// Opening, compiling or tuning failed on a device: `cuda:1 (NVIDIA H200): ...`. When
    /// several devices failed, the others follow.
    #[error("{device}: {message}")]
    Device { device: String, message: String },
}

/// One kind of GPU in a plan: its database and how its GPUs share the workloads.
#[derive(Debug, Clone)]
pub struct KindPlan {
    /// The header its database is written under (GPU name, compute capability, driver, NVRTC).
    pub header: DbHeader,
    pub db_path: PathBuf,
    /// Its devices, as positions in [`SpreadPlan::devices`], in list order.
    pub slots: Vec<usize>,
    /// For each workload: the slot that tunes it, `None` when the database already has it.
    pub assignment: Vec<Option<usize>>,
    /// Estimated seconds of each workload ([`estimated_cost`]; 0 for those already tuned).
    pub costs: Vec<f64>,
    /// Set when the database file was corrupt and was set aside on open.
    pub warning: Option<String>,
}

impl KindPlan {
    /// `NVIDIA H200 (sm_90)`.
    pub fn describe(&self) -> String {
        self.header.describe()
    }

    /// The workloads (indices) `slot` tunes, in workload order.
    pub fn share(&self, slot: usize) -> Vec<usize> {
        (0..self.assignment.len())
            .filter(|&i| self.assignment[i] == Some(slot))
            .collect()
    }

    /// The workloads the database already has.
    pub fn cached(&self) -> Vec<usize> {
        (0..self.assignment.len())
            .filter(|&i| self.assignment[i].is_none())
            .collect()
    }

    /// Estimated seconds of `slot`'s share.
    pub fn estimated_s(&self, slot: usize) -> f64 {
        self.share(slot).iter().map(|&i| self.costs[i]).sum()
    }

    /// `slot`'s share of the kind's estimated work (1 when there is none at all and it is the
    /// first device).
    fn work_share(&self, slot: usize) -> f64 {
        let total: f64 = self.costs.iter().sum();
        if total > 0.0 {
            self.estimated_s(slot) / total
        } else {
            1.0
        }
    }
}

/// What runs where: the devices, their kinds and each kind's split of the workloads.
#[derive(Debug, Clone)]
pub struct SpreadPlan {
    /// The devices, in the order given.
    pub devices: Vec<DeviceIdentity>,
    pub kinds: Vec<KindPlan>,
    pub workloads: Vec<Workload>,
    /// Whether workloads already in a database were planned to be tuned again.
    pub force: bool,
}

/// One workload's outcome and the device that measured it.
#[derive(Debug, Clone)]
pub struct SpreadResult {
    pub result: TuneResult,
    /// CUDA ordinal of the GPU that tuned it; `None` when it was read from the database.
    pub device: Option<usize>,
}

/// What one device did.
#[derive(Debug, Clone)]
pub struct DeviceWork {
    pub device: DeviceIdentity,
    /// Workloads it tuned (not those read from the database).
    pub tuned: usize,
    /// Wall time of its tuning run (0 when it had nothing to do).
    pub busy: Duration,
    /// The budget it was given.
    pub budget: Duration,
    /// Where its time went.
    pub phases: Phases,
}

/// One kind's outcome.
#[derive(Debug)]
pub struct KindOutcome {
    pub plan: KindPlan,
    /// Every workload, in the order given.
    pub results: Vec<SpreadResult>,
    /// Its devices, in list order.
    pub work: Vec<DeviceWork>,
}

impl SpreadPlan {
    /// Reads the devices (`ordinals`, each checked to exist), groups them by kind, opens each
    /// kind's database (`db` if given: only for GPUs of one kind) and assigns the workloads not
    /// tuned yet (all of them with `force`).
    pub fn new(
        catalog: &Catalog,
        ordinals: &[usize],
        db: Option<&Path>,
        workloads: &[Workload],
        force: bool,
    ) -> Result<SpreadPlan, SpreadError> {
        if ordinals.is_empty() {
            return Err(SpreadError::NoDevices);
        }
        let count = device_count().map_err(SpreadError::Count)?;
        if count == 0 {
            return Err(DeviceListError::NoGpu.into());
        }
        if let Some(&ordinal) = ordinals.iter().find(|&&o| o >= count) {
            return Err(DeviceListError::NoSuchDevice { ordinal, count }.into());
        }
        let devices = ordinals
            .iter()
            .map(|&ordinal| identify(ordinal).map_err(|source| SpreadError::Identify { ordinal, source }))
            .collect::<Result<Vec<_>, _>>()?;
        let groups = group_by_kind(&devices);
        // The ln_ rows (a layernorm folded into the GEMM after it) are offers, not needs: where
        // a family cannot run them the model runs the layernorm and the plain GEMM. Kept only
        // when every kind of GPU in the run has candidates for them.
        let offers: Vec<&Workload> = workloads.iter().filter(|w| w.epilogue.standardizes_input()).collect();
        let runnable: Vec<bool> = groups
            .iter()
            .map(|g| &devices[g[0]])
            .fold(vec![true; offers.len()], |keep, d| {
                let counts = candidate_counts(catalog, &offers, &d.limits);
                keep.iter().zip(counts).map(|(k, n)| *k && n > 0).collect()
            });
        let dropped: Vec<&Workload> = offers
            .iter()
            .zip(&runnable)
            .filter(|(_, r)| !**r)
            .map(|(w, _)| *w)
            .collect();
        let workloads: Vec<Workload> = workloads
            .iter()
            .filter(|w| !dropped.iter().any(|d| std::ptr::eq(*d, *w)))
            .cloned()
            .collect();
        let workloads = &workloads[..];
        if let (Some(path), true) = (db, groups.len() > 1) {
            return Err(SpreadError::DbForSeveralKinds {
                path: path.to_path_buf(),
                kinds: groups
                    .iter()
                    .map(|g| {
                        let list: Vec<String> = g.iter().map(|&s| format!("cuda:{}", devices[s].ordinal)).collect();
                        let d = &devices[g[0]];
                        format!(
                            "{} {} (sm_{}{})",
                            list.join(","),
                            d.name,
                            d.compute_capability.0,
                            d.compute_capability.1
                        )
                    })
                    .collect(),
            });
        }
        let driver = driver_version().map_err(|source| SpreadError::Identify {
            ordinal: ordinals[0],
            source,
        })?;
        let mut kinds = Vec::new();
        for slots in groups {
            let first = &devices[slots[0]];
            let nvrtc = Compiler::new(&first.arch())?.nvrtc_version;
            let header = DbHeader::new(&first.name, first.compute_capability, driver, nvrtc);
            let db_path = db.map(Path::to_path_buf).unwrap_or_else(|| default_path(&header));
            let opened = TuningDb::open(&db_path, header.clone()).map_err(|e| SpreadError::Device {
                device: first.label(),
                message: e.to_string(),
            })?;
            let todo: Vec<bool> = workloads
                .iter()
                .map(|w| force || opened.get(&w.key()).is_none())
                .collect();
            let to_count: Vec<&Workload> = workloads
                .iter()
                .zip(&todo)
                .filter(|(_, t)| **t)
                .map(|(w, _)| w)
                .collect();
            let mut counts = candidate_counts(catalog, &to_count, &first.limits).into_iter();
            let costs: Vec<Option<f64>> = workloads
                .iter()
                .zip(&todo)
                .map(|(w, &t)| t.then(|| estimated_cost(w, counts.next().unwrap_or(0))))
                .collect();
            let assignment = assign(&costs, slots.len())
                .into_iter()
                .map(|bin| bin.map(|b| slots[b]))
                .collect();
            kinds.push(KindPlan {
                header,
                db_path,
                slots,
                assignment,
                costs: costs.iter().map(|c| c.unwrap_or(0.0)).collect(),
                warning: opened.warning,
            });
        }
        Ok(SpreadPlan {
            devices,
            kinds,
            workloads: workloads.to_vec(),
            force,
        })
    }

    /// Tunes: one host thread per device with work, each running [`tune`] on its share (the
    /// first device of a kind also reports the kind's already-tuned workloads from the
    /// database) with [`device_budget`] of `options.budget`. `progress[slot]` draws device
    /// `slot`'s progress (missing entries: none). The plan's `force` replaces `options.force`
    /// (the split was made for it). Waits for every device; a failure names the device, after
    /// the others finished (what they tuned is saved).
    pub fn run(
        &self,
        catalog: &Catalog,
        options: &TuneOptions,
        progress: &[&dyn Progress],
    ) -> Result<Vec<KindOutcome>, SpreadError> {
        struct Job<'p> {
            kind: usize,
            slot: usize,
            /// Workload indices it runs (tuned ones and, on the first device, cached ones).
            indices: Vec<usize>,
            budget: Duration,
            db_path: &'p Path,
        }
        let mut jobs = Vec::new();
        for (k, kind) in self.kinds.iter().enumerate() {
            for (n, &slot) in kind.slots.iter().enumerate() {
                let mut indices = kind.share(slot);
                if n == 0 {
                    indices.extend(kind.cached());
                    indices.sort_unstable();
                }
                let budget = device_budget(options.budget, kind.work_share(slot));
                jobs.push(Job {
                    kind: k,
                    slot,
                    indices,
                    budget,
                    db_path: &kind.db_path,
                });
            }
        }
        type Outcome = Result<(TuneRun, Duration), String>;
        let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
            let handles: Vec<_> = jobs
                .iter()
                .map(|job| {
                    let device = &self.devices[job.slot];
                    let share: Vec<Workload> = job.indices.iter().map(|&i| self.workloads[i].clone()).collect();
                    let progress: &dyn Progress = progress.get(job.slot).copied().unwrap_or(&Quiet);
                    let options = TuneOptions {
                        budget: job.budget,
                        force: self.force,
                        ..options.clone()
                    };
                    let db_path = job.db_path;
                    if share.is_empty() {
                        return None;
                    }
                    Some(
                        std::thread::Builder::new()
                            .name(format!("kernelforge tune cuda:{}", device.ordinal))
                            .spawn_scoped(scope, move || {
                                tune_share(catalog, device.ordinal, db_path, &share, &options, progress)
                            }),
                    )
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    None => Ok((
                        TuneRun {
                            results: Vec::new(),
                            phases: Phases::default(),
                        },
                        Duration::ZERO,
                    )),
                    Some(Err(e)) => Err(format!("cannot start its host thread: {e}")),
                    Some(Ok(h)) => h
                        .join()
                        .unwrap_or_else(|_| Err("its tuning thread panicked".to_string())),
                })
                .collect()
        });

        let mut failures: Vec<(String, String)> = Vec::new();
        let mut per_kind: Vec<Vec<Option<SpreadResult>>> =
            self.kinds.iter().map(|_| vec![None; self.workloads.len()]).collect();
        let mut work: Vec<Vec<DeviceWork>> = self.kinds.iter().map(|_| Vec::new()).collect();
        for (job, outcome) in jobs.iter().zip(outcomes) {
            let device = &self.devices[job.slot];
            match outcome {
                Err(message) => failures.push((device.label(), message)),
                Ok((TuneRun { results, phases }, busy)) => {
                    if results.len() != job.indices.len() {
                        failures.push((
                            device.label(),
                            format!(
                                "the tuner returned {} results for {} workloads",
                                results.len(),
                                job.indices.len()
                            ),
                        ));
                        continue;
                    }
                    let mut tuned = 0;
                    for (&i, result) in job.indices.iter().zip(results) {
                        let measured = !result.from_db;
                        tuned += usize::from(measured);
                        per_kind[job.kind][i] = Some(SpreadResult {
                            result,
                            device: measured.then_some(device.ordinal),
                        });
                    }
                    work[job.kind].push(DeviceWork {
                        device: device.clone(),
                        tuned,
                        busy,
                        budget: job.budget,
                        phases,
                    });
                }
            }
        }
        if let Some(((device, message), rest)) = failures.split_first() {
            let mut message = message.clone();
            for (other, why) in rest {
                message.push_str(&format!("; also {other}: {why}"));
            }
            return Err(SpreadError::Device {
                device: device.clone(),
                message,
            });
        }
        self.kinds
            .iter()
            .zip(per_kind)
            .zip(work)
            .map(|((plan, results), work)| {
                let results = results
                    .into_iter()
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| SpreadError::Device {
                        device: self.devices[plan.slots[0]].label(),
                        message: "a workload was assigned to no device (a bug in the spread)".into(),
                    })?;
                Ok(KindOutcome {
                    plan: plan.clone(),
                    results,
                    work,
                })
            })
            .collect()
    }
}

/// One device's run: its own context, compiler, renderer and database handle.
fn tune_share(
    catalog: &Catalog,
    ordinal: usize,
    db_path: &Path,
    share: &[Workload],
    options: &TuneOptions,
    progress: &dyn Progress,
) -> Result<(TuneRun, Duration), String> {
    let started = Instant::now();
    let gpu = Gpu::new(ordinal).map_err(|e| e.to_string())?;
    let compiler = Compiler::new(&gpu.info.arch()).map_err(|e| e.to_string())?;
    let renderer = Renderer::new(&catalog.templates_dir).map_err(|e| e.to_string())?;
    let mut db = TuningDb::open(db_path, DbHeader::for_device(&gpu, &compiler)).map_err(|e| e.to_string())?;
    let run = tune(&gpu, &compiler, &renderer, catalog, &mut db, share, options, progress)?;
    Ok((run, started.elapsed()))
}

/// Plans and runs in one call (see [`SpreadPlan`]).
pub fn spread_tune(
    catalog: &Catalog,
    ordinals: &[usize],
    db: Option<&Path>,
    workloads: &[Workload],
    options: &TuneOptions,
    progress: &[&dyn Progress],
) -> Result<Vec<KindOutcome>, SpreadError> {
    SpreadPlan::new(catalog, ordinals, db, workloads, options.force)?.run(catalog, options, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_kinds_with_one_db_is_refused_with_the_fix() {
        let e = SpreadError::DbForSeveralKinds {
            path: "t.json".into(),
            kinds: vec![
                "cuda:0,2 NVIDIA H200 (sm_90)".into(),
                "cuda:1 NVIDIA A100 (sm_80)".into(),
            ],
        }
        .to_string();
        assert!(
            e.contains("--db t.json") && e.contains("2 kinds") && e.contains("drop --db") && e.contains("--devices"),
            "{e}"
        );
    }

    /// Without a GPU the plan fails with the device error, not a panic.
    #[test]
    fn no_gpu_is_an_error() {
        if crate::gpu::device::driver_present() {
            return;
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
        let e = SpreadPlan::new(&catalog, &[0], None, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no CUDA GPU"), "{e}");
        let e = SpreadPlan::new(&catalog, &[], None, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty"), "{e}");
    }
}
