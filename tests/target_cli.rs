//! `--target` and `KERNELFORGE_TARGET` on the command line, without a GPU: a target kernelforge
//! cannot stand in for is refused in one line naming the ones it can, before anything runs;
//! `--help` teaches the flag.

use std::process::Command;

fn kernelforge(args: &[&str], target_env: Option<&str>) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kernelforge"));
    command.current_dir(env!("CARGO_MANIFEST_DIR")).args(args);
    command.env_remove("KERNELFORGE_TARGET");
    if let Some(value) = target_env {
        command.env("KERNELFORGE_TARGET", value);
    }
    let out = command.output().expect("kernelforge runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unknown_target_is_refused_in_one_line_naming_the_known_ones() {
    for (args, env) in [
        (vec!["verify", "--op", "gelu", "--target", "sm_70"], None),
        (vec!["verify", "--op", "gelu"], Some("sm_70")),
    ] {
        let (ok, _, stderr) = kernelforge(&args, env);
        assert!(!ok, "{args:?} {env:?} ran");
        assert!(
            stderr.contains("`sm_70` is not a target kernelforge can stand in for")
                && stderr.contains("sm_75, sm_80, sm_86, sm_89, sm_90"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn help_teaches_the_target_flag() {
    let (ok, stdout, _) = kernelforge(&["generate", "--help"], None);
    assert!(ok);
    assert!(
        stdout.contains("--target <sm_75|sm_80|sm_86|sm_89|sm_90>")
            && stdout.contains("KERNELFORGE_TARGET")
            && stdout.contains("compute_XY"),
        "{stdout}"
    );
}
