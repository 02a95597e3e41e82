//! The `--batch` of `kernelforge bench`: one batch size, or a comma list (`--batch
//! 1,8,32,64,128,256`) timed in the order given; parsed with errors that name the bad value.

use crate::model::memory_fit::MAX_BATCH;

/// The `--batch` help of `bench`.
pub(crate) const BATCH_HELP: &str = "Sequences per batch: one size (--batch 8), or a comma list \
to time decode at each size in one process, the model loaded once, e.g. --batch 1,8,32,64,128,256: \
one table (batch, engine, tokens/s, GPU ms a step, the floor in ms and the bound that sets it, \
the share of the floor reached), or with --json one object with a `batches` array. \
With a list the forward pass (--seq) runs at the first batch only, and --timeline is refused";

/// The `--batch` of `bench`: one size, or a list of sizes timed in the order given (never
/// empty; every size at least 1 and listed once).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchList(Vec<usize>);

/// Why a `--batch` value is not a list of batch sizes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchListError {
    #[error(
        "{} is not a number of sequences; give sizes such as 8 or 1,8,32",
        quoted_in(item, list)
    )]
    NotANumber { list: String, item: String },
    #[error(
        "a batch of {} sequences runs nothing; give sizes of at least 1, such as 1,8,32",
        quoted_in("0", list)
    )]
    Zero { list: String },
    #[error("`{list}` has an empty entry; separate sizes with single commas, such as 1,8,32")]
    Empty { list: String },
    #[error("{size} is listed twice in `{list}`; list each batch once")]
    Repeated { list: String, size: usize },
    #[error("{} sequences are more than any device holds; give at most {MAX_BATCH}", quoted_in(&size.to_string(), list))]
    TooLarge { list: String, size: usize },
}

/// `` `x` in `1,x` ``, or `` `x` `` when the item is the whole list.
fn quoted_in(item: &str, list: &str) -> String {
    if item == list.trim() {
        format!("`{item}`")
    } else {
        format!("`{item}` (in `{list}`)")
    }
}

impl BatchList {
    /// Parses `8` or `1,8,32` (spaces around the commas allowed).
    pub fn parse(text: &str) -> Result<BatchList, BatchListError> {
        let list = text.to_string();
        let mut sizes = Vec::new();
        for item in text.split(',').map(str::trim) {
            if item.is_empty() {
                return Err(BatchListError::Empty { list });
            }
            let size: usize = item.parse().map_err(|_| BatchListError::NotANumber {
                list: list.clone(),
                item: item.to_string(),
            })?;
            if size == 0 {
                return Err(BatchListError::Zero { list });
            }
            if size > MAX_BATCH {
                return Err(BatchListError::TooLarge { list, size });
            }
            if sizes.contains(&size) {
                return Err(BatchListError::Repeated { list, size });
            }
            sizes.push(size);
        }
        Ok(BatchList(sizes))
    }

    /// The sizes, in the order given.
    pub fn sizes(&self) -> &[usize] {
        &self.0
    }

    /// The first size (the forward pass's batch).
    pub fn first(&self) -> usize {
        self.0[0]
    }

    /// The largest size (what the backend is built and the memory checked for).
    pub fn largest(&self) -> usize {
        self.0.iter().copied().max().unwrap_or(1)
    }

    /// Whether more than one size was given.
    pub fn is_list(&self) -> bool {
        self.0.len() > 1
    }
}

impl std::fmt::Display for BatchList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sizes: Vec<String> = self.0.iter().map(usize::to_string).collect();
        f.write_str(&sizes.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lists_parse_and_bad_values_are_named() {
        let one = BatchList::parse("8").unwrap();
        assert_eq!(
            (one.sizes(), one.first(), one.largest(), one.is_list()),
            (&[8][..], 8, 8, false)
        );
        let list = BatchList::parse("1, 8,32,256,64").unwrap();
        assert_eq!(list.sizes(), &[1, 8, 32, 256, 64]);
        assert_eq!((list.first(), list.largest(), list.is_list()), (1, 256, true));
        assert_eq!(list.to_string(), "1,8,32,256,64");
        let e = BatchList::parse("1,x").unwrap_err();
        assert_eq!(
            e,
            BatchListError::NotANumber {
                list: "1,x".into(),
                item: "x".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "`x` (in `1,x`) is not a number of sequences; give sizes such as 8 or 1,8,32"
        );
        for (text, named) in [
            ("0", "a batch of `0` sequences"),
            ("1,0,8", "`0` (in `1,0,8`) sequences"),
            ("-1", "`-1` is not"),
            ("1.5", "`1.5` is not"),
        ] {
            let e = BatchList::parse(text).unwrap_err().to_string();
            assert!(e.contains(named), "{text}: {e}");
        }
        assert!(BatchList::parse("").unwrap_err().to_string().contains("empty entry"));
        assert!(BatchList::parse("1,,8")
            .unwrap_err()
            .to_string()
            .contains("empty entry"));
        let e = BatchList::parse("8,1,8").unwrap_err().to_string();
        assert!(e.contains("8 is listed twice"), "{e}");
        let e = BatchList::parse("1,99999999999").unwrap_err().to_string();
        assert!(
            e.starts_with("`99999999999` (in `1,99999999999`) sequences are more than any device holds"),
            "{e}"
        );
        assert!(BatchList::parse(&MAX_BATCH.to_string()).is_ok());
    }

    #[test]
    fn the_batch_flag_takes_a_list_and_its_help_shows_one() {
        use clap::Parser;
        let parse = |args: &[&str]| crate::cli::Cli::try_parse_from(args.iter().copied());
        let batch = |extra: &[&str]| match parse(&[&["kernelforge", "bench", "--model", "gpt2"], extra].concat())
            .unwrap()
            .command
        {
            crate::cli::Command::Bench(a) => a.batch,
            _ => unreachable!(),
        };
        assert_eq!(batch(&[]).sizes(), &[1], "the default is one batch of 1");
        assert_eq!(batch(&["--batch", "8"]).sizes(), &[8]);
        assert_eq!(
            batch(&["--batch", "1,8,32,64,128,256"]).sizes(),
            &[1, 8, 32, 64, 128, 256]
        );
        for (bad, named) in [("1,x", "`x`"), ("0", "`0`")] {
            let e = parse(&["kernelforge", "bench", "--model", "gpt2", "--batch", bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains("--batch") && e.contains(named), "{bad}: {e}");
        }
        let help = parse(&["kernelforge", "bench", "--help"]).unwrap_err().to_string();
        assert!(help.contains("--batch <B[,B...]>"), "{help}");
        assert!(help.contains("--batch 1,8,32,64,128,256"), "{help}");
        assert!(
            help.contains("forward pass (--seq) runs at the first batch only"),
            "{help}"
        );
    }
}
