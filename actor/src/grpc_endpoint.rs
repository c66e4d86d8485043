//! A gRPC service named in a config table (`[reward]`, `[actor.env]`):
//! `grpc://host:port` (plaintext, loopback only unless the table says
//! `insecure`) or `grpcs://host:port` (TLS, the server verified against the
//! table's `ca`), where the actor proves who it is with a client
//! certificate (`cert`, `key`) or a bearer token (`token_file`, bapo's
//! token-file format, the first secret of role `actor`), as bapo's own
//! services do. One parser and one channel builder, so every table that
//! names a service accepts, refuses and connects alike, and its errors name
//! the table's own keys.

use std::{path::Path, time::Duration};

use bapo_proto::tls::{Role, token::TokenFile};
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
};

/// A table's endpoint and TLS settings, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct GrpcEndpoint<'a> {
    /// The table's name in errors: `reward`, `actor.env`.
    pub table: &'static str,
    pub endpoint: &'a str,
    pub ca: Option<&'a Path>,
    pub server_name: Option<&'a str>,
    pub insecure: bool,
    /// The actor's client certificate and key (PEM), with `grpcs://`.
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
    /// A bapo token file whose `actor` secret every call carries.
    pub token_file: Option<&'a Path>,
}

/// A channel whose calls carry the table's bearer token, if any.
pub type AuthedChannel = InterceptedService<Channel, Bearer>;

/// Adds `authorization: Bearer <secret>` to every call (read once, when
/// the channel is built).
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// Why a call to a service of the user's failed, one name per gRPC status
/// for every client (rewards and environments count failures by it), and
/// whether calling again could help.
pub fn failure(code: tonic::Code) -> (&'static str, bool) {
    use tonic::Code;
    match code {
        Code::DeadlineExceeded | Code::Cancelled => ("timeout", true),
        Code::Unavailable => ("unavailable", true),
        Code::ResourceExhausted => ("capacity", true),
        Code::NotFound => ("not_found", false),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => ("refused", false),
        Code::Unauthenticated | Code::PermissionDenied => ("unauthorized", false),
        _ => ("error", true),
    }
}

/// Where to connect: a tonic URL (`http://` or `https://`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub url: String,
    pub tls: bool,
}

/// An endpoint setting that cannot mean what it says, named by its table.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EndpointError {
    /// Not `grpc[s]://host:port`; the table says what it expects instead.
    #[error("{0}.endpoint = {1:?}: expected \"grpc://host:port\" or \"grpcs://host:port\"")]
    Malformed(&'static str, String),
    #[error("{0}.ca is needed with a grpcs:// endpoint (it verifies the server)")]
    NoCa(&'static str),
    #[error("{0}.{1} only applies to a grpcs:// endpoint")]
    TlsOnly(&'static str, &'static str),
    #[error("{0}.cert and {0}.key go together (the client certificate and its key)")]
    CertKey(&'static str),
    #[error(
        "{0}.endpoint = {1:?} is plaintext beyond loopback: use grpcs:// with {0}.ca, or set \
         {0}.insecure = true"
    )]
    Plaintext(&'static str, String),
}

impl GrpcEndpoint<'_> {
    /// Checks the settings together and says where to connect.
    pub fn target(&self) -> Result<Target, EndpointError> {
        let bad = || EndpointError::Malformed(self.table, self.endpoint.to_string());
        let (scheme, rest) = self.endpoint.split_once("://").ok_or_else(bad)?;
        let tls = match scheme {
            "grpc" => false,
            "grpcs" => true,
            _ => return Err(bad()),
        };
        let host = rest.rsplit_once(':').map(|(h, _)| h).ok_or_else(bad)?;
        if host.is_empty() || rest.contains('/') {
            return Err(bad());
        }
        match (tls, self.ca) {
            (true, None) => return Err(EndpointError::NoCa(self.table)),
            (false, Some(_)) => return Err(EndpointError::TlsOnly(self.table, "ca")),
            _ => {}
        }
        if self.cert.is_some() != self.key.is_some() {
            return Err(EndpointError::CertKey(self.table));
        }
        let credentials = [
            ("server_name", self.server_name.is_some()),
            ("cert", self.cert.is_some()),
            ("token_file", self.token_file.is_some()),
        ];
        if let Some((key, _)) = credentials.iter().find(|(_, set)| !tls && *set) {
            return Err(EndpointError::TlsOnly(self.table, key));
        }
        if !tls && !self.insecure && !bapo_proto::tls::is_loopback_url(self.endpoint) {
            return Err(EndpointError::Plaintext(
                self.table,
                self.endpoint.to_string(),
            ));
        }
        let scheme = if tls { "https" } else { "http" };
        Ok(Target {
            url: format!("{scheme}://{rest}"),
            tls,
        })
    }

    /// A tonic endpoint for `target` (from [`Self::target`]), TLS set up
    /// with the table's CA and server name; nothing is dialled yet.
    pub fn channel(&self, target: &Target) -> anyhow::Result<Endpoint> {
        let mut ep = Endpoint::from_shared(target.url.clone())?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        if target.tls {
            bapo_proto::tls::install_default_provider();
            let ca_path = self
                .ca
                .ok_or_else(|| anyhow::anyhow!("{}", EndpointError::NoCa(self.table)))?;
            let ca = std::fs::read(ca_path).map_err(|e| {
                anyhow::anyhow!("reading {}.ca {}: {e}", self.table, ca_path.display())
            })?;
            let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
            if let Some(name) = self.server_name {
                tls = tls.domain_name(name);
            }
            if let (Some(cert), Some(key)) = (self.cert, self.key) {
                let read = |what: &str, p: &Path| {
                    std::fs::read(p).map_err(|e| {
                        anyhow::anyhow!("reading {}.{what} {}: {e}", self.table, p.display())
                    })
                };
                tls = tls.identity(Identity::from_pem(read("cert", cert)?, read("key", key)?));
            }
            ep = ep.tls_config(tls)?;
        }
        Ok(ep)
    }

    /// A lazily connected channel to `target` whose calls carry the
    /// table's token.
    pub fn connect_lazy(&self, target: &Target) -> anyhow::Result<AuthedChannel> {
        let channel = self.channel(target)?.connect_lazy();
        Ok(InterceptedService::new(channel, self.bearer()?))
    }

    /// The `actor` secret of `token_file`, as a header value.
    fn bearer(&self) -> anyhow::Result<Bearer> {
        let Some(path) = self.token_file else {
            return Ok(Bearer::default());
        };
        let file =
            TokenFile::load(path).map_err(|e| anyhow::anyhow!("{}.token_file: {e}", self.table))?;
        let secret = file.secret_for(Role::Actor).ok_or_else(|| {
            anyhow::anyhow!(
                "{}.token_file {}: no plain secret of role actor",
                self.table,
                path.display()
            )
        })?;
        let value = format!("Bearer {secret}").parse().map_err(|_| {
            anyhow::anyhow!(
                "{}.token_file: the secret is not a header value",
                self.table
            )
        })?;
        Ok(Bearer(Some(value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(endpoint: &str, ca: Option<&str>, insecure: bool) -> Result<Target, EndpointError> {
        GrpcEndpoint {
            table: "t",
            endpoint,
            ca: ca.map(Path::new),
            server_name: None,
            insecure,
            cert: None,
            key: None,
            token_file: None,
        }
        .target()
    }

    #[test]
    fn grpc_and_grpcs_become_tonic_urls() {
        let plain = target("grpc://127.0.0.1:50061", None, false).unwrap();
        assert_eq!(plain.url, "http://127.0.0.1:50061");
        assert!(!plain.tls);
        assert!(
            target("grpc://[::1]:1", None, false).is_ok(),
            "IPv6 loopback"
        );
        assert!(target("grpc://localhost:1", None, false).is_ok());
        let tls = target("grpcs://svc.ns:50061", Some("ca.pem"), false).unwrap();
        assert_eq!(tls.url, "https://svc.ns:50061");
        assert!(tls.tls);
        assert!(
            target("grpc://svc.ns:1", None, true).is_ok(),
            "insecure allows it"
        );
    }

    #[test]
    fn each_refusal_names_the_tables_key() {
        let err = |e: &str, ca: Option<&str>| target(e, ca, false).unwrap_err().to_string();
        assert!(err("http://x:1", None).contains("t.endpoint"));
        assert!(err("grpc://:1", None).contains("t.endpoint"));
        assert!(err("grpc://x:1/path", None).contains("t.endpoint"));
        assert!(err("grpcs://x:1", None).contains("t.ca is needed"));
        assert!(err("grpc://127.0.0.1:1", Some("ca")).contains("t.ca only"));
        assert!(err("grpc://10.0.0.5:1", None).contains("t.insecure"));
        let named = GrpcEndpoint {
            table: "t",
            endpoint: "grpc://127.0.0.1:1",
            ca: None,
            server_name: Some("x"),
            insecure: false,
            cert: None,
            key: None,
            token_file: None,
        };
        assert!(
            named
                .target()
                .unwrap_err()
                .to_string()
                .contains("t.server_name")
        );
    }

    #[test]
    fn every_status_has_one_failure_name() {
        use tonic::Code;
        for (code, want) in [
            (Code::DeadlineExceeded, ("timeout", true)),
            (Code::Unavailable, ("unavailable", true)),
            (Code::ResourceExhausted, ("capacity", true)),
            (Code::NotFound, ("not_found", false)),
            (Code::InvalidArgument, ("refused", false)),
            (Code::FailedPrecondition, ("refused", false)),
            (Code::Unauthenticated, ("unauthorized", false)),
            (Code::PermissionDenied, ("unauthorized", false)),
            (Code::Internal, ("error", true)),
        ] {
            assert_eq!(failure(code), want, "{code:?}");
        }
    }

    #[test]
    fn client_credentials_need_tls_and_each_other() {
        let ep = |endpoint: &'static str,
                  cert: Option<&'static str>,
                  key: Option<&'static str>,
                  token: Option<&'static str>| {
            GrpcEndpoint {
                table: "t",
                endpoint,
                ca: endpoint.starts_with("grpcs").then(|| Path::new("ca.pem")),
                server_name: None,
                insecure: false,
                cert: cert.map(Path::new),
                key: key.map(Path::new),
                token_file: token.map(Path::new),
            }
            .target()
            .map_err(|e| e.to_string())
        };
        let tls = "grpcs://x:1";
        assert!(ep(tls, Some("c"), Some("k"), None).is_ok());
        assert!(ep(tls, None, None, Some("t")).is_ok());
        assert!(
            ep(tls, Some("c"), None, None)
                .unwrap_err()
                .contains("t.cert and t.key")
        );
        let plain = "grpc://127.0.0.1:1";
        assert!(
            ep(plain, Some("c"), Some("k"), None)
                .unwrap_err()
                .contains("t.cert only")
        );
        assert!(
            ep(plain, None, None, Some("t"))
                .unwrap_err()
                .contains("t.token_file only")
        );
    }

    #[test]
    fn a_token_file_without_an_actor_secret_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        std::fs::write(&file, "learner 0123456789abcdef0123\n").unwrap();
        let ep = GrpcEndpoint {
            table: "t",
            endpoint: "grpcs://x:1",
            ca: None,
            server_name: None,
            insecure: false,
            cert: None,
            key: None,
            token_file: Some(&file),
        };
        let e = ep.bearer().err().unwrap().to_string();
        assert!(e.contains("no plain secret of role actor"), "{e}");
        std::fs::write(&file, "actor 0123456789abcdef0123\n").unwrap();
        assert!(ep.bearer().unwrap().0.is_some());
    }

    #[test]
    fn a_missing_ca_file_is_named_when_the_channel_is_built() {
        let ep = GrpcEndpoint {
            table: "t",
            endpoint: "grpcs://x:1",
            ca: Some(Path::new("/nonexistent/ca.pem")),
            server_name: None,
            insecure: false,
            cert: None,
            key: None,
            token_file: None,
        };
        let e = ep.channel(&ep.target().unwrap()).unwrap_err().to_string();
        assert!(e.contains("reading t.ca /nonexistent/ca.pem"), "{e}");
    }
}
