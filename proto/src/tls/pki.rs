//! Certificates made in process (rcgen, ECDSA P-256): `bapo run`'s
//! ephemeral CA and the tests'. Not a CA for a cluster (use cert-manager or
//! your PKI there, see docs/deploy.md).

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
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
