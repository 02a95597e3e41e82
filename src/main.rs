//! The `kernelforge` binary: see `kernelforge --help`.

fn main() {
    if let Err(e) = kernelforge::cli::main() {
        // One clear line (plus causes) on stderr, non-zero exit.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
