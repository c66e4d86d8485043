//! Logging and the Prometheus exporter, shared by every `bapo` command.

use std::net::SocketAddr;

use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use tracing_subscriber::EnvFilter;

/// Logs to stderr; `RUST_LOG` overrides the default level. Colours only
/// on a terminal (and never under `NO_COLOR`): a service's stderr that
/// `bapo run` sends to a log file, or a pipe into another program, gets
/// plain text, not escape codes.
pub fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
}

/// `bapo run`'s logging. Its terminal belongs to the progress bar and a
/// short summary: only warnings and errors go to stderr (or what
/// `RUST_LOG` asks). Everything at `info` goes, without colour, to the
/// run's own log file once [`set_run_log`] names it (beside the services'
/// logs); lines before that (argument checks) are not kept.
pub fn init_run_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::{
        Layer, filter::LevelFilter, layer::SubscriberExt, util::SubscriberInitExt,
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let terminal = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_filter(filter);
    let file = tracing_subscriber::fmt::layer()
        .with_writer(|| RunLog)
        .with_ansi(false)
        .with_filter(LevelFilter::INFO);
    let _ = tracing_subscriber::registry()
        .with(terminal)
        .with(file)
        .try_init();
}

static RUN_LOG: std::sync::OnceLock<std::sync::Mutex<std::fs::File>> = std::sync::OnceLock::new();

/// Sends [`init_run_logging`]'s file layer to `path` (appended to).
pub fn set_run_log(path: &std::path::Path) -> std::io::Result<()> {
    let f = std::fs::File::options()
        .create(true)
        .append(true)
        .open(path)?;
    let _ = RUN_LOG.set(std::sync::Mutex::new(f));
    Ok(())
}

/// A writer into the run's log file, or nowhere before it is set.
struct RunLog;

impl std::io::Write for RunLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(f) = RUN_LOG.get() {
            let mut f = f.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            f.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Serves `/metrics` on `addr` for everything recorded in this process.
/// Latencies get second-scale buckets, staleness, reuse and turns integer
/// ones, shares tenths and token counts powers of two, so Prometheus can
/// aggregate them across pods (summaries cannot be).
pub fn serve_metrics(addr: SocketAddr) -> anyhow::Result<()> {
    const SECONDS: &[f64] = &[
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0, 10.0, 30.0, 60.0,
    ];
    const COUNTS: &[f64] = &[
        0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0,
    ];
    const SHARES: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
    const TOKENS: &[f64] = &[
        1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    ];
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("seconds".into()), SECONDS)?
        .set_buckets_for_metric(Matcher::Suffix("staleness".into()), COUNTS)?
        .set_buckets_for_metric(Matcher::Suffix("reuse".into()), COUNTS)?
        .set_buckets_for_metric(Matcher::Suffix("turns".into()), COUNTS)?
        .set_buckets_for_metric(Matcher::Suffix("share".into()), SHARES)?
        .set_buckets_for_metric(Matcher::Suffix("tokens".into()), TOKENS)?
        .install()
        .with_context(|| format!("serving Prometheus metrics on {addr}"))?;
    tracing::info!(%addr, "metrics at http://{addr}/metrics");
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM ({e}); Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
