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
    }
    Ok(())
}
