//! `kernelforge inspect --code-size`: each kernel's machine code from the CUBIN, compiled for
//! `--arch` (NVRTC, no GPU). Where NVRTC is missing, the command must say so. And `kernelforge
//! gen --root DIR`: the renders land in DIR's generated/, not in the current folder's.

use std::process::Command;

use kernelforge::gpu::compile::nvrtc_present;

/// `inspect decode_megakernel --code-size` at `max_rows` rows: the code bytes of its kernel.
fn megakernel_code_bytes(max_rows: u32) -> Result<u64, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_kernelforge"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "inspect",
            "decode_megakernel",
            "--dtype",
            "bf16",
            "--arch",
            "sm_90",
            "--no-source",
            "--code-size",
        ])
        .args(["--param", &format!("max_rows={max_rows}")])
        .output()
        .expect("kernelforge runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    assert!(stdout.contains("code bytes"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("decode_megakernel_") && l.contains("_main"))
        .unwrap_or_else(|| panic!("no row for the kernel in:\n{stdout}"));
    Ok(row.split_whitespace().last().unwrap().parse().unwrap())
}

#[test]
fn code_size_reports_the_kernels_machine_code_or_says_nvrtc_is_missing() {
    if !nvrtc_present() {
        let e = megakernel_code_bytes(1).unwrap_err();
        assert!(e.contains("NVRTC"), "{e}");
        eprintln!("NVRTC is missing here: checked that inspect says so");
        return;
    }
    let (one_row, eight_rows) = (megakernel_code_bytes(1).unwrap(), megakernel_code_bytes(8).unwrap());
    eprintln!("decode megakernel, bf16: {one_row} code bytes at 1 row, {eight_rows} at 8");
    // The whole decode step in one kernel: tens of KB of machine code, more with more rows
    // (every row's dot products are unrolled).
    assert!(one_row > 32 * 1024, "{one_row}");
    assert!(eight_rows > one_row, "{eight_rows} <= {one_row}");
}

/// `gen --root OTHER` from a folder with a generated/ of its own renders OTHER's specs into
/// OTHER/generated and leaves the current folder's alone; `--check` compares the same folder.
#[test]
fn gen_with_a_root_writes_into_that_projects_generated_folder() {
    let here = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(here.path().join("generated/keep")).unwrap();
    std::fs::write(here.path().join("generated/keep/mine.cu"), "// mine\n").unwrap();
    std::fs::create_dir_all(other.path().join("specs")).unwrap();
    std::fs::create_dir_all(other.path().join("templates/t")).unwrap();
    std::fs::write(
        other.path().join("specs/gelu_test.toml"),
        r#"[family]
name = "gelu_test"
op = "gelu"
template = "t/ok.cu.tera"
description = "test family"
dtypes = ["f32"]

[params]
block_size = [64, 128]

[[kernels]]
name = "main"
grid = ["ceil_div(N, block_size)", "1", "1"]
block = ["block_size", "1", "1"]

[default]
block_size = 128
"#,
    )
    .unwrap();
    std::fs::write(
        other.path().join("templates/t/ok.cu.tera"),
        "extern \"C\" __global__ void {{ kernel_name }}_main(float* out, const float* inp, int N) {}\n",
    )
    .unwrap();
    let gen = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kernelforge"))
            .current_dir(here.path())
            .args(["gen", "--root"])
            .arg(other.path())
            .args(extra)
            .output()
            .expect("kernelforge runs")
    };
    let out = gen(&[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rendered = cu_files(&other.path().join("generated"));
    assert_eq!(rendered.len(), 1, "{rendered:?}");
    assert_eq!(
        cu_files(&here.path().join("generated")),
        vec![here.path().join("generated/keep/mine.cu")],
        "the current folder's generated/ is untouched"
    );
    let check = gen(&["--check"]);
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
}

/// The .cu files under `dir`, sorted.
fn cu_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = kernelforge::codegen::cuda_files(dir);
    files.sort();
    files
}
