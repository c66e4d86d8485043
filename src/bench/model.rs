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
    /// Skip the PyTorch reference.
    #[arg(long)]
    pub no_torch: bool,
    /// Python with torch (`scripts/install-bench-deps.sh --torch`).
    #[arg(long, env = "BAPO_TORCH_PYTHON")]
    pub torch_python: Option<PathBuf>,
}

/// A framework the model is measured against: its name, the Python that
/// has it, and the script (in `scripts/`) that prints its JSON figures.
struct Reference {
    name: &'static str,
    python: PathBuf,
    script: &'static str,
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

/// The Python of a reference: the flag's, else its venv under
/// `~/.cache/bapo/<venv>` when scripts/install-bench-deps.sh made one.
fn reference_python(flag: &Option<PathBuf>, venv: &str) -> Option<PathBuf> {
    if let Some(p) = flag {
        return Some(p.clone());
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(format!(".cache/bapo/{venv}/bin/python"));
    p.exists().then_some(p)
}

/// The references this run compares with, saying which are skipped.
fn references(a: &ModelBenchArgs) -> Vec<Reference> {
    let wanted = [
        (
            !a.no_jax,
            "jax",
            &a.jax_python,
            "jax",
            "bench_model_jax.py",
            "",
        ),
        (
            !a.no_torch,
            "torch",
            &a.torch_python,
            "torch",
            "bench_model_torch.py",
            " --torch",
        ),
    ];
    let mut out = Vec::new();
    for (on, name, flag, venv, script, install) in wanted {
        match (on, reference_python(flag, venv)) {
            (false, _) => {}
            (true, Some(python)) => out.push(Reference {
                name,
                python,
                script,
            }),
            (true, None) => println!(
                "{name} reference skipped: no ~/.cache/bapo/{venv} (run scripts/install-bench-deps.sh{install})"
            ),
        }
    }
    out
}

fn run_reference(r: &Reference, c: &ModelConfig, a: &ModelBenchArgs) -> anyhow::Result<Value> {
    let cfg = c.to_hf_json();
    // `cargo run` sets it at run time; prefer that over the compile-time
    // path, which is stale when a shared target dir served another checkout.
    let script = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("scripts")
        .join(r.script);
    let out = Command::new(&r.python)
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
        .with_context(|| format!("running {}", r.python.display()))?;
    if !out.status.success() {
        bail!(
            "{} reference failed: {}",
            r.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line)
        .with_context(|| format!("reading the {} reference's output {line:?}", r.name))
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
    let refs = references(&a);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "bapo bench model: CPU ({threads} threads), training batch {}x{} tokens, generation prompt {} + {} new tokens at temperature 1",
        a.batch, a.seq, a.prompt, a.new_tokens
    );
    let sgemm = sgemm_gflops();
    println!(
        "machine: 1024^3 f32 matmul in Burn flex {sgemm:.1} GFLOP/s; \"% peak\" is against the best 1024^3 matmul of flex and the references on this machine"
    );
    for name in a.configs.split(',') {
        bench_preset(name, &a, &gen_batches, &refs, sgemm)?;
    }
    Ok(())
}

/// One preset measured in Burn and in each reference, printed as a table
/// against the machine's practical peak.
fn bench_preset(
    name: &str,
    a: &ModelBenchArgs,
    gen_batches: &[usize],
    refs: &[Reference],
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
    let got: Vec<(&str, Value)> = refs
        .iter()
        .map(|r| Ok((r.name, run_reference(r, &c, a)?)))
        .collect::<anyhow::Result<_>>()?;
    let mut header = format!("{:<28} {:>12} {:>10}", "", "burn tok/s", "GFLOP/s");
    for (n, _) in &got {
        header += &format!(" {:>12} {:>10}", format!("{n} tok/s"), format!("burn/{n}"));
    }
    println!("{header} {:>10}", "% peak");
    // The practical peak: the fastest of the 1024³ matmuls.
    let peak = got
        .iter()
        .filter_map(|(_, j)| j["sgemm_gflops"].as_f64())
        .fold(sgemm, f64::max);
    let row = |what: &str, tok: f64, gf: f64, path: &dyn Fn(&Value) -> Option<f64>| {
        let mut line = format!("{what:<28} {tok:>12.0} {gf:>10.1}");
        for (_, j) in &got {
            line += &match path(j) {
                Some(r) => format!(" {r:>12.0} {:>10}", format!("{:.2}x", tok / r)),
                None => format!(" {:>12} {:>10}", "-", "-"),
            };
        }
        println!("{line} {:>9.0}%", 100.0 * gf / peak);
    };
    row(
        "train step (fwd+bwd+AdamW)",
        m.train_tok_s,
        m.train_gflops,
        &|j| j["train"]["tokens_per_s"].as_f64(),
    );
    for (b, tok, gf) in &m.generation {
        let key = b.to_string();
        row(&format!("generate, batch {b}, cached"), *tok, *gf, &|j| {
            j["generate"][&key]["tokens_per_s"].as_f64()
        });
    }
    for (n, j) in &got {
        println!(
            "({n} {}: sgemm {:.1} GFLOP/s; first train step {:.1} s)",
            j[*n].as_str().unwrap_or("?"),
            j["sgemm_gflops"].as_f64().unwrap_or(0.0),
            j["train"]["first_step_s"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}
