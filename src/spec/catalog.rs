//! The families of a project, loaded from its `specs/` and checked against its `templates/`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;

/// The families of a project, loaded from its `specs/` and checked against its `templates/`.
#[derive(Debug, Clone)]
pub struct Catalog {
    pub families: Vec<Arc<Family>>,
    pub specs_dir: PathBuf,
    pub templates_dir: PathBuf,
}

impl Catalog {
    /// Loads every `*.toml` in `specs_dir`, sorted by name.
    pub fn load(specs_dir: &Path, templates_dir: &Path) -> Result<Catalog, SpecError> {
        let entries = std::fs::read_dir(specs_dir).map_err(|source| SpecError::Io {
            file: specs_dir.to_path_buf(),
            source,
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(SpecError::NoSpecs(specs_dir.to_path_buf()));
        }
        // In parallel (each family is checked on its own: its default point, and its whole
        // space only when the default fails; `space.rs`).
        let families = {
            use rayon::prelude::*;
            files
                .par_iter()
                .map(|f| Family::load(f, templates_dir).map(Arc::new))
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(Catalog {
            families,
            specs_dir: specs_dir.to_path_buf(),
            templates_dir: templates_dir.to_path_buf(),
        })
    }

    /// Loads a single spec file (for `gen --spec`).
    pub fn load_one(file: &Path, templates_dir: &Path) -> Result<Catalog, SpecError> {
        Ok(Catalog {
            families: vec![Arc::new(Family::load(file, templates_dir)?)],
            specs_dir: file.parent().unwrap_or(Path::new(".")).to_path_buf(),
            templates_dir: templates_dir.to_path_buf(),
        })
    }

    pub fn family(&self, name: &str) -> Result<&Arc<Family>, SpecError> {
        self.families
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| SpecError::UnknownFamily {
                name: name.to_string(),
                known: self
                    .families
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Families implementing `op`.
    pub fn for_op<'a>(&'a self, op: &'a str) -> impl Iterator<Item = &'a Arc<Family>> + 'a {
        self.families.iter().filter(move |f| f.op.name() == op)
    }

    /// Whether some family implements `op` in `dtype`.
    pub fn has_dtype(&self, op: &str, dtype: Dtype) -> bool {
        self.for_op(op).any(|f| f.dtypes.contains(&dtype))
    }
}
