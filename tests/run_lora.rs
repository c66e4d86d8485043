//! `bapo run --lora`: buffer, learner and actors as processes train LoRA
//! adapters on the frozen warm start. The learner broadcasts adapters
//! only, its checkpoints hold adapters and name their base, the books
//! reconcile, and the final export holds the merged model and a PEFT
//! adapter directory that give the same logits.

use std::process::Command;

use bapo_policy::{Policy, burn::prelude::*, peft};
use serde_json::Value;

const CONFIG: &str = r#"
[run]
actors = 2
eval_problems = 50
pass_k = 1

[sft]
steps = 600
batch = 32
lr = 6e-3
warmup_steps = 20
target_accuracy = 0.05
check_problems = 100

[buffer]
max_staleness = 4

[learner]
batch_groups = 4
lr = 3e-5
steps = 12
checkpoint_every = 6
eval_every = 0
eval_max_new_tokens = 8

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0

[actor.sampling]
max_new_tokens = 8
"#;

fn logits(p: &Policy) -> Vec<f32> {
    let t = Policy::tokens(&[vec![5, 6, 7, 8, 9]], &p.device());
    p.model
        .forward(t, &p.rope, None)
        .into_data()
        .try_into_vec()
        .unwrap()
}

#[test]
fn a_lora_run_trains_adapters_and_exports_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("lora.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let out = dir.path().join("run");
    let status = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--lora", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "bapo run --lora failed");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["reconciled"], true, "{summary}");
    assert_eq!(summary["steps"], 12, "{summary}");
    assert_eq!(summary["lora_rank"], 16, "{summary}");
    let report = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(
        report.contains("LoRA adapters, rank 16"),
        "the report says LoRA was on"
    );

    // --lora trains at 10x the config's rate.
    let lrs: Vec<f64> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["lr"].as_f64())
        .collect();
    assert!(!lrs.is_empty());
    assert!(lrs.iter().all(|&lr| lr <= 3e-4 * (1.0 + 1e-9)), "{lrs:?}");
    assert!(lrs.iter().any(|&lr| lr > 3e-5), "{lrs:?}");

    // Checkpoints hold adapters, and the base once beside them.
    let ckpt = bapo_learner::checkpoint::latest(&out.join("checkpoints"))
        .unwrap()
        .expect("a checkpoint");
    let (trained, state) = bapo_learner::checkpoint::load_policy(&ckpt, &Device::flex()).unwrap();
    let lora = state.lora.expect("a LoRA checkpoint");
    assert_eq!(lora.rank, 16);
    assert!(ckpt.parent().unwrap().join(&lora.base_file).exists());

    // The export: merged weights and PEFT's adapter directory, both the
    // trained policy.
    let final_dir = out.join("final");
    let (merged, _) = bapo_policy::ModelSpec::from_dir(final_dir.clone())
        .load(&Device::flex())
        .unwrap();
    let adapter_dir = final_dir.join("adapter");
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(adapter_dir.join(peft::CONFIG_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(json["r"], 16);
    let (adapters, _) = peft::read_dir(&adapter_dir, &trained.config, &Device::flex()).unwrap();
    let mut via_peft = trained.model.clone();
    via_peft.lora = Some(adapters);
    let via_peft = Policy::with_model(trained.config.clone(), via_peft, &Device::flex());
    let max = |a: Vec<f32>, b: Vec<f32>| {
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    assert!(max(logits(&trained), logits(&merged)) < 1e-4);
    assert!(max(logits(&trained), logits(&via_peft)) < 1e-5);
}
