//! Diagnostic: on-policy RL on fixed arith prompts from a warm-started
//! model (BAPO_DIAG_MODEL=dir). Ignored by default; run on purpose, it
//! fails without a model and fails when the reward of the last ten steps is
//! not above that of the first ten.

mod common;

use bapo_learner::{LearnerConfig, TrainGroup, Trainer, rollouts::Sequence};
use bapo_policy::{Generation, ModelSpec, SamplingParams, burn::prelude::*, evaluate::completion};
use bapo_tasks::TaskSpec;

#[test]
#[ignore]
fn on_policy_rl_raises_reward_on_fixed_prompts() {
    let dir = std::env::var("BAPO_DIAG_MODEL")
        .expect("set BAPO_DIAG_MODEL to a warm-started HF model directory (e.g. a run's final/)");
    let lr: f64 = std::env::var("BAPO_DIAG_LR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1e-4);
    let algo = std::env::var("BAPO_DIAG_ALGO").unwrap_or("grpo".into());
    let (policy, tok) = ModelSpec::from_dir(dir.into())
        .load(&Device::flex())
        .unwrap();
    let task = bapo_tasks::build(&TaskSpec::default()).unwrap();
    let problems: Vec<_> = (0..16).map(|i| task.train_problem(i)).collect();
    let stop = vec![tok.token_id("<eos>").unwrap()];
    let cfg = LearnerConfig {
        algo,
        lr,
        batch_groups: 16,
        ..Default::default()
    };
    let mut t = Trainer::new(cfg, policy, 0).unwrap();
    let mut rewards = Vec::new();
    for step in 0..60 {
        let p = t.policy();
        let mut groups = Vec::new();
        let mut total = 0.0;
        for (i, prob) in problems.iter().enumerate() {
            let prompt = tok.encode(&prob.prompt).unwrap();
            let mut g = Generation::new(
                prompt.clone(),
                8,
                SamplingParams {
                    temperature: 1.0,
                    max_new_tokens: 8,
                    stop_tokens: stop.clone(),
                    seed: (step * 100 + i) as u64,
                    ..Default::default()
                },
            );
            g.run(&p, 0);
            let seqs: Vec<Sequence> = g
                .into_responses()
                .into_iter()
                .map(|r| {
                    let reward = task.score(prob, &completion(&tok, &r.tokens, &stop));
                    total += reward as f64;
                    Sequence {
                        prompt: prompt.clone(),
                        response: r.tokens,
                        behavior_logprobs: r.logprobs,
                        versions: r.versions,
                        reward,
                        ..Default::default()
                    }
                })
                .collect();
            groups.push(TrainGroup {
                group_id: format!("{i}"),
                sequences: seqs,
                sequence_number: 0,
            });
        }
        rewards.push(total / 128.0);
        let r = t.step(&groups).unwrap();
        eprintln!(
            "step {step}: reward {:.3} entropy {:.3} ratio_std {:.2e} gn {:.3}",
            total / 128.0,
            r.metrics["entropy"],
            r.metrics["ratio_std"],
            r.metrics["grad_norm"]
        );
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&rewards[..10]), mean(&rewards[50..]));
    assert!(
        last > first,
        "reward did not rise: first ten steps {first:.3}, last ten {last:.3}"
    );
}
