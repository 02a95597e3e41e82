//! The family pages (`families/<name>.html`: the spec's description, search space, derived
//! values, constraints, launch geometry and default, the default's rendered CUDA and resources,
//! the tuned winners) and one page per tuned winner (`families/<name>/<kernel>.html`: its
//! source beside the default's, as a side-by-side diff, and in full).

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{json, Value};

use super::code::{listing, side_by_side};
use super::pages::{resource_key, resources_text, Page, Shared, Winner};
use super::svg::num;
use super::ReportError;
use crate::spec::{expand, variant_with, Family, Points, Variant};

/// Unchanged lines shown around each changed hunk of a winner's diff against the default: two
/// place a change in its code; each more line costs every winner's page two table rows (the site
/// of a fully tuned GPT-2 holds ~50 such diffs and must stay under 10 MB).
const DIFF_CONTEXT: usize = 2;

/// Rendered sources by kernel name (`Err`: the template's message), so each renders once.
#[derive(Default)]
pub struct Sources(HashMap<String, Result<String, String>>);

impl Sources {
    fn get(&mut self, s: &Shared, v: &Variant) -> Result<String, String> {
        self.0
            .entry(v.kernel_name())
            .or_insert_with(|| s.renderer.render(v).map(|src| src.code).map_err(|e| e.to_string()))
            .clone()
    }
}

/// Every family's page and every winner's page.
pub fn family_pages(s: &Shared) -> Result<Vec<Page>, ReportError> {
    let mut sources = Sources::default();
    let mut pages = Vec::new();
    for f in &s.input.catalog.families {
        pages.push(family_page(s, f, &mut sources)?);
    }
    for w in &s.winners {
        pages.push(winner_page(s, w, &mut sources)?);
    }
    Ok(pages)
}

/// `listing` of a source, or a note saying why there is none.
fn listing_or_note(source: &Result<String, String>) -> String {
    match source {
        Ok(code) => listing(code),
        Err(e) => format!(
            "<p class=\"note\">The template did not render: {}</p>",
            super::svg::esc(e)
        ),
    }
}

/// The resources recorded for `v` on a workload of `kind`; else for the same point under any
/// dtype or kind (said so).
fn resources_of(s: &Shared, v: &Variant, kind: &str) -> String {
    let key = resource_key(&v.family.name, &v.dtype.to_string(), kind, &v.params);
    if let Some(r) = s.resources.get(&key) {
        return resources_text(Some(r));
    }
    let prefix = format!("{}|", v.family.name);
    let suffix = key.rsplit_once('|').map(|(_, p)| format!("|{p}")).unwrap_or_default();
    match s
        .resources
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix) && k.ends_with(&suffix))
        .min_by_key(|(k, _)| k.as_str())
    {
        Some((k, r)) => format!(
            "{} (as measured for {})",
            resources_text(Some(r)),
            k.split('|').skip(1).take(2).collect::<Vec<_>>().join(" ")
        ),
        None => "not measured (this point was not a candidate in the database)".into(),
    }
}

fn family_page(s: &Shared, f: &Arc<Family>, sources: &mut Sources) -> Result<Page, ReportError> {
    let defaults = expand(f, Points::Default, &s.limits)?;
    let default = defaults.first();
    let space: usize = f.params.values().map(|v| v.len().max(1)).product();
    let join = |v: Vec<String>| v.join(", ");
    let fam = json!({
        "name": f.name,
        "description": f.description,
        "op": f.op.name(),
        "spec": f.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "template": f.template,
        "dtypes": join(f.dtypes.iter().map(|d| d.to_string()).collect()),
        "epilogues": join(f.epilogues.iter().filter(|e| e.as_str() != "none").map(|e| e.as_str().to_string()).collect()),
        "masks": join(f.masks.iter().filter(|m| m.as_str() != "none").map(|m| m.as_str().to_string()).collect()),
        "rank": f.rank,
        "prefer_when": f.prefer_when.as_ref().map(|e| e.to_string()),
        "arch": f.arch.as_ref().map(|a| a.name.clone()),
        "points": s.point_counts.get(&f.name),
        "space": space,
        "params": f.params.iter().map(|(name, values)| json!({
            "name": name,
            "values": values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", "),
            "default": f.default.get(name).map(|v| v.to_string()).unwrap_or_default(),
        })).collect::<Vec<_>>(),
        "derived": f.derived.iter().map(|(name, expr)| json!({
            "name": name,
            "expr": expr.to_string(),
            "value": default.and_then(|d| d.derived.get(name)).map(|v| v.to_string()).unwrap_or_default(),
        })).collect::<Vec<_>>(),
        "require": f.require.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
        "shape_rules": f.shape_constraints.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
        "kernels": f.kernels.iter().map(|k| json!({
            "name": k.name,
            "grid": k.grid.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", "),
            "block": k.block.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", "),
            "smem": k.smem.to_string(),
        })).collect::<Vec<_>>(),
    });
    let winners: Vec<Value> = s
        .winners
        .iter()
        .filter(|w| w.variant.family.name == f.name)
        .map(|w| {
            let changed: Vec<String> = w
                .variant
                .params
                .iter()
                .filter(|(k, v)| f.default.get(*k) != Some(*v))
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            json!({
                "kernel": w.kernel,
                "key": w.variant.key(),
                "won": won(s, w),
                "changed": if changed.is_empty() { "nothing: the default point".to_string() } else { changed.join(" ") },
                "resources": resources_of(s, &w.variant, &w.kind),
            })
        })
        .collect();
    let unresolved: Vec<String> = s
        .workloads
        .iter()
        .zip(&s.winner_of)
        .filter(|(w, k)| k.is_none() && w.entry.family == f.name)
        .map(|(w, _)| format!("#{} names parameters the spec no longer has", w.number))
        .collect();
    let (listing, key, kernel, default_resources) = match default {
        Some(v) => {
            let kind = if v.epilogue.as_str() != "none" {
                v.epilogue.as_str()
            } else {
                v.mask.as_str()
            };
            (
                listing_or_note(&sources.get(s, v)),
                v.key(),
                v.kernel_name(),
                resources_of(s, v, kind),
            )
        }
        None => (String::new(), String::new(), String::new(), "no default point".into()),
    };
    let ctx = json!({
        "f": fam,
        "winners": winners,
        "unresolved": unresolved.join("; "),
        "default_listing": listing,
        "default_key": key,
        "default_kernel": kernel,
        "default_resources": default_resources,
    });
    s.render("family.html", &format!("families/{}.html", f.name), &f.name, "../", ctx)
}

/// The workloads a winner won, as the pages list them.
fn won(s: &Shared, w: &Winner) -> Vec<Value> {
    w.won
        .iter()
        .map(|&i| {
            let wl = &s.workloads[i];
            json!({
                "number": wl.number,
                "slug": wl.slug,
                "title": wl.title(),
                "shape": wl.shape,
                "ms": num(wl.entry.median_ms),
            })
        })
        .collect()
}

fn winner_page(s: &Shared, w: &Winner, sources: &mut Sources) -> Result<Page, ReportError> {
    let v = &w.variant;
    let f = &v.family;
    let default = variant_with(f, &[], v.dtype, v.epilogue, v.mask, &s.limits);
    let winner_src = sources.get(s, v);
    let (diff, summary, default_resources) = match &default {
        Ok(d) => {
            let default_src = sources.get(s, d);
            match (&default_src, &winner_src) {
                (Ok(a), Ok(b)) => {
                    let (html, stats) =
                        side_by_side(a, b, &format!("default {}", d.kernel_name()), &w.kernel, DIFF_CONTEXT);
                    let summary = if stats.added + stats.removed == 0 {
                        "The winner is the default point: the sources are identical.".to_string()
                    } else {
                        format!(
                            "{} lines of the default replaced by {} (changed hunks with {DIFF_CONTEXT} lines of context; the rest is folded).",
                            stats.removed, stats.added
                        )
                    };
                    (html, summary, resources_of(s, d, &w.kind))
                }
                (Err(e), _) | (_, Err(e)) => (String::new(), format!("No diff: {e}"), resources_of(s, d, &w.kind)),
            }
        }
        Err(e) => (
            String::new(),
            format!("No diff: the default point is not valid here ({e})"),
            "-".into(),
        ),
    };
    let params: Vec<Value> = v
        .params
        .iter()
        .map(|(k, val)| {
            let d = f.default.get(k).copied();
            json!({
                "name": k,
                "default": d.map(|x| x.to_string()).unwrap_or_default(),
                "winner": val,
                "changed": d != Some(*val),
            })
        })
        .collect();
    let ctx = json!({
        "family": f.name,
        "kernel": w.kernel,
        "key": v.key(),
        "won": won(s, w),
        "params": params,
        "resources": resources_of(s, v, &w.kind),
        "default_resources": default_resources,
        "diff": diff,
        "diff_summary": summary,
        "listing": listing_or_note(&winner_src),
    });
    s.render(
        "winner.html",
        &format!("families/{}/{}.html", f.name, w.kernel),
        &w.kernel,
        "../../",
        ctx,
    )
}
