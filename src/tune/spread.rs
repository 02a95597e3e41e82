//! Tuning spread over several GPUs of one host (`tune --devices`).
//!
//! The GPUs are grouped by kind (name and compute capability): every kind tunes every workload
//! into its own database (the default file of that kind, see [`default_path`]), because a
//! winner measured on one kind says nothing about another. Within a kind the workloads are
//! split across its GPUs: those the database already has (without `force`) are only reported
//! from it; the others go longest first to the GPU with the least estimated work so far (LPT
//! scheduling, see [`assign`] and [`estimated_cost`]). Each GPU then runs the ordinary
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
use super::search;
use super::tuner::{tune, workload_flops, Phases, Progress, Quiet, TuneOptions, TuneResult, TuneRun};
use super::workloads::Workload;
use crate::codegen::Renderer;
use crate::gpu::device::driver_version;
use crate::gpu::{device_count, identify, CompileError, Compiler, DeviceIdentity, DeviceListError, Gpu, GpuError};
use crate::spec::{Catalog, DeviceLimits, Dtype};

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

/// Seconds one candidate costs besides its kernel's run time: its share of compiling, loading
/// and verifying it (roughly what the tuner spends per candidate on an H100).
pub const CANDIDATE_OVERHEAD_S: f64 = 0.05;
/// Kernel runs per candidate: the quick timing plan with its warm-up, plus a share of the
/// finalists' re-timing.
pub const RUNS_PER_CANDIDATE: f64 = 30.0;
/// Seconds a workload costs whatever its candidates: inputs, the f64 CPU reference, the peer.
pub const WORKLOAD_OVERHEAD_S: f64 = 0.5;
/// Candidates counted per workload at most: the tuner samples large spaces (default points plus
/// a seeded sample and the best points' neighbours), so a family with thousands of points does
/// not cost thousands of candidates.
pub const CANDIDATES_COUNTED: usize = 96;

/// Nominal arithmetic rate used to turn a workload's flops into kernel time: only the ratios
/// between workloads matter (the GPUs of a kind are equal).
fn nominal_flops_per_s(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 50e12,
        Dtype::Tf32 | Dtype::F16 | Dtype::Bf16 => 400e12,
    }
}

/// Estimated seconds to tune `w` with `candidates` candidate variants:
/// `WORKLOAD_OVERHEAD_S + min(candidates, CANDIDATES_COUNTED) × (CANDIDATE_OVERHEAD_S +
/// RUNS_PER_CANDIDATE × flops / rate(dtype))`. Memory-bound ops (no flops) cost their
/// overheads only: their kernels run in microseconds. A rough, documented model; it only has
/// to rank workloads well enough for [`assign`] to balance the GPUs.
pub fn estimated_cost(w: &Workload, candidates: usize) -> f64 {
    let kernel_s = workload_flops(w) / nominal_flops_per_s(w.dtype);
    let counted = candidates.min(CANDIDATES_COUNTED) as f64;
    WORKLOAD_OVERHEAD_S + counted * (CANDIDATE_OVERHEAD_S + RUNS_PER_CANDIDATE * kernel_s)
}

/// For each workload, how many variants of the catalog are candidates on a device with
/// `limits` (its pool, as the tuner draws it: see [`search::Pools`]), counted up to
/// [`CANDIDATES_COUNTED`]. A catalog that does not expand counts nothing (the tuner reports
/// it).
pub fn candidate_counts(catalog: &Catalog, workloads: &[&Workload], limits: &DeviceLimits) -> Vec<usize> {
    match search::Pools::new(catalog, workloads, limits) {
        Ok(pools) => workloads
            .iter()
            .map(|w| pools.candidates(w, limits).take(CANDIDATES_COUNTED).count())
            .collect(),
        Err(_) => vec![0; workloads.len()],
    }
}

/// Longest-processing-time-first assignment: jobs with a cost (`None`: nothing to do) taken
/// from the most to the least costly (ties: the earlier job first) each go to the bin with the
/// least cost so far (ties: the lower bin). Returns each job's bin, in job order; `None` stays
/// `None`. Deterministic; no bin ends later than 4/3 of the best possible split.
pub fn assign(costs: &[Option<f64>], bins: usize) -> Vec<Option<usize>> {
    let mut out = vec![None; costs.len()];
    if bins == 0 {
        return out;
    }
    let mut order: Vec<(usize, f64)> = costs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.map(|c| (i, if c.is_finite() { c.max(0.0) } else { 0.0 })))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut load = vec![0.0f64; bins];
    for (job, cost) in order {
        let bin = (0..bins)
            .min_by(|&x, &y| load[x].total_cmp(&load[y]).then(x.cmp(&y)))
            .unwrap_or(0);
        load[bin] += cost;
        out[job] = Some(bin);
    }
    out
}

/// The budget of a GPU that does `share` (0..=1) of its kind's estimated work: the one-GPU
/// budget times its share (at least one second), so each workload gets the search it would get
/// on one GPU.
pub fn device_budget(budget: Duration, share: f64) -> Duration {
    let share = if share.is_finite() { share.clamp(0.0, 1.0) } else { 1.0 };
    budget.mul_f64(share).max(Duration::from_secs(1).min(budget))
}

/// Devices (by position in the list) grouped by kind (name and compute capability), kinds in
/// the order they first appear, devices in list order within a kind.
pub fn group_by_kind(devices: &[DeviceIdentity]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (slot, d) in devices.iter().enumerate() {
        let same = |g: &Vec<usize>| {
            let first = &devices[g[0]];
            first.name == d.name && first.compute_capability == d.compute_capability
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => g.push(slot),
            None => groups.push(vec![slot]),
        }
    }
    groups
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
    use crate::model::GPT2Config;
    use crate::tune::workloads::model_workloads;

    fn loads(costs: &[Option<f64>], bins: &[Option<usize>], n: usize) -> Vec<f64> {
        let mut load = vec![0.0; n];
        for (c, b) in costs.iter().zip(bins) {
            if let (Some(c), Some(b)) = (c, b) {
                load[*b] += c;
            }
        }
        load
    }

    #[test]
    fn lpt_assigns_every_job_once_balanced_and_deterministic() {
        let costs = [
            Some(5.0),
            Some(1.0),
            None,
            Some(4.0),
            Some(3.0),
            Some(3.0),
            Some(2.0),
            None,
        ];
        let bins = assign(&costs, 2);
        // Result in input order, one bin per job with a cost, none for the others.
        assert_eq!(bins.len(), costs.len());
        assert_eq!(bins[2], None);
        assert_eq!(bins[7], None);
        assert!(costs.iter().zip(&bins).all(|(c, b)| c.is_some() == b.is_some()));
        // LPT: 5→0, 4→1, 3→1, 3→0, 2→0|1 (tie: 0 has 8, 1 has 7 → 1), 1→0.
        assert_eq!(
            bins,
            vec![Some(0), Some(0), None, Some(1), Some(1), Some(0), Some(1), None]
        );
        assert_eq!(loads(&costs, &bins, 2), vec![9.0, 9.0]);
        assert_eq!(assign(&costs, 2), bins, "deterministic");
        // Equal costs alternate, earlier jobs first.
        assert_eq!(
            assign(&[Some(1.0); 5], 2),
            vec![Some(0), Some(1), Some(0), Some(1), Some(0)]
        );
        // One bin takes everything; no bins, nothing; fewer jobs than bins leaves bins idle.
        assert!(assign(&costs, 1).iter().flatten().all(|&b| b == 0));
        assert!(assign(&costs, 0).iter().all(Option::is_none));
        assert_eq!(assign(&[Some(2.0)], 3), vec![Some(0)]);
        // NaN and negative costs are treated as free, not a panic.
        assert_eq!(assign(&[Some(f64::NAN), Some(-1.0), Some(1.0)], 2).len(), 3);
    }

    /// Graham's bound for list scheduling: no bin ends later than the average plus the largest
    /// job.
    #[test]
    fn lpt_stays_within_the_list_scheduling_bound() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) % 1000) as f64 + 1.0
        };
        for bins in 2..5 {
            for _ in 0..50 {
                let costs: Vec<Option<f64>> = (0..23).map(|_| Some(next())).collect();
                let assigned = assign(&costs, bins);
                let load = loads(&costs, &assigned, bins);
                let total: f64 = costs.iter().flatten().sum();
                let largest = costs.iter().flatten().cloned().fold(0.0, f64::max);
                let bound = total / bins as f64 + largest;
                let worst = load.iter().cloned().fold(0.0, f64::max);
                assert!(worst <= bound + 1e-9, "{worst} vs {bound}");
                assert!((load.iter().sum::<f64>() - total).abs() < 1e-6);
            }
        }
    }

    /// GPT-2 at batch 1 and 8 in bf16 on two equal GPUs: every workload once, both GPUs busy,
    /// the estimated work within a few percent.
    #[test]
    fn gpt2_workloads_split_evenly_over_two_gpus() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let catalog = Catalog::load(&root.join("specs"), &root.join("templates")).unwrap();
        let limits = DeviceLimits::default();
        let workloads = model_workloads(&GPT2Config::gpt2(), &[1, 8], &[1024], Dtype::Bf16);
        let all: Vec<&Workload> = workloads.iter().collect();
        let counts = candidate_counts(&catalog, &all, &limits);
        let costs: Vec<Option<f64>> = workloads
            .iter()
            .zip(&counts)
            .map(|(w, &n)| {
                assert!(n > 0, "no candidate for {} {:?}", w.role, w.shape);
                Some(estimated_cost(w, n))
            })
            .collect();
        let lm_head = workloads.iter().position(|w| w.role.starts_with("LM head")).unwrap();
        assert_eq!(counts[lm_head], CANDIDATES_COUNTED, "matmuls have thousands");
        let encoder = workloads.iter().position(|w| w.op == "encoder").unwrap();
        assert!(counts[encoder] < CANDIDATES_COUNTED, "{counts:?}");
        let bins = assign(&costs, 2);
        assert!(bins.iter().all(Option::is_some));
        let load = loads(&costs, &bins, 2);
        let total: f64 = load.iter().sum();
        assert!((load[0] - load[1]).abs() / total < 0.05, "{load:?} from {costs:?}");
    }

    #[test]
    fn cost_grows_with_work_and_candidates() {
        let workloads = model_workloads(&GPT2Config::gpt2(), &[1, 8], &[1024], Dtype::Bf16);
        let lm_head = |m: i64| {
            workloads
                .iter()
                .find(|w| w.role.starts_with("LM head") && w.shape["M"] == m)
                .unwrap()
        };
        assert!(estimated_cost(lm_head(8192), 50) > estimated_cost(lm_head(1), 50));
        assert!(estimated_cost(lm_head(1), 50) > estimated_cost(lm_head(1), 10));
        assert_eq!(
            estimated_cost(lm_head(1), 1000),
            estimated_cost(lm_head(1), CANDIDATES_COUNTED)
        );
        assert!(estimated_cost(lm_head(1), 0) >= WORKLOAD_OVERHEAD_S);
    }

    #[test]
    fn budgets_follow_the_share() {
        let b = Duration::from_secs(120);
        assert_eq!(device_budget(b, 0.5), Duration::from_secs(60));
        assert_eq!(device_budget(b, 1.0), b);
        assert_eq!(device_budget(b, 0.0), Duration::from_secs(1));
        assert_eq!(device_budget(b, f64::NAN), b);
        assert_eq!(
            device_budget(Duration::from_millis(200), 0.1),
            Duration::from_millis(200)
        );
    }

    fn identity(ordinal: usize, name: &str, cc: (i32, i32)) -> DeviceIdentity {
        DeviceIdentity {
            ordinal,
            name: name.into(),
            compute_capability: cc,
            limits: DeviceLimits::default(),
        }
    }

    #[test]
    fn devices_group_by_name_and_compute_capability() {
        let devices = [
            identity(0, "NVIDIA H200", (9, 0)),
            identity(1, "NVIDIA A100-SXM4-80GB", (8, 0)),
            identity(2, "NVIDIA H200", (9, 0)),
            identity(0, "NVIDIA H200", (9, 0)),
        ];
        assert_eq!(group_by_kind(&devices), vec![vec![0, 2, 3], vec![1]]);
        assert_eq!(group_by_kind(&devices[..1]), vec![vec![0]]);
        assert!(group_by_kind(&[]).is_empty());
        assert_eq!(devices[1].label(), "cuda:1 (NVIDIA A100-SXM4-80GB)");
    }

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
