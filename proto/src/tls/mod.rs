//! TLS, client authentication (certificates or bearer tokens) and per-role
//! authorization, shared by every bapo server and client.
//!
//! * **Transport.** A server given a [`ServerTls`] speaks only TLS (1.2 or
//!   1.3, rustls with the ring provider, ALPN `h2`). Clients ([`ClientTls`],
//!   [`connector`]) verify the server against their CA bundle.
//! * **Authentication**, one of two ways or both:
//!   - *client certificates* (mutual TLS): the server requires one issued
//!     by its CA bundle; a connection without one, with one from another CA
//!     or an expired one is refused at the handshake, inside the socket
//!     guard's handshake timeout ([`crate::transport`]);
//!   - *bearer tokens* ([`token`]), for clusters without a PKI: a shared
//!     secret per role, sent as `authorization: Bearer …` and checked in
//!     constant time; a missing or wrong token is `UNAUTHENTICATED`. Tokens
//!     are only ever sent over TLS.
//!
//!   With both configured, a client certificate is optional and wins when
//!   presented.
//! * **Roles** ([`roles`]). A certificate's role is read from its SAN URI
//!   `spiffe://<trust-domain>/<role>[/<name>]` (`actor`, `learner` or
//!   `admin`); the whole URI is the caller's identity. A token's role is
//!   the line of the token file it matches; its identity is `token:<role>`.
//! * **Authorization** ([`authorize`], applied by [`AuthLayer`] before any
//!   service sees the call): actors may `RolloutSink/Push`,
//!   `RolloutSink/Lease`, `RolloutSink/ReleaseLease` and
//!   `WeightSource/Subscribe`; the learner `BatchSource/Sample`,
//!   `SampleStream` and `ReportVersion`; any authenticated caller (admin
//!   included) `BatchSource/GetStats`, health checking and reflection.
//!   Everything else is `PERMISSION_DENIED`, naming the role and the
//!   method. Identities in the server's blocklist file are refused every
//!   call.
//! * **Rotation.** The server re-reads its certificate, key, CA bundle,
//!   token file and blocklist every [`RELOAD_INTERVAL`] (Kubernetes
//!   rewrites mounted secrets in place); new connections get the new
//!   certificate, new calls the new tokens and blocklist, and established
//!   connections and their streams keep going. Clients read their files
//!   whenever they build a [`connector`] (the weight subscription does on
//!   every reconnect).
//!
//! [`pki`] makes certificates (`bapo run`'s ephemeral CA, the tests).

mod client;
pub mod pki;
pub mod roles;
mod server;
pub mod token;

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rustls::{
    crypto::CryptoProvider,
    pki_types::{CertificateDer, pem::PemObject},
};

pub use client::{
    AuthChannel, CertKey, ClientTls, ClientToken, Connector, connector, is_loopback_url,
};
pub use roles::{Access, ConnInfo, Peer, Role, access, authorize, peer};
pub use server::{AuthLayer, Authorize, ServerFiles, ServerSecurity, ServerTls};

/// How often a server re-reads its certificate files, token file and
/// blocklist.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// How long a peer has to complete its handshake: the server's guard
/// closes a silent connection after it, a client gives up connecting.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS setting that cannot be used, named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsError(pub String);

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TlsError {}

fn err(msg: impl Into<String>) -> TlsError {
    TlsError(msg.into())
}

/// The crypto provider: ring, the only one compiled in. Also installed as
/// the process default, so that nothing that asks rustls for "the default"
/// can find two and panic.
fn provider() -> Arc<CryptoProvider> {
    install_default_provider();
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Installs ring as the process's default rustls provider (idempotent).
/// `main` calls it first thing; every constructor here calls it too.
pub fn install_default_provider() {
    if CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// A process's certificate, its key and the CA bundle it trusts, as PEM
/// files. One certificate serves both ways: the learner presents the same
/// one to actors (as a server) and to the buffer (as a client), so it
/// needs both the `serverAuth` and `clientAuth` usages (or none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| err(format!("reading the {what} {}: {e}", path.display())))
}

/// The text of an optional file (a blocklist, a token file).
fn read_text(path: Option<&Path>, what: &str) -> Result<Option<String>, TlsError> {
    path.map(|p| {
        std::fs::read_to_string(p)
            .map_err(|e| err(format!("reading the {what} {}: {e}", p.display())))
    })
    .transpose()
}

fn certs(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(err(format!("{}: no PEM certificate in it", path.display())));
    }
    Ok(certs)
}
