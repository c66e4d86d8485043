//! LoRA in the learner: only adapters move, the policy-gradient objective
//! rises, a resumed run equals an uninterrupted one, a checkpoint
//! holds adapters and names its base, and the KL reference is the base.

mod common;

use bapo_learner::{Trainer, checkpoint};
use bapo_policy::{Policy, burn::prelude::*, lora::LoraConfig};
use common::{config, group, logprobs, tiny_policy};

fn lora_config(algo: &str) -> bapo_learner::LearnerConfig {
    let mut cfg = config(algo);
    cfg.lora = Some(LoraConfig {
        rank: 4,
        ..LoraConfig::default()
    });
    cfg.lr = 1e-2;
    cfg
}

fn flat(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_into_vec().unwrap()
}

/// `Σ_i A_i · log π(response_i)` over the batch, with GRPO's advantages
/// (rewards 1 and 0 in equal numbers: ±1): the objective a policy-gradient
/// step climbs.
fn objective(p: &Policy, batch: &[bapo_learner::TrainGroup]) -> f32 {
    batch
        .iter()
        .flat_map(|g| &g.sequences)
        .map(|s| {
            let lp: f32 = logprobs(p, &s.prompt, &s.response).iter().sum();
            if s.reward > 0.5 { lp } else { -lp }
        })
        .sum()
}

#[test]
fn only_the_adapters_move_and_the_objective_rises() {
    let start = tiny_policy(21);
    let batch: Vec<_> = (0..4).map(|i| group(&start, i, 0)).collect();
    // A copy of `start`, not a second draw: tests in parallel share the
    // device's generator, so two draws of one seed can differ.
    let same = Policy::with_model(start.config.clone(), start.model.clone(), &start.device());
    let mut cfg = lora_config("grpo");
    cfg.lr = 1e-3;
    let mut t = Trainer::new(cfg, same, 0).unwrap();
    let before = objective(&t.policy(), &batch);
    for _ in 0..3 {
        t.step(&batch).unwrap();
    }
    let after = t.policy();
    let base_before = flat(start.model.layers[0].self_attn.q_proj.weight.val());
    let base_after = flat(after.model.layers[0].self_attn.q_proj.weight.val());
    assert_eq!(base_before, base_after, "the base is frozen");
    let b = after.model.lora.as_ref().unwrap().layers[0]
        .q_proj
        .as_ref()
        .unwrap()
        .b
        .val();
    assert!(b.abs().max().into_scalar::<f32>() > 0.0, "B has moved");
    let gained = objective(&after, &batch);
    assert!(
        gained > before,
        "the policy-gradient objective rose: {before} -> {gained}"
    );
    let fp = bapo_policy::lora::fingerprint(&start.model);
    assert_eq!(t.base_fingerprint(), fp);
}

#[test]
fn a_resumed_lora_run_equals_an_uninterrupted_one() {
    let stale = tiny_policy(22);
    let batches: Vec<Vec<_>> = (0..3)
        .map(|b| (0..2).map(|i| group(&stale, b * 2 + i, 0)).collect())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = lora_config("bapo");
    cfg.kl_coef = 0.05;
    let mut straight = Trainer::new(cfg.clone(), tiny_policy(23), 0).unwrap();
    straight.step(&batches[0]).unwrap();
    let saved = checkpoint::save(dir.path(), &straight, &Default::default()).unwrap();
    straight.step(&batches[1]).unwrap();
    let want = straight.step(&batches[2]).unwrap();

    // The step directory holds adapters, not the model; the base sits
    // once beside the step directories, named in state.json.
    let state = checkpoint::read_state(&saved).unwrap();
    let lora = state.lora.as_ref().expect("a LoRA checkpoint");
    assert!(state.files.contains_key("adapters.bpk"));
    assert!(!state.files.contains_key("model.bin"));
    assert!(
        !state.files.contains_key("reference.bin"),
        "the base is the reference"
    );
    assert!(dir.path().join(&lora.base_file).exists());
    let adapters = std::fs::metadata(saved.join("adapters.bpk")).unwrap().len();
    let base = std::fs::metadata(dir.path().join(&lora.base_file))
        .unwrap()
        .len();
    assert!(
        adapters * 5 < base,
        "adapters {adapters} B vs base {base} B"
    );

    let (mut resumed, _) = checkpoint::load(&saved, cfg, &Device::flex()).unwrap();
    resumed.step(&batches[1]).unwrap();
    let got = resumed.step(&batches[2]).unwrap();
    // Equal third-step losses need the AdamW moments of the adapters and
    // the KL reference (the base) back.
    assert!(
        (got.loss - want.loss).abs() < 1e-6 * want.loss.abs().max(1.0),
        "resumed {} vs uninterrupted {}",
        got.loss,
        want.loss
    );
    assert_eq!(got.metrics["kl_ref_k3"], want.metrics["kl_ref_k3"]);
}

#[test]
fn a_checkpoint_on_another_base_is_refused_by_name() {
    let policy = tiny_policy(24);
    let batch: Vec<_> = (0..2).map(|i| group(&policy, i, 0)).collect();
    let dir = tempfile::tempdir().unwrap();
    let cfg = lora_config("bapo");
    let mut t = Trainer::new(cfg.clone(), policy, 0).unwrap();
    t.step(&batch).unwrap();
    let saved = checkpoint::save(dir.path(), &t, &Default::default()).unwrap();
    // Resumed under other LoRA settings: refused, naming both.
    let mut other_rank = cfg.clone();
    other_rank.lora.as_mut().unwrap().rank = 8;
    let err = checkpoint::load(&saved, other_rank, &Device::flex())
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("rank 4") && err.to_string().contains("rank 8"),
        "{err}"
    );
    let state = checkpoint::read_state(&saved).unwrap();
    let base = dir.path().join(&state.lora.unwrap().base_file);
    // Another base under the same name, checksum updated: the
    // fingerprint still tells.
    let other = tiny_policy(25);
    let (h, payload) = bapo_policy::weights::encode(&other.model, 0).unwrap();
    let mut bytes = h.to_bytes().to_vec();
    bytes.extend_from_slice(&payload);
    std::fs::write(&base, &bytes).unwrap();
    let mut text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(saved.join("state.json")).unwrap()).unwrap();
    text["lora"]["base_sum"] = serde_json::json!({
        "len": bytes.len(),
        "crc32": crc32fast::hash(&bytes),
    });
    std::fs::write(saved.join("state.json"), text.to_string()).unwrap();
    let err = checkpoint::load(&saved, cfg.clone(), &Device::flex())
        .err()
        .unwrap();
    assert!(err.to_string().contains("trained on base"), "{err}");
    std::fs::remove_file(&base).unwrap();
    let err = checkpoint::load(&saved, cfg, &Device::flex())
        .err()
        .unwrap();
    assert!(err.to_string().contains("LoRA base"), "{err}");
}

#[test]
fn lora_settings_that_cannot_mean_what_they_say_are_refused() {
    let refused = |cfg: bapo_learner::LearnerConfig| {
        Trainer::new(cfg, tiny_policy(26), 0)
            .err()
            .expect("refused")
            .to_string()
    };
    let mut cfg = lora_config("bapo");
    cfg.lora.as_mut().unwrap().rank = 4096;
    assert!(
        refused(cfg).contains("learner.lora"),
        "rank above the model's width"
    );
    let mut cfg = lora_config("remix");
    cfg.lora.as_mut().unwrap().rank = 4;
    assert!(refused(cfg).contains("remix"));
    // LoRA weights under a config without [learner.lora].
    let mut adapted = tiny_policy(27);
    let t = Trainer::new(
        lora_config("bapo"),
        Policy::init(adapted.config.clone(), &Device::flex()),
        0,
    )
    .unwrap();
    adapted.model = t.policy().model;
    let e = Trainer::new(config("bapo"), adapted, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("[learner.lora]"), "{e}");
}
