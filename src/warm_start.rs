//! The supervised warm start: `[model]` trained on `[task]` per `[sft]`,
//! written as a HF directory. `bapo sft` runs it alone; `bapo run` and
//! `bapo study` run it first.

use std::path::{Path, PathBuf};

use anyhow::Context;
use bapo_learner::sft::{SftStep, sft};
use bapo_policy::{evaluate::evaluate, hf};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::common;
use crate::config_file::ConfigFile;

#[derive(Debug, Clone, Serialize)]
pub struct SftSummary {
    /// Steps run: `[sft] steps`, or fewer when the target accuracy was met.
    pub steps: u64,
    /// The last check's greedy accuracy on training problems (with
    /// `[sft] target_accuracy`).
    pub train_accuracy: Option<f64>,
    /// Every check on the way, so a warm start that stopped at the step
    /// cap shows how far from its target it was and whether it was still
    /// climbing.
    pub checks: Vec<SftCheck>,
    pub final_nll: f64,
    pub accuracy_before: f64,
    pub accuracy_after: f64,
    pub seconds: f64,
    pub out: PathBuf,
}

/// One greedy accuracy check of `[sft] check_every`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SftCheck {
    pub step: u64,
    pub train_accuracy: f64,
}

/// Trains `[model]` on `[task]` per `[sft]` and writes the result to `out`.
pub fn warm_start(
    cfg: &ConfigFile,
    out: &Path,
    eval_problems: usize,
    quiet: bool,
) -> anyhow::Result<SftSummary> {
    let t0 = std::time::Instant::now();
    let device = cfg.model.burn_device()?;
    let (policy, tokenizer) = cfg.model.load(&device)?;
    let task = common::task(&cfg.task, &tokenizer)?;
    let stop = tokenizer.stop_ids(&cfg.actor.stop)?;
    let problems = task.eval_problems(eval_problems);
    let max_new = cfg.learner.eval_max_new_tokens;
    let before = evaluate(&policy, &tokenizer, &*task, &problems, max_new, &stop, None);
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cfg.sft.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("sft {bar:30} {pos}/{len} [{elapsed}<{eta}] {wide_msg}")
            .expect("valid template"),
    );
    let mut last = SftStep::default();
    let mut train_accuracy = None;
    let mut checks = Vec::new();
    let policy = sft(policy, &tokenizer, &*task, stop[0], &cfg.sft, |s| {
        bar.set_position(s.step);
        train_accuracy = s.accuracy.or(train_accuracy);
        if let Some(a) = s.accuracy {
            checks.push(SftCheck {
                step: s.step,
                train_accuracy: a,
            });
        }
        let acc = train_accuracy.map_or(String::new(), |a| format!("  train acc {a:.2}"));
        bar.set_message(format!(
            "nll {:.3}{acc}  {:.0} tok/s",
            s.nll, s.tokens_per_s
        ));
        if quiet && (s.step % 50 == 0 || s.accuracy.is_some()) {
            tracing::info!(
                step = s.step,
                nll = s.nll,
                train_accuracy = s.accuracy,
                "sft"
            );
        }
        last = s;
    })?;
    bar.finish_and_clear();
    let after = evaluate(&policy, &tokenizer, &*task, &problems, max_new, &stop, None);
    hf::save(&policy, out).with_context(|| format!("writing {}", out.display()))?;
    tokenizer.save(&out.join("tokenizer.json"))?;
    Ok(SftSummary {
        steps: last.step,
        train_accuracy,
        checks,
        final_nll: last.nll,
        accuracy_before: before.greedy_accuracy,
        accuracy_after: after.greedy_accuracy,
        seconds: t0.elapsed().as_secs_f64(),
        out: out.to_path_buf(),
    })
}
