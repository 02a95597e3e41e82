//! The `kernelforge` command line: each subcommand is a thin layer over the library.

mod kernels;
pub mod model;
mod report;
mod tune;
mod tune_bars;
mod tune_decode;
mod tune_decode_points;
mod tune_table;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::gpu::{compile_workers, StandIn};

/// Generate, verify and autotune GPU kernels for GPT-2 from declarative specs.
///
/// Kernel families live in specs/*.toml (search space, constraints, launch geometry) and
/// templates/**/*.cu.tera (the CUDA). `gen` renders them to generated/ for reading; `inspect`
/// shows one variant's source, PTX and resource use; `verify` runs variants on the GPU against
/// an f64 CPU reference.
#[derive(Debug, Parser)]
#[command(name = "kernelforge", version, propagate_version = true)]
pub struct Cli {
    /// Project folder holding specs/ and templates/ (default: the current folder if it has
    /// specs/, else the folder kernelforge was built from).
    #[arg(long, global = true, env = "KERNELFORGE_ROOT", value_name = "DIR")]
    pub root: Option<PathBuf>,

    /// Stand in for an older GPU (tune, verify, forward, generate, bench): the GPU here takes
    /// that target's compute capability (families that need a newer GPU drop out), the limits
    /// of one real GPU of it (sm_75 T4, sm_80 A100, sm_86 RTX 3090, sm_89 RTX 4090, sm_90
    /// H100: SMs, shared memory, occupancy, memory), compiles every kernel to its PTX
    /// (compute_XY, which the driver JIT-compiles here, so a newer instruction fails as it would
    /// there) and tunes into a database of its own. Proves the pipeline for a GPU you do not
    /// have; figures are this GPU's, not the target's.
    #[arg(long, global = true, env = crate::gpu::stand_in::TARGET_VAR, value_name = "sm_75|sm_80|sm_86|sm_89|sm_90",
          value_parser = crate::gpu::stand_in::parse)]
    pub target: Option<&'static StandIn>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    Gen(kernels::GenArgs),
    Inspect(kernels::InspectArgs),
    Verify(kernels::VerifyArgs),
    Tune(tune::TuneArgs),
    Tokenize(model::TokenizeArgs),
    Forward(model::ForwardArgs),
    Generate(model::GenerateArgs),
    Bench(model::BenchArgs),
    Report(report::ReportArgs),
    /// Internal: compile NVRTC requests from stdin (the tuner starts these; see
    /// `gpu::compile_workers`).
    #[command(hide = true)]
    CompileWorker,
}

/// Parses the command line and runs it.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    // Batches of compiles run in copies of this binary (NVRTC stops scaling at a few threads
    // of one process).
    let worker = matches!(cli.command, Command::CompileWorker);
    if let (false, Ok(exe)) = (worker, std::env::current_exe()) {
        compile_workers::use_worker_processes(compile_workers::WorkerProgram {
            exe,
            args: vec!["compile-worker".into()],
        });
    }
    crate::gpu::stand_in::select(cli.target);
    if let (Some(target), false) = (cli.target, worker) {
        eprintln!(
            "standing in for {} ({}): {} SMs, {} KiB of shared memory per block, kernels as {} PTX, its own \
             tuning database",
            target.arch,
            target.gpu,
            target.sms,
            target.smem_per_block / 1024,
            target.virtual_arch()
        );
    }
    let root = || project_root(cli.root.as_deref());
    match cli.command {
        Command::Gen(args) => kernels::gen(&root()?, args),
        Command::Inspect(args) => kernels::inspect(&root()?, args),
        Command::Verify(args) => kernels::verify(&root()?, args),
        Command::Tune(args) => tune::run(&root()?, args),
        Command::Tokenize(args) => model::run_tokenize(&args),
        Command::Forward(mut args) => {
            args.target.root = cli.root.clone();
            model::run_forward(&args)
        }
        Command::Generate(mut args) => {
            args.target.root = cli.root.clone();
            model::run_generate(&args)
        }
        Command::Bench(mut args) => {
            args.target.root = cli.root.clone();
            model::run_bench(&args)
        }
        Command::Report(args) => report::run(&root()?, args),
        Command::CompileWorker => compile_workers::serve_stdio().context("compile worker"),
    }
}

pub use crate::project::project_root;
