//! Writing the site: every page and asset is rendered in memory first, written into a fresh
//! temporary folder beside `--out`, and only then swapped in with renames, so a failed run
//! never leaves a half-written site (and an existing one stays as it was). A folder that is not
//! a kernelforge report is never replaced.

use std::path::{Path, PathBuf};

use super::data::ReportInput;
use super::pages::{self, Page, Shared};
use super::ReportError;

/// The file that marks a folder as a kernelforge report (and says what is in it).
pub const MARKER: &str = "kernelforge-report.json";

/// What was written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SiteSummary {
    pub out: PathBuf,
    pub files: usize,
    pub bytes: u64,
    pub workloads: usize,
    pub families: usize,
    pub winners: usize,
    pub benches: usize,
}

/// Every file of the site, in memory.
pub fn build(input: &ReportInput) -> Result<Vec<Page>, ReportError> {
    let shared = Shared::new(input)?;
    let mut files = vec![
        Page {
            path: "assets/style.css".into(),
            contents: include_bytes!("html/style.css").to_vec(),
        },
        Page {
            path: "assets/favicon.svg".into(),
            contents: include_bytes!("html/favicon.svg").to_vec(),
        },
        pages::overview(&shared)?,
        pages::families_index(&shared)?,
    ];
    files.extend(pages::model(&shared)?);
    files.extend(super::tuning::workload_pages(&shared)?);
    files.extend(super::family::family_pages(&shared)?);
    Ok(files)
}

/// Renders the site for `input` into the folder `out` (replacing an earlier report there).
pub fn render_site(input: &ReportInput, out: &Path) -> Result<SiteSummary, ReportError> {
    let files = build(input)?;
    let mut summary = SiteSummary {
        out: out.to_path_buf(),
        files: files.len() + 1,
        bytes: files.iter().map(|f| f.contents.len() as u64).sum(),
        workloads: input.db.as_ref().map(|d| d.len()).unwrap_or(0),
        families: input.catalog.families.len(),
        winners: 0,
        benches: input.benches.len(),
    };
    summary.winners = files
        .iter()
        .filter(|f| f.path.starts_with("families/") && f.path.matches('/').count() == 2)
        .count();
    check_out(out)?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(ReportError::io(&parent))?;
    let tmp = tempfile::Builder::new()
        .prefix(".kernelforge-report-")
        .tempdir_in(&parent)
        .map_err(ReportError::io(&parent))?;
    for f in &files {
        let path = tmp.path().join(&f.path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(ReportError::io(dir))?;
        }
        std::fs::write(&path, &f.contents).map_err(ReportError::io(&path))?;
    }
    let marker = serde_json::json!({
        "generator": format!("kernelforge {}", env!("CARGO_PKG_VERSION")),
        "summary": &summary,
        "files": files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
    });
    let marker_path = tmp.path().join(MARKER);
    std::fs::write(&marker_path, serde_json::to_string_pretty(&marker).unwrap_or_default())
        .map_err(ReportError::io(&marker_path))?;
    summary.bytes += std::fs::metadata(&marker_path).map(|m| m.len()).unwrap_or(0);
    swap_in(tmp, out)?;
    Ok(summary)
}

/// Refuses an `out` that exists and is not an earlier report (or an empty folder).
fn check_out(out: &Path) -> Result<(), ReportError> {
    if !out.exists() {
        return Ok(());
    }
    let refuse = |message: &str| ReportError::Out {
        path: out.to_path_buf(),
        message: message.into(),
    };
    if !out.is_dir() {
        return Err(refuse("exists and is not a folder; pick another --out"));
    }
    let empty = std::fs::read_dir(out).map_err(ReportError::io(out))?.next().is_none();
    if !empty && !out.join(MARKER).is_file() {
        return Err(refuse(&format!(
            "exists and is not a kernelforge report (no {MARKER}): not replacing it; pick another --out"
        )));
    }
    Ok(())
}

/// Moves the finished folder to `out`: the old report (if any) is renamed aside first, then
/// removed once the new one is in place.
fn swap_in(tmp: tempfile::TempDir, out: &Path) -> Result<(), ReportError> {
    let new = tmp.keep();
    let undo_new = |e: ReportError| {
        let _ = std::fs::remove_dir_all(&new);
        e
    };
    let old = if out.exists() {
        let aside = new.with_extension("old");
        std::fs::rename(out, &aside).map_err(|e| undo_new(ReportError::io(out)(e)))?;
        Some(aside)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(&new, out) {
        if let Some(aside) = &old {
            let _ = std::fs::rename(aside, out);
        }
        return Err(undo_new(ReportError::io(out)(e)));
    }
    if let Some(aside) = old {
        let _ = std::fs::remove_dir_all(aside);
    }
    Ok(())
}
