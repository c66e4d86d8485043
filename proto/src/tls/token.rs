//! Bearer tokens: client authentication for clusters without a PKI.
//!
//! A token file has one `<role> <secret>` line per token (`#` comments,
//! blank lines ignored), for example
//!
//! ```text
//! actor   4c0b8f2e9d1a7b3c5e6f…
//! learner sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! ```
//!
//! A server accepts every line: a caller whose `authorization: Bearer
//! <secret>` matches a line has that line's role. A role may have several
//! lines, so a new token can be rolled out before the old one is removed.
//! A line may hold `sha256:<hex>` instead of the secret, so that a server
//! can check a token it could not send (the learner verifies actors'
//! tokens without being able to pose as an actor). A client sends the
//! first plain secret of its own role.
//!
//! Checking digests every line's SHA-256 against the presented token's in
//! constant time (`subtle`), so the time a check takes tells nothing about
//! how much of a guess was right, or how long the real secret is.

use std::{fmt, path::Path};

use ring::digest::{SHA256, digest};
use subtle::ConstantTimeEq;

use super::{Role, TlsError, err};

/// The shortest secret accepted: 16 characters (a token from `openssl rand
/// -hex 16` has 32).
pub const MIN_SECRET_LEN: usize = 16;

/// The parsed lines of a token file.
#[derive(Clone, Default)]
pub struct TokenFile {
    entries: Vec<Entry>,
}

#[derive(Clone)]
struct Entry {
    role: Role,
    /// The secret, when the line holds it (not only its digest).
    secret: Option<String>,
    digest: [u8; 32],
}

impl fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roles: Vec<_> = self.entries.iter().map(|e| e.role.as_str()).collect();
        f.debug_struct("TokenFile").field("roles", &roles).finish()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A secret must survive an HTTP header unchanged: visible ASCII, no
/// spaces.
fn valid_secret(s: &str) -> bool {
    s.len() >= MIN_SECRET_LEN && s.bytes().all(|b| b.is_ascii_graphic())
}

fn parse_line(line: &str) -> Result<Option<Entry>, String> {
    let line = line.split('#').next().unwrap_or("").trim();
    if line.is_empty() {
        return Ok(None);
    }
    let mut words = line.split_whitespace();
    let (Some(role), Some(secret), None) = (words.next(), words.next(), words.next()) else {
        return Err("expected `<role> <secret>`".into());
    };
    let role = Role::parse(role)
        .ok_or_else(|| format!("unknown role {role:?} (known: actor, learner, admin)"))?;
    if let Some(hex) = secret.strip_prefix("sha256:") {
        let digest =
            parse_hex_digest(hex).ok_or("sha256: must be followed by 64 hexadecimal digits")?;
        return Ok(Some(Entry {
            role,
            secret: None,
            digest,
        }));
    }
    if !valid_secret(secret) {
        return Err(format!(
            "the {role} token must be at least {MIN_SECRET_LEN} visible ASCII characters"
        ));
    }
    Ok(Some(Entry {
        role,
        secret: Some(secret.to_string()),
        digest: sha256(secret.as_bytes()),
    }))
}

impl TokenFile {
    /// Parses a token file's text; `path` names it in errors (which never
    /// quote a secret).
    pub fn parse(text: &str, path: &Path) -> Result<Self, TlsError> {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            match parse_line(line) {
                Ok(Some(e)) => entries.push(e),
                Ok(None) => {}
                Err(why) => return Err(err(format!("{}:{}: {why}", path.display(), i + 1))),
            }
        }
        if entries.is_empty() {
            return Err(err(format!("{}: no token in it", path.display())));
        }
        Ok(Self { entries })
    }

    /// Reads and parses a token file.
    pub fn load(path: &Path) -> Result<Self, TlsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(format!("reading the token file {}: {e}", path.display())))?;
        Self::parse(&text, path)
    }

    /// The secret a client of `role` sends: the first plain one of that
    /// role.
    pub fn secret_for(&self, role: Role) -> Option<&str> {
        self.entries
            .iter()
            .filter(|e| e.role == role)
            .find_map(|e| e.secret.as_deref())
    }

    /// The role `presented` is a token of, if any. Every line is compared,
    /// each in constant time.
    pub fn verify(&self, presented: &str) -> Option<Role> {
        let d = sha256(presented.as_bytes());
        let mut found = None;
        for e in &self.entries {
            let same: bool = e.digest.ct_eq(&d).into();
            if same && found.is_none() {
                found = Some(e.role);
            }
        }
        found
    }
}

/// The token of an `authorization: Bearer <token>` header value.
pub fn bearer(header: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(header).ok()?;
    let (scheme, token) = s.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACTOR: &str = "actor-secret-0123456789";
    const LEARNER: &str = "learner-secret-0123456789";

    fn file(text: &str) -> Result<TokenFile, TlsError> {
        TokenFile::parse(text, Path::new("tokens"))
    }

    fn hex(d: [u8; 32]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn each_token_has_its_role_and_nothing_else_has_one() {
        let f = file(&format!(
            "# tokens\nactor {ACTOR}\n\nlearner sha256:{}  # digest only\n",
            hex(sha256(LEARNER.as_bytes()))
        ))
        .unwrap();
        assert_eq!(f.verify(ACTOR), Some(Role::Actor));
        assert_eq!(f.verify(LEARNER), Some(Role::Learner));
        assert_eq!(f.verify("actor-secret-012345678"), None, "a prefix");
        assert_eq!(f.verify(&format!("{ACTOR}x")), None, "an extension");
        assert_eq!(f.verify(""), None);
        assert_eq!(f.secret_for(Role::Actor), Some(ACTOR));
        assert_eq!(
            f.secret_for(Role::Learner),
            None,
            "only its digest is known"
        );
    }

    #[test]
    fn a_role_may_have_two_tokens_while_one_is_rolled_out() {
        let f = file(&format!("actor {ACTOR}\nactor {LEARNER}\n")).unwrap();
        assert_eq!(f.verify(ACTOR), Some(Role::Actor));
        assert_eq!(f.verify(LEARNER), Some(Role::Actor));
        assert_eq!(f.secret_for(Role::Actor), Some(ACTOR));
    }

    #[test]
    fn bad_lines_are_named_without_their_secret() {
        for (text, why) in [
            ("actor short\n", "at least 16"),
            (&*format!("judge {ACTOR}\n"), "unknown role \"judge\""),
            ("actor\n", "expected `<role> <secret>`"),
            (&*format!("actor {ACTOR} extra\n"), "expected"),
            ("learner sha256:abc\n", "64 hexadecimal"),
            ("# nothing\n", "no token"),
        ] {
            let e = file(text).unwrap_err().0;
            assert!(e.contains(why), "{text:?}: {e}");
            assert!(!e.contains(ACTOR), "{e}");
        }
        let e = file(&format!("actor {ACTOR}\nadmin x\n")).unwrap_err().0;
        assert!(e.starts_with("tokens:2:"), "{e}");
    }

    #[test]
    fn bearer_headers_are_read_case_insensitively() {
        assert_eq!(bearer(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer(b"bearer abc "), Some("abc"));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearerabc"), None);
        assert_eq!(bearer(&[0xff, b' ', b'a']), None);
    }
}
