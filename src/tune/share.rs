//! How the workloads of one GPU kind are shared out among its GPUs (`tune --devices`): each
//! workload's estimated cost, longest-processing-time assignment to the least busy GPU, each
//! GPU's share of the budget, and the grouping of GPUs by kind. Pure arithmetic, tested without
//! a GPU; `spread.rs` plans and runs with it.

use std::time::Duration;

use super::search;
use super::tuner::workload_flops;
use super::workloads::Workload;
use crate::gpu::DeviceIdentity;
use crate::spec::{Catalog, DeviceLimits, Dtype};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::model_dims::ModelDims;
    use crate::tune::workloads::model_workloads;
    use std::path::Path;

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
        let workloads = model_workloads(&ModelDims::released_gpt2(12, 12, 768), &[1, 8], &[1024], Dtype::Bf16);
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
        let workloads = model_workloads(&ModelDims::released_gpt2(12, 12, 768), &[1, 8], &[1024], Dtype::Bf16);
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
            stand_in: None,
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
}
