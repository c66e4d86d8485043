//! `bapo learner`: train from the buffer and broadcast weights.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context;
use bapo_learner::{
    Trainer,
    broadcast::WeightHub,
    checkpoint::{self, Provenance},
    run::{EvalFn, RunOptions},
    server,
    tracking::samples::DecodeFn,
};
use bapo_policy::{Policy, burn::prelude::Device, tokenizer::TextTokenizer};
use clap::Args;
use tokio::sync::watch;

use crate::common;
use bapo_proto::tls::Role;

use crate::{config_file::ConfigFile, security::TlsArgs, telemetry};

#[derive(Debug, Args)]
pub struct LearnerArgs {
    /// TOML config file (its `[learner]`, `[model]`, `[task]` tables).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// The buffer service.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub buffer: String,
    /// gRPC address of the weight stream.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Prometheus /metrics listen address.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Run directory: checkpoints/, metrics.jsonl, final/.
    #[arg(long, default_value = "bapo-learner")]
    pub out: PathBuf,
    /// Continue from the newest checkpoint in --out, if there is one.
    #[arg(long)]
    pub resume: bool,
    /// Start from this HF model directory instead of `[model]`.
    #[arg(long)]
    pub init: Option<PathBuf>,
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long)]
    pub algo: Option<String>,
    /// Export the final weights in HF format to --out/final.
    #[arg(long)]
    pub export_final: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

pub async fn run(args: LearnerArgs) -> anyhow::Result<()> {
    let mut cfg = ConfigFile::load(args.config.as_deref())?;
    if let Some(s) = args.steps {
        cfg.learner.steps = s;
    }
    if let Some(a) = &args.algo {
        cfg.learner.algo = a.clone();
    }
    if let Some(dir) = &args.init {
        cfg.model = cfg.model.at_dir(dir.clone());
    }
    cfg.learner.validate()?;
    if let Some(addr) = args.metrics_listen {
        telemetry::serve_metrics(addr)?;
    }
    // One certificate both ways: served to actors, presented to the buffer.
    let security = args.tls.resolve(&cfg.tls)?;
    let server_security = security.server(args.listen)?;
    let buffer_tls = security.client(&args.buffer, Role::Learner)?;
    let device = args.device.resolve(&mut cfg.model)?;
    let (policy, tokenizer) = cfg.model.load(&device)?;
    let (trainer, provenance) = start_trainer(&args, &cfg, policy, &device)?;
    std::fs::create_dir_all(&args.out)?;
    tokenizer
        .save(&args.out.join("tokenizer.json"))
        .context("saving the tokenizer next to the checkpoints")?;
    let eval = eval_hook(&cfg, &tokenizer)?;

    let hub = WeightHub::new().with_deltas(cfg.learner.broadcast_deltas);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the learner's gRPC address {}", args.listen))?;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let server = tokio::spawn(server::serve_with(
        hub.clone(),
        listener,
        server_security,
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    ));
    let summary = bapo_learner::run::run(
        trainer,
        hub.clone(),
        RunOptions {
            buffer: args.buffer.clone(),
            tls: buffer_tls,
            out: args.out.clone(),
            provenance,
            eval,
            decode: Some(decoder(&tokenizer)),
            params: serde_json::to_value(&cfg)?,
            export_final: args.export_final,
        },
        telemetry::shutdown_signal(),
    )
    .await;
    hub.close();
    let _ = stop_tx.send(true);
    let _ = server.await;
    let summary = summary?;
    if args.export_final {
        tokenizer.save(&args.out.join("final").join("tokenizer.json"))?;
    }
    println!(
        "{}",
        serde_json::json!({
            "steps": summary.steps,
            "version": summary.version,
            "wall_s": summary.wall_s,
            "idle_s": summary.idle_s,
            "last_eval_accuracy": summary.last_eval,
        })
    );
    Ok(())
}

/// The trainer and what its weights descend from: the newest checkpoint in
/// `--out` with `--resume` (when there is one), else fresh from `policy`.
fn start_trainer(
    args: &LearnerArgs,
    cfg: &ConfigFile,
    policy: Policy,
    device: &Device,
) -> anyhow::Result<(Trainer, Provenance)> {
    let ckpt_dir = args.out.join("checkpoints");
    let latest = args
        .resume
        .then(|| checkpoint::latest(&ckpt_dir))
        .transpose()?
        .flatten();
    let Some(dir) = latest else {
        return Ok((
            Trainer::new(cfg.learner.clone(), policy, 0)?,
            Provenance::default(),
        ));
    };
    check_base(&dir, &policy)?;
    let (mut t, state) = checkpoint::load(&dir, cfg.learner.clone(), device)
        .with_context(|| format!("resuming from {}", dir.display()))?;
    t.set_precision(cfg.model.precision);
    tracing::info!(
        step = state.step,
        version = state.policy_version,
        "resumed from {}",
        dir.display()
    );
    Ok((t, state.provenance))
}

/// A LoRA checkpoint resumes only on the base it was trained on: the one
/// the learner's `[model]` names now.
fn check_base(dir: &std::path::Path, policy: &Policy) -> anyhow::Result<()> {
    let state = checkpoint::read_state(dir)?;
    let Some(lora) = state.lora else {
        return Ok(());
    };
    let here = format!("{:016x}", bapo_policy::lora::fingerprint(&policy.model));
    anyhow::ensure!(
        here == lora.base_fingerprint,
        "resuming from {}: its LoRA adapters were trained on base {}, but [model] now loads \
         base {here}",
        dir.display(),
        lora.base_fingerprint
    );
    Ok(())
}

/// The periodic held-out evaluation, when `[learner] eval_every` asks for one.
/// The tokenizer as the decoder of the rollouts a person reads.
fn decoder(tokenizer: &TextTokenizer) -> DecodeFn {
    let t = tokenizer.clone();
    std::sync::Arc::new(move |ids: &[u32]| {
        t.decode(ids)
            .unwrap_or_else(|e| format!("<undecodable: {e}>"))
    })
}

fn eval_hook(cfg: &ConfigFile, tokenizer: &TextTokenizer) -> anyhow::Result<Option<EvalFn>> {
    // Checked even without an evaluation: a config whose stop tokens the
    // tokenizer lacks is wrong either way.
    let stop = tokenizer.stop_ids(&cfg.actor.stop)?;
    if cfg.learner.eval_every == 0 {
        return Ok(None);
    }
    let task = common::task(&cfg.task, tokenizer)?;
    let scorer = common::Scorer::new(
        cfg,
        task.clone(),
        tokenizer,
        stop,
        cfg.learner.eval_max_new_tokens,
    )?;
    Ok(Some(common::eval_hook(
        &*task,
        scorer,
        cfg.learner.eval_problems,
    )))
}

#[cfg(test)]
mod tests {
    use bapo_learner::{LearnerConfig, Trainer, checkpoint};
    use bapo_policy::{Policy, lora::LoraConfig, testing::tiny_policy};

    use super::check_base;

    /// A LoRA checkpoint resumes only under a `[model]` that loads its
    /// base; a full fine-tuning checkpoint is not checked.
    #[test]
    fn a_lora_checkpoint_resumes_only_on_its_base() {
        let base = tiny_policy(31);
        let copy = || Policy::with_model(base.config.clone(), base.model.clone(), &base.device());
        let cfg = LearnerConfig {
            lora: Some(LoraConfig {
                rank: 4,
                ..Default::default()
            }),
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let t = Trainer::new(cfg, copy(), 0).unwrap();
        let saved = checkpoint::save(dir.path(), &t, &Default::default()).unwrap();
        check_base(&saved, &copy()).unwrap();
        let e = check_base(&saved, &tiny_policy(32))
            .unwrap_err()
            .to_string();
        assert!(e.contains("trained on base"), "{e}");
        let full = Trainer::new(LearnerConfig::default(), copy(), 0).unwrap();
        let other = tempfile::tempdir().unwrap();
        let saved = checkpoint::save(other.path(), &full, &Default::default()).unwrap();
        check_base(&saved, &tiny_policy(32)).unwrap();
    }
}
