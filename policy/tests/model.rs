//! The model's own consistency: cached decoding equals full recomputation,
//! a chunked prefill after cached positions equals one pass, the learner's
//! log-probs equal the actor's, and gradients flow.

use bapo_policy::{
    Generation, ModelConfig, Policy, SamplingParams, burn::prelude::*, cache::KvCache,
};

fn tiny() -> ModelConfig {
    ModelConfig::from_toml_str(
        r#"
        model_type = "qwen2"
        vocab_size = 97
        hidden_size = 48
        intermediate_size = 96
        num_hidden_layers = 2
        num_attention_heads = 4
        num_key_value_heads = 2
        tie_word_embeddings = true
        max_position_embeddings = 64
        "#,
    )
    .unwrap()
}

fn max_abs_diff(a: Tensor<3>, b: Tensor<3>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

#[test]
fn cached_decoding_equals_full_recomputation() {
    let device = Device::flex();
    let policy = Policy::init(tiny(), &device);
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 12,
        ..Default::default()
    };
    let prompt = vec![3, 14, 15, 92, 65];
    let mut cached = Generation::new(prompt.clone(), 2, params.clone());
    cached.run(&policy, 0);
    let mut full = Generation::new(prompt, 2, params);
    while !full.is_done() {
        full.invalidate_cache();
        full.step(&policy, 0);
    }
    for (a, b) in cached.responses().iter().zip(full.responses()) {
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.tokens.len(), 12);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
}

#[test]
fn a_batch_of_prompts_decodes_as_each_prompt_alone() {
    let device = Device::flex();
    let policy = Policy::init(tiny(), &device);
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 10,
        stop_tokens: vec![7],
        ..Default::default()
    };
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|r| (0..6).map(|i| (r * 31 + i * 11 + 2) % 97).collect())
        .collect();
    let mut batch = Generation::batch(prompts.clone(), params.clone());
    batch.run(&policy, 0);
    let mut distinct = std::collections::HashSet::new();
    for (prompt, b) in prompts.into_iter().zip(batch.responses()) {
        let mut alone = Generation::new(prompt, 1, params.clone());
        alone.run(&policy, 0);
        let a = &alone.responses()[0];
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.finish, b.finish);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
        distinct.insert(b.tokens.clone());
    }
    // Rows really are different problems, not copies of the first.
    assert!(distinct.len() > 1);
}

#[test]
#[should_panic(expected = "one length")]
fn a_batch_refuses_prompts_of_different_lengths() {
    Generation::batch(vec![vec![1, 2], vec![3]], SamplingParams::default());
}

#[test]
fn a_chunked_prefill_after_cached_positions_equals_one_pass() {
    let device = Device::flex();
    let policy = Policy::init(tiny(), &device);
    let rows = vec![(0..9).map(|i| (i * 7 + 1) % 97).collect::<Vec<u32>>(); 2];
    let all = Policy::tokens(&rows, &device);
    let full = policy.model.forward(all.clone(), &policy.rope, None);
    let mut cache = KvCache::new(2);
    let first = policy
        .model
        .forward(all.clone().narrow(1, 0, 5), &policy.rope, Some(&mut cache));
    let rest = policy
        .model
        .forward(all.narrow(1, 5, 4), &policy.rope, Some(&mut cache));
    assert_eq!(cache.len(), 9);
    assert!(max_abs_diff(full.clone().narrow(1, 0, 5), first) < 1e-4);
    assert!(max_abs_diff(full.narrow(1, 5, 4), rest) < 1e-4);
}

#[test]
fn learner_log_probs_equal_the_actors_behaviour_log_probs() {
    let device = Device::flex();
    let policy = Policy::init(tiny(), &device);
    let prompt = vec![1, 2, 3, 4];
    for temperature in [1.0f32, 0.7] {
        let mut g = Generation::new(
            prompt.clone(),
            3,
            SamplingParams {
                temperature,
                max_new_tokens: 8,
                seed: 5,
                ..Default::default()
            },
        );
        g.run(&policy, 7);
        let rows: Vec<Vec<u32>> = g
            .responses()
            .iter()
            .map(|r| prompt.iter().chain(&r.tokens).copied().collect())
            .collect();
        let (lp, entropy) = policy.token_logprobs(Policy::tokens(&rows, &device), temperature);
        let lp: Vec<f32> = lp.into_data().try_into_vec().unwrap();
        let width = rows[0].len() - 1;
        for (i, r) in g.responses().iter().enumerate() {
            assert!(r.versions.iter().all(|&v| v == 7));
            for (k, behav) in r.logprobs.iter().enumerate() {
                let learner = lp[i * width + prompt.len() - 1 + k];
                assert!((learner - behav).abs() < 1e-4, "{learner} vs {behav}");
            }
        }
        let h: Vec<f32> = entropy.into_data().try_into_vec().unwrap();
        let ln_v = (97f32).ln();
        assert!(h.iter().all(|&x| x > 0.0 && x <= ln_v + 1e-4), "{h:?}");
    }
}

#[test]
fn a_paused_generation_continues_with_new_weights_and_records_both_versions() {
    let device = Device::flex();
    let old = Policy::init(tiny(), &device);
    let new = Policy::init(tiny(), &device);
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 6,
        ..Default::default()
    };
    let mut g = Generation::new(vec![5, 6, 7], 1, params);
    for _ in 0..3 {
        g.step(&old, 1);
    }
    g.invalidate_cache();
    g.run(&new, 2);
    let r = &g.responses()[0];
    assert_eq!(r.versions, [1, 1, 1, 2, 2, 2]);
    // The tokens of version 2 carry the new weights' log-probs.
    let rows = vec![
        [5, 6, 7]
            .iter()
            .chain(&r.tokens)
            .copied()
            .collect::<Vec<u32>>(),
    ];
    let (lp, _) = new.token_logprobs(Policy::tokens(&rows, &device), 1.0);
    let lp: Vec<f32> = lp.into_data().try_into_vec().unwrap();
    for k in 3..6 {
        assert!((lp[2 + k] - r.logprobs[k]).abs() < 1e-4);
    }
}

#[test]
fn gradients_flow_to_every_layer() {
    let device = Device::flex().autodiff();
    let policy = Policy::init(tiny(), &device);
    let tokens = Policy::tokens(&[vec![1, 2, 3, 4, 5, 6]], &device);
    let (lp, _) = policy.token_logprobs(tokens, 1.0);
    let grads = lp.sum().backward();
    for layer in &policy.model.layers {
        let g = layer
            .self_attn
            .q_proj
            .weight
            .val()
            .grad(&grads)
            .expect("q_proj has a gradient");
        assert!(g.abs().sum().into_scalar::<f32>() > 0.0);
    }
    assert!(
        policy
            .model
            .embed_tokens
            .weight
            .val()
            .grad(&grads)
            .is_some()
    );
}
