//! `bapo bench model`: the policy's two hot paths on the CPU backend, the
//! training step (forward, next-token log-probs, backward, AdamW) and cached
//! group generation, for the built-in tiny preset and the ~25M `small`
//! one; beside the identical architecture and shapes in JAX with jit
//! (`scripts/bench_model_jax.py`, installed by
//! `scripts/install-bench-deps.sh`).

use std::{path::PathBuf, process::Command, time::Instant};

use anyhow::{Context, bail};
use bapo_policy::{
    Generation, ModelConfig, Policy, SamplingParams,
    burn::{
        optim::{AdamWConfig, GradientsParams},
        prelude::*,
        tensor::Distribution,
    },
    logprob::next_token_logprobs,
    model::Transformer,
};
use clap::Args;
use serde_json::Value;

#[derive(Debug, Args)]
pub struct ModelBenchArgs {
    /// Presets to measure, or paths of HF `config.json` files.
    #[arg(long, default_value = "tiny,small")]
    pub configs: String,
    /// Training batch (sequences) and length (tokens).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Generation batch sizes.
    #[arg(long, default_value = "16,64")]
    pub gen_batches: String,
    #[arg(long, default_value_t = 16)]
    pub prompt: usize,
    #[arg(long, default_value_t = 112)]
    pub new_tokens: usize,
    /// Skip the JAX reference.
    #[arg(long)]
    pub no_jax: bool,
    /// Python with jax and optax (see scripts/install-bench-deps.sh).
    #[arg(long, env = "BAPO_JAX_PYTHON")]
    pub jax_python: Option<PathBuf>,
}

/// Matmul FLOPs per token of one forward pass, attention included, with
/// `ctx` keys per query.
fn forward_flops_per_token(c: &ModelConfig, ctx: f64) -> f64 {
    let (h, f, v) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.vocab_size as f64,
    );
    let q = (c.num_attention_heads * c.head_dim()) as f64;
    let kv = (c.kv_heads() * c.head_dim()) as f64;
    let per_layer = 2.0 * (h * q + 2.0 * h * kv + q * h + 3.0 * h * f) + 4.0 * ctx * q;
    c.num_hidden_layers as f64 * per_layer + 2.0 * h * v
}

struct Measured {
    train_tok_s: f64,
    train_gflops: f64,
    generation: Vec<(usize, f64, f64)>,
}

fn measure_burn(
    c: &ModelConfig,
    a: &ModelBenchArgs,
    gen_batches: &[usize],
) -> anyhow::Result<Measured> {
    // Training step on the autodiff device.
    let device = Device::flex().autodiff();
    let mut model = Transformer::init(c, &device);
    let rope = bapo_policy::rope::Rope::new(c.head_dim(), c.rope_theta(), a.seq, &device);
    let mut optim = AdamWConfig::new().init();
    let ids: Vec<u32> = (0..a.batch * a.seq)
        .map(|i| (i * 7919 % c.vocab_size) as u32)
        .collect();
    let rows: Vec<Vec<u32>> = ids.chunks(a.seq).map(<[u32]>::to_vec).collect();
    let tokens = Policy::tokens(&rows, &device);
    let mut step = |model: Transformer| {
        let logits = model.forward(tokens.clone(), &rope, None);
        let loss = next_token_logprobs(logits, tokens.clone(), 1.0)
            .mean()
            .neg();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optim.step(1e-4, model, grads);
        // Read one weight back: the step has really run.
        let _ = model.norm.gamma.val().into_data();
        model
    };
    for _ in 0..a.warmup {
        model = step(model);
    }
    let t0 = Instant::now();
    for _ in 0..a.steps {
        model = step(model);
    }
    let per_step = t0.elapsed().as_secs_f64() / a.steps as f64;
    let train_tok_s = (a.batch * a.seq) as f64 / per_step;
    let train_gflops = 3.0 * forward_flops_per_token(c, a.seq as f64) * train_tok_s / 1e9;

    // Generation on the plain device.
    let plain = Device::flex();
    let policy = Policy::with_model(c.clone(), model.valid(), &plain);
    let mut generation = Vec::new();
    for &b in gen_batches {
        let run = || {
            let mut g = Generation::new(
                vec![1; a.prompt],
                b,
                SamplingParams {
                    temperature: 1.0,
                    max_new_tokens: a.new_tokens,
                    seed: 1,
                    ..Default::default()
                },
            );
            g.run(&policy, 0);
        };
        run();
        let t0 = Instant::now();
        run();
        let tok_s = (b * a.new_tokens) as f64 / t0.elapsed().as_secs_f64();
        let ctx = a.prompt as f64 + a.new_tokens as f64 / 2.0;
        generation.push((b, tok_s, forward_flops_per_token(c, ctx) * tok_s / 1e9));
    }
    Ok(Measured {
        train_tok_s,
        train_gflops,
        generation,
    })
}

fn sgemm_gflops() -> f64 {
    let device = Device::flex();
    let n = 1024;
    let x = Tensor::<2>::random([n, n], Distribution::Default, &device);
    let _ = x.clone().matmul(x.clone()).into_data();
    let reps = 10;
    let t0 = Instant::now();
    for _ in 0..reps {
        let _ = x.clone().matmul(x.clone()).into_data();
    }
    2.0 * (n as f64).powi(3) * reps as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn jax_python(a: &ModelBenchArgs) -> Option<PathBuf> {
    if let Some(p) = &a.jax_python {
        return Some(p.clone());
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/bapo/jax/bin/python");
    p.exists().then_some(p)
}

fn run_jax(python: &PathBuf, c: &ModelConfig, a: &ModelBenchArgs) -> anyhow::Result<Value> {
    let cfg = c.to_hf_json();
    // `cargo run` sets it at run time; prefer that over the compile-time
    // path, which is stale when a shared target dir served another checkout.
    let script = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("scripts/bench_model_jax.py");
    let out = Command::new(python)
        .arg(&script)
        .args(["--config", &cfg.to_string()])
        .args(["--batch", &a.batch.to_string(), "--seq", &a.seq.to_string()])
        .args([
            "--steps",
            &a.steps.to_string(),
            "--warmup",
            &a.warmup.to_string(),
        ])
        .args([
            "--gen-batches",
            &a.gen_batches,
            "--prompt",
            &a.prompt.to_string(),
        ])
        .args(["--new-tokens", &a.new_tokens.to_string()])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "JAX reference failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line)
        .with_context(|| format!("reading the JAX reference's output {line:?}"))
}

pub fn run(a: ModelBenchArgs) -> anyhow::Result<()> {
    let gen_batches: Vec<usize> = a
        .gen_batches
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .with_context(|| format!("--gen-batches: {s:?}"))
        })
        .collect::<anyhow::Result<_>>()?;
    let python = if a.no_jax { None } else { jax_python(&a) };
    if !a.no_jax && python.is_none() {
        println!("JAX reference skipped: no ~/.cache/bapo/jax (run scripts/install-bench-deps.sh)");
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "bapo bench model: CPU ({threads} threads), training batch {}x{} tokens, generation prompt {} + {} new tokens at temperature 1",
        a.batch, a.seq, a.prompt, a.new_tokens
    );
    let sgemm = sgemm_gflops();
    println!(
        "machine: 1024^3 f32 matmul in Burn flex {sgemm:.1} GFLOP/s; \"% peak\" is against the best 1024^3 matmul of flex and XLA on this machine"
    );
    for name in a.configs.split(',') {
        bench_preset(name, &a, &gen_batches, python.as_ref(), sgemm)?;
    }
    Ok(())
}

/// One preset measured in Burn (and in JAX with `python`), printed as a
/// table against the machine's practical peak.
fn bench_preset(
    name: &str,
    a: &ModelBenchArgs,
    gen_batches: &[usize],
    python: Option<&PathBuf>,
    sgemm: f64,
) -> anyhow::Result<()> {
    let c = super::model_config(name)?;
    println!(
        "\n== {name}: {:.2} M parameters, d_model {}, {} layers, {}/{} heads, vocab {} ==",
        c.num_params() as f64 / 1e6,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.kv_heads(),
        c.vocab_size
    );
    let m = measure_burn(&c, a, gen_batches)?;
    let jax = match python {
        Some(p) => Some(run_jax(p, &c, a)?),
        None => None,
    };
    println!(
        "{:<28} {:>12} {:>10} {:>12} {:>10} {:>10}",
        "", "burn tok/s", "GFLOP/s", "jax tok/s", "burn/jax", "% peak"
    );
    // The practical peak: the faster of the two 1024³ matmuls.
    let peak = jax
        .as_ref()
        .and_then(|j| j["sgemm_gflops"].as_f64())
        .map_or(sgemm, |j| j.max(sgemm));
    let jtrain = jax
        .as_ref()
        .and_then(|j| j["train"]["tokens_per_s"].as_f64());
    let row = |what: &str, tok: f64, gf: f64, j: Option<f64>| {
        let (js, ratio) = match j {
            Some(j) => (format!("{j:.0}"), format!("{:.2}x", tok / j)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:<28} {:>12.0} {:>10.1} {:>12} {:>10} {:>9.0}%",
            what,
            tok,
            gf,
            js,
            ratio,
            100.0 * gf / peak
        );
    };
    row(
        "train step (fwd+bwd+AdamW)",
        m.train_tok_s,
        m.train_gflops,
        jtrain,
    );
    for (b, tok, gf) in &m.generation {
        let j = jax
            .as_ref()
            .and_then(|j| j["generate"][b.to_string()]["tokens_per_s"].as_f64());
        row(&format!("generate, batch {b}, cached"), *tok, *gf, j);
    }
    if let Some(j) = &jax {
        println!(
            "(jax {}: sgemm {:.1} GFLOP/s; first jitted train step {:.1} s)",
            j["jax"].as_str().unwrap_or("?"),
            j["sgemm_gflops"].as_f64().unwrap_or(0.0),
            j["train"]["first_step_s"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}
