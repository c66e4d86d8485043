//! Roles and identities of callers, and who may call what.

use std::{fmt, sync::Arc};

use rustls::pki_types::CertificateDer;
use tonic::Status;

/// What a certificate or a token allows its holder to call.
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

/// An authenticated caller: the identity and role its certificate (or its
/// bearer token) carries.
///
/// The rule: the certificate's first SAN URI with the `spiffe` scheme is
/// its identity; the first segment of that URI's path is its role.
/// `spiffe://bapo.example/actor/actor-7` is an actor,
/// `spiffe://bapo.example/learner` the learner. A certificate without such
/// a URI (or with an unknown role) is authenticated (the CA issued it) but
/// has no role: it may call what any authenticated caller may. A caller
/// authenticated by a bearer token is `token:<role>`: tokens name a role,
/// not a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The SPIFFE ID, `token:<role>`, or `"(no SPIFFE ID)"`.
    pub id: String,
    pub role: Option<Role>,
}

/// What a server knows of a connection: its addresses and, with mutual
/// TLS, the peer its certificate names. In every request's extensions
/// (set by the transport's connection guard).
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub tcp: tonic::transport::server::TcpConnectInfo,
    pub peer: Option<Arc<Peer>>,
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

    /// The caller a valid bearer token of `role` authenticates.
    pub fn token(role: Role) -> Self {
        Self {
            id: format!("token:{role}"),
            role: Some(role),
        }
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

    pub(crate) fn role_name(&self) -> &'static str {
        self.role.map_or("none", Role::as_str)
    }
}

/// A caller authenticated by its bearer token, put in the request's
/// extensions by [`super::AuthLayer`] (a certificate's peer travels with
/// the connection instead).
#[derive(Debug, Clone)]
pub(crate) struct TokenPeer(pub Arc<Peer>);

/// The authenticated caller of `req`: the peer its connection's
/// certificate names, or else the one its bearer token names; `None` on a
/// plaintext server.
pub fn peer<T>(req: &tonic::Request<T>) -> Option<&Peer> {
    let ext = req.extensions();
    let by_cert = ext.get::<ConnInfo>().and_then(|c| c.peer.as_deref());
    by_cert.or_else(|| ext.get::<TokenPeer>().map(|t| &*t.0))
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
        ("bapo.v1.RolloutSink", "Push" | "Lease" | "ReleaseLease")
        | ("bapo.v1.WeightSource", "Subscribe") => Access::Only(Role::Actor),
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
            "{path} needs a client certificate or a bearer token"
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

#[cfg(test)]
mod tests {
    use rustls::pki_types::pem::PemObject;

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
            "/bapo.v1.RolloutSink/Lease",
            "/bapo.v1.RolloutSink/ReleaseLease",
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
        // A method of the actors' service that bapo does not serve is
        // nobody's, the actors' included.
        assert!(!ok(&actor, "/bapo.v1.RolloutSink/Drain"));
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
        let ca = super::super::pki::Ca::new("bapo.test").unwrap();
        let issued = ca
            .issue("actor/actor-3", &super::super::pki::Options::default())
            .unwrap();
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        let p = Peer::from_cert(&der);
        assert_eq!(p.id, "spiffe://bapo.test/actor/actor-3");
        assert_eq!(p.role, Some(Role::Actor));
    }
}
