//! `bapo bench episodes`: what multi-turn rollouts cost an actor. Groups
//! of K episodes against the built-in calculator, their members played in
//! turn (the Burn engine's default) and at once (`parallel_members`), beside the
//! reference, the same prompts as single-turn groups of K responses
//! generated together, on the same model, sampling and turn cap: tokens/s
//! of each and their ratio. With a warm start that calls the calculator (`--init`), the
//! episodes have several turns; a fresh model mostly answers at once.

use std::{path::PathBuf, sync::Arc, time::Instant};

use bapo_actor::env::{
    EnvConfig, EnvKind, ResetInput,
    episode::{EpisodeEnd, Members},
    evaluate::PolicyModel,
    setup,
};
use bapo_policy::{
    Generation, ModelConfig, ModelSpec, Policy, SamplingParams, burn::prelude::*,
    tokenizer::TextTokenizer,
};
use bapo_tasks::{ArithTool, Task};
use clap::Args;

#[derive(Debug, Args)]
pub struct EpisodesBenchArgs {
    /// A warm start (HF directory) to generate with; default a fresh tiny
    /// model.
    #[arg(long)]
    pub init: Option<PathBuf>,
    #[arg(long, default_value_t = 8)]
    pub group_size: usize,
    /// Groups timed in each mode.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    /// Tokens per turn (and per single-turn response).
    #[arg(long, default_value_t = 24)]
    pub max_new_tokens: usize,
}

pub fn run(args: EpisodesBenchArgs) -> anyhow::Result<()> {
    let (policy, tokenizer) = load(&args)?;
    let task: Arc<dyn Task> = Arc::new(ArithTool::new(0, 2)?);
    let stop = vec![
        tokenizer
            .token_id("<eos>")
            .ok_or_else(|| anyhow::anyhow!("the tokenizer has no <eos>"))?,
    ];
    let params = |seed| SamplingParams {
        temperature: 1.0,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: stop.clone(),
        seed,
        ..Default::default()
    };
    let problems: Vec<_> = (0..args.groups as u64)
        .map(|i| task.train_problem(i))
        .collect();

    // Reference: K responses to each prompt, generated together.
    let reference = single_turn(&policy, &tokenizer, &problems, args.group_size, params)?;

    // Episodes: the calculator answering between a member's turns.
    let cfg = EnvConfig {
        kind: EnvKind::Builtin,
        max_episode_tokens: 96,
        max_observation_tokens: 32,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let tok = Arc::new(tokenizer.clone());
    let env = rt
        .block_on(setup(&cfg, args.max_new_tokens, task.clone(), tok, None))?
        .ok_or_else(|| anyhow::anyhow!("no environment"))?;
    let runner = env.runner(&tokenizer, &stop, rt.handle());
    let play = |how: Members| {
        let t0 = Instant::now();
        let mut played = Played::default();
        for (i, p) in problems.iter().enumerate() {
            let members = (0..args.group_size)
                .map(|m| {
                    let seed = (i * args.group_size + m) as u64;
                    let model = PolicyModel {
                        policy: &policy,
                        params: params(seed),
                    };
                    let input = ResetInput {
                        task: task.name(),
                        problem: p,
                        seed,
                    };
                    (input, model)
                })
                .collect();
            for end in runner.run_group(members, how) {
                if let EpisodeEnd::Done(ep) = end {
                    played.tokens += ep.tokens.len() - ep.observation_tokens;
                    played.turns += ep.turns as usize;
                    played.episodes += 1;
                }
            }
        }
        played.seconds = t0.elapsed().as_secs_f64();
        played
    };
    let in_turn = play(Members::InTurn);
    let at_once = play(Members::AtOnce);
    report(
        &args,
        reference,
        [
            ("in turn", in_turn),
            ("at once (parallel_members)", at_once),
        ],
    );
    Ok(())
}

/// Tokens and seconds of `k` single responses to each problem, each
/// group generated together: the reference rate.
fn single_turn(
    policy: &Policy,
    tokenizer: &TextTokenizer,
    problems: &[bapo_tasks::Problem],
    k: usize,
    params: impl Fn(u64) -> SamplingParams,
) -> anyhow::Result<(usize, f64)> {
    let t0 = Instant::now();
    let mut tokens = 0;
    for (i, p) in problems.iter().enumerate() {
        let prompt = tokenizer.encode(&p.prompt)?;
        let mut g = Generation::new(prompt, k, params(i as u64));
        g.run(policy, 0);
        tokens += g
            .into_responses()
            .iter()
            .map(|r| r.tokens.len())
            .sum::<usize>();
    }
    Ok((tokens, t0.elapsed().as_secs_f64()))
}

/// The model of `--init`, or a fresh tiny one with the char tokenizer.
fn load(args: &EpisodesBenchArgs) -> anyhow::Result<(Policy, TextTokenizer)> {
    let device = Device::flex();
    Ok(match &args.init {
        Some(dir) => {
            let (p, _) = ModelSpec::from_dir(dir.clone()).load(&device)?;
            (p, TextTokenizer::from_file(&dir.join("tokenizer.json"))?)
        }
        None => {
            let c = ModelConfig::preset("tiny")?;
            (Policy::init(c, &device), TextTokenizer::char_level())
        }
    })
}

/// One way of playing the groups: the model's tokens, turns, episodes
/// and the seconds they took.
#[derive(Debug, Default, Clone, Copy)]
struct Played {
    tokens: usize,
    turns: usize,
    episodes: usize,
    seconds: f64,
}

/// The machine, the setting, the reference's rate and each mode's beside it.
fn report(
    args: &EpisodesBenchArgs,
    (single_tokens, single_s): (usize, f64),
    modes: [(&str, Played); 2],
) {
    let rate = |tokens: usize, s: f64| tokens as f64 / s.max(1e-9);
    println!(
        "{} ({} groups of {}, {} tokens a turn, {})",
        super::weights::cpu_name(),
        args.groups,
        args.group_size,
        args.max_new_tokens,
        args.init
            .as_ref()
            .map_or("fresh tiny model".into(), |d| d.display().to_string())
    );
    println!(
        "single-turn groups (reference): {single_tokens} tokens in {single_s:.2} s = {:.0} tokens/s",
        rate(single_tokens, single_s)
    );
    let reference = rate(single_tokens, single_s);
    for (name, p) in modes {
        println!(
            "episodes, members {name}: {} model tokens in {} episodes ({:.2} turns \
             each) in {:.2} s = {:.0} tokens/s ({:.2}x the reference's rate)",
            p.tokens,
            p.episodes,
            p.turns as f64 / p.episodes.max(1) as f64,
            p.seconds,
            rate(p.tokens, p.seconds),
            rate(p.tokens, p.seconds) / reference
        );
    }
}
