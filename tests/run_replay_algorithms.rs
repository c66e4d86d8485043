//! SPEAR's replay pass and ReMix's schedule in a short `bapo run` (buffer,
//! learner and actors as processes): SPEAR replays its remembered winners,
//! ReMix mixes replayed groups in, lowers λ and reincarnates, and the
//! books reconcile. The second run starts from the first's final weights
//! (`--init`), so only one warm start is paid for.

use std::{path::Path, process::Command};

use serde_json::Value;

const COMMON: &str = r#"
[run]
actors = 2
eval_problems = 50
pass_k = 1

[sft]
steps = 1500
batch = 32
lr = 6e-3
warmup_steps = 20
target_accuracy = 0.3
check_problems = 200

[buffer]
max_staleness = 4

[learner]
batch_groups = 4
lr = 1e-4
checkpoint_every = 0
eval_every = 0
eval_max_new_tokens = 8

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0

[actor.sampling]
max_new_tokens = 8
"#;

/// Two remembered winners are enough to replay (more than 1.5 × 1).
const SPEAR: &str = r#"
[learner.spear]
trajectory_buffer_size = 1
max_replay_loss_steps = 4
"#;

/// Two updates per batch (12 updates, 6 batches): λ falls from batch 2,
/// reincarnation at batch 4.
const REMIX: &str = r#"
[learner.remix]
off_policy_fraction = 0.5
policies = 2
reincarnate_at = 4
lambda_hold = 1
lambda_every = 1
lambda_step = 0.25
"#;

/// Runs `bapo run` with `config` (the [learner] additions appended to the
/// common tables); returns the summary and every metrics.jsonl step line.
fn run(
    dir: &Path,
    name: &str,
    extra_learner: &str,
    tables: &str,
    args: &[&str],
) -> (Value, Vec<Value>) {
    let config = dir.join(format!("{name}.toml"));
    let text = COMMON.replace("[learner]\n", &format!("[learner]\n{extra_learner}")) + tables;
    std::fs::write(&config, text).unwrap();
    let out = dir.join(name);
    let status = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "bapo run ({name}) failed");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["reconciled"], true, "{name}: {summary}");
    let steps = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .collect();
    (summary, steps)
}

fn values(steps: &[Value], key: &str) -> Vec<f64> {
    steps.iter().filter_map(|s| s[key].as_f64()).collect()
}

#[test]
fn spear_replays_and_remix_follows_its_schedule_in_a_short_run() {
    let dir = tempfile::tempdir().unwrap();
    let (spear, steps) = run(
        dir.path(),
        "spear",
        "algo = \"spear\"\nsteps = 24\n",
        SPEAR,
        &[],
    );
    let replays = values(&steps, "spear_replay");
    assert!(!replays.is_empty(), "SPEAR never replayed: {spear}");
    let coefs = values(&steps, "spear_replay_coef");
    assert!(coefs.iter().all(|c| (0.0..=1.0).contains(c)), "{coefs:?}");
    assert!(values(&steps, "spear_memory").iter().any(|&m| m > 0.0));

    let init = dir.path().join("spear/final");
    let (remix, steps) = run(
        dir.path(),
        "remix",
        "algo = \"remix\"\nsteps = 12\nproximal = \"recompute\"\nepochs = 2\n",
        REMIX,
        &["--init", init.to_str().unwrap()],
    );
    assert_eq!(remix["steps"], 12, "{remix}");
    let mut lambdas = values(&steps, "remix_lambda");
    lambdas.dedup();
    assert_eq!(lambdas, [1.0, 0.75, 0.5], "λ by batch: {steps:?}");
    let replayed = values(&steps, "remix_replayed_groups");
    assert!(replayed.iter().any(|&r| r > 0.0), "nothing replayed");
    let reincarnated = values(&steps, "remix_reincarnated");
    let first = reincarnated.iter().position(|&r| r == 1.0).unwrap();
    assert!(
        replayed[first..].iter().all(|&r| r == 0.0),
        "replay after reincarnation: {replayed:?}"
    );
    assert!(values(&steps, "kl_base_k3").iter().any(|&k| k > 0.0));
    // Two updates per batch: each has its line, and the batch's last also
    // carries the means over both.
    let norms = values(&steps, "grad_norm");
    let means = values(&steps, "grad_norm_batch_mean");
    assert_eq!((norms.len(), means.len()), (12, 6), "{steps:?}");
    for (k, m) in means.iter().enumerate() {
        let want = (norms[2 * k] + norms[2 * k + 1]) / 2.0;
        assert!((m - want).abs() < 1e-9, "batch {k}: {m} vs {want}");
    }
}
