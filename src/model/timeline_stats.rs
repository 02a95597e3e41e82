//! Where a megakernel decode step's time goes, in numbers: the [`Timeline`] folded per op into
//! what each stage adds to the step (the critical path) and how that splits into waiting for the
//! producing stage's signal, staging inputs and weights, and computing. The picture
//! ([`super::timeline_svg`]) shows the bubbles; this table sizes them.
//!
//! A stage is a run of consecutive tasks with the same op and layer (the stamps come in stage
//! order). Every stage waits for the one before it, so the step is the sum over stages of
//! `last end of the stage − last end of the stage before`. That difference splits exactly along
//! the stage's last task to finish: the signal (until the stage's first task sees its input),
//! how much later the last task saw it (its block still busy with an earlier task, or its own
//! poll seeing the count later), its inputs and its work. The means over all of a stage's tasks
//! say what a typical task costs; the last task's split says what the step waited for.

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
    /// The stage's last task to finish, the one the step waited for (µs, mean over the op's
    /// stages); `critical_us = signal_us + last_busy_us + last_poll_us + last_inputs_us +
    /// last_work_us`. Busy: its block was still running an earlier task when the stage's first
    /// task saw the input ready.
    pub last_busy_us: f64,
    /// Poll: the rest of how much later than the stage's first task it saw the input ready.
    pub last_poll_us: f64,
    /// Its input staged and weights landed.
    pub last_inputs_us: f64,
    /// Its arithmetic and stores.
    pub last_work_us: f64,
}

/// The per-op table of `timeline`, ops in step order (first appearance); empty when there are
/// no tasks.
pub fn summarize(timeline: &Timeline) -> Vec<OpSummary> {
    let stages = split_stages(&timeline.tasks);
    let mut ops: Vec<(String, Vec<StageTimes>)> = Vec::new();
    let mut previous_end: Option<u64> = None;
    for tasks in &stages {
        // the stage's last task to finish: the one the step waited for (split_stages makes no
        // empty stage)
        let last = tasks.iter().max_by_key(|t| t.end_ns).expect("a stage has tasks");
        let last_end = last.end_ns;
        let first_start = tasks.iter().map(|t| t.start_ns).min().unwrap_or(0);
        let first_ready = tasks.iter().map(|t| t.ready_ns).min().unwrap_or(0);
        let before = previous_end.unwrap_or(first_start);
        let n = tasks.len() as f64;
        let late = last.ready_ns.saturating_sub(first_ready) as f64;
        let busy = (last.start_ns.min(last.ready_ns).saturating_sub(first_ready) as f64).min(late);
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
            last_busy_ns: busy,
            last_poll_ns: late - busy,
            last_inputs_ns: last.data_ns.saturating_sub(last.ready_ns) as f64,
            last_work_ns: last.end_ns.saturating_sub(last.data_ns.max(last.ready_ns)) as f64,
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
                last_busy_us: mean(|t| t.last_busy_ns),
                last_poll_us: mean(|t| t.last_poll_ns),
                last_inputs_us: mean(|t| t.last_inputs_ns),
                last_work_us: mean(|t| t.last_work_ns),
            }
        })
        .collect()
}

/// The tables as text, one row per op (for `bench --timeline`): the stages with their tasks'
/// means, then the split of each stage's time along its last task.
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
    s.push_str("what each stage waited for, its last task: µs/stage = signal + busy + poll + inputs + work\n");
    s.push_str("op          µs/stage  signal µs  busy µs  poll µs  inputs µs  work µs\n");
    for r in rows {
        s.push_str(&format!(
            "{:<11} {:>8.2} {:>10.2} {:>8.2} {:>8.2} {:>10.2} {:>8.2}\n",
            r.op, r.critical_us, r.signal_us, r.last_busy_us, r.last_poll_us, r.last_inputs_us, r.last_work_us
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
    last_busy_ns: f64,
    last_poll_ns: f64,
    last_inputs_ns: f64,
    last_work_ns: f64,
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
        // qkv layer 0's last task (block 1) saw its input 0.1 µs after block 0's (poll), had its
        // inputs 1.5 µs and worked 1 µs: 1.5 + 0.1 + 1.5 + 1.0 = 4.1; layer 1: 1.0 + 0 + 0 + 1.0
        assert!((qkv.last_busy_us - 0.0).abs() < 1e-9, "{qkv:?}");
        assert!((qkv.last_poll_us - 0.05).abs() < 1e-9, "{qkv:?}");
        assert!((qkv.last_inputs_us - 0.75).abs() < 1e-9, "{qkv:?}");
        assert!((qkv.last_work_us - 1.0).abs() < 1e-9, "{qkv:?}");
        for r in &rows {
            let split = r.signal_us + r.last_busy_us + r.last_poll_us + r.last_inputs_us + r.last_work_us;
            assert!((split - r.critical_us).abs() < 1e-9, "{r:?}: the split adds up");
        }
        let table = summary_table(&rows);
        assert!(table.lines().count() == 9 && table.contains("busy µs"), "{table}");
    }

    #[test]
    fn a_last_task_whose_block_was_busy_is_late_by_that_much() {
        let tl = Timeline {
            blocks: 2,
            tasks: vec![
                task("embed", None, 0, [0, 0, 0, 1_000]),
                // block 0 sees fc's input at 2.0 µs; block 1 is still busy until 3.0, sees it at
                // 3.2 (its own poll 0.2 more), stages 0.3 and works 1.0: the stage ends at 4.5
                task("fc", Some(0), 0, [1_000, 2_000, 2_100, 2_600]),
                task("fc", Some(0), 1, [3_000, 3_200, 3_500, 4_500]),
            ],
        };
        let fc = summarize(&tl).into_iter().find(|r| r.op == "fc").unwrap();
        assert!((fc.critical_us - 3.5).abs() < 1e-9, "{fc:?}");
        assert!((fc.signal_us - 1.0).abs() < 1e-9, "{fc:?}");
        assert!((fc.last_busy_us - 1.0).abs() < 1e-9, "{fc:?}");
        assert!((fc.last_poll_us - 0.2).abs() < 1e-9, "{fc:?}");
        assert!((fc.last_inputs_us - 0.3).abs() < 1e-9, "{fc:?}");
        assert!((fc.last_work_us - 1.0).abs() < 1e-9, "{fc:?}");
    }

    #[test]
    fn an_empty_timeline_has_no_rows() {
        assert!(summarize(&Timeline::default()).is_empty());
    }
}
