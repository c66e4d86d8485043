//! The training step on the real tiny model: it learns, its gradients are
//! the loss's (finite differences), and micro-batching changes nothing.

mod common;

use bapo_learner::{Trainer, config::Proximal};
use bapo_policy::{
    Policy,
    burn::{module::Param, prelude::*},
};
use common::{config, group, logprobs, tiny_policy};

#[test]
fn steps_raise_the_probability_of_rewarded_responses() {
    for algo in ["bapo", "grpo", "dapo", "cispo", "decoupled"] {
        let policy = tiny_policy(1);
        let groups: Vec<_> = (0..4).map(|i| group(&policy, i, 0)).collect();
        let prompt = &groups[0].sequences[0].prompt;
        let before: f32 = logprobs(&policy, prompt, &[10, 10, 4]).iter().sum();
        let mut cfg = config(algo);
        if algo == "decoupled" {
            // Against a recomputed proximal policy, which needs several
            // updates per batch to differ from the current one.
            cfg.proximal = Proximal::Recompute;
            cfg.epochs = 2;
        }
        let updates = cfg.updates_per_batch();
        let mut t = Trainer::new(cfg, policy, 0).unwrap();
        for _ in 0..5 {
            let r = t.step(&groups).unwrap();
            assert!(r.loss.is_finite(), "{algo}: loss {}", r.loss);
        }
        assert_eq!(t.version(), 5 * updates);
        let after: f32 = logprobs(&t.policy(), prompt, &[10, 10, 4]).iter().sum();
        assert!(
            after > before + 0.5,
            "{algo}: rewarded response log-prob {before} -> {after}"
        );
    }
}

#[test]
fn bapo_reports_its_bounds_and_the_step_metrics() {
    let stale = tiny_policy(2);
    let groups: Vec<_> = (0..4).map(|i| group(&stale, i, 0)).collect();
    let mut t = Trainer::new(config("bapo"), tiny_policy(3), 4).unwrap();
    let r = t.step(&groups).unwrap();
    for key in [
        "c_low",
        "c_high",
        "pos_fraction",
        "entropy",
        "grad_norm",
        "reward_mean",
        "staleness_mean",
        "clip_frac_low",
        "ratio_mean",
    ] {
        assert!(
            r.metrics.contains_key(key),
            "missing {key}: {:?}",
            r.metrics
        );
    }
    assert_eq!(r.metrics["staleness_max"], 4.0);
    assert_eq!(r.metrics["reward_mean"], 0.5);
    assert_eq!(r.tokens, 4 * 4 * 3);
}

fn direction(n: usize, device: &Device) -> Tensor<1> {
    let d: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0).collect();
    Tensor::from_data(TensorData::new(d, [n]), device)
}

/// The parameter gradient of the surrogate equals the finite-difference
/// derivative of the host loss, along a direction in the final norm's
/// weights (through every layer's output). Checked where the loss is
/// smooth: clipped GRPO on fresh data (ratios at 1, far from the clip
/// bounds) and SAPO's soft gate on stale data (ratios away from 1).
#[test]
fn gradients_match_finite_differences_through_the_model() {
    let trained = tiny_policy(5);
    let stale = tiny_policy(4);
    for (algo, behaviour) in [("grpo", &trained), ("sapo", &stale)] {
        let groups: Vec<_> = (0..2).map(|i| group(behaviour, i, 0)).collect();
        let t = Trainer::new(
            config(algo),
            Policy::with_model(
                trained.config.clone(),
                trained.model.clone(),
                &trained.device(),
            ),
            0,
        )
        .unwrap();
        let back = t.gradients(&groups).unwrap();
        let gamma = &t.model().norm.gamma;
        let n = gamma.val().dims()[0];
        let d = direction(n, &gamma.val().device());
        let g = back
            .grads
            .get::<1>(gamma.id)
            .expect("gradient of the final norm");
        let analytic = g.mul(d.clone()).sum().into_scalar::<f32>() as f64;

        let loss_at = |eps: f32| {
            let mut policy = t.policy();
            let gamma = policy.model.norm.gamma.val();
            let shifted = gamma.clone() + direction(n, &gamma.device()).mul_scalar(eps);
            policy.model.norm.gamma = Param::from_tensor(shifted);
            let t2 = Trainer::new(config(algo), policy, 0).unwrap();
            t2.gradients(&groups).unwrap().loss.loss
        };
        let eps = 3e-3;
        let numeric = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps as f64);
        let tol = 2e-2 * analytic.abs().max(1e-3);
        assert!(
            (numeric - analytic).abs() < tol,
            "{algo}: analytic {analytic} vs finite difference {numeric}"
        );
    }
}

#[test]
fn micro_batching_gives_the_same_loss_and_gradients() {
    let stale = tiny_policy(6);
    let groups: Vec<_> = (0..3).map(|i| group(&stale, i, 0)).collect();
    let one = Trainer::new(config("bapo"), tiny_policy(7), 0).unwrap();
    let mut cfg = config("bapo");
    cfg.micro_batch_seqs = 5;
    let many = Trainer::new(cfg, one.policy(), 0).unwrap();
    let a = one.gradients(&groups).unwrap();
    let b = many.gradients(&groups).unwrap();
    assert!((a.loss.loss - b.loss.loss).abs() < 1e-6);
    assert_eq!(a.loss.metrics["c_high"], b.loss.metrics["c_high"]);
    let ga: Vec<f32> = a
        .grads
        .get::<2>(one.model().embed_tokens.weight.id)
        .unwrap()
        .into_data()
        .try_into_vec()
        .unwrap();
    let gb: Vec<f32> = b
        .grads
        .get::<2>(many.model().embed_tokens.weight.id)
        .unwrap()
        .into_data()
        .try_into_vec()
        .unwrap();
    let max = ga
        .iter()
        .zip(&gb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-5, "max embedding-gradient difference {max}");
}

/// A group of 4 responses of `lens` tokens (token 10 rewarded).
fn ragged_group(behaviour: &Policy, id: u32, lens: [usize; 4]) -> bapo_learner::TrainGroup {
    let mut g = group(behaviour, id, 0);
    for (k, (s, len)) in g.sequences.iter_mut().zip(lens).enumerate() {
        s.response = (0..len).map(|j| [10, 20, 22, 4][(j + k) % 4]).collect();
        s.behavior_logprobs = logprobs(behaviour, &s.prompt, &s.response);
        s.versions = vec![0; len];
    }
    g
}

/// The gradient of every weight named here, flattened.
fn some_grads(t: &Trainer, back: &bapo_learner::trainer::Backward) -> Vec<f32> {
    let m = t.model();
    let layer = &m.layers[0];
    let mut out: Vec<f32> = Vec::new();
    for id in [
        m.embed_tokens.weight.id,
        layer.self_attn.q_proj.weight.id,
        layer.mlp.down_proj.weight.id,
    ] {
        out.extend(grad_of(back, id));
    }
    out
}

/// The gradient of parameter `id` in `back`, flattened.
fn grad_of(
    back: &bapo_learner::trainer::Backward,
    id: bapo_policy::burn::module::ParamId,
) -> Vec<f32> {
    let g = back.grads.get::<2>(id).expect("a gradient");
    g.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// A token budget cuts a ragged batch into passes of like length: the
/// loss and every gradient are the one-pass step's.
#[test]
fn a_token_budget_gives_the_same_loss_and_gradients() {
    let stale = tiny_policy(18);
    let groups = [
        ragged_group(&stale, 0, [2, 11, 3, 9]),
        ragged_group(&stale, 1, [12, 2, 6, 4]),
        ragged_group(&stale, 2, [5, 5, 10, 3]),
    ];
    let one = Trainer::new(config("bapo"), tiny_policy(19), 0).unwrap();
    let a = one.gradients(&groups).unwrap();
    assert_eq!(a.metrics["micro_batches"], 1.0);
    let mut cfg = config("bapo");
    cfg.micro_batch_tokens = 40;
    let budget = Trainer::new(cfg, one.policy(), 0).unwrap();
    let b = budget.gradients(&groups).unwrap();
    assert!(b.metrics["micro_batches"] > 3.0, "{:?}", b.metrics);
    // Grouped by length, the passes pad less than the one pass does.
    assert!(b.metrics["padding_fraction"] < a.metrics["padding_fraction"] / 2.0);
    assert!((a.loss.loss - b.loss.loss).abs() < 1e-6);
    assert_eq!(a.loss.metrics["c_high"], b.loss.metrics["c_high"]);
    let (ga, gb) = (some_grads(&one, &a), some_grads(&budget, &b));
    let max = ga
        .iter()
        .zip(&gb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-5, "max gradient difference {max}");
}

/// Packed several a row (`pack_sequences`), the sequences of a ragged
/// batch give the one-pass step's loss, entropy, KL and gradients, with
/// less padding than sorting by length leaves; also with the layers
/// recomputed (their attention and positions see the packing too).
#[test]
fn packed_sequences_give_the_same_loss_and_gradients() {
    let stale = tiny_policy(24);
    let groups = [
        ragged_group(&stale, 0, [2, 11, 3, 9]),
        ragged_group(&stale, 1, [12, 2, 6, 4]),
        ragged_group(&stale, 2, [5, 5, 10, 3]),
    ];
    let mut cfg = config("bapo");
    cfg.kl_coef = 0.05;
    cfg.entropy_coef = 0.01;
    let one = Trainer::new(cfg.clone(), tiny_policy(25), 0).unwrap();
    let a = one.gradients(&groups).unwrap();
    cfg.micro_batch_tokens = 40;
    let sorted = Trainer::new(cfg.clone(), one.policy(), 0).unwrap();
    let by_length = sorted.gradients(&groups).unwrap();
    cfg.pack_sequences = true;
    for checkpoint_layers in [false, true] {
        cfg.checkpoint_layers = checkpoint_layers;
        let packed = Trainer::new(cfg.clone(), one.policy(), 0).unwrap();
        let b = packed.gradients(&groups).unwrap();
        let what = format!("checkpoint_layers = {checkpoint_layers}");
        assert!(
            b.metrics["padding_fraction"] < by_length.metrics["padding_fraction"],
            "{what}: {:?} vs {:?}",
            b.metrics,
            by_length.metrics
        );
        assert!((a.loss.loss - b.loss.loss).abs() < 1e-6, "{what}");
        assert_eq!(a.loss.metrics["c_high"], b.loss.metrics["c_high"]);
        for key in ["entropy", "kl_ref_k3"] {
            let (x, y) = (a.metrics[key], b.metrics[key]);
            assert!((x - y).abs() < 1e-6, "{what}: {key} {x} vs {y}");
        }
        let (ga, gb) = (some_grads(&one, &a), some_grads(&packed, &b));
        let max = ga
            .iter()
            .zip(&gb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(max < 1e-5, "{what}: max gradient difference {max}");
    }
}

/// Packing needs a budget, and cannot pack a loss whose micro-batches are
/// its unit: both refused by name.
#[test]
fn packing_without_a_budget_or_with_micro_batch_losses_is_refused() {
    let mut cfg = config("bapo");
    cfg.pack_sequences = true;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(
        err.contains("pack_sequences") && err.contains("micro_batch_tokens"),
        "{err}"
    );
    cfg.micro_batch_tokens = 64;
    cfg.search_scope = bapo_learner::config::SearchScope::MicroBatch;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(
        err.contains("pack_sequences") && err.contains("search_scope"),
        "{err}"
    );
}

/// Where each micro-batch computes its own loss, a budget keeps the rows
/// in order: a budget of 4 rows of equal length is `micro_batch_seqs = 4`.
#[test]
fn a_token_budget_keeps_micro_batch_scoped_losses_in_order() {
    use bapo_learner::config::SearchScope;
    let stale = tiny_policy(20);
    let groups: Vec<_> = (0..3).map(|i| group(&stale, i, 0)).collect();
    let mut seqs = config("bapo");
    seqs.search_scope = SearchScope::MicroBatch;
    seqs.micro_batch_seqs = 4;
    let mut tokens = seqs.clone();
    tokens.micro_batch_seqs = 64;
    // Prompt 3 + response 3 tokens: 4 rows are 24 padded tokens.
    tokens.micro_batch_tokens = 24;
    let by_seqs = Trainer::new(seqs, tiny_policy(21), 0).unwrap();
    let by_tokens = Trainer::new(tokens, by_seqs.policy(), 0).unwrap();
    let (a, b) = (
        by_seqs.gradients(&groups).unwrap(),
        by_tokens.gradients(&groups).unwrap(),
    );
    assert_eq!(b.metrics["micro_batches"], 3.0);
    assert_eq!(a.loss.loss, b.loss.loss);
    assert_eq!(a.loss.grad, b.loss.grad);
}

/// Layers recomputed one at a time in the backward pass give the loss and
/// gradients of the plain pass (tied embedding: its gradient gathers the
/// head's share and the embedding's), in full fine-tuning, under LoRA and
/// with a KL penalty and an entropy bonus on the head.
#[test]
fn checkpointed_layers_give_the_same_loss_and_gradients() {
    let stale = tiny_policy(22);
    let groups = [
        ragged_group(&stale, 0, [2, 7, 3, 5]),
        ragged_group(&stale, 1, [6, 2, 4, 4]),
    ];
    let lora = bapo_policy::lora::LoraConfig::default();
    for (name, lora) in [("full", None), ("lora", Some(lora))] {
        let mut cfg = config("bapo");
        cfg.lora = lora;
        cfg.kl_coef = 0.05;
        cfg.entropy_coef = 0.01;
        cfg.micro_batch_seqs = 3;
        let plain = Trainer::new(cfg.clone(), tiny_policy(23), 0).unwrap();
        cfg.checkpoint_layers = true;
        let ck = Trainer::new(cfg, plain.policy(), 0).unwrap();
        let (a, b) = (
            plain.gradients(&groups).unwrap(),
            ck.gradients(&groups).unwrap(),
        );
        assert!((a.loss.loss - b.loss.loss).abs() < 1e-9, "{name}");
        assert!((a.metrics["entropy"] - b.metrics["entropy"]).abs() < 1e-6);
        let (ga, gb) = if name == "full" {
            (some_grads(&plain, &a), some_grads(&ck, &b))
        } else {
            (lora_grads(&plain, &a), lora_grads(&ck, &b))
        };
        assert!(!ga.is_empty() && ga.iter().any(|&x| x != 0.0), "{name}");
        let max = ga
            .iter()
            .zip(&gb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(max < 1e-5, "{name}: max gradient difference {max}");
    }
}

/// The gradients of layer 0's and the last layer's query adapters.
fn lora_grads(t: &Trainer, back: &bapo_learner::trainer::Backward) -> Vec<f32> {
    use bapo_policy::lora::Target;
    let adapters = t.model().lora.as_ref().expect("adapters");
    let mut out: Vec<f32> = Vec::new();
    for layer in [&adapters.layers[0], adapters.layers.last().unwrap()] {
        let pair = layer.get(Target::Q).expect("a query adapter");
        for id in [pair.a.id, pair.b.id] {
            out.extend(grad_of(back, id));
        }
    }
    out
}

#[test]
fn bad_batches_are_refused_by_name() {
    let p = tiny_policy(8);
    let mut g = group(&p, 0, 0);
    g.sequences[1].response[0] = 9999;
    let t = Trainer::new(config("bapo"), p, 0).unwrap();
    let e = t.gradients(&[g]).err().unwrap().to_string();
    assert!(e.contains("9999") && e.contains("g0"), "{e}");
    let e = t.gradients(&[]).err().unwrap().to_string();
    assert!(e.contains("no sequence"), "{e}");
}

/// Every parameter of a model loaded from disk gets a gradient (loading
/// must not leave tensors untracked).
#[test]
fn every_parameter_of_a_loaded_model_is_trained() {
    use bapo_policy::burn::module::{Module, ModuleVisitor};
    struct Count<'a>(&'a bapo_policy::burn::optim::GradientsParams, usize, usize);
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.1 += 1;
            self.2 += self.0.get::<D>(p.id).is_some() as usize;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let src = tiny_policy(9);
    bapo_policy::hf::save(&src, dir.path()).unwrap();
    let loaded = bapo_policy::hf::load(dir.path(), &Device::flex()).unwrap();
    let groups: Vec<_> = (0..2).map(|i| group(&src, i, 0)).collect();
    let t = Trainer::new(config("grpo"), loaded, 0).unwrap();
    let back = t.gradients(&groups).unwrap();
    let mut c = Count(&back.grads, 0, 0);
    t.model().visit(&mut c);
    assert_eq!(c.2, c.1, "{} of {} parameters have a gradient", c.2, c.1);
}

/// Per-micro-batch search: each micro-batch chooses its own bounds, the
/// denominators stay global, so the gradient is the sum of the micro-batch
/// losses' gradients; with one micro-batch it is the step scope exactly.
#[test]
fn micro_batch_search_scope_uses_global_denominators() {
    use bapo_learner::config::SearchScope;
    let stale = tiny_policy(16);
    let groups: Vec<_> = (0..2).map(|i| group(&stale, i, 0)).collect();
    let step = Trainer::new(config("bapo"), tiny_policy(17), 0).unwrap();
    let mut cfg = config("bapo");
    cfg.search_scope = SearchScope::MicroBatch;
    cfg.micro_batch_seqs = 4;
    let micro = Trainer::new(cfg.clone(), step.policy(), 0).unwrap();
    let a = step.gradients(&groups).unwrap();
    let b = micro.gradients(&groups).unwrap();
    // One group per micro-batch, each meeting the positive-share target
    // at the initial bounds, as the whole step does: the micro-batch
    // losses over the global denominators add up to the step's loss.
    assert_eq!(a.loss.metrics["search_steps"], 0.0);
    assert_eq!(b.loss.metrics["search_steps"], 0.0);
    assert!(
        (b.loss.loss - a.loss.loss).abs() < 1e-9,
        "{} vs {}",
        b.loss.loss,
        a.loss.loss
    );
    for (x, y) in b.loss.grad.iter().zip(&a.loss.grad) {
        assert!((x - y).abs() < 1e-9);
    }
    cfg.micro_batch_seqs = 64;
    let single = Trainer::new(cfg, step.policy(), 0).unwrap();
    let c = single.gradients(&groups).unwrap();
    assert!((c.loss.loss - a.loss.loss).abs() < 1e-9);
    for (x, y) in c.loss.grad.iter().zip(&a.loss.grad) {
        assert!((x - y).abs() < 1e-9);
    }
}

/// Per-micro-batch search records each micro-batch's own choices beside
/// the step's means, and says which had nothing to train on: here the
/// second group's rewards are all 1, so all its advantages are 0.
#[test]
fn micro_batch_search_records_each_micro_batchs_bounds() {
    use bapo_learner::config::SearchScope;
    let stale = tiny_policy(18);
    let mut groups: Vec<_> = (0..2).map(|i| group(&stale, i, 0)).collect();
    for s in &mut groups[1].sequences {
        s.reward = 1.0;
    }
    let mut cfg = config("bapo");
    cfg.search_scope = SearchScope::MicroBatch;
    cfg.micro_batch_seqs = 4;
    cfg.filter_zero_variance = false;
    let t = Trainer::new(cfg, tiny_policy(19), 0).unwrap();
    let m = t.gradients(&groups).unwrap().loss.metrics;
    assert_eq!((m["empty_mb0"], m["empty_mb1"]), (0.0, 1.0));
    for key in [
        "c_low",
        "c_high",
        "search_steps",
        "target_met",
        "pos_fraction",
    ] {
        for i in 0..2 {
            assert!(
                m.contains_key(&format!("{key}_mb{i}")),
                "{key}_mb{i}: {m:?}"
            );
        }
    }
    assert!(!m.contains_key("empty_mb2"));
}

/// A two-turn episode: the model's turn, an environment's observation
/// (masked), the model's answer; its behaviour log-probs of the
/// observation set to `obs_lp`.
fn episode_group(
    stale: &bapo_policy::Policy,
    obs_lp: f32,
    masked: bool,
) -> bapo_learner::TrainGroup {
    let prompt = vec![1, 5, 3];
    let turns: [(&[u32], f32); 4] = [
        (&[10, 11, 4, 30, 31, 32, 10, 4], 1.0),
        (&[20, 21, 4, 30, 33, 32, 22, 4], 0.0),
        (&[10, 22, 4, 34, 31, 32, 10, 4], 1.0),
        (&[23, 20, 4, 30, 31, 35, 21, 4], 0.0),
    ];
    let mask = [true, true, true, false, false, false, true, true];
    let sequences = turns
        .iter()
        .map(|(r, reward)| {
            let mut lp = logprobs(stale, &prompt, r);
            for (j, m) in mask.iter().enumerate() {
                if !m {
                    lp[j] = obs_lp;
                }
            }
            bapo_learner::rollouts::Sequence {
                prompt: prompt.clone(),
                response: r.to_vec(),
                behavior_logprobs: lp,
                versions: vec![0; r.len()],
                reward: *reward,
                mask: if masked { mask.to_vec() } else { Vec::new() },
                turns: vec![0, 0, 0, 0, 0, 0, 1, 1],
                truncated: false,
            }
        })
        .collect();
    bapo_learner::TrainGroup {
        group_id: "episode".into(),
        sequences,
        sequence_number: 0,
    }
}

/// An episode's length counts the environment's observations; the
/// model's own tokens are reported beside it (5 of each 8 here), and the
/// two agree on single answers.
#[test]
fn an_episodes_own_tokens_are_reported_beside_its_length() {
    let stale = tiny_policy(18);
    let mut t = Trainer::new(config("bapo"), tiny_policy(19), 0).unwrap();
    let r = t.step(&[episode_group(&stale, 0.0, true)]).unwrap();
    assert_eq!(r.metrics["response_len_mean"], 8.0);
    assert_eq!(r.metrics["model_tokens_mean"], 5.0);
    let r = t.step(&[episode_group(&stale, 0.0, false)]).unwrap();
    assert_eq!(r.metrics["model_tokens_mean"], 8.0);
}

/// Observation tokens carry no gradient: whatever their behaviour
/// log-probs say, the loss, the entropy bonus and the KL penalty see only
/// the model's tokens. Trained as the model's, the same tokens move the
/// gradient (the control that shows the test can fail).
#[test]
fn observation_tokens_carry_no_gradient() {
    let stale = tiny_policy(18);
    let mut cfg = config("bapo");
    cfg.entropy_coef = 0.01;
    cfg.kl_coef = 0.05;
    let t = Trainer::new(cfg, tiny_policy(19), 0).unwrap();
    let embed = |groups: &[bapo_learner::TrainGroup]| -> (f64, Vec<f32>) {
        let b = t.gradients(groups).unwrap();
        let g = b
            .grads
            .get::<2>(t.model().embed_tokens.weight.id)
            .unwrap()
            .into_data()
            .try_into_vec()
            .unwrap();
        (b.loss.loss, g)
    };
    let (loss, grads) = embed(&[episode_group(&stale, 0.0, true)]);
    let (loss2, grads2) = embed(&[episode_group(&stale, -9.0, true)]);
    assert_eq!(loss, loss2);
    assert_eq!(grads, grads2, "observation log-probs moved a gradient");
    let (loss3, grads3) = embed(&[episode_group(&stale, -9.0, false)]);
    assert_ne!(loss, loss3, "trained as the model's, they count");
    assert_ne!(grads, grads3);
}

/// Rewards at f32's limits under Dr. GRPO's unnormalised advantages
/// overflow the loss's gradient: the update is skipped (weights, step and
/// version unchanged) and reported; the third in a row is an error that
/// names the cause, and the weights are still the last finite ones.
#[test]
fn non_finite_updates_are_skipped_then_stop_the_learner() {
    use bapo_learner::{advantage::Estimator, trainer::TrainError};
    let p = tiny_policy(24);
    let mut g = group(&p, 0, 0);
    for (i, s) in g.sequences.iter_mut().enumerate() {
        s.reward = if i % 2 == 0 { f32::MAX } else { -f32::MAX };
    }
    let mut cfg = config("grpo");
    cfg.advantage = Some(Estimator::DrGrpo);
    let mut t = Trainer::new(cfg, p, 5).unwrap();
    let before = logprobs(&t.policy(), &g.sequences[0].prompt, &[10, 10, 4]);
    for _ in 0..2 {
        let r = t.step(std::slice::from_ref(&g)).unwrap();
        assert_eq!(r.metrics["nonfinite_skipped"], 1.0, "{:?}", r.metrics);
        assert_eq!((r.step, r.version), (0, 5));
    }
    let e = t.step(std::slice::from_ref(&g)).unwrap_err();
    assert!(
        matches!(e, TrainError::NonFinite { in_a_row: 3, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("non-finite"), "{e}");
    let after = logprobs(&t.policy(), &g.sequences[0].prompt, &[10, 10, 4]);
    assert_eq!(before, after);
    assert!(after.iter().all(|x| x.is_finite()));
    assert_eq!((t.steps_done(), t.version()), (0, 5));
}

/// A sequence longer than the token budget is refused by name; a step the
/// device cannot hold is refused when the trainer starts, with the
/// numbers, not in the middle of a step.
#[test]
fn the_budget_and_the_memory_estimate_refuse_by_name() {
    use bapo_learner::trainer::TrainError;
    let p = tiny_policy(25);
    let g = ragged_group(&p, 0, [2, 12, 3, 4]);
    let mut cfg = config("bapo");
    cfg.micro_batch_tokens = 10;
    let t = Trainer::new(cfg.clone(), p, 0).unwrap();
    let e = t.gradients(&[g]).err().unwrap();
    assert!(
        matches!(
            e,
            TrainError::OverBudget {
                len: 15,
                budget: 10,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("learner.micro_batch_tokens = 10"),
        "{e}"
    );

    cfg.device_memory_gib = 0.001;
    let e = Trainer::new(cfg, tiny_policy(25), 0).err().unwrap();
    assert!(matches!(e, TrainError::Memory(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("more than the device's 0.00 GiB (learner.device_memory_gib)"),
        "{msg}"
    );
}
