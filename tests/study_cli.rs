//! `bapo study`'s controlled designs refuse flags that cannot mean what
//! they say before any warm start is trained.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// Runs `bapo study ARGS`; a refusal comes at once, so a study still
/// running after a minute was accepted: it is killed and reported so.
fn bapo_study(args: &[&str]) -> (bool, String) {
    let out = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .arg("study")
        .args(args)
        .arg("--out")
        .arg(out.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running bapo study");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("waiting").is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            return (true, format!("bapo study {args:?} was accepted and ran"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let run = child.wait_with_output().expect("collecting");
    (
        run.status.success(),
        String::from_utf8_lossy(&run.stderr).to_string(),
    )
}

#[test]
fn lag_and_reuse_exclude_each_other() {
    let (ok, err) = bapo_study(&["--lag", "4", "--reuse", "2"]);
    assert!(!ok && err.contains("--reuse"), "{err}");
}

#[test]
fn reuse_only_flags_need_reuse() {
    let (ok, err) = bapo_study(&["--lag", "4", "--gate-groups", "8"]);
    assert!(!ok && err.contains("--gate-groups"), "{err}");
    let (ok, err) = bapo_study(&["--gate-groups", "8"]);
    assert!(!ok && err.contains("--reuse"), "{err}");
    let (ok, err) = bapo_study(&["--warm-starts", "3"]);
    assert!(!ok && err.contains("--warm-starts"), "{err}");
    let (ok, err) = bapo_study(&["--lag", "4", "--gate-only"]);
    assert!(!ok && err.contains("--gate-only"), "{err}");
    let (ok, err) = bapo_study(&["--lag", "4", "--ni-margin", "0.01"]);
    assert!(!ok && err.contains("--ni-margin"), "{err}");
}

#[test]
fn a_margin_or_gate_that_cannot_mean_anything_is_refused_by_name() {
    let (ok, err) = bapo_study(&["--reuse", "2", "--ni-margin", "0"]);
    assert!(!ok && err.contains("--ni-margin 0"), "{err}");
    let (ok, err) = bapo_study(&["--reuse", "2", "--gate-only", "--gate-groups", "0"]);
    assert!(!ok && err.contains("--gate-only"), "{err}");
}

#[test]
fn updates_that_split_into_no_whole_epochs_are_refused_by_name() {
    let (ok, err) = bapo_study(&["--reuse", "6"]);
    assert!(!ok && err.contains("--reuse 6"), "{err}");
    let (ok, err) = bapo_study(&["--reuse", "2", "--arms", "a,zz"]);
    assert!(!ok && err.contains("\"zz\""), "{err}");
    let (ok, err) = bapo_study(&[
        "--reuse",
        "2",
        "--warm-starts",
        "2",
        "--init",
        "/nonexistent",
    ]);
    assert!(!ok && err.contains("--warm-starts 2"), "{err}");
}
