//! `bapo bench weights`: what one weight broadcast costs, f32 beside bf16
//! (`[learner] broadcast_dtype`), measured in the same run on the same
//! weights: the payload bytes every subscriber is sent per update, the
//! learner's encode time (burnpack, bf16 rounding, CRC32) and an actor's
//! decode time (CRC32 check, burnpack, widening back to f32, load into a
//! fresh model). The gRPC transfer itself is not included: it is the
//! bytes, times the subscribers, over the link's rate.

use std::time::Instant;

use bapo_policy::{
    ModelConfig,
    burn::prelude::*,
    model::Transformer,
    weights::{self, Encoding},
};
use clap::Args;

#[derive(Debug, Args)]
pub struct WeightsBenchArgs {
    /// Models to measure: preset names or paths to an HF `config.json`.
    #[arg(long, default_value = "tiny,small")]
    pub configs: String,
    /// Timed repetitions of each encode and decode (the median is shown).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

pub(crate) fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|n| n.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

struct Measured {
    payload_bytes: usize,
    encode_s: f64,
    decode_s: f64,
}

/// Encodes `model` in `encoding` and decodes it into a fresh model,
/// `reps` times each after one untimed round.
fn measure(
    c: &ModelConfig,
    model: &Transformer,
    encoding: Encoding,
    reps: usize,
) -> anyhow::Result<Measured> {
    let device = Device::flex();
    let encode = || -> anyhow::Result<_> {
        let (header, payload) = weights::encode_as(model, 1, encoding)?;
        Ok((header.to_bytes_as(encoding), payload))
    };
    let (wire, payload) = encode()?;
    let mut encode_s = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let out = encode()?;
        encode_s.push(t.elapsed().as_secs_f64());
        drop(out);
    }
    let mut decode_s = Vec::new();
    for _ in 0..reps + 1 {
        // What an actor holds once the chunks are in: the header and the
        // assembled payload.
        let received = payload.to_vec();
        let t = Instant::now();
        let (header, announced) = weights::WeightsHeader::read(&wire)?;
        let loaded =
            weights::decode_as(&header, announced, received, Transformer::init(c, &device))?;
        // The weights are on the device and usable.
        let _ = loaded.norm.gamma.val().into_data();
        decode_s.push(t.elapsed().as_secs_f64());
    }
    decode_s.remove(0);
    Ok(Measured {
        payload_bytes: payload.len(),
        encode_s: super::median(encode_s),
        decode_s: super::median(decode_s),
    })
}

pub fn run(a: WeightsBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.reps > 0, "--reps must be at least 1");
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "bapo bench weights: {} ({threads} threads), Burn flex; one update as the learner publishes it and an actor loads it; median of {} runs",
        cpu_name(),
        a.reps
    );
    for name in a.configs.split(',') {
        let c = super::model_config(name)?;
        let n = c.num_params();
        println!(
            "\n== {}: {:.2} M parameters, d_model {}, {} layers, vocab {} ==",
            name.trim(),
            n as f64 / 1e6,
            c.hidden_size,
            c.num_hidden_layers,
            c.vocab_size
        );
        let device = Device::flex();
        device.seed(0);
        let model = Transformer::init(&c, &device);
        println!(
            "{:<6} {:>14} {:>11} {:>11} {:>11} {:>13} {:>13}",
            "dtype",
            "payload bytes",
            "bytes/param",
            "encode ms",
            "decode ms",
            "encode MB/s",
            "decode MB/s"
        );
        let mut f32_row = None;
        for encoding in Encoding::ALL {
            let m = measure(&c, &model, encoding, a.reps)?;
            let mb = m.payload_bytes as f64 / 1e6;
            println!(
                "{:<6} {:>14} {:>11.3} {:>11.1} {:>11.1} {:>13.0} {:>13.0}",
                encoding.name(),
                m.payload_bytes,
                m.payload_bytes as f64 / n as f64,
                m.encode_s * 1e3,
                m.decode_s * 1e3,
                mb / m.encode_s,
                mb / m.decode_s
            );
            match &f32_row {
                None => f32_row = Some(m),
                Some(f) => println!(
                    "bf16/f32: {:.3} of the bytes, {:.2}x the encode time, {:.2}x the decode time",
                    m.payload_bytes as f64 / f.payload_bytes as f64,
                    m.encode_s / f.encode_s,
                    m.decode_s / f.decode_s
                ),
            }
        }
        for lr in [1e-6, 3e-5] {
            deltas(&c, &model, lr, a.reps)?;
        }
    }
    Ok(())
}

/// Deltas of real optimiser steps (BAPO on the tiny task's kind of
/// batch: 4 groups of 4 responses, half rewarded) at `lr`, from `model`:
/// per step, the words whose bits changed and the delta's bytes beside
/// the full payload's, in bf16 and f32, with the time to make and apply
/// one (`bapo_policy::delta`).
fn deltas(c: &ModelConfig, model: &Transformer, lr: f64, steps: usize) -> anyhow::Result<()> {
    use bapo_learner::{LearnerConfig, Trainer};
    let device = Device::flex();
    let policy = bapo_policy::Policy::with_model(c.clone(), model.clone(), &device);
    let cfg = LearnerConfig {
        lr,
        batch_groups: 4,
        ..LearnerConfig::default()
    };
    let mut trainer = Trainer::new(cfg, policy, 0)?;
    let mut prev: Vec<(Encoding, Vec<u8>)> = Encoding::ALL
        .iter()
        .map(|&e| Ok((e, weights::encode_as(trainer.model(), 0, e)?.1.to_vec())))
        .collect::<anyhow::Result<_>>()?;
    for step in 1..=steps.max(1) {
        let groups = batch(&trainer.policy(), step as u32);
        trainer.step(&groups)?;
        for (encoding, old) in &mut prev {
            let (_, payload) = weights::encode_as(trainer.model(), step as u64, *encoding)?;
            let word = encoding.word_bytes();
            let t = Instant::now();
            let d = bapo_policy::delta::diff(old, &payload, word)?;
            let diff_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let rebuilt = bapo_policy::delta::apply(old, &d)?;
            let apply_s = t.elapsed().as_secs_f64();
            anyhow::ensure!(rebuilt[..] == payload[..], "a delta rebuilt other weights");
            let changed = bapo_policy::delta::changed_words(&d).unwrap_or(0);
            println!(
                "delta, lr {lr:e}, step {step}, {:<4}: {:.4} of the words changed, {} bytes = {:.4} of the full {} ({:.1} ms to make, {:.1} ms to apply)",
                encoding.name(),
                changed as f64 / (payload.len() / word) as f64,
                d.len(),
                d.len() as f64 / payload.len() as f64,
                payload.len(),
                diff_s * 1e3,
                apply_s * 1e3
            );
            *old = payload.to_vec();
        }
    }
    Ok(())
}

/// A batch as the learner samples it: 4 groups of 4 random 8-token
/// responses with the policy's own log-probs, two of each group rewarded.
pub(crate) fn batch(policy: &bapo_policy::Policy, seed: u32) -> Vec<bapo_learner::TrainGroup> {
    use bapo_learner::rollouts::Sequence;
    let vocab = policy.config.vocab_size as u32;
    let device = policy.device();
    (0..4u32)
        .map(|g| {
            let prompt = vec![1, 2 + (seed + g) % 7, 3];
            let sequences = (0..4u32)
                .map(|i| {
                    let response: Vec<u32> = (0..8u32)
                        .map(|j| (seed * 7919 + g * 131 + i * 17 + j * 31) % vocab)
                        .collect();
                    let row: Vec<u32> = prompt.iter().chain(&response).copied().collect();
                    let (lp, _) =
                        policy.token_logprobs(bapo_policy::Policy::tokens(&[row], &device), 1.0);
                    let lp: Vec<f32> = lp
                        .into_data()
                        .convert::<f32>()
                        .try_into_vec::<f32>()
                        .unwrap_or_default();
                    Sequence {
                        prompt: prompt.clone(),
                        behavior_logprobs: lp[prompt.len() - 1..].to_vec(),
                        versions: vec![0; response.len()],
                        response,
                        reward: (i % 2) as f32,
                        ..Sequence::default()
                    }
                })
                .collect();
            bapo_learner::TrainGroup {
                group_id: format!("g{seed}-{g}"),
                sequence_number: u64::from(seed * 4 + g),
                sequences,
            }
        })
        .collect()
}
