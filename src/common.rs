//! What several commands share: the device, stop tokens, the evaluation
//! hook and the loading of a model from a directory of any kind.

use bapo_learner::record::Metric;
use std::{path::Path, sync::Arc};

use anyhow::Context;
use bapo_learner::{checkpoint, run::EvalFn};
use bapo_policy::{
    ComputeDevice, ModelSpec, Policy, Precision, burn::prelude::*, chat::ChatTask,
    evaluate::evaluate, tokenizer::TextTokenizer,
};
use bapo_tasks::{PromptFormat, Split, Task, TaskSpec};

/// `--device` and `--precision`, the command line's say over `[model]
/// device` and `[model] precision`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DeviceArgs {
    /// Backend of the model: cpu, wgpu or cuda (default: `[model] device`,
    /// else cpu).
    #[arg(long)]
    pub device: Option<ComputeDevice>,
    /// Compute dtype: f32, bf16 or f16; weights and optimiser stay f32
    /// (default: `[model] precision`, else f32).
    #[arg(long)]
    pub precision: Option<Precision>,
}

impl DeviceArgs {
    /// Applies the flags to `spec` and gives its Burn device, refused by
    /// name when this binary lacks the backend or the backend the dtype.
    pub fn resolve(&self, spec: &mut ModelSpec) -> anyhow::Result<Device> {
        self.apply(spec);
        let device = spec.burn_device()?;
        log_device(spec);
        Ok(device)
    }

    pub fn apply(&self, spec: &mut ModelSpec) {
        if let Some(d) = self.device {
            spec.device = d;
        }
        if let Some(p) = self.precision {
            spec.precision = p;
        }
    }
}

/// One line in the service's log: where and in what dtype the model runs.
/// On wgpu the line names the adapter and graphics API wgpu chose.
pub fn log_device(spec: &ModelSpec) {
    let adapter = spec.device.adapter();
    tracing::info!(
        device = %spec.device,
        precision = %spec.precision,
        adapter = adapter.as_deref().unwrap_or("-"),
        "model on {} in {}{}",
        spec.device,
        spec.precision,
        adapter
            .as_ref()
            .map(|a| format!(", adapter {a}"))
            .unwrap_or_default()
    );
}

/// The task `spec` names, its prompts in `tokenizer`'s chat format when
/// `prompt_format = "chat"` (refused by name when the tokenizer has no
/// chat template).
pub fn task(spec: &TaskSpec, tokenizer: &TextTokenizer) -> anyhow::Result<Arc<dyn Task>> {
    let task: Arc<dyn Task> = Arc::from(
        bapo_tasks::build(spec).with_context(|| format!("building task {:?}", spec.name))?,
    );
    if spec.prompt_format == PromptFormat::Raw {
        return Ok(task);
    }
    let template = tokenizer.chat_template()?.with_context(|| {
        format!(
            "task.prompt_format = \"chat\" but the tokenizer {} has no chat_template \
             (in a tokenizer_config.json beside it)",
            tokenizer.path()
        )
    })?;
    Ok(Arc::new(ChatTask::new(
        task,
        template,
        spec.system_prompt.clone(),
    )?))
}

/// The chat template and system prompt a task's prompts are rendered
/// with (`prompt_format = "chat"`); `None` for raw prompts.
pub fn chat(
    spec: &TaskSpec,
    tokenizer: &TextTokenizer,
) -> anyhow::Result<Option<(bapo_policy::chat::ChatTemplate, Option<String>)>> {
    if spec.prompt_format == PromptFormat::Raw {
        return Ok(None);
    }
    Ok(tokenizer
        .chat_template()?
        .map(|t| (t, spec.system_prompt.clone())))
}

/// How a policy is scored on held-out problems: one response each, or,
/// with `[actor.env]` on, one episode each in that environment (a tool
/// task's accuracy then counts what the model does with its tool).
pub enum Scorer {
    Single {
        task: Arc<dyn Task>,
        tokenizer: Box<TextTokenizer>,
        stop: Vec<u32>,
        max_new_tokens: usize,
    },
    Episodes(Box<bapo_actor::env::evaluate::EpisodeEval>),
}

impl Scorer {
    /// The scorer of `cfg`'s task, turns (or responses) of at most
    /// `max_new_tokens`.
    pub fn new(
        cfg: &crate::config_file::ConfigFile,
        task: Arc<dyn Task>,
        tokenizer: &TextTokenizer,
        stop: Vec<u32>,
        max_new_tokens: usize,
    ) -> anyhow::Result<Self> {
        let episodes = bapo_actor::env::evaluate::EpisodeEval::new(
            &cfg.actor.env,
            max_new_tokens,
            task.clone(),
            Arc::new(tokenizer.clone()),
            chat(&cfg.task, tokenizer)?,
            stop.clone(),
        )?;
        Ok(match episodes {
            Some(e) => Self::Episodes(Box::new(e)),
            None => Self::Single {
                task,
                tokenizer: Box::new(tokenizer.clone()),
                stop,
                max_new_tokens,
            },
        })
    }

    pub fn evaluate(
        &self,
        policy: &Policy,
        problems: &[bapo_tasks::Problem],
        pass: Option<bapo_policy::evaluate::PassAtK>,
    ) -> bapo_policy::evaluate::EvalResult {
        match self {
            Self::Single {
                task,
                tokenizer,
                stop,
                max_new_tokens,
            } => evaluate(
                policy,
                tokenizer,
                &**task,
                problems,
                *max_new_tokens,
                stop,
                pass,
            ),
            Self::Episodes(e) => e.evaluate(policy, problems, pass),
        }
    }
}

/// Greedy accuracy on the validation half, as the learner's periodic
/// evaluation.
pub fn eval_hook(task: &dyn Task, scorer: Scorer, problems: usize) -> EvalFn {
    // In-run evaluation reads the validation half: the test half is kept
    // for the one number reported at the end.
    let problems = Split::Validation.problems(task, problems);
    Arc::new(move |p: &Policy| {
        let r = scorer.evaluate(p, &problems, None);
        vec![
            (Metric::EvalAccuracy.into(), r.greedy_accuracy),
            ("eval_reward".to_string(), r.mean_reward),
        ]
    })
}

/// A model from `dir`: a learner checkpoint (`state.json`), a run
/// directory (its `final/` or newest checkpoint), or a HF directory.
pub fn load_model_dir(dir: &Path, device: &Device) -> anyhow::Result<(Policy, TextTokenizer)> {
    if dir.join(checkpoint::STATE_FILE).exists() {
        let (policy, _) = checkpoint::load_policy(dir, device)?;
        // The learner saves its tokenizer in the run directory, two levels
        // up from `checkpoints/step-N`; without one, the built-in one.
        let spec = ModelSpec {
            tokenizer: dir
                .parent()
                .and_then(Path::parent)
                .map(|r| r.join("tokenizer.json"))
                .filter(|p| p.exists()),
            ..ModelSpec::default()
        };
        let tokenizer = spec.tokenizer()?;
        return Ok((policy, tokenizer));
    }
    if dir.join("config.json").exists() {
        return Ok(ModelSpec::from_dir(dir.to_path_buf()).load(device)?);
    }
    if dir.join("final").join("config.json").exists() {
        return load_model_dir(&dir.join("final"), device);
    }
    if let Some(latest) = checkpoint::latest(&dir.join("checkpoints"))? {
        return load_model_dir(&latest, device);
    }
    anyhow::bail!(
        "{} is neither a HF model directory, a learner checkpoint nor a run directory",
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_task_without_a_template_is_refused_at_start() {
        let spec = TaskSpec {
            prompt_format: PromptFormat::Chat,
            ..Default::default()
        };
        let e = task(&spec, &TextTokenizer::char_level()).err().unwrap();
        assert!(format!("{e:#}").contains("no chat_template"), "{e:#}");
        assert!(task(&TaskSpec::default(), &TextTokenizer::char_level()).is_ok());
    }
}
