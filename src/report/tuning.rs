//! The workload pages (`workloads/<slug>.html`): every candidate the tuner tried for one
//! tuned key with its parameters, time, verified error and resources; the strip plot of the
//! timed ones by family; and one small plot per parameter of each family.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::charts::{param_plot, param_plot_axes, strip_plot, StripRow, StripTimes};
use super::pages::{family_colour, params_text, resources_text, Page, Shared};
use super::svg::num;
use super::ReportError;
use crate::tune::db::Candidate;

/// The longest rejection reason shown in the table (the rest is cut with an ellipsis).
const REASON_CHARS: usize = 200;

/// Every workload's page.
pub fn workload_pages(s: &Shared) -> Result<Vec<Page>, ReportError> {
    (0..s.workloads.len()).map(|i| workload_page(s, i)).collect()
}

fn short(text: &str) -> String {
    let first = text.lines().next().unwrap_or("");
    if first.chars().count() > REASON_CHARS || text.lines().count() > 1 {
        format!("{}…", first.chars().take(REASON_CHARS).collect::<String>())
    } else {
        first.to_string()
    }
}

fn workload_page(s: &Shared, i: usize) -> Result<Page, ReportError> {
    let w = &s.workloads[i];
    let timed = w.timed();
    let rejected: Vec<&Candidate> = w.entry.candidates.iter().filter(|c| c.median_ms.is_none()).collect();

    // Families in the order of their best time.
    let mut by_family: Vec<(String, Vec<&Candidate>)> = Vec::new();
    for c in &timed {
        match by_family.iter_mut().find(|(f, _)| *f == c.family) {
            Some((_, v)) => v.push(c),
            None => by_family.push((c.family.clone(), vec![c])),
        }
    }
    let strip = (!timed.is_empty()).then(|| {
        let rows: Vec<StripRow> = by_family
            .iter()
            .map(|(family, cands)| StripRow {
                label: family.clone(),
                colour: family_colour(s.input, family),
                points: cands
                    .iter()
                    .filter_map(|c| {
                        c.median_ms
                            .map(|ms| (ms, format!("{} ms: {}", num(ms), params_text(&c.params))))
                    })
                    .collect(),
            })
            .collect();
        // The decode step's points are whole greedy steps (`tune --decode-step`), not kernels.
        let times_are = if w.op == crate::ops::decode_step::NAME {
            StripTimes::DecodeStep
        } else {
            StripTimes::Kernel
        };
        strip_plot(
            &rows,
            times_are,
            Some((w.entry.median_ms, w.entry.family.as_str())),
            w.entry.baseline_ms.zip(crate::tune::baseline::entry_peer(&w.entry)),
        )
    });

    // One small plot per parameter that took two or more values among a family's timed variants.
    let times: Vec<f64> = timed.iter().filter_map(|c| c.median_ms).collect();
    let (lo, hi) = times
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), t| (a.min(*t), b.max(*t)));
    let y_range = if lo.is_finite() && lo > 0.0 {
        let (lo, hi) = if hi / lo < 1.5 {
            (lo / 1.25, hi * 1.25)
        } else {
            (lo, hi)
        };
        (lo / 1.15, hi * 1.15)
    } else {
        (0.1, 10.0)
    };
    let mut knobs = Vec::new();
    for (family, cands) in by_family.iter().filter(|(_, c)| c.len() >= 2) {
        let names: Vec<&String> = cands[0].params.keys().collect();
        let mut plots = Vec::new();
        for name in names {
            let mut values: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
            for c in cands {
                if let (Some(v), Some(ms)) = (c.params.get(name), c.median_ms) {
                    values.entry(*v).or_default().push(ms);
                }
            }
            if values.len() >= 2 {
                let values: Vec<(i64, Vec<f64>)> = values.into_iter().collect();
                plots.push(param_plot(name, &values, y_range, family_colour(s.input, family)));
            }
        }
        if !plots.is_empty() {
            knobs.push(json!({ "family": family, "timed": cands.len(), "plots": plots }));
        }
    }

    let mut rows: Vec<Value> = Vec::new();
    for (rank, c) in timed.iter().enumerate() {
        let winner = Shared::is_winner(w, c);
        rows.push(json!({
            "rank": rank + 1,
            "winner": winner,
            "family": c.family,
            "params": params_text(&c.params),
            "ms": c.median_ms.map(num).unwrap_or_default(),
            "spread": c.spread_ms.map(num).unwrap_or_default(),
            "error": c.error.map(|e| format!("{e:.1e}")).unwrap_or_else(|| "-".into()),
            "resources": resources_text(Some(&c.resources)),
            "outcome": if winner { "winner".to_string() } else { "timed".to_string() },
        }));
    }
    for c in &rejected {
        rows.push(json!({
            "rank": "-",
            "winner": false,
            "family": c.family,
            "params": params_text(&c.params),
            "ms": "-",
            "spread": "-",
            "error": c.error.map(|e| format!("{e:.1e}")).unwrap_or_else(|| "-".into()),
            "resources": resources_text(Some(&c.resources)),
            "outcome": format!("rejected: {}", short(c.rejected.as_deref().unwrap_or("not timed"))),
        }));
    }
    let ctx = json!({
        "w": s.workload_row(i),
        "strip": strip,
        "knob_axes": (!knobs.is_empty()).then(|| param_plot_axes(y_range)),
        "knobs": knobs,
        "rows": rows,
        "timed": timed.len(),
        "tried": if w.entry.candidates.is_empty() { w.entry.variants_tried } else { w.entry.candidates.len() },
        "rejected": rejected.len(),
    });
    let title = format!("#{} {}", w.number, w.title());
    s.render(
        "workload.html",
        &format!("workloads/{}.html", w.slug),
        &title,
        "../",
        ctx,
    )
}
