//! Mutual TLS and per-role authorization, shared by every bapo server and
//! client.
//!
//! * **Transport.** A server given a [`ServerTls`] speaks only TLS (1.2 or
//!   1.3, rustls with the ring provider, ALPN `h2`) and requires a client
//!   certificate issued by its CA bundle: a connection without one, with
//!   one from another CA, or with an expired one is refused at the
//!   handshake, inside the socket guard's handshake timeout
//!   ([`crate::transport`]). Clients ([`ClientTls`], [`endpoint`]) verify
//!   the server against the same CA bundle and present their own
//!   certificate.
//! * **Roles.** A caller's role is read from its certificate: the SAN URI
//!   `spiffe://<trust-domain>/<role>[/<name>]`, role `actor`, `learner`
//!   or `admin` (see [`Peer`]). The whole URI is the caller's identity.
//! * **Authorization** ([`authorize`], applied by [`AuthLayer`] before any
//!   service sees the call): actors may `RolloutSink/Push` and
//!   `WeightSource/Subscribe`; the learner `BatchSource/Sample`,
//!   `SampleStream` and `ReportVersion`; any authenticated caller (admin
//!   included) `BatchSource/GetStats`, health checking and reflection.
//!   Everything else is `PERMISSION_DENIED`, naming the role and the
//!   method. Identities in the server's blocklist file are refused every
//!   call.
//! * **Rotation.** The server re-reads its certificate, key, CA bundle and
//!   blocklist every [`RELOAD_INTERVAL`] (Kubernetes rewrites mounted
//!   secrets in place); new connections get the new ones, established
//!   connections and their streams keep going. Clients read their files
//!   whenever they build an [`endpoint`] (the weight subscription does on
//!   every reconnect).
//!
//! [`pki`] makes certificates (`bapo run`'s ephemeral CA, the tests).

use std::{
    collections::BTreeSet,
    fmt,
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, RwLock},
    task::{Context, Poll},
    time::Duration,
};

use rustls::{
    RootCertStore, ServerConfig,
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};
use tonic::{
    Status,
    codegen::{Service, http},
    transport::{Certificate, ClientTlsConfig, Endpoint, Identity},
};

/// How often a server re-reads its certificate files and blocklist.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

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

impl TlsFiles {
    fn read_all(&self) -> Result<[Vec<u8>; 3], TlsError> {
        Ok([
            read(&self.cert, "TLS certificate")?,
            read(&self.key, "TLS key")?,
            read(&self.ca, "CA bundle")?,
        ])
    }
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

// ---------------------------------------------------------------------------
// Roles and identities

/// What a certificate allows its holder to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Pushes rollouts, follows the weights.
    Actor,
    /// Samples batches, reports its version.
    Learner,
    /// Reads stats, health and reflection (operators, `bapo run`).
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Actor, Role::Learner, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Actor => "actor",
            Role::Learner => "learner",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An authenticated caller: the identity and role its certificate carries.
///
/// The rule: the certificate's first SAN URI with the `spiffe` scheme is
/// its identity; the first segment of that URI's path is its role.
/// `spiffe://bapo.example/actor/actor-7` is an actor,
/// `spiffe://bapo.example/learner` the learner. A certificate without such
/// a URI (or with an unknown role) is authenticated (the CA issued it) but
/// has no role: it may call what any authenticated caller may.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The SPIFFE ID, or `"(no SPIFFE ID)"`.
    pub id: String,
    pub role: Option<Role>,
}

const NO_ID: &str = "(no SPIFFE ID)";

impl Peer {
    /// The identity in `spiffe://<trust-domain>/<role>[/<name>]`.
    pub fn from_spiffe_id(uri: &str) -> Option<Self> {
        let rest = uri.strip_prefix("spiffe://")?;
        let (_trust_domain, path) = rest.split_once('/')?;
        let role = Role::parse(path.split('/').next().unwrap_or(""));
        Some(Self {
            id: uri.to_string(),
            role,
        })
    }

    /// The peer a (verified) end-entity certificate names.
    pub fn from_cert(der: &CertificateDer<'_>) -> Self {
        let none = Self {
            id: NO_ID.into(),
            role: None,
        };
        let Ok(cert) = webpki::EndEntityCert::try_from(der) else {
            return none;
        };
        cert.valid_uri_names()
            .find_map(Self::from_spiffe_id)
            .unwrap_or(none)
    }

    fn role_name(&self) -> &'static str {
        self.role.map_or("none", Role::as_str)
    }
}

/// The peer authenticated on the connection that carried `req`; `None` on
/// a plaintext server.
pub fn peer<T>(req: &tonic::Request<T>) -> Option<&Peer> {
    req.extensions()
        .get::<crate::transport::ConnInfo>()?
        .peer
        .as_deref()
}

// ---------------------------------------------------------------------------
// Authorization

/// Who may call a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Any authenticated caller.
    Authenticated,
    /// Only this role.
    Only(Role),
    /// Nobody (a method bapo does not serve).
    Nobody,
}

/// The access rule of a gRPC method path (`/package.Service/Method`).
pub fn access(path: &str) -> Access {
    let (service, method) = path
        .strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .unwrap_or(("", ""));
    match (service, method) {
        ("bapo.v1.RolloutSink", "Push") | ("bapo.v1.WeightSource", "Subscribe") => {
            Access::Only(Role::Actor)
        }
        ("bapo.v1.BatchSource", "Sample" | "SampleStream" | "ReportVersion") => {
            Access::Only(Role::Learner)
        }
        ("bapo.v1.BatchSource", "GetStats")
        | ("grpc.health.v1.Health", _)
        | ("grpc.reflection.v1.ServerReflection", _)
        | ("grpc.reflection.v1alpha.ServerReflection", _) => Access::Authenticated,
        _ => Access::Nobody,
    }
}

/// Whether `peer` may call `path`; `blocked` says its identity is in the
/// server's blocklist.
pub fn authorize(peer: Option<&Peer>, path: &str, blocked: bool) -> Result<(), Status> {
    let Some(peer) = peer else {
        return Err(Status::unauthenticated(format!(
            "{path} needs a client certificate"
        )));
    };
    if blocked {
        return Err(Status::permission_denied(format!(
            "{} (role {}) is blocked on this server; {path} refused",
            peer.id,
            peer.role_name()
        )));
    }
    let allowed = match access(path) {
        Access::Authenticated => true,
        Access::Only(role) => peer.role == Some(role),
        Access::Nobody => false,
    };
    if allowed {
        return Ok(());
    }
    let who = match access(path) {
        Access::Only(role) => format!("only the {role} role may"),
        _ => "no role may".into(),
    };
    Err(Status::permission_denied(format!(
        "role {} ({}) may not call {path}: {who}",
        peer.role_name(),
        peer.id
    )))
}

// ---------------------------------------------------------------------------
// Servers

/// A server's TLS state: the rustls configuration new connections get, the
/// files it came from and the blocklist, reloaded in place by
/// [`ServerTls::reload`].
pub struct ServerTls {
    files: TlsFiles,
    blocklist: Option<PathBuf>,
    state: RwLock<State>,
}

struct State {
    config: Arc<ServerConfig>,
    /// The bytes `config` was built from, to notice a change.
    loaded: [Vec<u8>; 3],
    blocked: BTreeSet<String>,
    blocklist_text: Option<String>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .field("blocklist", &self.blocklist)
            .finish()
    }
}

fn server_config(files: &TlsFiles, pem: &[Vec<u8>; 3]) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certs(&pem[0], &files.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&pem[1])
        .map_err(|e| err(format!("{}: {e}", files.key.display())))?;
    let mut roots = RootCertStore::empty();
    for ca in certs(&pem[2], &files.ca)? {
        roots
            .add(ca)
            .map_err(|e| err(format!("{}: {e}", files.ca.display())))?;
    }
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| err(format!("client verifier from {}: {e}", files.ca.display())))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
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

impl ServerTls {
    /// Loads the files; an unusable one is an error naming it. `blocklist`
    /// (optional) lists identities (SPIFFE IDs) refused every call.
    pub fn load(files: TlsFiles, blocklist: Option<PathBuf>) -> Result<Arc<Self>, TlsError> {
        let loaded = files.read_all()?;
        let config = server_config(&files, &loaded)?;
        let blocklist_text = match &blocklist {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|e| err(format!("reading the blocklist {}: {e}", p.display())))?,
            ),
            None => None,
        };
        let blocked = parse_blocklist(blocklist_text.as_deref().unwrap_or(""));
        Ok(Arc::new(Self {
            files,
            blocklist,
            state: RwLock::new(State {
                config,
                loaded,
                blocked,
                blocklist_text,
            }),
        }))
    }

    /// Re-reads the files; a changed certificate, key or CA bundle replaces
    /// the configuration of new connections (established ones keep
    /// theirs), a changed blocklist applies to the next call. Returns
    /// whether anything changed. On an error (a half-written file) the
    /// current state stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let pem = self.files.read_all()?;
        let text = match &self.blocklist {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .map_err(|e| err(format!("reading the blocklist {}: {e}", p.display())))?,
            ),
            None => None,
        };
        let (certs_changed, list_changed) = {
            let s = self.state.read().expect("tls state lock");
            (s.loaded != pem, s.blocklist_text != text)
        };
        let config = if certs_changed {
            Some(server_config(&self.files, &pem)?)
        } else {
            None
        };
        let mut s = self.state.write().expect("tls state lock");
        if let Some(c) = config {
            s.config = c;
            s.loaded = pem;
            tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
        }
        if list_changed {
            s.blocked = parse_blocklist(text.as_deref().unwrap_or(""));
            s.blocklist_text = text;
            tracing::info!(blocked = s.blocked.len(), "blocklist reloaded");
        }
        Ok(certs_changed || list_changed)
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
}

/// How a server speaks: plaintext (loopback, or `--insecure`), or mutual
/// TLS with per-role authorization.
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

/// The authorization layer of a server (`Server::layer`): with mutual TLS,
/// every call is checked by [`authorize`] before any service sees it, and
/// the caller's [`Peer`] is put in the request's extensions; plaintext, it
/// lets everything through.
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

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let Some(tls) = &self.tls else {
            return Box::pin(self.inner.call(req));
        };
        let peer = req
            .extensions()
            .get::<crate::transport::ConnInfo>()
            .and_then(|c| c.peer.clone());
        let blocked = peer.as_ref().is_some_and(|p| tls.is_blocked(&p.id));
        match authorize(peer.as_deref(), req.uri().path(), blocked) {
            // The service reads the peer from the connection's info, which
            // tonic puts on every request: nothing to copy per call.
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => {
                tracing::debug!(path = req.uri().path(), "{}", status.message());
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Clients

/// A client's TLS settings: its certificate, key and CA bundle, and the
/// name to verify in the server's certificate (default: the URL's host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTls {
    pub files: TlsFiles,
    pub server_name: Option<String>,
}

/// An endpoint for `url` with bapo's client settings (5 s connect timeout,
/// Nagle off) and, given `tls`, mutual TLS: the files are read now, and
/// `http://` becomes `https://` (tonic connects in plaintext to an
/// `http://` URL even with a TLS configuration).
pub fn endpoint(url: &str, tls: Option<&ClientTls>) -> Result<Endpoint, TlsError> {
    let url = match (tls, url.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => url.to_string(),
    };
    let mut ep = Endpoint::from_shared(url.clone())
        .map_err(|e| err(format!("address {url:?}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        let [cert, key, ca] = tls.files.read_all()?;
        // Checked here, so a bad file is named now rather than at connect.
        certs(&ca, &tls.files.ca)?;
        certs(&cert, &tls.files.cert)?;
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .identity(Identity::from_pem(cert, key))
            .timeout(crate::transport::HANDSHAKE_TIMEOUT);
        if let Some(name) = &tls.server_name {
            config = config.domain_name(name.clone());
        }
        install_default_provider();
        ep = ep
            .tls_config(config)
            .map_err(|e| err(format!("TLS for {url}: {e}")))?;
    }
    Ok(ep)
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

// ---------------------------------------------------------------------------
// Certificates

/// Certificates made in process (rcgen, ECDSA P-256): `bapo run`'s
/// ephemeral CA and the tests'. Not a CA for a cluster (use cert-manager or
/// your PKI there, see docs/deploy.md).
pub mod pki {
    use std::path::Path;

    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose, SanType,
    };

    use super::{TlsError, TlsFiles, err};

    fn e(x: rcgen::Error) -> TlsError {
        err(format!("making a certificate: {x}"))
    }

    /// A certificate authority whose key lives only in memory.
    pub struct Ca {
        issuer: CertifiedIssuer<'static, KeyPair>,
        trust_domain: String,
    }

    /// A certificate and its key, PEM.
    #[derive(Debug, Clone)]
    pub struct Issued {
        pub cert_pem: String,
        pub key_pem: String,
    }

    /// A calendar day, `(year, month, day)`.
    pub type Day = (i32, u8, u8);

    /// What to put in a certificate besides its SPIFFE ID.
    #[derive(Debug, Clone, Default)]
    pub struct Options {
        /// DNS names and IP addresses the holder serves on.
        pub hosts: Vec<String>,
        /// `(year, month, day)` bounds of validity; default: rcgen's
        /// (1975 to 4096).
        pub valid: Option<(Day, Day)>,
    }

    impl Ca {
        pub fn new(trust_domain: &str) -> Result<Self, TlsError> {
            let mut params = CertificateParams::default();
            params
                .distinguished_name
                .push(DnType::CommonName, format!("bapo CA ({trust_domain})"));
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let key = KeyPair::generate().map_err(e)?;
            let issuer = CertifiedIssuer::self_signed(params, key).map_err(e)?;
            Ok(Self {
                issuer,
                trust_domain: trust_domain.to_string(),
            })
        }

        pub fn cert_pem(&self) -> String {
            self.issuer.pem()
        }

        /// The SPIFFE ID of `path` (`actor/actor-0`, `learner`) in this
        /// CA's trust domain.
        pub fn spiffe_id(&self, path: &str) -> String {
            format!("spiffe://{}/{path}", self.trust_domain)
        }

        /// A certificate for `spiffe://<trust-domain>/<path>`, usable as a
        /// client and as a server certificate.
        pub fn issue(&self, path: &str, opts: &Options) -> Result<Issued, TlsError> {
            let mut params = CertificateParams::new(opts.hosts.clone()).map_err(e)?;
            params
                .subject_alt_names
                .push(SanType::URI(self.spiffe_id(path).try_into().map_err(e)?));
            params
                .distinguished_name
                .push(DnType::CommonName, path.to_string());
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            params.use_authority_key_identifier_extension = true;
            if let Some(((y0, m0, d0), (y1, m1, d1))) = opts.valid {
                params.not_before = rcgen::date_time_ymd(y0, m0, d0);
                params.not_after = rcgen::date_time_ymd(y1, m1, d1);
            }
            let key = KeyPair::generate().map_err(e)?;
            let cert = params.signed_by(&key, &self.issuer).map_err(e)?;
            Ok(Issued {
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
            })
        }

        /// Writes the CA certificate to `<dir>/ca.pem` (once) and `issued`
        /// to `<dir>/<name>.pem` and `<dir>/<name>.key` (owner-only), and
        /// returns the three paths.
        pub fn write(&self, dir: &Path, name: &str, issued: &Issued) -> Result<TlsFiles, TlsError> {
            let io = |p: &Path, x: std::io::Error| err(format!("writing {}: {x}", p.display()));
            std::fs::create_dir_all(dir).map_err(|x| io(dir, x))?;
            let ca = dir.join("ca.pem");
            if !ca.exists() {
                std::fs::write(&ca, self.cert_pem()).map_err(|x| io(&ca, x))?;
            }
            let cert = dir.join(format!("{name}.pem"));
            std::fs::write(&cert, &issued.cert_pem).map_err(|x| io(&cert, x))?;
            let key = dir.join(format!("{name}.key"));
            write_private(&key, &issued.key_pem).map_err(|x| io(&key, x))?;
            Ok(TlsFiles { cert, key, ca })
        }
    }

    fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
        use std::io::Write;
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        o.open(path)?.write_all(text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: &str) -> Peer {
        Peer::from_spiffe_id(id).unwrap()
    }

    #[test]
    fn roles_come_from_the_spiffe_path() {
        assert_eq!(peer("spiffe://bapo.test/actor/a-7").role, Some(Role::Actor));
        assert_eq!(peer("spiffe://bapo.test/learner").role, Some(Role::Learner));
        assert_eq!(peer("spiffe://bapo.test/admin/me").role, Some(Role::Admin));
        assert_eq!(peer("spiffe://bapo.test/actors/x").role, None);
        assert!(Peer::from_spiffe_id("https://bapo.test/actor").is_none());
        assert!(Peer::from_spiffe_id("spiffe://bapo.test").is_none());
    }

    #[test]
    fn each_method_is_open_to_its_role_only() {
        let actor = peer("spiffe://t/actor/a");
        let learner = peer("spiffe://t/learner");
        let admin = peer("spiffe://t/admin");
        let ok = |p: &Peer, m: &str| authorize(Some(p), m, false).is_ok();
        for m in [
            "/bapo.v1.RolloutSink/Push",
            "/bapo.v1.WeightSource/Subscribe",
        ] {
            assert!(ok(&actor, m) && !ok(&learner, m) && !ok(&admin, m), "{m}");
        }
        for m in [
            "/bapo.v1.BatchSource/Sample",
            "/bapo.v1.BatchSource/SampleStream",
            "/bapo.v1.BatchSource/ReportVersion",
        ] {
            assert!(ok(&learner, m) && !ok(&actor, m) && !ok(&admin, m), "{m}");
        }
        for m in [
            "/bapo.v1.BatchSource/GetStats",
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ] {
            assert!(ok(&learner, m) && ok(&actor, m) && ok(&admin, m), "{m}");
        }
        assert!(!ok(&admin, "/bapo.v1.BatchSource/Drain"));
        let denied = authorize(Some(&actor), "/bapo.v1.BatchSource/Sample", false).unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied.message().contains("role actor"),
            "{}",
            denied.message()
        );
        assert!(
            denied.message().contains("/bapo.v1.BatchSource/Sample"),
            "{}",
            denied.message()
        );
        let blocked = authorize(Some(&actor), "/bapo.v1.RolloutSink/Push", true).unwrap_err();
        assert_eq!(blocked.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            authorize(None, "/bapo.v1.RolloutSink/Push", false)
                .unwrap_err()
                .code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn issued_certificates_carry_their_role() {
        let ca = pki::Ca::new("bapo.test").unwrap();
        let issued = ca.issue("actor/actor-3", &pki::Options::default()).unwrap();
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        let p = Peer::from_cert(&der);
        assert_eq!(p.id, "spiffe://bapo.test/actor/actor-3");
        assert_eq!(p.role, Some(Role::Actor));
    }

    #[test]
    fn blocklists_ignore_comments_and_blank_lines() {
        let b = parse_blocklist(
            "# bad actors\nspiffe://t/actor/a-1  # poisoned\n\n  spiffe://t/actor/a-2\n",
        );
        assert_eq!(b.len(), 2);
        assert!(b.contains("spiffe://t/actor/a-1"));
    }

    #[test]
    fn loopback_urls_are_recognised() {
        assert!(is_loopback_url("http://127.0.0.1:50051"));
        assert!(is_loopback_url("https://localhost:1"));
        assert!(is_loopback_url("http://[::1]:5"));
        assert!(!is_loopback_url("http://bapo-buffer:50051"));
        assert!(!is_loopback_url("http://10.0.0.2:50051"));
    }
}
