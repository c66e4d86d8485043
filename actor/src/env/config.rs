//! The `[actor.env]` table: which environment answers the model's turns,
//! and the bounds of one episode.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::grpc_endpoint::{EndpointError, GrpcEndpoint};

/// Where an episode's observations come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvKind {
    /// Single-turn rollouts: no environment (the default).
    #[default]
    None,
    /// The built-in calculator (`<call>EXPR</call>` answered with
    /// `<result>VALUE</result>`), rewarded by the task's verifier.
    Builtin,
    /// A `bapo.v1.EnvironmentService` at `endpoint`.
    Grpc,
    /// An OpenEnv server at `endpoint` (`http://host:port`), spoken to over
    /// its stateful WebSocket protocol (`[actor.env.openenv]`).
    Openenv,
}

/// How bapo's turns and observations map onto an OpenEnv environment's
/// action and observation JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OpenEnvConfig {
    /// The action of a turn, as JSON: every `{text}` in a string value is
    /// replaced by the turn's text (checked against the server's
    /// `/schema` at start).
    pub action: String,
    /// The observation field the model reads (dots for nested objects).
    pub observation_field: String,
    /// Episodes open at once per actor, at most: the server's
    /// `max_concurrent_envs` divided among the actors. Must cover
    /// `actor.concurrency` (each slot plays one episode at a time), or
    /// `actor.concurrency x group_size` with `parallel_members`.
    pub max_sessions: usize,
    /// Rewards outside `[min_reward, max_reward]` are refused and the
    /// episode dropped (OpenEnv declares no range).
    pub min_reward: f32,
    pub max_reward: f32,
    /// Largest WebSocket frame read from the server; a bigger one drops
    /// its episode (`garbage`) instead of being held in memory.
    pub max_frame_bytes: usize,
}

impl Default for OpenEnvConfig {
    fn default() -> Self {
        Self {
            action: r#"{"message": "{text}"}"#.into(),
            observation_field: "text".into(),
            max_sessions: 1,
            min_reward: 0.0,
            max_reward: 1.0,
            max_frame_bytes: 4 << 20,
        }
    }
}

/// Which end of an overlong observation is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TruncateSide {
    /// Keep the start (a long tool output's head).
    #[default]
    Right,
    /// Keep the end (a log's tail).
    Left,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvConfig {
    /// `none` (single-turn), `builtin` (the calculator), `grpc` or
    /// `openenv`.
    pub kind: EnvKind,
    /// `grpc`: `grpc://host:port` (plaintext) or `grpcs://host:port` (TLS).
    pub endpoint: String,
    /// Model turns per episode, at most (the environment may allow fewer).
    pub max_turns: u32,
    /// Response tokens per episode, model turns and observations together;
    /// each turn's cap is the smaller of `[actor.sampling]
    /// max_new_tokens` and what is left.
    pub max_episode_tokens: usize,
    /// Tokens of one observation's content, at most; longer ones are cut
    /// at `truncate`.
    pub max_observation_tokens: usize,
    pub truncate: TruncateSide,
    /// Deadline of one Reset, Step or Close call.
    pub step_timeout_ms: u64,
    /// Wall-clock limit of one episode (generation included); past it the
    /// episode is dropped.
    pub episode_timeout_s: f64,
    /// Further attempts after a failed call; then the episode is dropped.
    pub retries: u32,
    /// Delay before the first retry, doubled each retry (capped at 10 s,
    /// with jitter).
    pub backoff_ms: u64,
    /// grpcs: the CA bundle (PEM) that verifies the server.
    pub ca: Option<PathBuf>,
    /// grpcs: the name to verify in its certificate (default: the host).
    pub server_name: Option<String>,
    /// Allow plaintext (`grpc://`, or `http://` for OpenEnv) to a host
    /// beyond loopback.
    pub insecure: bool,
    /// grpcs: the actor's client certificate and key (PEM), for a server
    /// that requires one (the reference servers' `--client-ca`).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// grpcs: a bapo token file; every call carries its `actor` secret
    /// (the reference servers' `--token-file`).
    pub token_file: Option<PathBuf>,
    /// Play a group's K episodes at once, each on a thread of its own,
    /// instead of one after another: vLLM batches their concurrent turns.
    /// Each slot then holds K environment sessions at a time. Unset: at
    /// once with `engine = "vllm"` (6.6-7.6x the tokens/s of in turn,
    /// measured by actor/tests/vllm_episodes.rs), in turn with Burn
    /// (which generates a turn for one context at a time).
    pub parallel_members: Option<bool>,
    pub openenv: OpenEnvConfig,
}

impl Default for EnvConfig {
    fn default() -> Self {
        Self {
            kind: EnvKind::None,
            endpoint: String::new(),
            max_turns: 4,
            max_episode_tokens: 256,
            max_observation_tokens: 64,
            truncate: TruncateSide::Right,
            step_timeout_ms: 10_000,
            episode_timeout_s: 300.0,
            retries: 3,
            backoff_ms: 200,
            ca: None,
            server_name: None,
            insecure: false,
            cert: None,
            key: None,
            token_file: None,
            parallel_members: None,
            openenv: OpenEnvConfig::default(),
        }
    }
}

/// An `[actor.env]` setting that cannot mean what it says, named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvConfigError {
    #[error("actor.env.{0} must be at least 1")]
    Zero(&'static str),
    #[error("actor.env.episode_timeout_s = {0} must be a finite number of seconds > 0")]
    EpisodeTimeout(f64),
    #[error(
        "actor.env.endpoint = {0:?}: expected \"grpc://host:port\" or \"grpcs://host:port\" \
         with kind = \"grpc\""
    )]
    Endpoint(String),
    #[error(
        "actor.env.endpoint is set but actor.env.kind = {0:?}: set kind = \"grpc\" (or \
         \"openenv\") to use it"
    )]
    EndpointUnused(String),
    #[error(transparent)]
    Grpc(EndpointError),
    #[error(
        "actor.env.endpoint = {0:?} is plaintext beyond loopback (OpenEnv is spoken \
         without TLS): set actor.env.insecure = true to allow it"
    )]
    Plaintext(String),
    #[error("actor.env.ca and actor.env.server_name do not apply to kind = \"openenv\" (no TLS)")]
    OpenEnvTls,
    #[error(
        "actor.env.max_observation_tokens = {obs} leaves no room for a model turn within \
         actor.env.max_episode_tokens = {episode}"
    )]
    NoRoom { obs: usize, episode: usize },
    #[error(
        "actor.env.endpoint = {0:?}: expected \"http://host:port\" (the OpenEnv server's \
         base URL; its WebSocket is at /ws) with kind = \"openenv\""
    )]
    OpenEnvEndpoint(String),
    #[error("actor.env.openenv.{field}: {why}")]
    OpenEnv { field: &'static str, why: String },
}

impl EnvConfig {
    pub fn enabled(&self) -> bool {
        self.kind != EnvKind::None
    }

    /// Checks the table; with `kind = "grpc"`, returns the tonic URL and
    /// whether it is TLS.
    pub fn validate(&self) -> Result<Option<(String, bool)>, EnvConfigError> {
        if !self.enabled() {
            if !self.endpoint.is_empty() {
                return Err(EnvConfigError::EndpointUnused("none".into()));
            }
            return Ok(None);
        }
        for (name, v) in [
            ("max_turns", self.max_turns as u64),
            ("max_episode_tokens", self.max_episode_tokens as u64),
            ("max_observation_tokens", self.max_observation_tokens as u64),
            ("step_timeout_ms", self.step_timeout_ms),
        ] {
            if v == 0 {
                return Err(EnvConfigError::Zero(name));
            }
        }
        if !(self.episode_timeout_s.is_finite() && self.episode_timeout_s > 0.0) {
            return Err(EnvConfigError::EpisodeTimeout(self.episode_timeout_s));
        }
        if self.max_observation_tokens >= self.max_episode_tokens {
            return Err(EnvConfigError::NoRoom {
                obs: self.max_observation_tokens,
                episode: self.max_episode_tokens,
            });
        }
        match self.kind {
            EnvKind::Grpc => self.url().map(Some),
            EnvKind::Openenv => self.openenv_url().map(|u| Some((u, false))),
            _ if !self.endpoint.is_empty() => Err(EnvConfigError::EndpointUnused("builtin".into())),
            _ => Ok(None),
        }
    }

    /// The OpenEnv server's base URL, its mapping checked.
    fn openenv_url(&self) -> Result<String, EnvConfigError> {
        let bad = || EnvConfigError::OpenEnvEndpoint(self.endpoint.clone());
        let rest = self.endpoint.strip_prefix("http://").ok_or_else(bad)?;
        let rest = rest.trim_end_matches('/');
        let host = rest.rsplit_once(':').map(|(h, _)| h).ok_or_else(bad)?;
        if host.is_empty() || rest.contains('/') {
            return Err(bad());
        }
        if !self.insecure && !bapo_proto::tls::is_loopback_url(&self.endpoint) {
            return Err(EnvConfigError::Plaintext(self.endpoint.clone()));
        }
        if self.ca.is_some() || self.server_name.is_some() {
            return Err(EnvConfigError::OpenEnvTls);
        }
        let o = &self.openenv;
        let field = |field, why: String| EnvConfigError::OpenEnv { field, why };
        let action: serde_json::Value = serde_json::from_str(&o.action)
            .map_err(|e| field("action", format!("not JSON: {e}")))?;
        if !action.is_object() || !o.action.contains("{text}") {
            return Err(field(
                "action",
                "must be a JSON object with \"{text}\" in a string value".into(),
            ));
        }
        if o.observation_field.is_empty() {
            return Err(field("observation_field", "is empty".into()));
        }
        if o.max_sessions == 0 {
            return Err(EnvConfigError::Zero("openenv.max_sessions"));
        }
        if !(1 << 10..=1 << 30).contains(&o.max_frame_bytes) {
            return Err(field(
                "max_frame_bytes",
                format!("{} is not within 1 KiB to 1 GiB", o.max_frame_bytes),
            ));
        }
        let finite = o.min_reward.is_finite() && o.max_reward.is_finite();
        if !finite || o.min_reward > o.max_reward {
            return Err(field(
                "min_reward",
                format!("[{}, {}] is not a range", o.min_reward, o.max_reward),
            ));
        }
        Ok(format!("http://{rest}"))
    }

    fn url(&self) -> Result<(String, bool), EnvConfigError> {
        let target = self.grpc().target().map_err(|e| match e {
            EndpointError::Malformed(..) => EnvConfigError::Endpoint(self.endpoint.clone()),
            e => EnvConfigError::Grpc(e),
        })?;
        Ok((target.url, target.tls))
    }

    /// The endpoint and its TLS settings, for the shared parser and
    /// channel builder.
    pub fn grpc(&self) -> GrpcEndpoint<'_> {
        GrpcEndpoint {
            table: "actor.env",
            endpoint: &self.endpoint,
            ca: self.ca.as_deref(),
            server_name: self.server_name.as_deref(),
            insecure: self.insecure,
            cert: self.cert.as_deref(),
            key: self.key.as_deref(),
            token_file: self.token_file.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut EnvConfig)) -> Result<Option<(String, bool)>, EnvConfigError> {
        let mut c = EnvConfig {
            kind: EnvKind::Grpc,
            endpoint: "grpc://127.0.0.1:50071".into(),
            ..Default::default()
        };
        f(&mut c);
        c.validate()
    }

    #[test]
    fn off_by_default_and_a_loopback_endpoint_is_accepted() {
        assert_eq!(EnvConfig::default().validate(), Ok(None));
        assert_eq!(
            with(|_| {}),
            Ok(Some(("http://127.0.0.1:50071".into(), false)))
        );
    }

    #[test]
    fn settings_that_cannot_mean_what_they_say_are_refused_by_name() {
        let err = |f: fn(&mut EnvConfig)| with(f).unwrap_err().to_string();
        assert!(err(|c| c.max_turns = 0).contains("actor.env.max_turns"));
        assert!(err(|c| c.endpoint = "http://x:1".into()).contains("actor.env.endpoint"));
        assert!(err(|c| c.endpoint = "grpc://10.0.0.5:1".into()).contains("plaintext"));
        assert!(err(|c| c.endpoint = "grpcs://h:1".into()).contains("actor.env.ca"));
        assert!(err(|c| c.episode_timeout_s = f64::NAN).contains("episode_timeout_s"));
        assert!(err(|c| c.max_observation_tokens = 256).contains("no room"));
        assert!(
            err(|c| c.kind = EnvKind::Builtin).contains("kind"),
            "an endpoint nothing reads"
        );
        assert!(
            err(|c| c.kind = EnvKind::None).contains("actor.env.kind = \"none\""),
            "an endpoint without a kind is not silently single-turn"
        );
        assert!(
            with(|c| {
                c.endpoint = "grpc://10.0.0.5:1".into();
                c.insecure = true;
            })
            .is_ok()
        );
    }

    #[test]
    fn an_openenv_mapping_that_cannot_work_is_refused_by_name() {
        let openenv = |f: fn(&mut EnvConfig)| {
            with(|c| {
                c.kind = EnvKind::Openenv;
                c.endpoint = "http://127.0.0.1:8000".into();
                f(c);
            })
        };
        assert_eq!(
            openenv(|_| {}),
            Ok(Some(("http://127.0.0.1:8000".into(), false)))
        );
        let err = |f: fn(&mut EnvConfig)| openenv(f).unwrap_err().to_string();
        assert!(err(|c| c.endpoint = "ws://h:1".into()).contains("http://host:port"));
        assert!(err(|c| c.endpoint = "http://10.1.1.1:1".into()).contains("plaintext"));
        assert!(err(|c| c.openenv.action = "{".into()).contains("openenv.action"));
        assert!(err(|c| c.openenv.action = r#"{"m": "x"}"#.into()).contains("{text}"));
        assert!(err(|c| c.openenv.max_sessions = 0).contains("max_sessions"));
        assert!(err(|c| c.openenv.max_frame_bytes = 10).contains("max_frame_bytes"));
        assert!(err(|c| c.openenv.max_reward = -1.0).contains("not a range"));
    }
}
