//! The options of one local run: a config file (or the built-in one), the
//! command line's overrides of its values, and how to run it. Resolving
//! them checks the config and makes the numbers several services read one.

use std::path::PathBuf;

use crate::{common::DeviceArgs, config_file::ConfigFile};

/// `--lora`'s learning rate over full fine-tuning's: LoRA's best rate was
/// about 10x full fine-tuning's across models in "LoRA Without Regret"
/// (Schulman et al., 2025).
pub const LORA_LR_FACTOR: f64 = 10.0;

/// Overrides of the config file (`None` keeps the file's value) and how to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The config file (default: the built-in configs/tiny-arith.toml).
    pub config: Option<PathBuf>,
    pub actors: Option<usize>,
    pub steps: Option<u64>,
    pub algo: Option<String>,
    pub max_staleness: Option<u64>,
    /// Run directory (default runs/<unix time>).
    pub out: Option<PathBuf>,
    /// Start RL from this HF model directory (skips the warm start).
    pub init: Option<PathBuf>,
    pub task: Option<String>,
    pub data: Option<PathBuf>,
    /// Supervised warm-start steps (0 skips it).
    pub sft_steps: Option<u64>,
    /// Seed of the model, task and sampling.
    pub seed: Option<u64>,
    /// No progress bar: log lines only.
    pub quiet: bool,
    /// Train LoRA adapters (`--lora`).
    pub lora: bool,
    /// `--engine`: what generates the rollouts.
    pub engine: Option<bapo_actor::EngineKind>,
    /// `--device`, `--precision`: every process's `[model]` device and dtype.
    pub device: DeviceArgs,
}

impl RunOptions {
    /// The config this run uses.
    pub fn resolve(&self) -> anyhow::Result<ConfigFile> {
        let mut c = ConfigFile::load_or_builtin(self.config.as_deref())?;
        if let Some(n) = self.actors {
            c.run.actors = n;
        }
        if let Some(s) = self.steps {
            c.learner.steps = s;
        }
        if let Some(a) = &self.algo {
            c.learner.algo = a.clone();
        }
        if let Some(s) = self.max_staleness {
            c.buffer.max_staleness = s;
        }
        if let Some(t) = &self.task {
            c.task.name = t.clone();
        }
        if let Some(d) = &self.data {
            c.task.path = Some(d.clone());
        }
        if let Some(s) = self.sft_steps {
            c.sft.steps = s;
            c.run.sft = s > 0;
        }
        if let Some(s) = self.seed {
            c.model.seed = s;
            c.learner.seed = s;
            c.actor.sampling.seed = s;
        }
        if self.lora && c.learner.lora.is_none() {
            c.learner.lora = Some(Default::default());
            c.learner.lr *= LORA_LR_FACTOR;
        }
        if let Some(e) = self.engine {
            c.actor.engine = e;
        }
        self.device.apply(&mut c.model);
        if let Some(o) = &self.out {
            c.run.out = Some(o.clone());
        }
        anyhow::ensure!(
            c.learner.steps > 0,
            "bapo run needs learner.steps > 0 (or --steps)"
        );
        anyhow::ensure!(c.run.actors > 0, "bapo run needs at least one actor");
        if self.task.is_some() {
            tool_task(&mut c);
        }
        // One number each, wherever it is read.
        c.buffer.batch_groups = c.learner.batch_groups;
        c.buffer.group_size = c.actor.group_size as u32;
        c.learner.temperature = c.actor.sampling.temperature;
        c.actor.vllm.lora_rank = c.learner.lora.as_ref().map_or(0, |l| l.rank);
        c.learner.validate()?;
        c.buffer.validate()?;
        c.actor.validate()?;
        Ok(c)
    }
}

/// `--task arith-tool`: episodes with the built-in calculator unless the
/// config names another environment, turns (sampled and evaluated) long
/// enough for a call. (A config file that names the task itself is taken
/// as written: without `[actor.env]`, single answers, the tool-less
/// control of docs/notes/2026-11-26-tool-use.md.)
fn tool_task(c: &mut ConfigFile) {
    if c.task.name != "arith-tool" {
        return;
    }
    if !c.actor.env.enabled() {
        tracing::info!(
            "task arith-tool: episodes with the built-in calculator ([actor.env] kind = \"builtin\")"
        );
        c.actor.env.kind = bapo_actor::env::EnvKind::Builtin;
    }
    let need = bapo_tasks::tool::call_tokens(c.task.difficulty);
    for (name, v) in [
        (
            "actor.sampling.max_new_tokens",
            &mut c.actor.sampling.max_new_tokens,
        ),
        (
            "learner.eval_max_new_tokens",
            &mut c.learner.eval_max_new_tokens,
        ),
    ] {
        if *v < need {
            tracing::info!(
                "task arith-tool: {name} {} -> {need}, the length of a call",
                *v
            );
            *v = need;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bapo run --task arith-tool` on the built-in config plays episodes
    /// with the calculator, turns long enough to call it.
    #[test]
    fn a_tool_task_gets_the_calculator_and_room_for_a_call() {
        let opts = RunOptions {
            task: Some("arith-tool".into()),
            ..Default::default()
        };
        let c = opts.resolve().unwrap();
        assert_eq!(c.actor.env.kind, bapo_actor::env::EnvKind::Builtin);
        let need = bapo_tasks::tool::call_tokens(c.task.difficulty);
        assert!(c.actor.sampling.max_new_tokens >= need);
        assert!(c.learner.eval_max_new_tokens >= need);
        let plain = RunOptions::default().resolve().unwrap();
        assert!(!plain.actor.env.enabled(), "arith keeps single answers");
    }

    /// `--engine vllm` puts the built-in run's actors on vLLM, whose
    /// members then play at once; the config's own engine otherwise.
    #[test]
    fn the_engine_flag_picks_what_generates() {
        use bapo_actor::{EngineKind, env::episode::Members};
        let on = |engine| {
            RunOptions {
                task: Some("arith-tool".into()),
                engine,
                ..Default::default()
            }
            .resolve()
            .unwrap()
        };
        let vllm = on(Some(EngineKind::Vllm));
        assert_eq!(vllm.actor.engine, EngineKind::Vllm);
        assert_eq!(vllm.actor.members(), Members::AtOnce);
        let burn = on(None);
        assert_eq!(burn.actor.engine, EngineKind::Burn);
        assert_eq!(burn.actor.members(), Members::InTurn);
    }
}
