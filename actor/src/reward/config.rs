//! The `[reward]` table: where a group's rewards come from, and how hard
//! to try before a group is given up.

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use crate::grpc_endpoint::{EndpointError, GrpcEndpoint};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// `builtin` (the task's own verifier), `builtin:<task>` (the same,
    /// checked against `[task] name`), `grpc://host:port` (a
    /// `bapo.v1.RewardService`, plaintext) or `grpcs://host:port` (TLS).
    pub endpoint: String,
    /// Deadline of one Score call.
    pub timeout_ms: u64,
    /// Further attempts after a failed call; then the group is dropped.
    pub retries: u32,
    /// Delay before the first retry, doubled each retry (capped at 10 s,
    /// with jitter).
    pub backoff_ms: u64,
    /// Score calls in flight at once, per actor.
    pub concurrency: usize,
    /// Also send each completion's token ids.
    pub send_tokens: bool,
    /// grpcs: the CA bundle (PEM) that verifies the reward server.
    pub ca: Option<PathBuf>,
    /// grpcs: the name to verify in its certificate (default: the host).
    pub server_name: Option<String>,
    /// Allow `grpc://` (plaintext) to a host beyond loopback.
    pub insecure: bool,
    /// grpcs: the actor's client certificate and key (PEM), for a server
    /// that requires one (the reference servers' `--client-ca`).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// grpcs: a bapo token file; every call carries its `actor` secret
    /// (the reference servers' `--token-file`).
    pub token_file: Option<PathBuf>,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            endpoint: "builtin".into(),
            timeout_ms: 30_000,
            retries: 3,
            backoff_ms: 250,
            concurrency: 8,
            send_tokens: false,
            ca: None,
            server_name: None,
            insecure: false,
            cert: None,
            key: None,
            token_file: None,
        }
    }
}

/// Where rewards come from, as `endpoint` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Builtin,
    /// An `http://` or `https://` URL for tonic, and whether it is TLS.
    Remote {
        url: String,
        tls: bool,
    },
}

/// A `[reward]` setting that cannot mean what it says, named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RewardConfigError {
    #[error(
        "reward.endpoint = {0:?}: expected \"builtin\", \"builtin:<task>\", \
         \"grpc://host:port\" or \"grpcs://host:port\""
    )]
    Endpoint(String),
    #[error("reward.endpoint = \"builtin:{named}\" but [task] name is {task:?}")]
    BuiltinTask { named: String, task: String },
    #[error("reward.{0} must be at least 1")]
    Zero(&'static str),
    #[error(transparent)]
    Grpc(EndpointError),
    #[error(
        "actor.shaping.format_bonus needs the task's own format check, which a reward \
         service does not have: set it to 0 with a grpc endpoint (the service can \
         score format itself)"
    )]
    FormatBonus,
}

impl RewardConfig {
    /// Checks the table against the task it scores and the shaping laid
    /// on top, and says where rewards come from.
    pub fn source(&self, task: &str, format_bonus: f32) -> Result<Source, RewardConfigError> {
        let bad = || RewardConfigError::Endpoint(self.endpoint.clone());
        for (name, v) in [
            ("timeout_ms", self.timeout_ms),
            ("concurrency", self.concurrency as u64),
        ] {
            if v == 0 {
                return Err(RewardConfigError::Zero(name));
            }
        }
        if !self.endpoint.contains("://") {
            return self.builtin(task);
        }
        let target = self.grpc().target().map_err(|e| match e {
            EndpointError::Malformed(..) => bad(),
            e => RewardConfigError::Grpc(e),
        })?;
        if format_bonus != 0.0 {
            return Err(RewardConfigError::FormatBonus);
        }
        Ok(Source::Remote {
            url: target.url,
            tls: target.tls,
        })
    }

    /// The endpoint and its TLS settings, for the shared parser and
    /// channel builder.
    pub fn grpc(&self) -> GrpcEndpoint<'_> {
        GrpcEndpoint {
            table: "reward",
            endpoint: &self.endpoint,
            ca: self.ca.as_deref(),
            server_name: self.server_name.as_deref(),
            insecure: self.insecure,
            cert: self.cert.as_deref(),
            key: self.key.as_deref(),
            token_file: self.token_file.as_deref(),
        }
    }

    fn builtin(&self, task: &str) -> Result<Source, RewardConfigError> {
        match self.endpoint.strip_prefix("builtin") {
            Some("") => Ok(Source::Builtin),
            Some(named) => match named.strip_prefix(':') {
                Some(n) if n == task => Ok(Source::Builtin),
                Some(n) => Err(RewardConfigError::BuiltinTask {
                    named: n.into(),
                    task: task.into(),
                }),
                None => Err(RewardConfigError::Endpoint(self.endpoint.clone())),
            },
            None => Err(RewardConfigError::Endpoint(self.endpoint.clone())),
        }
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(f: impl FnOnce(&mut RewardConfig)) -> Result<Source, RewardConfigError> {
        let mut c = RewardConfig::default();
        f(&mut c);
        c.source("arith", 0.0)
    }

    #[test]
    fn endpoints_name_their_source() {
        assert_eq!(source(|_| {}), Ok(Source::Builtin));
        assert_eq!(
            source(|c| c.endpoint = "builtin:arith".into()),
            Ok(Source::Builtin)
        );
        assert_eq!(
            source(|c| c.endpoint = "grpc://127.0.0.1:50061".into()),
            Ok(Source::Remote {
                url: "http://127.0.0.1:50061".into(),
                tls: false
            })
        );
        assert_eq!(
            source(|c| {
                c.endpoint = "grpcs://reward.ns.svc:50061".into();
                c.ca = Some("ca.pem".into());
            }),
            Ok(Source::Remote {
                url: "https://reward.ns.svc:50061".into(),
                tls: true
            })
        );
        assert!(
            source(|c| {
                c.endpoint = "grpc://reward:1".into();
                c.insecure = true;
            })
            .is_ok()
        );
    }

    #[test]
    fn settings_that_cannot_mean_what_they_say_are_refused_by_name() {
        type Case = (fn(&mut RewardConfig), &'static str);
        let cases: [Case; 9] = [
            (|c| c.endpoint = "http://x:1".into(), "reward.endpoint"),
            (|c| c.endpoint = "builtinx".into(), "reward.endpoint"),
            (|c| c.endpoint = "grpc://:1".into(), "reward.endpoint"),
            (
                |c| c.endpoint = "builtin:countdown".into(),
                "[task] name is \"arith\"",
            ),
            (|c| c.timeout_ms = 0, "reward.timeout_ms"),
            (|c| c.endpoint = "grpcs://x:1".into(), "reward.ca"),
            (
                |c| {
                    c.endpoint = "grpc://127.0.0.1:1".into();
                    c.ca = Some("ca".into());
                },
                "reward.ca only",
            ),
            (|c| c.endpoint = "grpc://reward:1".into(), "reward.insecure"),
            (|c| c.concurrency = 0, "reward.concurrency"),
        ];
        for (f, want) in cases {
            let e = source(f).unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want:?})");
        }
        let mut c = RewardConfig {
            endpoint: "grpc://127.0.0.1:1".into(),
            ..Default::default()
        };
        assert_eq!(c.source("arith", 0.5), Err(RewardConfigError::FormatBonus));
        c.endpoint = "builtin".into();
        assert!(
            c.source("arith", 0.5).is_ok(),
            "builtin has the format check"
        );
    }
}
