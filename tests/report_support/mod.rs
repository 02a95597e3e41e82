//! Helpers shared by the report tests: the fixtures, the project's catalog (loaded once), and
//! the structural check of a rendered site.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use kernelforge::report::data::load_bench;
use kernelforge::report::{Bench, ReportInput};
use kernelforge::spec::Catalog;
use kernelforge::tune::db::TuningDb;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixtures() -> PathBuf {
    root().join("tests/fixtures/report")
}

/// The project's catalog, loaded once for all tests (validating every spec takes seconds in a
/// debug build).
pub fn catalog() -> Catalog {
    static CATALOG: std::sync::OnceLock<Catalog> = std::sync::OnceLock::new();
    CATALOG
        .get_or_init(|| Catalog::load(&root().join("specs"), &root().join("templates")).unwrap())
        .clone()
}

pub fn benches() -> Vec<Bench> {
    ["bench-b8.json", "bench-b1.json"]
        .iter()
        .map(|b| load_bench(&fixtures().join(b)).unwrap())
        .collect()
}

/// The fixture inputs (what `ReportInput::load` reads, with the shared catalog).
pub fn fixture_input() -> ReportInput {
    ReportInput {
        catalog: catalog(),
        db: Some(TuningDb::read_only(&fixtures().join("db.json")).unwrap()),
        benches: benches(),
    }
}

/// Every file under `dir`, relative, sorted.
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// Values of `attr="..."` in `html`.
pub fn attr_values<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let pat = format!(" {attr}=\"");
    html.match_indices(&pat)
        .filter_map(|(i, _)| {
            let rest = &html[i + pat.len()..];
            rest.find('"').map(|end| &rest[..end])
        })
        .collect()
}

/// Every inline `<svg ...>...</svg>` of a page.
pub fn inline_svgs(html: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(start) = html[from..].find("<svg").map(|i| i + from) {
        let Some(end) = html[start..].find("</svg>").map(|i| i + start + 6) else {
            panic!("unclosed <svg> at byte {start}");
        };
        out.push(&html[start..end]);
        from = end;
    }
    out
}

/// The checks the issue asks for: links resolve inside `dir` (anchors included), SVGs parse,
/// nothing points outside.
pub fn check_site(dir: &Path) -> usize {
    let dir = dir.canonicalize().unwrap();
    let all = files(&dir);
    let mut ids: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    let mut texts: BTreeMap<PathBuf, String> = BTreeMap::new();
    for f in &all {
        if f.extension().is_some_and(|x| x == "html" || x == "css" || x == "svg") {
            let text = std::fs::read_to_string(dir.join(f)).unwrap();
            ids.insert(
                f.clone(),
                attr_values(&text, "id").into_iter().map(String::from).collect(),
            );
            texts.insert(f.clone(), text);
        }
    }
    let mut svgs = 0;
    for (f, text) in &texts {
        let is_svg = f.extension().is_some_and(|x| x == "svg");
        if !is_svg {
            assert!(
                !text.contains("http://") && !text.contains("https://"),
                "{}: names an address outside",
                f.display()
            );
            assert!(!text.contains("<script"), "{}: the site has no scripts", f.display());
        }
        let mut urls: Vec<&str> = attr_values(text, "href");
        urls.extend(attr_values(text, "src"));
        urls.extend(attr_values(text, "xlink:href"));
        for (i, _) in text.match_indices("url(") {
            let rest = &text[i + 4..];
            urls.push(rest[..rest.find(')').unwrap()].trim_matches(['"', '\'']));
        }
        for url in urls {
            let url = &url.replace("&#x2F;", "/").replace("&amp;", "&");
            assert!(
                !url.contains(':') && !url.starts_with("//") && !url.starts_with('/'),
                "{}: `{url}` points outside the folder",
                f.display()
            );
            let (path, fragment) = url.split_once('#').unwrap_or((url, ""));
            let target = if path.is_empty() {
                f.clone()
            } else {
                let joined = dir.join(f.parent().unwrap()).join(path);
                let resolved = joined
                    .canonicalize()
                    .unwrap_or_else(|_| panic!("{}: link `{url}` names no file", f.display()));
                assert!(resolved.starts_with(&dir), "{}: `{url}` leaves the folder", f.display());
                assert!(resolved.is_file(), "{}: `{url}` is not a file", f.display());
                resolved.strip_prefix(&dir).unwrap().to_path_buf()
            };
            if !fragment.is_empty() {
                assert!(
                    ids.get(&target).is_some_and(|s| s.contains(fragment)),
                    "{}: `{url}`: no id `{fragment}` there",
                    f.display()
                );
            }
        }
        let docs: Vec<&str> = if is_svg { vec![text.as_str()] } else { inline_svgs(text) };
        for svg in docs {
            roxmltree::Document::parse(svg).unwrap_or_else(|e| {
                panic!(
                    "{}: an SVG does not parse: {e}\n{}",
                    f.display(),
                    &svg[..svg.len().min(300)]
                )
            });
            svgs += 1;
        }
    }
    svgs
}
