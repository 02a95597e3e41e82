//! `kernelforge report`: writes the static study site (no GPU needed), a thin layer over
//! [`crate::report`].

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;

use crate::report::{render_site, ReportInput};

/// Write a self-contained static site about the kernels, their tuning and the model's time.
///
/// Built from the specs, the templates' rendered sources, the tuning database and optional
/// `bench --json` outputs; it needs no GPU. The folder opens straight from the file system
/// (open DIR/index.html): styles, charts and pictures are all inside it, nothing is fetched.
///
/// Pages: the overview (the GPU, the ceilings the tuner measured, every tuned workload with its
/// winner, time, throughput and ratio to cuBLAS, and a roofline); one page per workload (every
/// variant the tuner timed with its parameters, time, error and registers / shared memory /
/// spills, a strip plot, and one small plot per parameter: which knob mattered); one page per
/// family (search space, constraints, derived values, default source) and per tuned winner
/// (its CUDA beside the default's as a side-by-side diff); and the model page (time per op of
/// the forward pass and the decode step, tokens/s beside the memory floor, the decode timeline).
///
/// DIR is replaced only when it is empty or an earlier report: the site is written into a
/// temporary folder beside it and renamed into place when complete.
///
/// Examples (one per paragraph):
///
/// kernelforge report --out site
///
/// kernelforge report --db ~/.cache/kernelforge/tuning/nvidia-h100-80gb-hbm3-sm90.json --out site
///
/// kernelforge bench --model gpt2 --json > b8.json && kernelforge report --bench b8.json --out site
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Tuning database to show (default: the only file in the user's tuning folder,
    /// ~/.cache/kernelforge/tuning/; without one the site shows the specs and bench runs).
    #[arg(long, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// A `kernelforge bench --json` output to show on the model page; repeat for several runs
    /// (batches, dtypes, engines). A decode timeline it names (`timeline_svg`) is copied in.
    #[arg(long, value_name = "FILE.json")]
    pub bench: Vec<PathBuf>,
    /// The folder to write (created; replaced when it holds an earlier report).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

pub fn run(root: &Path, args: ReportArgs) -> Result<()> {
    let started = std::time::Instant::now();
    let input = ReportInput::load(root, args.db.as_deref(), &args.bench).context("reading the report's inputs")?;
    if input.db.is_none() {
        eprintln!("note: no tuning database (pass --db PATH): the site shows the specs and bench runs only");
    }
    let summary =
        render_site(&input, &args.out).with_context(|| format!("writing the site to {}", args.out.display()))?;
    eprintln!(
        "report written to {} ({} files, {:.1} MB: {} workloads, {} families, {} winners, {} bench runs) in {:.2} s; open {}",
        summary.out.display(),
        summary.files,
        summary.bytes as f64 / 1e6,
        summary.workloads,
        summary.families,
        summary.winners,
        summary.benches,
        started.elapsed().as_secs_f64(),
        summary.out.join("index.html").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::{Cli, Command};

    #[test]
    fn report_takes_db_benches_and_out() {
        let cli = Cli::try_parse_from([
            "kernelforge",
            "report",
            "--db",
            "d.json",
            "--bench",
            "a.json",
            "--bench",
            "b.json",
            "--out",
            "site",
        ])
        .unwrap();
        match cli.command {
            Command::Report(a) => {
                assert_eq!(a.bench.len(), 2);
                assert_eq!(a.out, std::path::PathBuf::from("site"));
            }
            other => panic!("{other:?}"),
        }
        assert!(
            Cli::try_parse_from(["kernelforge", "report"]).is_err(),
            "--out is required"
        );
    }
}
