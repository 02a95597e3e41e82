//! Where a megakernel decode step's time goes, in numbers: the [`Timeline`] folded per op into
//! what each stage adds to the step (the critical path) and how that splits into waiting for the
//! producing stage's signal, staging inputs and weights, and computing. The picture
//! ([`super::timeline_svg`]) shows the bubbles; this table sizes them.
//!
//! A stage is a run of consecutive tasks with the same op and layer (the stamps come in stage
//! order). Every stage waits for the one before it, so the step is the sum over stages of
//! `last end of the stage − last end of the stage before`.

use super::engine::{TaskStamp, Timeline};

/// One op's stages, averaged over its occurrences (e.g. the 12 `qkv` stages of GPT-2 small).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct OpSummary {
    pub op: String,
    /// Stages of this op in the step, and tasks per stage.
    pub stages: usize,
    pub tasks_per_stage: f64,
    /// What one stage adds to the step (µs): its last task's end minus the previous stage's.
    pub critical_us: f64,
    /// From the previous stage's last end (outputs stored) to this stage's first task seeing its
    /// input ready (µs): the release, the poll that sees it, the acquire.
    pub signal_us: f64,
    /// Per task, from input ready to input staged and weights landed (µs), mean.
    pub stage_in_us: f64,
    /// Per task, from data ready to the task's end (µs), mean: the arithmetic and the stores.
    pub compute_us: f64,
    /// Share of the step spent in this op's stages (critical path).
    pub share: f64,
}

/// The per-op table of `timeline`, ops in step order (first appearance); empty when there are
/// no tasks.
pub fn summarize(timeline: &Timeline) -> Vec<OpSummary> {
    let stages = split_stages(&timeline.tasks);
    let mut ops: Vec<(String, Vec<StageTimes>)> = Vec::new();
    let mut previous_end: Option<u64> = None;
    for tasks in &stages {
        let first_start = tasks.iter().map(|t| t.start_ns).min().unwrap_or(0);
        let last_end = tasks.iter().map(|t| t.end_ns).max().unwrap_or(0);
        let first_ready = tasks.iter().map(|t| t.ready_ns).min().unwrap_or(0);
        let before = previous_end.unwrap_or(first_start);
        let n = tasks.len() as f64;
        let times = StageTimes {
            tasks: tasks.len(),
            critical_ns: last_end.saturating_sub(before) as f64,
            signal_ns: first_ready.saturating_sub(before) as f64,
            stage_in_ns: tasks
                .iter()
                .map(|t| t.data_ns.saturating_sub(t.ready_ns) as f64)
                .sum::<f64>()
                / n,
            compute_ns: tasks
                .iter()
                .map(|t| t.end_ns.saturating_sub(t.data_ns.max(t.ready_ns)) as f64)
                .sum::<f64>()
                / n,
        };
        previous_end = Some(last_end.max(before));
        match ops.iter_mut().find(|(op, _)| *op == tasks[0].op) {
            Some((_, list)) => list.push(times),
            None => ops.push((tasks[0].op.clone(), vec![times])),
        }
    }
    let total: f64 = ops.iter().flat_map(|(_, l)| l.iter().map(|t| t.critical_ns)).sum();
    ops.into_iter()
        .map(|(op, list)| {
            let n = list.len() as f64;
            let mean = |f: fn(&StageTimes) -> f64| list.iter().map(f).sum::<f64>() / n / 1e3;
            let critical: f64 = list.iter().map(|t| t.critical_ns).sum();
            OpSummary {
                op,
                stages: list.len(),
                tasks_per_stage: list.iter().map(|t| t.tasks as f64).sum::<f64>() / n,
                critical_us: mean(|t| t.critical_ns),
                signal_us: mean(|t| t.signal_ns),
                stage_in_us: mean(|t| t.stage_in_ns),
                compute_us: mean(|t| t.compute_ns),
                share: if total > 0.0 { critical / total } else { 0.0 },
            }
        })
        .collect()
}

/// The table as text, one row per op (for `bench --timeline`).
pub fn summary_table(rows: &[OpSummary]) -> String {
    let mut s = String::from("op          stages  tasks  µs/stage  signal µs  inputs µs  compute µs  share\n");
    for r in rows {
        s.push_str(&format!(
            "{:<11} {:>6} {:>6.0} {:>9.2} {:>10.2} {:>10.2} {:>11.2} {:>5.1}%\n",
            r.op,
            r.stages,
            r.tasks_per_stage,
            r.critical_us,
            r.signal_us,
            r.stage_in_us,
            r.compute_us,
            100.0 * r.share
        ));
    }
    s
}

struct StageTimes {
    tasks: usize,
    critical_ns: f64,
    signal_ns: f64,
    stage_in_ns: f64,
    compute_ns: f64,
}

/// Consecutive tasks of one (op, layer).
fn split_stages(tasks: &[TaskStamp]) -> Vec<&[TaskStamp]> {
    let mut out = Vec::new();
    let mut begin = 0;
    for i in 1..=tasks.len() {
        if i == tasks.len() || (tasks[i].op != tasks[begin].op || tasks[i].layer != tasks[begin].layer) {
            if i > begin {
                out.push(&tasks[begin..i]);
            }
            begin = i;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(op: &str, layer: Option<u32>, block: u32, t: [u64; 4]) -> TaskStamp {
        TaskStamp {
            block,
            op: op.into(),
            layer,
            start_ns: t[0],
            ready_ns: t[1],
            data_ns: t[2],
            end_ns: t[3],
        }
    }

    #[test]
    fn stages_add_up_to_the_step_and_split_into_signal_inputs_compute() {
        let tl = Timeline {
            blocks: 2,
            tasks: vec![
                task("embed", None, 0, [0, 0, 0, 1_000]),
                // qkv layer 0: ready 1.5 µs after embed ended; inputs 0.5 / 1.5 µs; compute 1 µs
                task("qkv", Some(0), 0, [1_000, 2_500, 3_000, 4_000]),
                task("qkv", Some(0), 1, [0, 2_600, 4_100, 5_100]),
                // qkv layer 1 is a different stage of the same op
                task("qkv", Some(1), 0, [5_100, 6_100, 6_100, 7_100]),
                task("lm_head", None, 1, [5_100, 7_600, 8_100, 10_100]),
            ],
        };
        let rows = summarize(&tl);
        let ops: Vec<&str> = rows.iter().map(|r| r.op.as_str()).collect();
        assert_eq!(ops, ["embed", "qkv", "lm_head"]);
        let qkv = &rows[1];
        assert_eq!(qkv.stages, 2);
        assert!((qkv.tasks_per_stage - 1.5).abs() < 1e-9);
        // layer 0 adds 5.1 - 1.0 = 4.1 µs, layer 1 adds 7.1 - 5.1 = 2.0 µs
        assert!((qkv.critical_us - 3.05).abs() < 1e-9, "{qkv:?}");
        // signals 1.5 and 1.0 µs
        assert!((qkv.signal_us - 1.25).abs() < 1e-9, "{qkv:?}");
        // inputs: layer 0 mean (0.5 + 1.5) / 2 = 1.0, layer 1: 0 -> 0.5
        assert!((qkv.stage_in_us - 0.5).abs() < 1e-9, "{qkv:?}");
        assert!((qkv.compute_us - 1.0).abs() < 1e-9, "{qkv:?}");
        let total: f64 = rows.iter().map(|r| r.critical_us * r.stages as f64).sum();
        assert!((total - 10.1).abs() < 1e-9, "the stages add up to the step: {total}");
        let shares: f64 = rows.iter().map(|r| r.share).sum();
        assert!((shares - 1.0).abs() < 1e-9);
        let table = summary_table(&rows);
        assert!(table.lines().count() == 4 && table.contains("lm_head"), "{table}");
    }

    #[test]
    fn an_empty_timeline_has_no_rows() {
        assert!(summarize(&Timeline::default()).is_empty());
    }
}
