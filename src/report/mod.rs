//! `kernelforge report`: a self-contained static site for studying the kernels, their tuning and
//! the model's time, built without a GPU from the specs, the templates' rendered sources, a
//! tuning database and `bench --json` outputs.
//!
//! The site opens from the file system: every style is in `assets/`, charts are inline SVG, no
//! script, no font or address outside the folder. Pages: the overview (GPU, ceilings, winners,
//! roofline), one per tuned workload (every candidate, a strip plot, one small plot per
//! parameter), one per family (spec, default source, winners) and one per tuned winner (its
//! source and a side-by-side diff against the default), and the model page (bench runs).
//!
//! The parts, one job each: [`data`] (loading and the views pages draw from), [`svg`] and
//! [`charts`] (hand-written SVG), [`code`] (CUDA highlighting and the diff), [`pages`] (the
//! tera environment over `src/report/html/`, shared facts, overview and model pages),
//! [`tuning`] (workload pages), [`family`] (family and winner pages), [`site`] (writing the
//! folder atomically).

pub mod charts;
pub mod code;
pub mod data;
pub mod family;
pub mod pages;
pub mod site;
pub mod svg;
pub mod tuning;

use std::path::PathBuf;

pub use data::{Bench, ReportInput};
pub use site::{render_site, SiteSummary};

/// Why a report could not be made; every message names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Db(#[from] crate::tune::db::DbError),
    #[error("{path}: not a `kernelforge bench --json` output: {message}")]
    Bench { path: PathBuf, message: String },
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecError),
    #[error(transparent)]
    Codegen(#[from] crate::codegen::CodegenError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("report page {page}: {message}")]
    Page { page: String, message: String },
    #[error("{path}: {message}")]
    Out { path: PathBuf, message: String },
}

impl ReportError {
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ReportError {
        let path = path.to_path_buf();
        move |source| ReportError::Io { path, source }
    }
}
