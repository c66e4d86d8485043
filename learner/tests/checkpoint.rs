//! Checkpoints: resuming equals never stopping, and damaged checkpoints are
//! refused by name.

mod common;

use std::path::Path;

use bapo_learner::{
    Trainer,
    checkpoint::{self, Provenance},
    lineage::{Incarnation, Lineage},
};
use bapo_policy::{Precision, burn::prelude::*};
use common::{config, group, tiny_policy};

fn cursor(data_cursor: u64) -> Provenance {
    Provenance {
        data_cursor,
        ..Default::default()
    }
}

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
    let saved = checkpoint::save(dir.path(), &straight, &cursor(41)).unwrap();
    straight.step(&batches[1]).unwrap();
    let want = straight.step(&batches[2]).unwrap();

    let found = checkpoint::latest(dir.path()).unwrap().unwrap();
    assert_eq!(found, saved);
    let (mut resumed, state) = checkpoint::load(&found, cfg, &Device::flex()).unwrap();
    assert_eq!(
        (
            state.step,
            state.policy_version,
            state.provenance.data_cursor
        ),
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
    let path = checkpoint::save(dir.path(), &t, &Provenance::default()).unwrap();
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
        checkpoint::save(dir.path(), &t, &Provenance::default()).unwrap();
    }
    std::fs::create_dir(dir.path().join(".tmp-step-00000009")).unwrap();
    checkpoint::prune(dir.path(), 2).unwrap();
    let latest = checkpoint::latest(dir.path()).unwrap().unwrap();
    assert!(latest.ends_with("step-00000003"), "{}", latest.display());
    assert!(!checkpoint::step_dir(dir.path(), 1).exists());
    assert!(checkpoint::step_dir(dir.path(), 2).exists());
}

fn provenance() -> Provenance {
    Provenance {
        data_cursor: 41,
        lineage: Lineage::new(
            vec![
                Incarnation {
                    id: 0xa1,
                    first_version: 0,
                },
                Incarnation {
                    id: 0xb2,
                    first_version: 5,
                },
            ],
            7,
        )
        .unwrap(),
        groups_trained: 17,
    }
}

#[test]
fn round_trip_keeps_the_lineage_and_group_draws() {
    let dir = tempfile::tempdir().unwrap();
    let t = Trainer::new(config("bapo"), tiny_policy(16), 7).unwrap();
    let path = checkpoint::save(dir.path(), &t, &provenance()).unwrap();
    let (resumed, state) = checkpoint::load(&path, config("bapo"), &Device::flex()).unwrap();
    assert_eq!(state.provenance, provenance());
    assert_eq!(resumed.version(), 7);
    let text = std::fs::read_to_string(path.join("state.json")).unwrap();
    assert!(
        text.contains("\"lineage\"") && text.contains("\"groups_trained\": 17"),
        "{text}"
    );
}

/// Rewrites `state.json` in `dir` through `edit`.
fn edit_state(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("state.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

#[test]
fn a_state_written_before_incarnations_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let t = Trainer::new(config("bapo"), tiny_policy(17), 3).unwrap();
    let path = checkpoint::save(dir.path(), &t, &provenance_at(3)).unwrap();
    edit_state(&path, |o| {
        o.remove("lineage");
        o.remove("groups_trained");
    });
    let (resumed, state) = checkpoint::load(&path, config("bapo"), &Device::flex()).unwrap();
    assert_eq!(state.provenance.lineage, Lineage::default());
    assert_eq!(state.provenance.groups_trained, 0);
    assert_eq!(state.provenance.data_cursor, 41);
    assert_eq!(resumed.version(), 3);
}

fn provenance_at(version: u64) -> Provenance {
    Provenance {
        lineage: Lineage::default().continued(0xc3, version).unwrap(),
        ..provenance()
    }
}

#[test]
fn a_lineage_that_cannot_be_a_history_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let t = Trainer::new(config("bapo"), tiny_policy(18), 3).unwrap();
    let path = checkpoint::save(dir.path(), &t, &provenance_at(3)).unwrap();
    // An incarnation that started after the weights it is said to hold.
    edit_state(&path, |o| {
        o["lineage"] = serde_json::json!([{"id": 5, "first_version": 9}]);
    });
    let e = checkpoint::load(&path, config("bapo"), &Device::flex())
        .err()
        .expect("must be refused")
        .to_string();
    assert!(
        e.contains("state.json") && e.contains("lineage entry 0") && e.contains("version 9"),
        "{e}"
    );
}

/// The compute dtype is the config's, not the checkpoint's: an f16
/// learner's checkpoint holds f32 weights and loads computing in f32, and
/// the restarted learner sets its configured precision again (as `bapo
/// learner --resume` does) and trains on.
#[test]
fn a_checkpoint_holds_f32_weights_whatever_the_compute_dtype() {
    let stale = tiny_policy(15);
    let batch: Vec<_> = (0..2).map(|i| group(&stale, i, 0)).collect();
    let mut t = Trainer::new(config("bapo"), tiny_policy(16), 0).unwrap();
    t.set_precision(Precision::F16);
    t.step(&batch).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let saved = checkpoint::save(dir.path(), &t, &Provenance::default()).unwrap();
    let (mut back, _) = checkpoint::load(&saved, config("bapo"), &Device::flex()).unwrap();
    assert_eq!(back.model().compute, Precision::F32);
    let weight = back.model().embed_tokens.weight.val();
    assert_eq!(weight.dtype(), bapo_policy::burn::tensor::DType::F32);
    back.set_precision(Precision::F16);
    let r = back.step(&batch).unwrap();
    assert!(r.loss.is_finite() && r.metrics["grad_norm"] > 0.0, "{r:?}");
}
