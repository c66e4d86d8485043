//! The supervised warm start's early stop, on a task the tiny model learns
//! in a few dozen steps: every answer is `7`.

use bapo_learner::sft::{SftConfig, SftStep, sft};
use bapo_policy::{ModelSpec, Policy, burn::prelude::*, tokenizer::TextTokenizer};
use bapo_tasks::{Problem, Task};

struct Sevens;

impl Task for Sevens {
    fn name(&self) -> &str {
        "sevens"
    }

    fn train_problem(&self, index: u64) -> Problem {
        Problem {
            id: index.to_string(),
            prompt: format!("{}+0=", index % 50),
            answer: "7".into(),
            solution: "7".into(),
        }
    }

    fn eval_problems(&self, _n: usize) -> Vec<Problem> {
        Vec::new()
    }

    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        f32::from(u8::from(completion == problem.answer))
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }
}

fn tiny() -> (Policy, TextTokenizer) {
    let device = Device::flex();
    device.seed(0);
    ModelSpec::default().load(&device).expect("tiny preset")
}

fn train(cfg: &SftConfig) -> anyhow::Result<Vec<SftStep>> {
    let (policy, tok) = tiny();
    let stop = tok.token_id("<eos>").expect("<eos>");
    let mut steps = Vec::new();
    sft(policy, &tok, &Sevens, stop, cfg, |s| steps.push(s))?;
    Ok(steps)
}

#[test]
fn stops_at_the_first_check_that_meets_the_target() {
    let cfg = SftConfig {
        steps: 400,
        batch: 16,
        warmup_steps: 5,
        target_accuracy: 1.0,
        check_every: 10,
        check_problems: 20,
        ..Default::default()
    };
    let steps = train(&cfg).unwrap();
    let last = steps.last().expect("at least one step");
    assert!(last.step < 400, "never met the target: {last:?}");
    assert_eq!(last.accuracy, Some(1.0), "{last:?}");
    // Checked on every 10th step only, and below target before the last.
    for s in &steps[..steps.len() - 1] {
        assert_eq!(s.accuracy.is_some(), s.step % 10 == 0, "{s:?}");
        assert!(s.accuracy.is_none_or(|a| a < 1.0), "{s:?}");
    }
}

#[test]
fn without_a_target_it_runs_every_step_and_never_checks() {
    let cfg = SftConfig {
        steps: 30,
        batch: 8,
        ..Default::default()
    };
    let steps = train(&cfg).unwrap();
    assert_eq!(steps.len(), 30);
    assert!(steps.iter().all(|s| s.accuracy.is_none()));
}

#[test]
fn a_target_outside_zero_to_one_is_named() {
    for bad in [1.5, -0.1, f64::NAN] {
        let cfg = SftConfig {
            target_accuracy: bad,
            ..Default::default()
        };
        let err = train(&cfg).unwrap_err().to_string();
        assert!(err.contains("target_accuracy"), "{err}");
    }
    let cfg = SftConfig {
        target_accuracy: 0.5,
        check_every: 0,
        ..Default::default()
    };
    let err = train(&cfg).unwrap_err().to_string();
    assert!(err.contains("check_every"), "{err}");
}
