//! The model's own consistency: cached decoding equals full recomputation,
//! a chunked prefill after cached positions equals one pass, the learner's
//! log-probs equal the actor's, and gradients flow; the first four again on
//! wgpu, where the same code runs as GPU kernels.

use bapo_policy::{
    Generation, ModelConfig, Policy, Precision, SamplingParams,
    burn::prelude::*,
    burn::tensor::DType,
    cache::KvCache,
    device::{wgpu_for_test, wgpu_for_test_in},
    packing::Segments,
    weights,
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
    cached_decoding_equals_full_recomputation_on(&Device::flex());
}

fn cached_decoding_equals_full_recomputation_on(device: &Device) {
    let device = device.clone();
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
    a_chunked_prefill_after_cached_positions_equals_one_pass_on(&Device::flex());
}

fn a_chunked_prefill_after_cached_positions_equals_one_pass_on(device: &Device) {
    let device = device.clone();
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
    learner_log_probs_equal_the_actors_behaviour_log_probs_on(&Device::flex());
}

fn learner_log_probs_equal_the_actors_behaviour_log_probs_on(device: &Device) {
    let device = device.clone();
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
    a_paused_generation_continues_with_new_weights_and_records_both_versions_on(&Device::flex());
}

fn a_paused_generation_continues_with_new_weights_and_records_both_versions_on(device: &Device) {
    let device = device.clone();
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

#[test]
fn packed_sequences_get_the_logits_they_get_alone() {
    packed_sequences_get_the_logits_they_get_alone_on(&Device::flex());
}

/// Three sequences packed into two rows (the second with padding after
/// its sequence): every sequence's logits equal its own forward pass.
fn packed_sequences_get_the_logits_they_get_alone_on(device: &Device) {
    let policy = Policy::init(tiny(), device);
    let seqs: [Vec<u32>; 3] = [
        (1..=9).collect(),
        vec![40, 41, 42, 43, 44],
        (50..=61).collect(),
    ];
    let width = 14;
    let mut rows = vec![seqs[0].clone(), seqs[2].clone()];
    rows[0].extend(&seqs[1]);
    rows.iter_mut().for_each(|r| r.resize(width, 0));
    let segments = Segments::of_lengths(&[vec![9, 5], vec![12]], width);
    let packed =
        policy
            .model
            .forward_packed(Policy::tokens(&rows, device), &policy.rope, &segments);
    for (seq, (row, col)) in seqs.iter().zip([(0, 0), (0, 9), (1, 0)]) {
        let alone = policy.model.forward(
            Policy::tokens(std::slice::from_ref(seq), device),
            &policy.rope,
            None,
        );
        let got = packed.clone().narrow(0, row, 1).narrow(1, col, seq.len());
        let diff = max_abs_diff(got, alone);
        assert!(diff < 1e-4, "sequence at row {row} column {col}: {diff}");
    }
}

/// The cache, prefill, log-prob and weight-swap properties on wgpu: device
/// buffers, `slice_assign` into the cache, the composed attention and
/// log-prob ops instead of the CPU kernels, and host reads of logits.
#[test]
fn the_generation_properties_hold_on_wgpu() {
    let Some(device) = wgpu_for_test("generation on wgpu") else {
        return;
    };
    device.seed(0);
    cached_decoding_equals_full_recomputation_on(&device);
    a_chunked_prefill_after_cached_positions_equals_one_pass_on(&device);
    learner_log_probs_equal_the_actors_behaviour_log_probs_on(&device);
    a_paused_generation_continues_with_new_weights_and_records_both_versions_on(&device);
    packed_sequences_get_the_logits_they_get_alone_on(&device);
}

/// Every weight matrix of `model` with its name: what the gradient
/// comparisons below walk.
fn named_weights(model: &bapo_policy::model::Transformer) -> Vec<(String, Tensor<2>)> {
    let mut out = vec![("embed_tokens".to_string(), model.embed_tokens.weight.val())];
    for (i, l) in model.layers.iter().enumerate() {
        let a = &l.self_attn;
        let m = &l.mlp;
        for (n, w) in [
            ("q_proj", &a.q_proj),
            ("k_proj", &a.k_proj),
            ("v_proj", &a.v_proj),
            ("o_proj", &a.o_proj),
            ("gate_proj", &m.gate_proj),
            ("up_proj", &m.up_proj),
            ("down_proj", &m.down_proj),
        ] {
            out.push((format!("layers.{i}.{n}"), w.weight.val()));
        }
    }
    out
}

/// The gradients of a learner-like objective (weighted log-probs plus an
/// entropy bonus) for every weight matrix, as host vectors.
fn objective_gradients(policy: &Policy, device: &Device) -> Vec<(String, Vec<f32>)> {
    let rows = vec![vec![1, 2, 3, 4, 5, 6, 7, 8], vec![9, 8, 7, 6, 5, 4, 3, 2]];
    let tokens = Policy::tokens(&rows, device);
    let (lp, entropy) = policy.token_logprobs(tokens, 0.8);
    let w: Vec<f32> = (0..14).map(|i| (i as f32 - 6.5) / 7.0).collect();
    let w = Tensor::<2>::from_data(TensorData::new(w, [2, 7]), device);
    let grads = (lp * w)
        .sum()
        .add(entropy.sum().mul_scalar(0.01))
        .backward();
    named_weights(&policy.model)
        .into_iter()
        .map(|(n, t)| {
            let g = t
                .grad(&grads)
                .unwrap_or_else(|| panic!("{n} has no gradient"));
            assert_eq!(g.dtype(), DType::F32, "{n}: the gradient of an f32 weight");
            (
                n,
                g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            )
        })
        .collect()
}

/// An independent copy of `p`'s weights on `device`, with parameters of
/// its own (as an actor receives them): a module clone moved with
/// `to_device` shares its parameters' identity with the original, and
/// after a backward through one of them the other's lookups find no
/// gradient.
fn copy_to(p: &Policy, device: &Device) -> Policy {
    let (header, payload) = weights::encode(&p.model, 0).unwrap();
    let fresh = bapo_policy::model::Transformer::init(&p.config, device);
    let model = weights::decode(&header, payload.to_vec(), fresh).unwrap();
    Policy::with_model(p.config.clone(), model, device)
}

/// The largest |a − b| of each pair relative to the largest |a| of that
/// weight's gradient.
fn worst_relative_gap(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (String, f32) {
    a.iter()
        .zip(b)
        .map(|((n, x), (_, y))| {
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
            let gap = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            (n.clone(), gap / scale)
        })
        .fold((String::new(), 0.0), |w, c| if c.1 > w.1 { c } else { w })
}

/// The same weights on the CPU and on wgpu give the same gradients (the
/// CPU's are the fused kernels' hand-written backward; wgpu's come from
/// Burn's autodiff of the composed ops): relative gap below 1e-3, the
/// scale of f32 summation-order differences over 2 layers.
#[test]
fn gradients_on_wgpu_match_the_cpu() {
    let Some(gpu) = wgpu_for_test("gradients on wgpu") else {
        return;
    };
    let cpu = Device::flex().autodiff();
    let gpu = gpu.autodiff();
    let start = Policy::init(tiny(), &Device::flex());
    let on_cpu = copy_to(&start, &cpu);
    let on_gpu = copy_to(&start, &gpu);
    let (name, gap) = worst_relative_gap(
        &objective_gradients(&on_cpu, &cpu),
        &objective_gradients(&on_gpu, &gpu),
    );
    eprintln!("wgpu vs cpu: worst relative gradient gap {gap:.2e} ({name})");
    assert!(gap < 1e-3, "{name}: relative gradient gap {gap}");
}

/// Mixed precision as the learner runs it: f32 master weights, the
/// forward and backward in bf16 or f16, log-probs in f32. The gradients
/// reach the f32 weights in f32 and stay close to the full-precision ones
/// (half precision's rounding is 2⁻⁸ / 2⁻¹¹ relative per op).
#[test]
fn half_precision_trains_f32_master_weights() {
    let cpu = Device::flex().autodiff();
    let start = Policy::init(tiny(), &Device::flex());
    let exact = objective_gradients(&copy_to(&start, &cpu), &cpu);
    let mut half = vec![(Precision::Bf16, 0.1, cpu.clone())];
    half.push((Precision::F16, 0.02, cpu.clone()));
    if let Some(gpu) = wgpu_for_test_in("f16 gradients on wgpu", Precision::F16) {
        half.push((Precision::F16, 0.02, gpu.autodiff()));
    }
    for (precision, tolerance, device) in half {
        let mut p = copy_to(&start, &device);
        p.model = p.model.with_precision(precision);
        let (name, gap) = worst_relative_gap(&exact, &objective_gradients(&p, &device));
        eprintln!("{precision} on {device:?}: worst relative gradient gap {gap:.2e} ({name})");
        assert!(gap < tolerance, "{precision}: {name} off by {gap} relative");
        assert_eq!(p.model.embed_tokens.weight.val().dtype(), DType::F32);
    }
}
