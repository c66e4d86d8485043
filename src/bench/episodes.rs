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
    let device = Device::flex();
    let (policy, tokenizer) = match &args.init {
        Some(dir) => {
            let (p, _) = ModelSpec::from_dir(dir.clone()).load(&device)?;
            (p, TextTokenizer::from_file(&dir.join("tokenizer.json"))?)
        }
        None => {
            let c = ModelConfig::preset("tiny")?;
            (Policy::init(c, &device), TextTokenizer::char_level())
        }
    };
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
    let t0 = Instant::now();
    let mut single_tokens = 0;
    for (i, p) in problems.iter().enumerate() {
        let prompt = tokenizer.encode(&p.prompt)?;
        let mut g = Generation::new(prompt, args.group_size, params(i as u64));
        g.run(&policy, 0);
        single_tokens += g
            .into_responses()
            .iter()
            .map(|r| r.tokens.len())
            .sum::<usize>();
    }
    let single_s = t0.elapsed().as_secs_f64();

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
        let (mut tokens, mut turns, mut episodes) = (0, 0, 0);
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
                    tokens += ep.tokens.len() - ep.observation_tokens;
                    turns += ep.turns as usize;
                    episodes += 1;
                }
            }
        }
        (tokens, turns, episodes, t0.elapsed().as_secs_f64())
    };
    let in_turn = play(Members::InTurn);
    let at_once = play(Members::AtOnce);
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
    for (name, (tokens, turns, episodes, secs)) in [
        ("in turn", in_turn),
        ("at once (parallel_members)", at_once),
    ] {
        println!(
            "episodes, members {name}: {tokens} model tokens in {episodes} episodes ({:.2} turns \
             each) in {secs:.2} s = {:.0} tokens/s ({:.2}x the reference's rate)",
            turns as f64 / episodes.max(1) as f64,
            rate(tokens, secs),
            rate(tokens, secs) / reference
        );
    }
    Ok(())
}
