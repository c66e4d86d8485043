//! The TLS flags and `[tls]` table every service command shares, and the
//! rule "plaintext only on request": a server refuses to listen on a
//! non-loopback address, and a client to talk to a non-loopback one,
//! without mutual TLS unless `--insecure` says so (then it warns and sets
//! the `bapo_insecure` gauge). The mechanism is `bapo_proto::tls`.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, bail};
use bapo_proto::tls::{ClientTls, ServerSecurity, ServerTls, TlsFiles};
use clap::Args;
use serde::{Deserialize, Serialize};

/// Gauge: 1 while this process serves or calls plaintext beyond loopback.
pub const INSECURE_GAUGE: &str = "bapo_insecure";

/// The `[tls]` table of the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// This process's certificate (PEM): served to clients and presented
    /// to servers. Its SAN URI `spiffe://<trust-domain>/<role>[/<name>]`
    /// gives its role.
    pub cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub key: Option<PathBuf>,
    /// The CA bundle (PEM) peers' certificates must chain to.
    pub ca: Option<PathBuf>,
    /// The name to verify in servers' certificates (default: the host of
    /// the URL).
    pub server_name: Option<String>,
    /// Servers: a file of identities (SPIFFE IDs, one per line) refused
    /// every call; re-read while running.
    pub blocklist: Option<PathBuf>,
    /// Allow plaintext beyond loopback.
    pub insecure: bool,
}

/// TLS flags; each overrides the `[tls]` table.
#[derive(Debug, Args, Default, Clone)]
pub struct TlsArgs {
    /// This process's certificate, PEM (enables mutual TLS with --tls-key
    /// and --tls-ca).
    #[arg(long, value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// Its private key, PEM.
    #[arg(long, value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// CA bundle that peers' certificates must chain to, PEM.
    #[arg(long, value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// Name to verify in servers' certificates (default: the URL's host).
    #[arg(long)]
    pub tls_server_name: Option<String>,
    /// Servers: identities (SPIFFE IDs, one per line) refused every call;
    /// re-read while running.
    #[arg(long, value_name = "FILE")]
    pub blocklist: Option<PathBuf>,
    /// Allow plaintext gRPC beyond loopback (a warning at start and the
    /// `bapo_insecure` gauge).
    #[arg(long)]
    pub insecure: bool,
}

impl TlsArgs {
    /// The file's `[tls]` table with the flags laid over it.
    pub fn resolve(&self, file: &TlsConfig) -> anyhow::Result<Security> {
        let pick = |flag: &Option<PathBuf>, key: &Option<PathBuf>| flag.clone().or(key.clone());
        let cert = pick(&self.tls_cert, &file.cert);
        let key = pick(&self.tls_key, &file.key);
        let ca = pick(&self.tls_ca, &file.ca);
        let files = match (cert, key, ca) {
            (Some(cert), Some(key), Some(ca)) => Some(TlsFiles { cert, key, ca }),
            (None, None, None) => None,
            _ => bail!(
                "mutual TLS needs all three of --tls-cert, --tls-key and --tls-ca \
                 (or [tls] cert, key, ca)"
            ),
        };
        Ok(Security {
            files,
            server_name: self.tls_server_name.clone().or(file.server_name.clone()),
            blocklist: pick(&self.blocklist, &file.blocklist),
            insecure: self.insecure || file.insecure,
        })
    }
}

/// A command's resolved TLS settings.
#[derive(Debug, Clone, Default)]
pub struct Security {
    pub files: Option<TlsFiles>,
    pub server_name: Option<String>,
    pub blocklist: Option<PathBuf>,
    pub insecure: bool,
}

fn insecure_warning(what: &str) {
    tracing::warn!(
        "{what} in PLAINTEXT beyond loopback (--insecure): anyone who can reach it \
         can push rollouts, take batches or download the weights"
    );
    metrics::gauge!(INSECURE_GAUGE).set(1.0);
}

impl Security {
    /// How a server listening on `listen` speaks.
    pub fn server(&self, listen: SocketAddr) -> anyhow::Result<ServerSecurity> {
        if let Some(files) = &self.files {
            let tls = ServerTls::load(files.clone(), self.blocklist.clone())
                .context("loading the server's TLS files")?;
            return Ok(ServerSecurity::Mtls(tls));
        }
        if self.blocklist.is_some() {
            bail!("--blocklist needs mutual TLS (identities come from certificates)");
        }
        if !listen.ip().is_loopback() {
            if !self.insecure {
                bail!(
                    "refusing to serve gRPC on {listen} without TLS: give --tls-cert, \
                     --tls-key and --tls-ca (see docs/deploy.md), listen on loopback, \
                     or pass --insecure"
                );
            }
            insecure_warning(&format!("serving gRPC on {listen}"));
        }
        Ok(ServerSecurity::Plaintext)
    }

    /// How a client calls the service at `url`.
    pub fn client(&self, url: &str) -> anyhow::Result<Option<ClientTls>> {
        if let Some(files) = &self.files {
            return Ok(Some(ClientTls {
                files: files.clone(),
                server_name: self.server_name.clone(),
            }));
        }
        if !bapo_proto::tls::is_loopback_url(url) {
            if !self.insecure {
                bail!(
                    "refusing to call {url} without TLS: give --tls-cert, --tls-key and \
                     --tls-ca (see docs/deploy.md), or pass --insecure"
                );
            }
            insecure_warning(&format!("calling {url}"));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_beyond_loopback_only_on_request() {
        let plain = Security::default();
        assert!(plain.server("127.0.0.1:50051".parse().unwrap()).is_ok());
        let e = plain
            .server("0.0.0.0:50051".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("--insecure"), "{e}");
        assert!(plain.client("http://127.0.0.1:1").unwrap().is_none());
        assert!(plain.client("http://bapo-buffer:50051").is_err());
        let insecure = Security {
            insecure: true,
            ..Default::default()
        };
        assert!(insecure.server("0.0.0.0:50051".parse().unwrap()).is_ok());
        assert!(insecure.client("http://bapo-buffer:50051").is_ok());
    }

    #[test]
    fn all_three_files_or_none() {
        let args = TlsArgs {
            tls_cert: Some("c.pem".into()),
            ..Default::default()
        };
        assert!(args.resolve(&TlsConfig::default()).is_err());
        let file = TlsConfig {
            key: Some("k.pem".into()),
            ca: Some("ca.pem".into()),
            ..Default::default()
        };
        let s = args.resolve(&file).unwrap();
        assert_eq!(s.files.unwrap().cert, PathBuf::from("c.pem"));
    }
}
