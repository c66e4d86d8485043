//! The learner on wgpu, Burn's GPU backend (CI runs it on lavapipe, a
//! Vulkan driver on the CPU): a training step there matches the CPU's, a
//! checkpoint saved there loads on the CPU and back, and mixed precision
//! (f16 compute, f32 master weights) trains. Each test says it skips where
//! the machine has no Vulkan driver, and fails instead under
//! `BAPO_REQUIRE_WGPU=1`.

mod common;

use bapo_learner::{
    StepReport, Trainer,
    checkpoint::{self, Provenance},
};
use bapo_policy::{
    Policy, Precision,
    burn::prelude::*,
    device::{wgpu_for_test, wgpu_for_test_in},
};
use common::{config, group, logprobs, tiny_policy};

/// `policy`'s weights on `device`.
fn moved(policy: &Policy, device: &Device) -> Policy {
    let model = policy.model.clone().to_device(device);
    Policy::with_model(policy.config.clone(), model, device)
}

/// |a − b| relative to |a|, or to 1e-2 where `a` is near zero (a
/// group-normalised loss at ratio 1 is about 0).
fn relative_gap(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(1e-2)
}

/// Log-probs of one fixed response under `p`.
fn probe(p: &Policy) -> Vec<f32> {
    logprobs(p, &[1, 2, 3], &[10, 22, 4, 7])
}

/// Loss and gradient norm of `got` within `tolerance` (relative) of `want`.
fn assert_step_close(want: &StepReport, got: &StepReport, tolerance: f64, what: &str) {
    for (name, w, g) in [
        ("loss", want.loss, got.loss),
        (
            "grad_norm",
            want.metrics["grad_norm"],
            got.metrics["grad_norm"],
        ),
    ] {
        let gap = relative_gap(w, g);
        eprintln!(
            "{what}, step {}: {name} {w:.6} vs {g:.6} (gap {gap:.1e})",
            got.step
        );
        assert!(gap < tolerance, "{what}: {name} {w} vs {g}");
    }
}

fn max_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Two optimiser steps of BAPO on the same batches from the same weights:
/// loss and gradient norm agree with the CPU's to 1e-3 relative (f32
/// summation order; the first AdamW step moves each weight by about ±lr,
/// so a sign error or a missing gradient would show at 1e-1), and so do
/// the log-probs of the updated policy.
#[test]
fn a_training_step_on_wgpu_matches_the_cpu() {
    let Some(gpu) = wgpu_for_test("learner step on wgpu") else {
        return;
    };
    let stale = tiny_policy(11);
    let batches: Vec<Vec<_>> = (0..2)
        .map(|b| (0..2).map(|i| group(&stale, b * 2 + i, 0)).collect())
        .collect();
    let start = tiny_policy(12);
    let mut cpu = Trainer::new(config("bapo"), moved(&start, &Device::flex()), 0).unwrap();
    let mut gpu_t = Trainer::new(config("bapo"), moved(&start, &gpu), 0).unwrap();
    for b in &batches {
        let want = cpu.step(b).unwrap();
        let got = gpu_t.step(b).unwrap();
        assert_step_close(&want, &got, 1e-3, "cpu vs wgpu");
    }
    let gap = max_gap(&probe(&cpu.policy()), &probe(&gpu_t.policy()));
    assert!(gap < 1e-3, "log-probs after two steps differ by {gap}");
}

/// Saved on wgpu, loaded on the CPU: the same log-probs, and training goes
/// on from the saved optimiser state on either device with the same loss.
#[test]
fn a_checkpoint_saved_on_wgpu_loads_on_the_cpu_and_back() {
    let Some(gpu) = wgpu_for_test("checkpoint across devices") else {
        return;
    };
    let stale = tiny_policy(21);
    let batch: Vec<_> = (0..2).map(|i| group(&stale, i, 0)).collect();
    let mut on_gpu = Trainer::new(config("bapo"), moved(&tiny_policy(22), &gpu), 0).unwrap();
    on_gpu.step(&batch).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let saved = checkpoint::save(dir.path(), &on_gpu, &Provenance::default()).unwrap();

    let (mut on_cpu, state) = checkpoint::load(&saved, config("bapo"), &Device::flex()).unwrap();
    assert_eq!((state.step, state.policy_version), (1, 1));
    let gap = max_gap(&probe(&on_gpu.policy()), &probe(&on_cpu.policy()));
    assert!(gap < 1e-5, "log-probs after the round trip differ by {gap}");

    let (mut back, _) = checkpoint::load(&saved, config("bapo"), &gpu).unwrap();
    let want = on_gpu.step(&batch).unwrap();
    for (device, t) in [("cpu", &mut on_cpu), ("wgpu", &mut back)] {
        let got = t.step(&batch).unwrap();
        let gap = relative_gap(want.loss, got.loss);
        assert!(
            gap < 1e-3,
            "{device}: loss {} vs {} on wgpu",
            got.loss,
            want.loss
        );
    }
}

/// f16 compute on wgpu, f32 master weights and optimiser: the step's loss
/// and gradient norm stay within 5% of the f32 step's (f16 rounds to 2⁻¹¹
/// relative per op), and the weights stay f32.
#[test]
fn mixed_precision_trains_on_wgpu() {
    let Some(gpu) = wgpu_for_test_in("f16 learner step on wgpu", Precision::F16) else {
        return;
    };
    let stale = tiny_policy(31);
    let batch: Vec<_> = (0..2).map(|i| group(&stale, i, 0)).collect();
    let start = tiny_policy(32);
    let mut exact = Trainer::new(config("bapo"), moved(&start, &gpu), 0).unwrap();
    let mut half = Trainer::new(config("bapo"), moved(&start, &gpu), 0).unwrap();
    half.set_precision(Precision::F16);
    let want = exact.step(&batch).unwrap();
    let got = half.step(&batch).unwrap();
    assert_step_close(&want, &got, 5e-2, "f32 vs f16 on wgpu");
    let weight = half.model().embed_tokens.weight.val();
    assert_eq!(weight.dtype(), bapo_policy::burn::tensor::DType::F32);
}

/// The memory features on a GPU backend: a step with layers checkpointed
/// and a token budget equals the plain step (loss, gradient norm), and the
/// device's memory pools are sampled into the step's metrics (the CPU
/// backend keeps no pools, so this is its only test).
#[test]
fn checkpointed_budgeted_steps_on_wgpu_match_and_report_device_memory() {
    let Some(gpu) = wgpu_for_test("checkpointed step on wgpu") else {
        return;
    };
    let stale = tiny_policy(13);
    let batch: Vec<_> = (0..3).map(|i| group(&stale, i, 0)).collect();
    let start = tiny_policy(14);
    let mut plain = Trainer::new(config("bapo"), moved(&start, &gpu), 0).unwrap();
    let mut cfg = config("bapo");
    cfg.checkpoint_layers = true;
    cfg.micro_batch_tokens = 30;
    let mut lean = Trainer::new(cfg, moved(&start, &gpu), 0).unwrap();
    let want = plain.step(&batch).unwrap();
    let got = lean.step(&batch).unwrap();
    assert_step_close(&want, &got, 1e-4, "checkpointed, budgeted");
    assert!(got.metrics["micro_batches"] > 1.0, "{:?}", got.metrics);
    for r in [&want, &got] {
        let used = r.metrics["device_mem_in_use_gib"];
        let reserved = r.metrics["device_mem_reserved_gib"];
        assert!(used > 0.0 && reserved >= used, "{used} of {reserved} GiB");
    }
}

/// A pass whose f32 logits would be one buffer larger than wgpu's largest
/// is refused when the trainer starts, by name and with the budget that
/// fits; on the CPU there is no such limit.
#[test]
fn a_pass_over_wgpus_largest_buffer_is_refused_at_start() {
    use bapo_policy::device::max_buffer_bytes;
    assert_eq!(max_buffer_bytes(&Device::flex()), None);
    let Some(gpu) = wgpu_for_test("buffer limit on wgpu") else {
        return;
    };
    let max = max_buffer_bytes(&gpu).expect("wgpu names its largest buffer");
    let policy = moved(&tiny_policy(13), &gpu);
    let vocab = policy.config.vocab_size as u64;
    let mut cfg = config("bapo");
    cfg.micro_batch_tokens = (max / (4 * vocab) + 1) as usize;
    let err = Trainer::new(cfg, policy, 0)
        .err()
        .expect("refused")
        .to_string();
    let fits = max / (4 * vocab);
    assert!(
        err.contains("learner.micro_batch_tokens") && err.contains(&format!("at most {fits}")),
        "{err}"
    );
}
