//! Checkpoints: resuming equals never stopping, and damaged checkpoints are
//! refused by name.

mod common;

use bapo_learner::{Trainer, checkpoint};
use bapo_policy::burn::prelude::*;
use common::{config, group, tiny_policy};

#[test]
fn resume_continues_exactly_like_an_uninterrupted_run() {
    let stale = tiny_policy(11);
    let batches: Vec<Vec<_>> = (0..3)
        .map(|b| (0..2).map(|i| group(&stale, b * 2 + i, 0)).collect())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("bapo");
    cfg.warmup_steps = 3;

    let mut straight = Trainer::new(cfg.clone(), tiny_policy(12), 0).unwrap();
    straight.step(&batches[0]).unwrap();
    let saved = checkpoint::save(dir.path(), &straight, 41).unwrap();
    straight.step(&batches[1]).unwrap();
    let want = straight.step(&batches[2]).unwrap();

    let found = checkpoint::latest(dir.path()).unwrap().unwrap();
    assert_eq!(found, saved);
    let (mut resumed, state) = checkpoint::load(&found, cfg, &Device::flex()).unwrap();
    assert_eq!(
        (state.step, state.policy_version, state.data_cursor),
        (1, 1, 41)
    );
    resumed.step(&batches[1]).unwrap();
    let got = resumed.step(&batches[2]).unwrap();
    assert_eq!(got.version, want.version);
    assert_eq!(got.lr, want.lr);
    // The third step's loss depends on the second step's AdamW moments:
    // equal losses mean the optimiser state came back too.
    assert!(
        (got.loss - want.loss).abs() < 1e-6 * want.loss.abs().max(1.0),
        "resumed {} vs uninterrupted {}",
        got.loss,
        want.loss
    );
    assert!((got.metrics["grad_norm"] - want.metrics["grad_norm"]).abs() < 1e-4);
}

#[test]
fn truncated_or_corrupt_checkpoints_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let t = Trainer::new(config("bapo"), tiny_policy(13), 7).unwrap();
    let path = checkpoint::save(dir.path(), &t, 0).unwrap();
    let load = || {
        checkpoint::load(&path, config("bapo"), &Device::flex())
            .err()
            .expect("must be refused")
            .to_string()
    };

    let model = path.join("model.bin");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let e = load();
    assert!(e.contains("model.bin") && e.contains("truncated"), "{e}");

    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x40;
    std::fs::write(&model, &flipped).unwrap();
    let e = load();
    assert!(e.contains("model.bin") && e.contains("checksum"), "{e}");
    std::fs::write(&model, &bytes).unwrap();

    let optim = path.join("optimizer.bpk");
    let o = std::fs::read(&optim).unwrap();
    std::fs::write(&optim, &o[..10]).unwrap();
    let e = load();
    assert!(e.contains("optimizer.bpk"), "{e}");
    std::fs::write(&optim, &o).unwrap();

    std::fs::write(path.join("state.json"), "{\"format\": 1, \"step\":").unwrap();
    let e = load();
    assert!(e.contains("state.json"), "{e}");
}

#[test]
fn interrupted_writes_are_ignored_and_old_checkpoints_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(config("bapo"), tiny_policy(14), 0).unwrap();
    let stale = tiny_policy(15);
    let g = vec![group(&stale, 0, 0)];
    for _ in 0..3 {
        t.step(&g).unwrap();
        checkpoint::save(dir.path(), &t, 0).unwrap();
    }
    std::fs::create_dir(dir.path().join(".tmp-step-00000009")).unwrap();
    checkpoint::prune(dir.path(), 2).unwrap();
    let latest = checkpoint::latest(dir.path()).unwrap().unwrap();
    assert!(latest.ends_with("step-00000003"), "{}", latest.display());
    assert!(!checkpoint::step_dir(dir.path(), 1).exists());
    assert!(checkpoint::step_dir(dir.path(), 2).exists());
}
