//! The TLS flags and `[tls]` table every service command shares, and the
//! rule "plaintext only on request": a server refuses to listen on a
//! non-loopback address, and a client to talk to a non-loopback one,
//! without TLS unless `--insecure` says so (then it warns and sets the
//! `bapo_insecure` gauge). Clients authenticate with a certificate
//! (mutual TLS) or a bearer token (`--auth-token-file`, for clusters
//! without a PKI), and a token is never sent without TLS. The mechanism is
//! `bapo_proto::tls`.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, bail};
use bapo_proto::tls::{
    CertKey, ClientTls, ClientToken, Role, ServerFiles, ServerSecurity, ServerTls,
};
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
    /// Bearer tokens, `<role> <secret>` per line: servers accept each,
    /// clients send their own role's; re-read while running.
    pub auth_token_file: Option<PathBuf>,
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
    /// Bearer tokens, one `<role> <secret>` per line (or `<role>
    /// sha256:<hex>`, verify only): servers accept each, clients send
    /// their own role's. Needs TLS; with --tls-ca too, a client certificate
    /// becomes optional.
    #[arg(long, value_name = "FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// Allow plaintext gRPC beyond loopback (a warning at start and the
    /// `bapo_insecure` gauge).
    #[arg(long)]
    pub insecure: bool,
}

impl TlsArgs {
    /// The file's `[tls]` table with the flags laid over it.
    pub fn resolve(&self, file: &TlsConfig) -> anyhow::Result<Security> {
        let pick = |flag: &Option<PathBuf>, key: &Option<PathBuf>| flag.clone().or(key.clone());
        let identity = match (
            pick(&self.tls_cert, &file.cert),
            pick(&self.tls_key, &file.key),
        ) {
            (Some(cert), Some(key)) => Some(CertKey { cert, key }),
            (None, None) => None,
            _ => bail!("--tls-cert and --tls-key (or [tls] cert, key) go together"),
        };
        let s = Security {
            identity,
            ca: pick(&self.tls_ca, &file.ca),
            tokens: pick(&self.auth_token_file, &file.auth_token_file),
            server_name: self.tls_server_name.clone().or(file.server_name.clone()),
            blocklist: pick(&self.blocklist, &file.blocklist),
            insecure: self.insecure || file.insecure,
        };
        if s.identity.is_none() && s.ca.is_none() {
            if s.tokens.is_some() {
                bail!(
                    "--auth-token-file needs TLS (tokens are never sent in plaintext): \
                     give --tls-ca, and --tls-cert/--tls-key to serve"
                );
            }
            if s.blocklist.is_some() {
                bail!("--blocklist needs TLS (identities come from certificates or tokens)");
            }
        }
        Ok(s)
    }
}

/// A command's resolved TLS settings.
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// This process's certificate and key.
    pub identity: Option<CertKey>,
    /// The CA bundle servers (and, for a server, client certificates)
    /// must chain to.
    pub ca: Option<PathBuf>,
    /// The bearer token file.
    pub tokens: Option<PathBuf>,
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
        if let Some(id) = &self.identity {
            let files = ServerFiles {
                cert: id.cert.clone(),
                key: id.key.clone(),
                client_ca: self.ca.clone(),
                tokens: self.tokens.clone(),
                blocklist: self.blocklist.clone(),
            };
            let tls = ServerTls::load(files).context("loading the server's TLS files")?;
            return Ok(ServerSecurity::Mtls(tls));
        }
        if self.ca.is_some() {
            bail!("serving TLS needs this server's certificate: give --tls-cert and --tls-key");
        }
        if !listen.ip().is_loopback() {
            if !self.insecure {
                bail!(
                    "refusing to serve gRPC on {listen} without TLS: give --tls-cert, \
                     --tls-key and --tls-ca or --auth-token-file (see docs/deploy.md), \
                     listen on loopback, or pass --insecure"
                );
            }
            insecure_warning(&format!("serving gRPC on {listen}"));
        }
        Ok(ServerSecurity::Plaintext)
    }

    /// How a client of `role` calls the service at `url`.
    pub fn client(&self, url: &str, role: Role) -> anyhow::Result<Option<ClientTls>> {
        if let Some(ca) = &self.ca {
            let token = self.tokens.clone().map(|file| ClientToken { file, role });
            if self.identity.is_none() && token.is_none() {
                bail!(
                    "calling {url} over TLS needs a client certificate (--tls-cert, \
                     --tls-key) or a bearer token (--auth-token-file)"
                );
            }
            return Ok(Some(ClientTls {
                ca: ca.clone(),
                identity: self.identity.clone(),
                token,
                server_name: self.server_name.clone(),
            }));
        }
        if self.identity.is_some() {
            bail!("calling {url} over TLS needs the CA bundle to verify it: give --tls-ca");
        }
        if !bapo_proto::tls::is_loopback_url(url) {
            if !self.insecure {
                bail!(
                    "refusing to call {url} without TLS: give --tls-ca and --tls-cert/--tls-key \
                     or --auth-token-file (see docs/deploy.md), or pass --insecure"
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

    const BUFFER: &str = "http://bapo-buffer:50051";

    fn listen(a: &str) -> SocketAddr {
        a.parse().unwrap()
    }

    #[test]
    fn plaintext_beyond_loopback_only_on_request() {
        let plain = Security::default();
        assert!(plain.server(listen("127.0.0.1:50051")).is_ok());
        let e = plain
            .server(listen("0.0.0.0:50051"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--insecure"), "{e}");
        assert!(
            plain
                .client("http://127.0.0.1:1", Role::Actor)
                .unwrap()
                .is_none()
        );
        assert!(plain.client(BUFFER, Role::Actor).is_err());
        let insecure = Security {
            insecure: true,
            ..Default::default()
        };
        assert!(insecure.server(listen("0.0.0.0:50051")).is_ok());
        assert!(insecure.client(BUFFER, Role::Actor).is_ok());
    }

    #[test]
    fn cert_and_key_go_together_and_flags_beat_the_file() {
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
        assert_eq!(s.identity.unwrap().cert, PathBuf::from("c.pem"));
    }

    #[test]
    fn a_token_client_sends_its_own_role_and_never_in_plaintext() {
        let no_tls = TlsArgs {
            auth_token_file: Some("tokens".into()),
            ..Default::default()
        };
        let e = no_tls
            .resolve(&TlsConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("never sent in plaintext"), "{e}");
        let actor = TlsArgs {
            tls_ca: Some("ca.pem".into()),
            ..no_tls
        }
        .resolve(&TlsConfig::default())
        .unwrap();
        let tls = actor.client(BUFFER, Role::Actor).unwrap().unwrap();
        assert_eq!(tls.token.unwrap().role, Role::Actor);
        assert!(tls.identity.is_none());
        let e = actor.server(listen("0.0.0.0:1")).unwrap_err().to_string();
        assert!(e.contains("--tls-cert"), "{e}");
    }

    #[test]
    fn a_tls_client_needs_credentials_and_a_ca() {
        let ca_only = Security {
            ca: Some("ca.pem".into()),
            ..Default::default()
        };
        let e = ca_only.client(BUFFER, Role::Actor).unwrap_err().to_string();
        assert!(e.contains("--auth-token-file"), "{e}");
        let no_ca = Security {
            identity: Some(CertKey {
                cert: "c".into(),
                key: "k".into(),
            }),
            ..Default::default()
        };
        let e = no_ca.client(BUFFER, Role::Actor).unwrap_err().to_string();
        assert!(e.contains("--tls-ca"), "{e}");
    }
}
