//! The client side: the server verified against a CA bundle, the caller
//! authenticated by its certificate, its bearer token, or both.

use std::{
    fmt,
    path::PathBuf,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tonic::{
    body::Body,
    codegen::{Service, http, http::HeaderValue},
    transport::{
        Certificate, Channel, ClientTlsConfig, Endpoint, Identity, channel::ResponseFuture,
    },
};

use super::{
    RELOAD_INTERVAL, Role, TlsError, TlsFiles, certs, err, install_default_provider, read,
    token::TokenFile,
};

/// A certificate and its private key, PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertKey {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Where a client's bearer token comes from: the first plain secret of
/// `role` in the token `file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientToken {
    pub file: PathBuf,
    pub role: Role,
}

/// A client's TLS settings: the CA bundle it verifies servers with, the
/// name to verify in the server's certificate (default: the URL's host),
/// and how it authenticates: a certificate, a bearer token, or both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTls {
    pub ca: PathBuf,
    pub identity: Option<CertKey>,
    pub token: Option<ClientToken>,
    pub server_name: Option<String>,
}

impl ClientTls {
    /// Mutual TLS with `files`: their CA bundle, certificate and key.
    pub fn mtls(files: TlsFiles) -> Self {
        Self {
            ca: files.ca,
            identity: Some(CertKey {
                cert: files.cert,
                key: files.key,
            }),
            token: None,
            server_name: None,
        }
    }
}

/// The channel every bapo client calls through. It adds the caller's
/// bearer token to every call, and, with TLS, follows its files: at most
/// every [`RELOAD_INTERVAL`], before a call, it re-reads the CA bundle,
/// certificate, key and token file, and when they changed (a certificate
/// renewed in place) later calls go through a new connection made with
/// them. Calls in flight and open streams keep their connection; files
/// that cannot be used (half written) are logged and the current settings
/// kept. Clones share the reloading.
#[derive(Clone)]
pub struct AuthChannel {
    live: Live,
    reload: Option<Arc<Reload>>,
}

/// A channel and the token its calls carry, numbered by reload.
#[derive(Clone)]
struct Live {
    channel: Channel,
    bearer: Option<HeaderValue>,
    generation: u64,
}

struct Reload {
    url: String,
    tls: ClientTls,
    every: Duration,
    state: Mutex<ReloadState>,
}

struct ReloadState {
    checked: Instant,
    fingerprint: Vec<u8>,
    live: Live,
}

impl fmt::Debug for AuthChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthChannel")
            .field("generation", &self.live.generation)
            .field("token", &self.live.bearer.is_some())
            .finish()
    }
}

impl Reload {
    /// The newest channel, when it is newer than `generation`; re-reads
    /// the files first if they are due.
    fn newer_than(&self, generation: u64) -> Option<Live> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.checked.elapsed() >= self.every {
            s.checked = Instant::now();
            match fingerprint(&self.tls) {
                Ok(f) if f != s.fingerprint => match settings(&self.url, &self.tls) {
                    Ok((endpoint, bearer)) => {
                        s.live = Live {
                            channel: endpoint.connect_lazy(),
                            bearer,
                            generation: s.live.generation + 1,
                        };
                        s.fingerprint = f;
                        tracing::info!(url = %self.url, "client TLS files changed; new connections use them");
                    }
                    Err(e) => {
                        tracing::warn!(url = %self.url, "keeping the current TLS settings: {e}")
                    }
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(url = %self.url, "keeping the current TLS settings: {e}"),
            }
        }
        (s.live.generation != generation).then(|| s.live.clone())
    }
}

impl Service<http::Request<Body>> for AuthChannel {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let Some(newer) = self
            .reload
            .as_ref()
            .and_then(|r| r.newer_than(self.live.generation))
        {
            self.live = newer;
        }
        self.live.channel.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        if let Some(v) = &self.live.bearer {
            req.headers_mut()
                .insert(http::header::AUTHORIZATION, v.clone());
        }
        self.live.channel.call(req)
    }
}

/// An endpoint, the token its calls carry, and what to re-read.
#[derive(Debug, Clone)]
pub struct Connector {
    pub endpoint: Endpoint,
    bearer: Option<HeaderValue>,
    /// The URL and TLS settings (and their files' fingerprint) to reload.
    reload: Option<(String, ClientTls, Vec<u8>)>,
    every: Duration,
}

impl Connector {
    /// How often the channels it makes check their files (default
    /// [`RELOAD_INTERVAL`]).
    pub fn reload_every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    fn channel(&self, channel: Channel) -> AuthChannel {
        let live = Live {
            channel,
            bearer: self.bearer.clone(),
            generation: 0,
        };
        let reload = self.reload.clone().map(|(url, tls, fingerprint)| {
            Arc::new(Reload {
                url,
                tls,
                every: self.every,
                state: Mutex::new(ReloadState {
                    checked: Instant::now(),
                    fingerprint,
                    live: live.clone(),
                }),
            })
        });
        AuthChannel { live, reload }
    }

    /// A channel that connects on first use (and reconnects after).
    pub fn connect_lazy(&self) -> AuthChannel {
        self.channel(self.endpoint.connect_lazy())
    }

    /// A channel connected now.
    pub async fn connect(&self) -> Result<AuthChannel, tonic::transport::Error> {
        Ok(self.channel(self.endpoint.connect().await?))
    }
}

/// The bytes of every file a client's TLS settings name, to notice a
/// change.
fn fingerprint(tls: &ClientTls) -> Result<Vec<u8>, TlsError> {
    let mut out = Vec::new();
    let mut add = |bytes: Vec<u8>| {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes);
    };
    add(read(&tls.ca, "CA bundle")?);
    if let Some(id) = &tls.identity {
        add(read(&id.cert, "TLS certificate")?);
        add(read(&id.key, "TLS key")?);
    }
    if let Some(t) = &tls.token {
        add(read(&t.file, "token file")?);
    }
    Ok(out)
}

fn bearer(token: &ClientToken) -> Result<HeaderValue, TlsError> {
    let file = TokenFile::load(&token.file)?;
    let secret = file.secret_for(token.role).ok_or_else(|| {
        err(format!(
            "{}: no token of role {} in it (a client sends its own role's)",
            token.file.display(),
            token.role
        ))
    })?;
    let mut value = HeaderValue::from_str(&format!("Bearer {secret}")).map_err(|_| {
        err(format!(
            "{}: the token is not header-safe",
            token.file.display()
        ))
    })?;
    // Kept out of debug output.
    value.set_sensitive(true);
    Ok(value)
}

fn tls_config(tls: &ClientTls) -> Result<ClientTlsConfig, TlsError> {
    let ca = read(&tls.ca, "CA bundle")?;
    // Checked here, so a bad file is named now rather than at connect.
    certs(&ca, &tls.ca)?;
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .timeout(super::HANDSHAKE_TIMEOUT);
    if let Some(id) = &tls.identity {
        let cert = read(&id.cert, "TLS certificate")?;
        let key = read(&id.key, "TLS key")?;
        certs(&cert, &id.cert)?;
        config = config.identity(Identity::from_pem(cert, key));
    }
    if let Some(name) = &tls.server_name {
        config = config.domain_name(name.clone());
    }
    Ok(config)
}

/// A connector for `url` with bapo's client settings (5 s connect timeout,
/// Nagle off) and, given `tls`, TLS and the caller's credentials: the files
/// are read now, and `http://` becomes `https://` (tonic connects in
/// plaintext to an `http://` URL even with a TLS configuration). A
/// `ClientTls` with neither certificate nor token is refused: it could
/// call nothing.
pub fn connector(url: &str, tls: Option<&ClientTls>) -> Result<Connector, TlsError> {
    let url = match (tls, url.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => url.to_string(),
    };
    let (endpoint, bearer) = match tls {
        Some(tls) => settings(&url, tls)?,
        None => (plain_endpoint(&url)?, None),
    };
    let reload = match tls {
        Some(tls) => Some((url, tls.clone(), fingerprint(tls)?)),
        None => None,
    };
    Ok(Connector {
        endpoint,
        bearer,
        reload,
        every: RELOAD_INTERVAL,
    })
}

fn plain_endpoint(url: &str) -> Result<Endpoint, TlsError> {
    Ok(Endpoint::from_shared(url.to_string())
        .map_err(|e| err(format!("address {url:?}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true))
}

/// The endpoint and token of a TLS client of `url` (already `https://`),
/// from the files as they are now.
fn settings(url: &str, tls: &ClientTls) -> Result<(Endpoint, Option<HeaderValue>), TlsError> {
    if tls.identity.is_none() && tls.token.is_none() {
        return Err(err(format!(
            "calling {url} over TLS needs a client certificate or a bearer token"
        )));
    }
    install_default_provider();
    let endpoint = plain_endpoint(url)?
        .tls_config(tls_config(tls)?)
        .map_err(|e| err(format!("TLS for {url}: {e}")))?;
    let bearer = tls.token.as_ref().map(bearer).transpose()?;
    Ok((endpoint, bearer))
}

/// Whether `url`'s host is a loopback address or `localhost`.
pub fn is_loopback_url(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_urls_are_recognised() {
        assert!(is_loopback_url("http://127.0.0.1:50051"));
        assert!(is_loopback_url("https://localhost:1"));
        assert!(is_loopback_url("http://[::1]:5"));
        assert!(!is_loopback_url("http://bapo-buffer:50051"));
        assert!(!is_loopback_url("http://10.0.0.2:50051"));
    }

    #[test]
    fn a_tls_client_without_credentials_is_refused() {
        let tls = ClientTls {
            ca: "ca.pem".into(),
            identity: None,
            token: None,
            server_name: None,
        };
        let e = connector("http://buffer:1", Some(&tls)).unwrap_err().0;
        assert!(e.contains("certificate or a bearer token"), "{e}");
    }
}
