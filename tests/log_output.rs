//! What a person or a program reading bapo's stderr through a pipe or a
//! log file gets: log lines as plain text, without terminal colour codes.

use std::process::Command;

#[test]
fn logs_written_to_a_pipe_carry_no_escape_codes() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/policy/tests/fixtures/llama");
    let out = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args([
            "eval",
            "--checkpoint",
            fixture,
            "--problems",
            "2",
            "--k",
            "1",
        ])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .output()
        .expect("running bapo eval");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("model on cpu"), "no log line: {err}");
    assert!(
        !err.contains('\u{1b}'),
        "escape codes in piped logs: {err:?}"
    );
}
