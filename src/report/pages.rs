//! The site's pages: the tera environment over the HTML templates in `src/report/html/`, the
//! facts every page shares (workloads, winners, resources), and the overview, families index
//! and model pages. The workload pages are in [`super::tuning`]'s care and the family and winner
//! pages in [`super::family`]'s.

use std::collections::HashMap;

use serde_json::{json, Value};

use super::charts::{bar_chart, roofline, Bar, RoofPoint};
use super::data::{limits_for, variant_of, workloads, Bench, ReportInput, Timeline, Workload};
use super::svg::num;
use super::ReportError;
use crate::codegen::Renderer;
use crate::spec::{DeviceLimits, Variant};
use crate::tune::baseline::entry_peer;
use crate::tune::db::{Candidate, Resources};

/// One file of the site: its path inside the output folder and its contents.
#[derive(Debug, Clone)]
pub struct Page {
    pub path: String,
    pub contents: Vec<u8>,
}

const TEMPLATES: [(&str, &str); 7] = [
    ("base.html", include_str!("html/base.html.tera")),
    ("overview.html", include_str!("html/overview.html.tera")),
    ("families.html", include_str!("html/families.html.tera")),
    ("workload.html", include_str!("html/workload.html.tera")),
    ("family.html", include_str!("html/family.html.tera")),
    ("winner.html", include_str!("html/winner.html.tera")),
    ("model.html", include_str!("html/model.html.tera")),
];

/// A distinct winning variant (one page each), and the workloads it won.
pub struct Winner {
    pub variant: Variant,
    pub kernel: String,
    /// `kind` as the database names it (epilogue, mask or `none`).
    pub kind: String,
    pub won: Vec<usize>,
}

impl Winner {
    /// Its page, from the site's root.
    pub fn href(&self) -> String {
        format!("families/{}/{}.html", self.variant.family.name, self.kernel)
    }
}

/// Whether `limits` gives spec expressions the same variables as the default limits (only the
/// compute capability differs).
fn same_vars(limits: &DeviceLimits) -> bool {
    DeviceLimits {
        compute_capability: limits.compute_capability,
        ..DeviceLimits::default()
    } == *limits
}

/// What every page draws from.
pub struct Shared<'a> {
    pub input: &'a ReportInput,
    pub workloads: Vec<Workload>,
    pub winners: Vec<Winner>,
    /// Per workload: its winner's index in `winners` (`None`: the specs cannot rebuild it).
    pub winner_of: Vec<Option<usize>>,
    /// Resources by `family|dtype|kind|params`, from every candidate of the database.
    pub resources: HashMap<String, Vec<Resources>>,
    pub limits: DeviceLimits,
    /// Valid points per family (or why they cannot be counted), counted once, in parallel.
    pub point_counts: HashMap<String, String>,
    pub renderer: Renderer,
    tera: tera::Tera,
}

/// `block_m=64 block_n=128`.
pub fn params_text(params: &indexmap::IndexMap<String, i64>) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `main: 128 / 16384 / 0` per kernel, `;`-separated; `not measured` when empty.
pub fn resources_text(resources: Option<&Vec<Resources>>) -> String {
    match resources {
        Some(r) if !r.is_empty() => r
            .iter()
            .map(|k| {
                format!(
                    "{}: {} / {} / {}",
                    k.kernel, k.registers, k.static_smem_bytes, k.local_bytes
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        _ => "not measured".into(),
    }
}

/// The key of a point's resources: family, dtype, kind and the params in name order (a
/// database written through other tools may hold them in another order).
pub fn resource_key(family: &str, dtype: &str, kind: &str, params: &indexmap::IndexMap<String, i64>) -> String {
    let sorted: std::collections::BTreeMap<&String, &i64> = params.iter().collect();
    let text: Vec<String> = sorted.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{family}|{dtype}|{kind}|{}", text.join(" "))
}

/// The colour class index of a family: its place in the catalog.
pub fn family_colour(input: &ReportInput, family: &str) -> usize {
    input
        .catalog
        .families
        .iter()
        .position(|f| f.name == family)
        .unwrap_or(usize::MAX - 1)
        % super::charts::COLOURS
}

fn dtype_colour(dtype: &str) -> usize {
    match dtype {
        "f32" => 0,
        "tf32" => 1,
        "f16" => 2,
        "bf16" => 3,
        _ => 4,
    }
}

impl<'a> Shared<'a> {
    pub fn new(input: &'a ReportInput) -> Result<Shared<'a>, ReportError> {
        let mut tera = tera::Tera::default();
        tera.add_raw_templates(TEMPLATES).map_err(|e| ReportError::Page {
            page: "templates".into(),
            message: error_chain(&e),
        })?;
        let limits = limits_for(input.db.as_ref().map(|d| &d.header));
        let workloads = input.db.as_ref().map(workloads).unwrap_or_default();
        let mut winners: Vec<Winner> = Vec::new();
        let mut winner_of = Vec::new();
        for (i, w) in workloads.iter().enumerate() {
            let e = &w.entry;
            let found = match variant_of(&input.catalog, &e.family, &e.params, &w.dtype, &w.kind, &limits) {
                Ok(v) => {
                    let kernel = v.kernel_name();
                    let at = match winners.iter().position(|x| x.kernel == kernel) {
                        Some(at) => at,
                        None => {
                            winners.push(Winner {
                                variant: v,
                                kernel,
                                kind: w.kind.clone(),
                                won: Vec::new(),
                            });
                            winners.len() - 1
                        }
                    };
                    winners[at].won.push(i);
                    Some(at)
                }
                Err(_) => None,
            };
            winner_of.push(found);
        }
        let mut resources = HashMap::new();
        for w in &workloads {
            for c in w.entry.candidates.iter().filter(|c| !c.resources.is_empty()) {
                resources
                    .entry(resource_key(&c.family, &w.dtype, &w.kind, &c.params))
                    .or_insert_with(|| c.resources.clone());
            }
        }
        // Counted once under the default limits (whose expression variables `limits` shares);
        // counted under `limits` where they differ.
        let point_counts = input
            .catalog
            .families
            .iter()
            .map(|f| {
                let n = if same_vars(&limits) {
                    f.valid_points()
                } else {
                    f.point_count(&limits)
                };
                (
                    f.name.clone(),
                    n.map(|n| n.to_string()).unwrap_or_else(|e| e.to_string()),
                )
            })
            .collect();
        Ok(Shared {
            input,
            workloads,
            winners,
            winner_of,
            resources,
            limits,
            point_counts,
            renderer: Renderer::new(&input.catalog.templates_dir)?,
            tera,
        })
    }

    /// Renders `template` with `ctx` plus the fields the layout needs; `root` leads back to
    /// the site's top folder from the page (`""`, `"../"`, ...).
    pub fn render(&self, template: &str, path: &str, title: &str, root: &str, ctx: Value) -> Result<Page, ReportError> {
        let mut context = tera::Context::from_value(ctx).map_err(|e| ReportError::Page {
            page: path.into(),
            message: error_chain(&e),
        })?;
        context.insert("title", title);
        context.insert("root", root);
        context.insert("version", env!("CARGO_PKG_VERSION"));
        context.insert(
            "gpu",
            &self.input.db.as_ref().map(|d| d.header.describe()).unwrap_or_default(),
        );
        context.insert("sources", &self.sources());
        let html = self.tera.render(template, &context).map_err(|e| ReportError::Page {
            page: path.into(),
            message: error_chain(&e),
        })?;
        Ok(Page {
            path: path.into(),
            contents: html.into_bytes(),
        })
    }

    fn sources(&self) -> String {
        let db = match &self.input.db {
            Some(db) => format!("the tuning database {}", file_name(&db.path)),
            None => "no tuning database".into(),
        };
        match self.input.benches.len() {
            0 => db,
            n => format!("{db} and {n} bench run(s)"),
        }
    }

    /// A workload's row of facts, as the overview table and its own page show it; links are
    /// relative to the site's root.
    pub fn workload_row(&self, i: usize) -> Value {
        let w = &self.workloads[i];
        let e = &w.entry;
        let c = self.input.db.as_ref().map(|d| d.ceilings.clone()).unwrap_or_default();
        let rate = w.rate(e.median_ms);
        let rate_text = match rate {
            Some(r) if w.flops > 0.0 => format!("{} TFLOP/s", num(r / 1e12)),
            Some(r) => format!("{} GB/s", num(r / 1e9)),
            None => "-".into(),
        };
        let of_ceiling = match (rate, w.ceiling(&c)) {
            (Some(r), Some((peak, _))) if peak > 0.0 => format!("{:.0}%", 100.0 * r / peak),
            _ => "-".into(),
        };
        let timed = e.candidates.iter().filter(|c| c.median_ms.is_some()).count();
        json!({
            "number": w.number,
            "slug": w.slug,
            "title": w.title(),
            "op": w.op,
            "dtype": w.dtype,
            "kind": w.kind,
            "shape": w.shape,
            "family": e.family,
            "params": params_text(&e.params),
            "winner_href": self.winner_of[i].map(|k| self.winners[k].href()),
            "ms": num(e.median_ms),
            "spread": num(e.spread_ms),
            "rate": rate_text,
            "of_ceiling": of_ceiling,
            "peer": entry_peer(e).unwrap_or("-"),
            "peer_ms": e.baseline_ms.map(num).unwrap_or_else(|| {
                if e.baseline_unavailable.is_some() { "n/a" } else { "-" }.into()
            }),
            "peer_note": e.baseline_unavailable,
            "vs_peer": e
                .baseline_ms
                .filter(|b| *b > 0.0 && e.median_ms > 0.0)
                .map(|b| format!("{:.2}×", b / e.median_ms))
                .unwrap_or_else(|| "-".into()),
            "tried": if e.candidates.is_empty() { e.variants_tried.to_string() } else { format!("{timed} / {}", e.candidates.len()) },
        })
    }

    /// Whether `c` is the candidate that won `w`.
    pub fn is_winner(w: &Workload, c: &Candidate) -> bool {
        c.is_point(&w.entry.family, &w.entry.params)
    }
}

fn file_name(path: &std::path::Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}

/// `index.html`: the GPU, its ceilings, every workload's winner and the roofline.
pub fn overview(s: &Shared) -> Result<Page, ReportError> {
    let db = s.input.db.as_ref();
    let c = db.map(|d| d.ceilings.clone()).unwrap_or_default();
    let measured =
        |v: Option<f64>, unit: &str| v.map(|v| format!("{} {unit}", num(v))).unwrap_or("not measured".into());
    let ceilings = json!([
        {"name": "FP32 FMA peak", "value": measured(c.fp32_tflops, "TFLOP/s"), "how": "computed from the clock and SM count (SMs × 128 lanes × 2 FLOP × clock); f32 rows are compared with it"},
        {"name": "TF32 tensor cores", "value": measured(c.tf32_tflops, "TFLOP/s"), "how": "cuBLAS TF32 on an 8192³ GEMM, measured by the tuner; tf32 rows are compared with it"},
        {"name": "BF16 tensor cores", "value": measured(c.bf16_tflops, "TFLOP/s"), "how": "cuBLAS BF16 on an 8192³ GEMM, measured by the tuner; f16 and bf16 rows are compared with it"},
        {"name": "copy bandwidth", "value": measured(c.copy_gb_per_s, "GB/s"), "how": "device-to-device copy, measured by the tuner; memory-bound rows are compared with it"},
    ]);
    let mut points = Vec::new();
    let mut series: Vec<(usize, String)> = Vec::new();
    for w in s.workloads.iter().filter(|w| w.flops > 0.0 && w.bytes > 0.0) {
        let ai = w.flops / w.bytes;
        for cand in w.entry.candidates.iter().filter(|c| !Shared::is_winner(w, c)) {
            if let Some(ms) = cand.median_ms.filter(|ms| *ms > 0.0) {
                points.push(RoofPoint {
                    intensity: ai,
                    flops_per_s: w.flops / (ms * 1e-3),
                    label: None,
                    colour: 9,
                    tip: format!("#{} {} {} ms", w.number, cand.family, num(ms)),
                });
            }
        }
        if w.entry.median_ms > 0.0 {
            let colour = dtype_colour(&w.dtype);
            if !series.iter().any(|(c, _)| *c == colour) {
                series.push((colour, w.dtype.clone()));
            }
            let rate = w.flops / (w.entry.median_ms * 1e-3);
            points.push(RoofPoint {
                intensity: ai,
                flops_per_s: rate,
                label: Some(w.number.to_string()),
                colour,
                tip: format!(
                    "#{} {} {} {}: {} {}, {} ms, {} TFLOP/s, {} FLOP/byte",
                    w.number,
                    w.title(),
                    w.dtype,
                    w.shape,
                    w.entry.family,
                    params_text(&w.entry.params),
                    num(w.entry.median_ms),
                    num(rate / 1e12),
                    num(ai)
                ),
            });
        }
    }
    series.sort();
    let roof = (!points.is_empty()).then(|| roofline(&points, &c, &series));
    let rows: Vec<Value> = (0..s.workloads.len()).map(|i| s.workload_row(i)).collect();
    let header = db.map(|d| {
        let h = &d.header;
        json!({
            "gpu": h.gpu,
            "cc": format!("{}{}", h.compute_capability.0, h.compute_capability.1),
            "driver": h.driver_version,
            "nvrtc": format!("{}.{}", h.nvrtc_version.0, h.nvrtc_version.1),
        })
    });
    let ctx = json!({
        "header": header,
        "db_path": db.map(|d| d.path.display().to_string()),
        "ceilings": ceilings,
        "roofline": roof,
        "workloads": rows,
        "family_count": s.input.catalog.families.len(),
        "benches": s.input.benches.len(),
    });
    s.render("overview.html", "index.html", "Overview", "", ctx)
}

/// `families.html`: every family with its op, dtypes, size and wins.
pub fn families_index(s: &Shared) -> Result<Page, ReportError> {
    let families: Vec<Value> = s
        .input
        .catalog
        .families
        .iter()
        .map(|f| {
            let wins: usize = s
                .winners
                .iter()
                .filter(|w| w.variant.family.name == f.name)
                .map(|w| w.won.len())
                .sum();
            json!({
                "name": f.name,
                "op": f.op.name(),
                "dtypes": f.dtypes.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
                "points": s.point_counts.get(&f.name),
                "wins": wins,
                "description": f.description,
            })
        })
        .collect();
    s.render(
        "families.html",
        "families.html",
        "Families",
        "",
        json!({ "families": families }),
    )
}

/// `model.html` and the timeline pictures it shows: one section per bench run.
pub fn model(s: &Shared) -> Result<Vec<Page>, ReportError> {
    let mut pages = Vec::new();
    let mut runs = Vec::new();
    for (i, b) in s.input.benches.iter().enumerate() {
        let (run, timeline) = bench_section(b, i + 1);
        if let Some((path, svg)) = timeline {
            pages.push(Page {
                path,
                contents: svg.into_bytes(),
            });
        }
        runs.push(run);
    }
    pages.push(s.render("model.html", "model.html", "Model", "", json!({ "runs": runs }))?);
    Ok(pages)
}

/// Time per role (summed over its kernels), largest first.
fn per_role(rows: &[super::data::ProfileRow], divide: f64) -> Vec<Bar> {
    let mut roles: Vec<(String, f64, u64, Vec<String>)> = Vec::new();
    for r in rows {
        match roles.iter_mut().find(|x| x.0 == r.role) {
            Some(x) => {
                x.1 += r.total_ms;
                x.2 += r.calls;
                x.3.push(r.kernel.clone());
            }
            None => roles.push((r.role.clone(), r.total_ms, r.calls, vec![r.kernel.clone()])),
        }
    }
    roles.sort_by(|a, b| b.1.total_cmp(&a.1));
    roles
        .into_iter()
        .enumerate()
        .map(|(i, (role, ms, calls, kernels))| Bar {
            value: ms / divide,
            colour: i % super::charts::COLOURS,
            tip: format!("{role}: {} ms, {calls} calls; {}", num(ms / divide), kernels.join(", ")),
            label: role,
        })
        .collect()
}

fn bench_section(b: &Bench, n: usize) -> (Value, Option<(String, String)>) {
    let r = &b.run;
    let mut title = format!(
        "{} on {}",
        if r.model.is_empty() { "model" } else { &r.model },
        if r.device_name.is_empty() {
            &r.device
        } else {
            &r.device_name
        }
    );
    if r.batch > 0 {
        title.push_str(&format!(", batch {} × seq {}", r.batch, r.seq));
    }
    if let Some(d) = &r.dtype {
        title.push_str(&format!(", {d}"));
    }
    let mut summary = Vec::new();
    if let Some(f) = &r.forward {
        summary.push(json!({"what": "forward", "time": format!("{} ms", num(f.median_ms)), "rate": num(f.tokens_per_s), "note": format!("{} tokens per pass (median)", f.tokens)}));
    }
    let (mut floor_chart, mut floor_text, mut decode_chart) = (None, String::new(), None);
    if let Some(d) = &r.decode {
        let mut note = format!("{} steps after a {}-token prefill", d.steps, d.prefill_tokens);
        if let Some(e) = &d.engine {
            note.push_str(&format!("; engine {e}"));
        } else if let Some(g) = d.cuda_graphs {
            note.push_str(if g { "; CUDA graphs" } else { "; kernel by kernel" });
        }
        if let Some(g) = d.gpu_ms_per_step {
            note.push_str(&format!("; GPU busy {} ms per step", num(g)));
        }
        summary.push(json!({"what": "decode", "time": format!("{} ms/step", num(d.ms_per_step)), "rate": num(d.tokens_per_s), "note": note}));
        let floor_ms = d.floor_ms.or(match (d.floor_bytes, d.copy_gb_per_s) {
            (Some(bytes), Some(bw)) if bw > 0.0 => Some(bytes / (bw * 1e9) * 1e3),
            _ => None,
        });
        let floor_tps = match (floor_ms, d.floor_share) {
            (Some(ms), _) if ms > 0.0 && r.batch > 0 => Some(r.batch as f64 * 1e3 / ms),
            (_, Some(share)) if share > 0.0 => Some(d.tokens_per_s / share),
            _ => None,
        };
        if let Some(ftps) = floor_tps {
            let share = d.floor_share.unwrap_or(d.tokens_per_s / ftps);
            floor_text = format!(
                "{} MB per step at {} GB/s; this run reached {:.0}% of it",
                d.floor_bytes.map(|b| num(b / 1e6)).unwrap_or("?".into()),
                d.copy_gb_per_s.map(num).unwrap_or("?".into()),
                100.0 * share
            );
            summary.push(json!({"what": "decode floor", "time": floor_ms.map(|m| format!("{} ms/step", num(m))).unwrap_or("-".into()), "rate": num(ftps), "note": floor_text}));
            let bars = [
                Bar {
                    label: "decode, measured".into(),
                    value: d.tokens_per_s,
                    colour: 0,
                    tip: format!("{} tokens/s measured", num(d.tokens_per_s)),
                },
                Bar {
                    label: "floor (bytes at copy bandwidth)".into(),
                    value: ftps,
                    colour: 9,
                    tip: format!("{} tokens/s if a step only read its bytes at copy bandwidth", num(ftps)),
                },
            ];
            floor_chart = Some(bar_chart("Decode tokens/s beside the floor", &bars, "tokens/s"));
        }
        if !r.profile.decode.is_empty() && d.steps > 0 {
            let bars = per_role(&r.profile.decode, d.steps as f64);
            decode_chart = Some(bar_chart("Decode: GPU time per op per step", &bars, "ms per step"));
        }
    }
    let forward_chart = (!r.profile.forward.is_empty()).then(|| {
        bar_chart(
            "Forward: GPU time per op",
            &per_role(&r.profile.forward, 1.0),
            "ms per forward pass",
        )
    });
    let (timeline, timeline_note, file) = match &b.timeline {
        Timeline::None => (None, None, None),
        Timeline::Unusable(why) => (None, Some(why.clone()), None),
        Timeline::Svg(svg) => {
            let path = format!("assets/timeline-{n}.svg");
            (Some(path.clone()), None, Some((path, svg.clone())))
        }
    };
    let run = json!({
        "title": title,
        "file": b.path.display().to_string(),
        "notes": r.notes,
        "summary": summary,
        "floor_chart": floor_chart,
        "floor_text": floor_text,
        "forward_chart": forward_chart,
        "decode_chart": decode_chart,
        "timeline": timeline,
        "timeline_note": timeline_note,
    });
    (run, file)
}
