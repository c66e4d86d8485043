//! Supervised warm-up: next-token cross-entropy on a task's worked
//! solutions (`prompt → solution <eos>`, loss on the solution and the stop
//! token only), so RL starts from a partly competent policy.

use std::time::Instant;

use anyhow::Context;
use bapo_policy::{
    Policy,
    burn::{
        module::Module,
        optim::{AdamWConfig, GradientsParams},
        prelude::*,
    },
    evaluate::evaluate,
    logprob::next_token_logprobs,
    rope::Rope,
    tokenizer::TextTokenizer,
};
use bapo_tasks::{Problem, Task};
use serde::{Deserialize, Serialize};

use crate::{
    grads::clip_global_norm,
    schedule::{Decay, LrSchedule},
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub steps: u64,
    /// Sequences per step.
    pub batch: usize,
    pub lr: f64,
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    /// First training-problem index; RL draws its own at random.
    pub first_problem: u64,
    /// Stop once greedy accuracy on `check_problems` training problems
    /// reaches this (0 never stops early). How fast a seed learns varies a
    /// lot, so a fixed step count lands the warm start anywhere between
    /// "barely competent" and "nothing left for RL"; a target lands every
    /// seed at the same competence. `steps` stays the cap and still sets
    /// the learning-rate schedule.
    pub target_accuracy: f64,
    /// Steps between two accuracy checks.
    pub check_every: u64,
    /// Training problems (indices 0..n, never held out) a check decodes.
    pub check_problems: usize,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            steps: 300,
            batch: 64,
            lr: 3e-3,
            warmup_steps: 20,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            first_problem: 1 << 40,
            target_accuracy: 0.0,
            check_every: 100,
            check_problems: 200,
        }
    }
}

impl SftConfig {
    /// Names the first field that cannot work.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.batch > 0, "[sft] batch must be positive");
        anyhow::ensure!(
            self.lr.is_finite() && self.lr > 0.0,
            "[sft] lr must be a positive number, got {}",
            self.lr
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.target_accuracy),
            "[sft] target_accuracy must be in 0..=1, got {}",
            self.target_accuracy
        );
        if self.target_accuracy > 0.0 {
            anyhow::ensure!(
                self.check_every > 0,
                "[sft] check_every must be positive when target_accuracy is set"
            );
            anyhow::ensure!(
                self.check_problems > 0,
                "[sft] check_problems must be positive when target_accuracy is set"
            );
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SftStep {
    pub step: u64,
    /// Mean negative log-likelihood per supervised token.
    pub nll: f64,
    pub tokens_per_s: f64,
    /// Greedy accuracy on the check problems, on the steps that check.
    pub accuracy: Option<f64>,
}

/// Trains `policy` on `task`'s solutions; `on_step` sees every step. Stops
/// after `cfg.steps`, or at the first check that meets `cfg.target_accuracy`.
pub fn sft(
    policy: Policy,
    tokenizer: &TextTokenizer,
    task: &dyn Task,
    stop: u32,
    cfg: &SftConfig,
    mut on_step: impl FnMut(SftStep),
) -> anyhow::Result<Policy> {
    let plain = policy.device();
    let device = plain.clone().autodiff();
    let config = policy.config.clone();
    let rope = Rope::new(
        config.head_dim(),
        config.rope_theta(),
        config.max_position_embeddings,
        &device,
    );
    let mut model = policy.model.to_device(&device).train();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(cfg.weight_decay as f32)
        .init();
    let schedule = LrSchedule {
        lr: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        decay: Decay::Cosine,
        decay_steps: cfg.steps.saturating_sub(cfg.warmup_steps),
        min_lr_ratio: 0.1,
    };
    cfg.validate()?;
    let check = if cfg.target_accuracy > 0.0 {
        Some(Check::new(task, tokenizer, cfg.check_problems)?)
    } else {
        None
    };
    let mut next = cfg.first_problem;
    for step in 0..cfg.steps {
        let t0 = Instant::now();
        let rows = next_rows(
            task,
            tokenizer,
            stop,
            cfg.batch,
            config.max_position_embeddings,
            &mut next,
        )?;
        let t = rows
            .iter()
            .map(|(p, a)| p.len() + a.len())
            .max()
            .unwrap_or(2);
        let (tokens, w) = supervised_batch(&rows, t, &device);
        let logits = model.forward(tokens.clone(), &rope, None);
        let nll = next_token_logprobs(logits, tokens, 1.0).mul(w).sum().neg();
        let nll_value = nll.clone().into_scalar::<f32>() as f64;
        let mut grads = GradientsParams::from_grads(nll.backward(), &model);
        clip_global_norm(&model, &mut grads, cfg.max_grad_norm);
        model = optim.step(schedule.at(step), model, grads);
        let tokens_per_s = (rows.len() * t) as f64 / t0.elapsed().as_secs_f64();
        let accuracy = check
            .as_ref()
            .filter(|_| (step + 1) % cfg.check_every == 0)
            .map(|c| {
                let p = Policy::with_model(config.clone(), model.valid(), &plain);
                c.accuracy(&p, tokenizer, task, stop)
            });
        on_step(SftStep {
            step: step + 1,
            nll: nll_value,
            tokens_per_s,
            accuracy,
        });
        if accuracy.is_some_and(|a| a >= cfg.target_accuracy) {
            break;
        }
    }
    Ok(Policy::with_model(config, model.valid(), &plain))
}

/// The next `batch` worked solutions from problem `*next` on, tokenized,
/// the answer ending in `stop`; an empty prompt or one too long for the
/// model is skipped.
fn next_rows(
    task: &dyn Task,
    tokenizer: &TextTokenizer,
    stop: u32,
    batch: usize,
    max_len: usize,
    next: &mut u64,
) -> anyhow::Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let mut rows = Vec::with_capacity(batch);
    while rows.len() < batch {
        let p = task.train_problem(*next);
        *next += 1;
        let prompt = tokenizer.encode(&p.prompt)?;
        let mut answer = tokenizer.encode(&p.solution)?;
        answer.push(stop);
        if prompt.is_empty() || prompt.len() + answer.len() > max_len {
            continue;
        }
        rows.push((prompt, answer));
    }
    Ok(rows)
}

/// `rows` padded to `t` tokens, and the weight of each next-token
/// log-prob: `1/n` on the `n` answer tokens of the batch, 0 on prompts
/// and padding (a token mean of the answers' NLL).
fn supervised_batch(
    rows: &[(Vec<u32>, Vec<u32>)],
    t: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2>) {
    let mut ids = Vec::with_capacity(rows.len() * t);
    let mut weights = vec![0.0f32; rows.len() * (t - 1)];
    let n_sup: usize = rows.iter().map(|(_, a)| a.len()).sum();
    for (i, (p, a)) in rows.iter().enumerate() {
        let start = i * t;
        ids.extend(p.iter().chain(a).map(|&x| x as i64));
        ids.resize(start + t, 0);
        for j in 0..a.len() {
            weights[i * (t - 1) + p.len() - 1 + j] = 1.0 / n_sup as f32;
        }
    }
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows.len(), t]), device);
    let w = Tensor::<2>::from_data(TensorData::new(weights, [rows.len(), t - 1]), device);
    (tokens, w)
}

/// The fixed training problems the early stop decodes, and how long their
/// answers can be (so the check needs no generation setting of its own).
struct Check {
    problems: Vec<Problem>,
    max_new_tokens: usize,
}

impl Check {
    fn new(task: &dyn Task, tokenizer: &TextTokenizer, n: usize) -> anyhow::Result<Self> {
        let problems: Vec<Problem> = (0..n as u64).map(|i| task.train_problem(i)).collect();
        let mut longest = 0;
        for p in &problems {
            let len = tokenizer
                .encode(&p.solution)
                .with_context(|| format!("encoding the solution of {}", p.id))?
                .len();
            longest = longest.max(len);
        }
        Ok(Self {
            problems,
            max_new_tokens: longest + 1,
        })
    }

    fn accuracy(&self, policy: &Policy, tok: &TextTokenizer, task: &dyn Task, stop: u32) -> f64 {
        evaluate(
            policy,
            tok,
            task,
            &self.problems,
            self.max_new_tokens,
            &[stop],
            None,
        )
        .greedy_accuracy
    }
}
