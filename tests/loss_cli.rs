//! `bapo loss` as a Python parity harness would call it: JSON files written
//! by Python's json module in, one JSON document out.

use std::process::Command;

use serde_json::Value;

/// This crate's directory, read at run time: the compile-time value goes
/// stale when a shared target dir built the same sources in another
/// checkout (cargo does not rebuild a test because its workspace moved).
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}

fn bapo_loss(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .arg("loss")
        .args(args)
        .current_dir(manifest_dir())
        .output()
        .expect("running bapo loss");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let doc = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.success(), doc, stderr)
}

fn close(v: &Value, want: f64) {
    let got = v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"));
    assert!((got - want).abs() < 1e-6, "got {got}, want {want}");
}

#[test]
fn bapo_paper_and_code_modes_on_t1() {
    let (ok, doc, err) = bapo_loss(&["--algo", "bapo", "--input", "tests/fixtures/loss/t1.json"]);
    assert!(ok, "{err}");
    close(&doc["loss"], 0.183333);
    close(&doc["metrics"]["c_high"], 1.3);
    close(&doc["metrics"]["c_low"], 0.6);
    close(&doc["metrics"]["target_met"], 1.0);
    close(&doc["metrics"]["search_steps"], 2.0);
    let grad: Vec<f64> = doc["grad"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_f64().unwrap())
        .collect();
    let want = [0.0, -0.166667, 0.0, 0.183333, 0.116667, 0.166667];
    for (g, w) in grad.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{grad:?}");
    }

    let (ok, doc, err) = bapo_loss(&[
        "--algo",
        "bapo",
        "--bapo-mode",
        "code",
        "--input",
        "tests/fixtures/loss/t1.json",
    ]);
    assert!(ok, "{err}");
    close(&doc["loss"], 0.2);
    close(&doc["metrics"]["pos_neg_ratio"], 0.675676);
    close(&doc["metrics"]["c_low"], 0.8);
    close(&doc["metrics"]["c_high"], 2.0);
}

/// The official example script's setting, as a preset and by hand
/// (ranges and the share 1/3 that is its P/N 0.5): vector E1.
#[test]
fn bapo_code_example_on_e1() {
    let input = ["--input", "tests/fixtures/loss/e1_bapo_example.json"];
    let preset = [
        &["--algo", "bapo", "--bapo-mode", "code-example"][..],
        &input,
    ]
    .concat();
    let (ok, doc, err) = bapo_loss(&preset);
    assert!(ok, "{err}");
    close(&doc["loss"], 2.6 / 6.0);
    close(&doc["metrics"]["c_low"], 0.95);
    close(&doc["metrics"]["c_high"], 1.4);
    close(&doc["metrics"]["search_steps"], 5.0);
    let by_hand = [
        &[
            "--algo",
            "bapo",
            "--bapo-mode",
            "code",
            "--bapo-rho0",
            "0.3333333333333333",
        ][..],
        &["--bapo-low", "0.8,0.95,0.05", "--bapo-high", "1.2,2.0,0.1"],
        &input,
    ]
    .concat();
    let (ok, hand, err) = bapo_loss(&by_hand);
    assert!(ok, "{err}");
    assert_eq!(hand["metrics"]["c_high"], doc["metrics"]["c_high"]);
    close(&hand["loss"], 2.6 / 6.0);
    let bad = [&["--algo", "bapo", "--bapo-high", "0.9,2,0.1"][..], &input].concat();
    let (ok, _, err) = bapo_loss(&bad);
    assert!(!ok && err.contains("bapo_high"), "{err}");
}

#[test]
fn ppo_options_on_t3() {
    let input = ["--input", "tests/fixtures/loss/t3.json"];
    let run = |extra: &[&str]| {
        let mut args = vec!["--algo"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&input);
        let (ok, doc, err) = bapo_loss(&args);
        assert!(ok, "{err}");
        doc
    };
    close(&run(&["ppo", "--clip-eps", "0.2"])["loss"], 0.754167);
    let dual = run(&["ppo", "--dual-clip", "3"]);
    close(&dual["loss"], 0.254167);
    close(&dual["metrics"]["dual_clip_frac"], 1.0 / 6.0);
    close(
        &run(&["ppo", "--clip-eps", "0.2", "--clip-eps-high", "0.28"])["loss"],
        0.7275,
    );
    close(&run(&["dapo"])["loss"], 0.7275);
    close(&run(&["sapo", "--agg", "token-mean"])["loss"], -0.126968);
    close(&run(&["cispo"])["loss"], 0.353509);
    let m = &run(&["ppo"])["metrics"];
    close(&m["kl_k3"], 0.425505);
    close(&m["ess_token"], 0.567369);
}

#[test]
fn malformed_input_exits_non_zero_naming_the_field() {
    let (ok, _, err) = bapo_loss(&[
        "--algo",
        "ppo",
        "--input",
        "tests/fixtures/loss/t3_nan.json",
    ]);
    assert!(!ok);
    assert!(err.contains("logp[4]"), "{err}");
    let (ok, _, err) = bapo_loss(&["--algo", "bapo3", "--input", "tests/fixtures/loss/t3.json"]);
    assert!(!ok);
    assert!(err.contains("algo") && err.contains("bapo3"), "{err}");
    let (ok, _, err) = bapo_loss(&[
        "--algo",
        "ppo",
        "--agg",
        "mean",
        "--input",
        "tests/fixtures/loss/t3.json",
    ]);
    assert!(!ok);
    assert!(err.contains("agg"), "{err}");
    let (ok, _, err) = bapo_loss(&[
        "--algo",
        "ppo",
        "--input",
        "tests/fixtures/loss/missing.json",
    ]);
    assert!(!ok);
    assert!(err.contains("missing.json"), "{err}");
}

/// The survey methods on their vectors: ReMix's V4 (additive window) and
/// SPEAR's Clip-Cov on the hand vector of `clip_cov.rs`, where no token
/// is a candidate under the default rule, so it is PPO-clip at 0.2/0.28
/// (seq-mean-token-sum-norm over one-token sequences, `L_const` 1).
#[test]
fn remix_and_spear_on_their_vectors() {
    let (ok, doc, err) = bapo_loss(&[
        "--algo",
        "remix",
        "--input",
        "tests/fixtures/loss/v4_remix.json",
    ]);
    assert!(ok, "{err}");
    close(&doc["loss"], -0.67);
    close(&doc["grad"][2], -0.27);
    let (ok, doc, err) = bapo_loss(&[
        "--algo",
        "spear",
        "--input",
        "tests/fixtures/loss/clip_cov.json",
    ]);
    assert!(ok, "{err}");
    assert_eq!(doc["aggregation"], "seq-mean-token-sum-norm");
    close(&doc["loss"], -1.28 - (-1.0f64).exp() + 1.0 + 0.8);
    close(&doc["metrics"]["clip_cov_frac"], 0.0);
    let (ok, _, err) = bapo_loss(&["--algo", "nope", "--input", "tests/fixtures/loss/t3.json"]);
    assert!(
        !ok && err.contains("spear") && err.contains("remix"),
        "{err}"
    );
}

/// Turn-PPO on the hand vector T4 of `turn_ppo.rs`: two turns of one
/// episode around a masked observation, one single-turn episode; without
/// `turn_ids` the first episode's two turns share one ratio instead.
#[test]
fn turn_ppo_reads_turn_ids() {
    let input = "tests/fixtures/loss/t4_turn_ppo.json";
    let (ok, doc, err) = bapo_loss(&["--algo", "turn-ppo", "--input", input]);
    assert!(ok, "{err}");
    close(&doc["loss"], -0.284282);
    close(&doc["grad"][3], -0.142141);
    close(&doc["metrics"]["turns"], 3.0);
    let text = std::fs::read_to_string(input).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("turn_ids");
    let dir = tempfile::tempdir().unwrap();
    let one_turn = dir.path().join("one_turn.json");
    std::fs::write(&one_turn, v.to_string()).unwrap();
    let (ok, doc, err) = bapo_loss(&["--algo", "turn-ppo", "--input", one_turn.to_str().unwrap()]);
    assert!(ok, "{err}");
    close(&doc["metrics"]["turns"], 2.0);
    v["turn_ids"] = serde_json::json!([0, 1]);
    std::fs::write(&one_turn, v.to_string()).unwrap();
    let (ok, _, err) = bapo_loss(&["--algo", "turn-ppo", "--input", one_turn.to_str().unwrap()]);
    assert!(!ok && err.contains("turn_ids"), "{err}");
}
