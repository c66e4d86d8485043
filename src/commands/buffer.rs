//! `bapo buffer`: run the buffer service.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context;
use bapo_buffer::{
    Buffer, BufferConfig,
    config::{FsyncPolicy, FullPolicy, SamplingMode},
};
use clap::{Args, ValueEnum};

use crate::{config_file::ConfigFile, security::TlsArgs, telemetry};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Sampling {
    Fifo,
    Uniform,
    Recency,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum WhenFull {
    Block,
    DropOldest,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Fsync {
    Always,
    Interval,
    Never,
}

/// Flags of `bapo buffer`; each overrides the `[buffer]` table of --config.
#[derive(Debug, Args, Default)]
pub struct BufferArgs {
    /// TOML config file (its `[buffer]` table).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// gRPC listen address.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Prometheus /metrics listen address.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Responses per prompt (K).
    #[arg(long)]
    pub group_size: Option<u32>,
    /// Members a timed-out group needs to be sampleable.
    #[arg(long)]
    pub min_group_size: Option<u32>,
    #[arg(long)]
    pub group_timeout_ms: Option<u64>,
    /// Groups per learner batch.
    #[arg(long)]
    pub batch_groups: Option<u32>,
    /// Maximum policy-version lag of trained data; 0 = synchronous.
    #[arg(long)]
    pub max_staleness: Option<u64>,
    #[arg(long)]
    pub capacity_groups: Option<u64>,
    #[arg(long)]
    pub capacity_bytes: Option<u64>,
    #[arg(long, value_enum)]
    pub when_full: Option<WhenFull>,
    #[arg(long, value_enum)]
    pub sampling: Option<Sampling>,
    #[arg(long)]
    pub max_reuse: Option<u32>,
    #[arg(long)]
    pub samples_per_insert: Option<f64>,
    /// Write-ahead log directory (enables durability).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[arg(long, value_enum)]
    pub fsync: Option<Fsync>,
    #[arg(long)]
    pub max_tokens: Option<usize>,
    #[arg(long)]
    pub max_rollout_bytes: Option<usize>,
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl BufferArgs {
    /// The file's `[buffer]` table with the flags laid over it.
    pub fn resolve(&self) -> anyhow::Result<BufferConfig> {
        let mut c = ConfigFile::load(self.config.as_deref())?.buffer;
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f.clone() { c.$f = v.into(); } )* };
        }
        set!(
            listen,
            group_size,
            min_group_size,
            group_timeout_ms,
            batch_groups,
            max_staleness,
            capacity_groups,
            capacity_bytes,
            max_reuse,
            samples_per_insert,
            max_tokens,
            max_rollout_bytes
        );
        if let Some(a) = self.metrics_listen {
            c.metrics_listen = Some(a);
        }
        if let Some(d) = &self.data_dir {
            c.data_dir = Some(d.clone());
        }
        if let Some(w) = self.when_full {
            c.when_full = match w {
                WhenFull::Block => FullPolicy::Block,
                WhenFull::DropOldest => FullPolicy::DropOldest,
            };
        }
        if let Some(s) = self.sampling {
            c.sampling = match s {
                Sampling::Fifo => SamplingMode::Fifo,
                Sampling::Uniform => SamplingMode::Uniform,
                Sampling::Recency => SamplingMode::Recency,
            };
        }
        if let Some(f) = self.fsync {
            c.fsync = match f {
                Fsync::Always => FsyncPolicy::Always,
                Fsync::Interval => FsyncPolicy::Interval,
                Fsync::Never => FsyncPolicy::Never,
            };
        }
        c.validate()?;
        Ok(c)
    }
}

pub async fn run(args: BufferArgs) -> anyhow::Result<()> {
    let cfg = args.resolve()?;
    if let Some(addr) = cfg.metrics_listen {
        telemetry::serve_metrics(addr)?;
    }
    let file = ConfigFile::load(args.config.as_deref())?;
    let security = args.tls.resolve(&file.tls)?.server(cfg.listen)?;
    bapo_buffer::metrics::describe();
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding the buffer's gRPC address {}", cfg.listen))?;
    let buffer = Buffer::open(cfg).context("opening the buffer")?;
    bapo_buffer::server::serve_with(buffer, listener, security, telemetry::shutdown_signal()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bapo.toml");
        std::fs::write(
            &path,
            "[buffer]\nmax_staleness = 7\ngroup_size = 4\nsampling = \"uniform\"\nmax_reuse = 2\n",
        )
        .unwrap();
        let args = BufferArgs {
            config: Some(path),
            max_staleness: Some(0),
            ..Default::default()
        };
        let c = args.resolve().unwrap();
        assert_eq!(c.max_staleness, 0);
        assert_eq!(c.group_size, 4);
        assert_eq!(c.sampling, SamplingMode::Uniform);
    }

    #[test]
    fn a_bad_file_is_named() {
        let args = BufferArgs {
            config: Some("/nonexistent/bapo.toml".into()),
            ..Default::default()
        };
        let err = format!("{:#}", args.resolve().unwrap_err());
        assert!(err.contains("/nonexistent/bapo.toml"), "{err}");
    }
}
