//! `bapo run --device wgpu`: the whole loop with every model on Burn's GPU
//! backend (in CI, lavapipe's Vulkan on the CPU). It checks plumbing, not
//! speed: the warm start, the learner and both actors come up on wgpu,
//! the versions advance, the books reconcile, and the final evaluation
//! runs there too.

use std::process::Command;

const CONFIG: &str = r#"
[run]
actors = 2
eval_problems = 20
pass_k = 1

[sft]
steps = 60
batch = 16
lr = 6e-3
warmup_steps = 10

[buffer]
max_staleness = 4

[learner]
batch_groups = 2
lr = 1e-4
steps = 24
checkpoint_every = 12
eval_every = 0

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0

[actor.sampling]
max_new_tokens = 6
"#;

#[test]
fn bapo_run_completes_on_wgpu() {
    if bapo_policy::device::wgpu_for_test("bapo run --device wgpu").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bapo.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let out = dir.path().join("run");
    let status = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--device", "wgpu", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "bapo run --device wgpu failed");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(s["steps"], 24, "{s}");
    assert_eq!(s["buffer"]["learner_version"], 24, "{s}");
    assert_eq!(s["reconciled"], true, "{s}");
    assert!(s["final_accuracy"].as_f64().is_some(), "{s}");
    // Every service said where its model ran.
    for name in ["learner", "actor-0", "actor-1"] {
        let log = std::fs::read_to_string(out.join("logs").join(format!("{name}.log"))).unwrap();
        assert!(
            log.contains("model on wgpu in f32"),
            "{name}.log does not say wgpu:\n{log}"
        );
    }
    let used = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(used.contains("device = \"wgpu\""), "{used}");
}

/// A device that cannot mean what it says is refused before any work, by
/// name: a backend this binary lacks, and bf16 on wgpu.
#[test]
fn an_impossible_device_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 2] = [
        (&["--device", "cuda"], "without the `cuda` cargo feature"),
        (
            &["--device", "wgpu", "--precision", "bf16"],
            "WGSL has no bf16",
        ),
    ];
    for (flags, why) in cases {
        if cfg!(feature = "cuda") && flags[1] == "cuda" {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_bapo"))
            .args(["run", "--quiet", "--out"])
            .arg(dir.path().join("run"))
            .args(flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} was accepted");
        assert!(err.contains(why), "{flags:?}: {err}");
        assert!(
            !dir.path().join("run").join("sft").exists(),
            "{flags:?} started work"
        );
    }
}
