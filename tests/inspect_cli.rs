//! `kernelforge inspect --code-size`: each kernel's machine code from the CUBIN, compiled for
//! `--arch` (NVRTC, no GPU). Where NVRTC is missing, the command must say so.

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
