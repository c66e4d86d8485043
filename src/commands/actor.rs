//! `bapo actor`: generate scored groups with the learner's weights.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use bapo_actor::{ActorOptions, UpdateMode};
use clap::Args;

use crate::common;
use bapo_proto::tls::Role;

use crate::{config_file::ConfigFile, security::TlsArgs, telemetry};

#[derive(Debug, Args, Default)]
pub struct ActorArgs {
    /// TOML config file (its `[actor]`, `[model]`, `[task]` tables).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub buffer: String,
    #[arg(long, default_value = "http://127.0.0.1:50052")]
    pub learner: String,
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Default: host name and process id.
    #[arg(long)]
    pub actor_id: Option<String>,
    #[arg(long)]
    pub concurrency: Option<usize>,
    #[arg(long, value_enum)]
    pub mode: Option<UpdateMode>,
    /// Tokenizer (default: from `[model]`).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

pub async fn run(args: ActorArgs) -> anyhow::Result<()> {
    let mut cfg = ConfigFile::load(args.config.as_deref())?;
    if let Some(c) = args.concurrency {
        cfg.actor.concurrency = c;
    }
    if let Some(m) = args.mode {
        cfg.actor.mode = m;
    }
    let device = args.device.resolve(&mut cfg.model)?;
    if let Some(t) = &args.tokenizer {
        cfg.model.tokenizer = Some(t.clone());
    }
    if let Some(addr) = args.metrics_listen {
        telemetry::serve_metrics(addr)?;
    }
    let security = args.tls.resolve(&cfg.tls)?;
    // One client setting for both services: a non-loopback one needs TLS.
    let tls = security.client(&args.buffer, Role::Actor)?;
    security.client(&args.learner, Role::Actor)?;
    let tokenizer = Arc::new(cfg.model.tokenizer()?);
    let task = common::task(&cfg.task, &tokenizer)?;
    let actor_id = args.actor_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let chat = common::chat(&cfg.task, &tokenizer)?;
    let summary = bapo_actor::run(
        cfg.actor,
        task,
        tokenizer,
        ActorOptions {
            buffer: args.buffer,
            learner: args.learner,
            actor_id,
            device,
            precision: cfg.model.precision,
            tls,
            reward: cfg.reward,
            model_dir: cfg.model.hf_dir.clone(),
            chat,
        },
        telemetry::shutdown_signal(),
    )
    .await?;
    println!(
        "{}",
        serde_json::json!({"groups": summary.groups, "tokens": summary.tokens})
    );
    Ok(())
}
