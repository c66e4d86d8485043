//! `bapo run` as a user runs it, on a short budget: a child process that
//! starts the buffer, the learner and two actors as processes of their own.
//! While it runs, every service's `/metrics` is scraped; at the end the
//! versions advanced, the buffer's books match the learner's, and the
//! warm-started policy is more accurate than the untrained one.

mod common;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use common::{read_json, scrape};

const CONFIG: &str = r#"
[run]
actors = 2
eval_problems = 100
pass_k = 2

[sft]
steps = 600
batch = 32
lr = 6e-3
warmup_steps = 20

[buffer]
max_staleness = 2

[learner]
batch_groups = 4
lr = 1e-4
steps = 12
checkpoint_every = 5
eval_every = 6
eval_problems = 50
eval_max_new_tokens = 8

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0

[actor.sampling]
max_new_tokens = 8
"#;

#[test]
fn bapo_run_trains_end_to_end_and_every_service_exports_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bapo.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let out = dir.path().join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();

    // Scrape each service while the run is up.
    let prefixes = [
        ("buffer", "bapo_buffer_"),
        ("learner", "bapo_learner_steps_total"),
        ("actor-0", "bapo_actor_groups_total"),
        ("actor-1", "bapo_actor_groups_total"),
    ];
    let mut seen = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(900);
    while seen.len() < prefixes.len() && Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("bapo run exited early with {status}");
        }
        if let Some(services) = read_json(&out.join("services.json")) {
            for (name, want) in prefixes {
                if let Some(url) = services["metrics"][name].as_str()
                    && scrape(url).is_some_and(|b| b.contains(want))
                {
                    seen.insert(name);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(seen.len(), prefixes.len(), "metrics seen from {seen:?}");

    let output = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bapo run failed: {err}");
    // Through a pipe: progress and the summary, no log lines or colour
    // codes; the log lines are in the run's own log file.
    assert!(!err.contains(" INFO "), "log lines in the output: {err}");
    assert!(
        !err.contains('\u{1b}'),
        "escape codes in the output: {err:?}"
    );
    let log = std::fs::read_to_string(out.join("logs/run.log")).unwrap();
    assert!(log.contains("model on cpu"), "{log}");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(!said.trim_start().starts_with('{'), "a JSON dump: {said}");
    let s = read_json(&out.join("summary.json")).expect("summary.json");
    assert_eq!(s["steps"], 12);
    assert_eq!(s["buffer"]["learner_version"], 12, "{s}");
    assert_eq!(s["reconciled"], true, "{s}");
    // An actor's group can go stale while it is still being generated (on
    // a loaded machine the learner may step past max_staleness meanwhile):
    // the buffer refuses the rollout (rejected_stale) and evicts the group
    // as stale, so its members still on their way are refused as members
    // of a sealed group (rejected_group_sealed). Both follow from
    // staleness, by design; any other refusal would be a malformed
    // rollout, which the loop must never produce.
    let b = &s["buffer"];
    let count = |k: &str| b[k].as_u64().unwrap_or(0);
    assert_eq!(
        count("rollouts_rejected"),
        count("rejected_stale") + count("rejected_group_sealed"),
        "a refusal other than staleness: {b}"
    );
    if count("rejected_group_sealed") > 0 {
        assert!(
            count("evicted_stale") + count("rejected_stale") > 0,
            "sealed-group refusals without any staleness: {b}"
        );
    }
    // An untrained tiny model never writes a correct sum (one in ~10^6
    // draws); after the warm start some of its samples are right.
    assert!(
        s["warm_start_pass_at_k"].as_f64().unwrap() > 0.0,
        "the warm start learned nothing: {s}"
    );
    assert!(s["final_accuracy"].as_f64().is_some());
    for f in [
        "report.html",
        "metrics.jsonl",
        "config.toml",
        "final/model.safetensors",
        "final/config.json",
        "charts/reward.svg",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let jsonl = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(jsonl.contains("\"eval_accuracy\""));
    assert!(jsonl.contains("\"c_high\""));
    researchers_views(&out);
}

/// What a researcher looks at: TensorBoard's own reader loads the run's
/// event files with a value per step, the evaluations and the sampled
/// rollouts; `bapo rollouts` prints the rollouts; the report shows them.
fn researchers_views(out: &std::path::Path) {
    let read = Command::new("bash")
        .args(["scripts/tensorboard.sh", "read"])
        .arg(out.join("tensorboard"))
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let tb: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    let run = &tb["runs"]["."];
    assert_eq!(run["file_version"], 2.0, "{run}");
    let steps = |tag: &str| -> Vec<u64> {
        run["scalars"][tag]["steps"]
            .as_array()
            .unwrap_or_else(|| panic!("no scalar {tag} in {}", run["scalars"]))
            .iter()
            .map(|s| s.as_u64().unwrap())
            .collect()
    };
    let every: Vec<u64> = (1..=12).collect();
    for tag in [
        "train/loss",
        "train/reward_mean",
        "train/c_high",
        "train/entropy",
    ] {
        assert_eq!(steps(tag), every, "{tag}");
    }
    assert_eq!(steps("eval/accuracy"), [0, 6, 12]);
    let text = &run["text"]["rollouts"];
    assert_eq!(text["steps"], serde_json::json!([6, 12]), "{}", run["text"]);
    let table = text["values"][0].as_array().unwrap();
    assert!(
        table.len() >= 2,
        "a header and at least one rollout: {table:?}"
    );
    assert_eq!(table[0][4], "**response**");

    let kept = std::fs::read_to_string(out.join("rollouts.jsonl")).unwrap();
    assert!(kept.lines().count() >= 2, "{kept}");
    let shown = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["rollouts", "--step", "12", "--run"])
        .arg(out)
        .output()
        .unwrap();
    assert!(shown.status.success());
    let shown = String::from_utf8(shown.stdout).unwrap();
    assert!(shown.starts_with("step 12  group "), "{shown}");
    assert!(shown.contains("prompt:"), "{shown}");
    let report = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(report.contains("<h2>Sample rollouts</h2>"));
    assert!(
        report.contains("<details open><summary>step 12:"),
        "rollouts of the last evaluation"
    );
}
