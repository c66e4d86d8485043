//! The server side: TLS state reloaded in place, and the layer that
//! authenticates and authorizes every call before a service sees it.

use std::{
    collections::BTreeSet,
    fmt,
    future::Future,
    path::PathBuf,
    pin::Pin,
    sync::{Arc, RwLock},
    task::{Context, Poll},
};

use rustls::{
    RootCertStore, ServerConfig,
    pki_types::{PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};
use tonic::{
    Status,
    codegen::{Service, http},
};

use super::{
    Peer, TlsError, TlsFiles, authorize, certs, err, provider, read, read_text,
    roles::TokenPeer,
    token::{self, TokenFile},
};

/// What a TLS server is made of: its certificate and key, and how it
/// authenticates clients (a CA bundle for client certificates, a token
/// file, or both), plus an optional blocklist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA bundle client certificates must chain to; `None`: clients
    /// present no certificate (tokens only).
    pub client_ca: Option<PathBuf>,
    /// Bearer tokens per role ([`token`]).
    pub tokens: Option<PathBuf>,
    /// Identities (SPIFFE IDs, `token:<role>`) refused every call.
    pub blocklist: Option<PathBuf>,
}

impl ServerFiles {
    /// Mutual TLS with `files`, no tokens, no blocklist.
    pub fn mtls(files: TlsFiles) -> Self {
        Self {
            cert: files.cert,
            key: files.key,
            client_ca: Some(files.ca),
            tokens: None,
            blocklist: None,
        }
    }
}

/// Everything a server reads from its files, compared on reload.
#[derive(PartialEq)]
struct Inputs {
    /// Certificate, key and client CA bundle (empty without one).
    pem: [Vec<u8>; 3],
    blocklist: Option<String>,
    tokens: Option<String>,
}

impl ServerFiles {
    fn read(&self) -> Result<Inputs, TlsError> {
        let ca = match &self.client_ca {
            Some(p) => read(p, "CA bundle")?,
            None => Vec::new(),
        };
        Ok(Inputs {
            pem: [
                read(&self.cert, "TLS certificate")?,
                read(&self.key, "TLS key")?,
                ca,
            ],
            blocklist: read_text(self.blocklist.as_deref(), "blocklist")?,
            tokens: read_text(self.tokens.as_deref(), "token file")?,
        })
    }
}

/// A server's TLS state: the rustls configuration new connections get, the
/// tokens and the blocklist calls are checked against, and the files they
/// came from, reloaded in place by [`ServerTls::reload`].
pub struct ServerTls {
    files: ServerFiles,
    state: RwLock<State>,
}

struct State {
    config: Arc<ServerConfig>,
    tokens: Option<TokenFile>,
    blocked: BTreeSet<String>,
    /// What the above were built from, to notice a change.
    inputs: Inputs,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish()
    }
}

fn server_config(files: &ServerFiles, pem: &[Vec<u8>; 3]) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certs(&pem[0], &files.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&pem[1])
        .map_err(|e| err(format!("{}: {e}", files.key.display())))?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| err(e.to_string()))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca_path) => {
            let mut roots = RootCertStore::empty();
            for ca in certs(&pem[2], ca_path)? {
                roots
                    .add(ca)
                    .map_err(|e| err(format!("{}: {e}", ca_path.display())))?;
            }
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            if files.tokens.is_some() {
                // A token may stand in for the certificate; one presented
                // is still verified against the bundle.
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .map_err(|e| err(format!("client verifier from {}: {e}", ca_path.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        err(format!(
            "{} with {}: {e}",
            files.cert.display(),
            files.key.display()
        ))
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The identities of a blocklist file: one per line, `#` comments.
fn parse_blocklist(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn parse_tokens(files: &ServerFiles, text: Option<&str>) -> Result<Option<TokenFile>, TlsError> {
    match (&files.tokens, text) {
        (Some(path), Some(text)) => TokenFile::parse(text, path).map(Some),
        _ => Ok(None),
    }
}

impl ServerTls {
    /// Loads the files; an unusable one is an error naming it, and so is a
    /// server with no way to authenticate its clients.
    pub fn load(files: ServerFiles) -> Result<Arc<Self>, TlsError> {
        if files.client_ca.is_none() && files.tokens.is_none() {
            return Err(err(
                "a TLS server must authenticate its clients: give a CA bundle for client \
                 certificates (--tls-ca) or a token file (--auth-token-file)",
            ));
        }
        let inputs = files.read()?;
        let state = State {
            config: server_config(&files, &inputs.pem)?,
            tokens: parse_tokens(&files, inputs.tokens.as_deref())?,
            blocked: parse_blocklist(inputs.blocklist.as_deref().unwrap_or("")),
            inputs,
        };
        Ok(Arc::new(Self {
            files,
            state: RwLock::new(state),
        }))
    }

    /// Re-reads the files; a changed certificate, key or CA bundle replaces
    /// the configuration of new connections (established ones keep
    /// theirs), changed tokens or blocklist apply to the next call. Returns
    /// whether anything changed. On an error (a half-written file) the
    /// current state stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let new = self.files.read()?;
        let (pem_changed, tokens_changed, list_changed) = {
            let s = self.state.read().expect("tls state lock");
            (
                s.inputs.pem != new.pem,
                s.inputs.tokens != new.tokens,
                s.inputs.blocklist != new.blocklist,
            )
        };
        let config = match pem_changed {
            true => Some(server_config(&self.files, &new.pem)?),
            false => None,
        };
        let tokens = parse_tokens(&self.files, new.tokens.as_deref())?;
        let mut s = self.state.write().expect("tls state lock");
        if let Some(c) = config {
            s.config = c;
            tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
        }
        if tokens_changed {
            tracing::info!("token file reloaded");
        }
        if list_changed {
            s.blocked = parse_blocklist(new.blocklist.as_deref().unwrap_or(""));
            tracing::info!(blocked = s.blocked.len(), "blocklist reloaded");
        }
        s.tokens = tokens;
        s.inputs = new;
        Ok(pem_changed || tokens_changed || list_changed)
    }

    /// The acceptor for a new connection.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.state.read().expect("tls state lock").config.clone())
    }

    /// Whether `id` is in the blocklist.
    pub fn is_blocked(&self, id: &str) -> bool {
        self.state
            .read()
            .expect("tls state lock")
            .blocked
            .contains(id)
    }

    /// The caller a bearer token authenticates: `Ok(None)` without an
    /// `authorization` header, `Err` for a token that is not valid (or a
    /// server without tokens).
    fn token_peer(&self, header: Option<&http::HeaderValue>) -> Result<Option<Peer>, Status> {
        let Some(value) = header else {
            return Ok(None);
        };
        let s = self.state.read().expect("tls state lock");
        let role = token::bearer(value.as_bytes())
            .zip(s.tokens.as_ref())
            .and_then(|(presented, tokens)| tokens.verify(presented));
        match role {
            Some(role) => Ok(Some(Peer::token(role))),
            None => Err(Status::unauthenticated(
                "the bearer token is not valid on this server",
            )),
        }
    }
}

/// How a server speaks: plaintext (loopback, or `--insecure`), or TLS with
/// authenticated clients and per-role authorization.
#[derive(Debug, Clone, Default)]
pub enum ServerSecurity {
    #[default]
    Plaintext,
    Mtls(Arc<ServerTls>),
}

impl ServerSecurity {
    pub fn tls(&self) -> Option<&Arc<ServerTls>> {
        match self {
            ServerSecurity::Plaintext => None,
            ServerSecurity::Mtls(t) => Some(t),
        }
    }
}

/// The authorization layer of a server (`Server::layer`): with TLS, every
/// call's caller is authenticated (its connection's certificate, else its
/// bearer token) and checked by [`authorize`] before any service sees it;
/// plaintext, it lets everything through.
#[derive(Debug, Clone, Default)]
pub struct AuthLayer {
    tls: Option<Arc<ServerTls>>,
}

impl AuthLayer {
    pub fn new(security: &ServerSecurity) -> Self {
        Self {
            tls: security.tls().cloned(),
        }
    }
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = Authorize<S>;

    fn layer(&self, inner: S) -> Authorize<S> {
        Authorize {
            inner,
            tls: self.tls.clone(),
        }
    }
}

/// See [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct Authorize<S> {
    inner: S,
    tls: Option<Arc<ServerTls>>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Authenticates and authorizes one call; a token's peer is added to the
/// request (a certificate's travels with the connection already).
fn check<B>(tls: &ServerTls, req: &mut http::Request<B>) -> Result<(), Status> {
    let by_cert = req
        .extensions()
        .get::<super::ConnInfo>()
        .and_then(|c| c.peer.clone());
    let by_token = match by_cert {
        Some(_) => None,
        None => tls
            .token_peer(req.headers().get(http::header::AUTHORIZATION))?
            .map(Arc::new),
    };
    let peer = by_cert.as_deref().or(by_token.as_deref());
    let blocked = peer.is_some_and(|p| tls.is_blocked(&p.id));
    authorize(peer, req.uri().path(), blocked)?;
    if let Some(p) = by_token {
        req.extensions_mut().insert(TokenPeer(p));
    }
    Ok(())
}

impl<S, B, R> Service<http::Request<B>> for Authorize<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let Some(tls) = &self.tls else {
            return Box::pin(self.inner.call(req));
        };
        match check(tls, &mut req) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => {
                tracing::debug!(path = req.uri().path(), "{}", status.message());
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocklists_ignore_comments_and_blank_lines() {
        let b = parse_blocklist(
            "# bad actors\nspiffe://t/actor/a-1  # poisoned\n\n  spiffe://t/actor/a-2\n",
        );
        assert_eq!(b.len(), 2);
        assert!(b.contains("spiffe://t/actor/a-1"));
    }
}
