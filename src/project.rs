//! Where a kernelforge project's specs/ and templates/ are: the library's model and the CLI both
//! start from it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Where specs/ and templates/ are.
pub fn project_root(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(dir) = explicit {
        anyhow::ensure!(
            dir.join("specs").is_dir(),
            "--root {}: no specs/ folder there (a kernelforge project has specs/ and templates/)",
            dir.display()
        );
        return Ok(dir.to_path_buf());
    }
    let cwd = std::env::current_dir().context("reading the current folder")?;
    if cwd.join("specs").is_dir() && cwd.join("templates").is_dir() {
        return Ok(cwd);
    }
    let built_from = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built_from.join("specs").is_dir() {
        return Ok(built_from);
    }
    anyhow::bail!("no specs/ and templates/ here: run from a kernelforge checkout or pass --root DIR")
}
