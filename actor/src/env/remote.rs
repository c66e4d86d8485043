//! A user's `bapo.v1.EnvironmentService`, one episode per group member.
//!
//! Every answer is checked before it is used: observations within
//! [`MAX_OBSERVATION_BYTES`], token ids packed whole, info maps bounded,
//! rewards finite (the declared range is checked per step by the episode).
//! A server that no longer knows an episode (it restarted) answers
//! NOT_FOUND, and the episode is dropped without a retry. Each Reset
//! proposes the episode's id, so one the actor gave up on (its call
//! timeout) or could not use is closed under that id and holds nothing on
//! the server.

use bapo_proto::{
    packed,
    v1::{
        self, CloseRequest, DescribeEnvRequest, ResetRequest, StepRequest,
        environment_service_client::EnvironmentServiceClient,
    },
};
use std::time::Duration;

use super::{
    EnvConfig, EnvError, EnvInfo, Environment, Message, Observation, ResetInput, Started,
    StepOutcome, Turn,
};
use crate::{
    grpc_endpoint::{AuthedChannel, Target},
    reward::BoxFuture,
};

/// Largest observation accepted, contents or token ids, in bytes.
pub const MAX_OBSERVATION_BYTES: usize = 1 << 20;
/// Most `info` entries per step, longest key and value in bytes (a key
/// becomes metadata `env.<key>`, which the buffer bounds at 128 bytes).
pub const MAX_INFO_ENTRIES: usize = 16;
pub const MAX_INFO_KEY_BYTES: usize = 64;
pub const MAX_INFO_BYTES: usize = 256;

pub struct Remote {
    client: EnvironmentServiceClient<AuthedChannel>,
    url: String,
}

impl Remote {
    /// A lazily connected client of `url` (from [`EnvConfig::validate`]).
    pub fn new(cfg: &EnvConfig, url: &str, tls: bool) -> anyhow::Result<Self> {
        let target = Target {
            url: url.to_string(),
            tls,
        };
        Ok(Self {
            client: EnvironmentServiceClient::new(cfg.grpc().connect_lazy(&target)?),
            url: url.to_string(),
        })
    }

    fn failed(&self, what: &str, s: &tonic::Status) -> EnvError {
        let (reason, retryable) = crate::grpc_endpoint::failure(s.code());
        EnvError::new(
            reason,
            format!("{what} at {}: {}: {}", self.url, s.code(), s.message()),
            retryable,
        )
    }
}

/// How long the Close of an abandoned Reset may take, in the background.
const ABANDONED_CLOSE: Duration = Duration::from_secs(10);

/// Closes an episode that is not to be kept: a Reset dropped mid-call (the
/// actor's call timeout), failed, or answered with what cannot be used
/// leaves nothing open on the server (the proposed id is what a server
/// that honours it opened; closing an unknown id succeeds).
struct CloseUnlessKept {
    client: Option<EnvironmentServiceClient<AuthedChannel>>,
    id: String,
}

impl CloseUnlessKept {
    fn keep(&mut self) {
        self.client = None;
    }
}

impl Drop for CloseUnlessKept {
    fn drop(&mut self) {
        let (Some(mut client), Ok(rt)) =
            (self.client.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let req = CloseRequest {
            episode_id: std::mem::take(&mut self.id),
        };
        rt.spawn(async move {
            match tokio::time::timeout(ABANDONED_CLOSE, client.close(req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(s)) => tracing::debug!("Close of an abandoned episode: {s}"),
                Err(_) => tracing::debug!("Close of an abandoned episode timed out"),
            }
        });
    }
}

fn garbage(message: String) -> EnvError {
    EnvError::new("garbage", message, false)
}

/// An observation off the wire, checked; `None` when it carries nothing.
pub fn observation(o: Option<v1::Observation>) -> Result<Option<Observation>, EnvError> {
    let Some(o) = o else { return Ok(None) };
    if !o.token_ids.is_empty() {
        if o.token_ids.len() > MAX_OBSERVATION_BYTES {
            return Err(garbage(format!(
                "observation of {} token bytes, over {MAX_OBSERVATION_BYTES}",
                o.token_ids.len()
            )));
        }
        let ids = packed::unpack_u32(&o.token_ids)
            .map_err(|e| garbage(format!("observation token_ids: {e}")))?;
        return Ok(Some(Observation::Tokens(ids)));
    }
    let bytes: usize = o
        .messages
        .iter()
        .map(|m| m.content.len() + m.role.len())
        .sum();
    if bytes > MAX_OBSERVATION_BYTES {
        return Err(garbage(format!(
            "observation of {bytes} bytes, over {MAX_OBSERVATION_BYTES}"
        )));
    }
    if let Some(m) = o.messages.iter().find(|m| m.role.is_empty()) {
        return Err(garbage(format!(
            "an observation message without a role ({:?}...)",
            m.content.chars().take(40).collect::<String>()
        )));
    }
    if o.messages.is_empty() {
        return Ok(None);
    }
    Ok(Some(Observation::Messages(
        o.messages
            .into_iter()
            .map(|m| Message {
                role: m.role,
                content: m.content,
            })
            .collect(),
    )))
}

/// A step's answer off the wire, checked.
pub fn step_outcome(r: v1::StepResponse) -> Result<StepOutcome, EnvError> {
    if !r.reward.is_finite() {
        return Err(garbage(format!("step reward {} is not finite", r.reward)));
    }
    if r.info.len() > MAX_INFO_ENTRIES
        || r.info
            .iter()
            .any(|(k, v)| k.len() > MAX_INFO_KEY_BYTES || v.len() > MAX_INFO_BYTES)
    {
        return Err(garbage(format!(
            "info of {} entries: at most {MAX_INFO_ENTRIES}, keys of at most \
             {MAX_INFO_KEY_BYTES} bytes and values of at most {MAX_INFO_BYTES}",
            r.info.len()
        )));
    }
    Ok(StepOutcome {
        observation: observation(r.observation)?,
        reward: r.reward,
        done: r.done,
        truncated: r.truncated,
        info: r.info.into_iter().collect(),
    })
}

impl Environment for Remote {
    fn describe(&self) -> BoxFuture<'_, Result<EnvInfo, EnvError>> {
        let mut client = self.client.clone();
        Box::pin(async move {
            let r = client
                .describe(DescribeEnvRequest {})
                .await
                .map_err(|s| self.failed("Describe", &s))?
                .into_inner();
            let ok = r.min_reward.is_finite() && r.max_reward.is_finite();
            if !ok || r.min_reward > r.max_reward {
                return Err(garbage(format!(
                    "declared reward range [{}, {}] is not a range",
                    r.min_reward, r.max_reward
                )));
            }
            Ok(EnvInfo {
                name: r.name,
                max_turns: r.max_turns,
                min_reward: r.min_reward,
                max_reward: r.max_reward,
            })
        })
    }

    fn reset<'a>(&'a self, input: ResetInput<'a>) -> BoxFuture<'a, Result<Started, EnvError>> {
        let mut client = self.client.clone();
        let proposed = format!("{:024x}", rand::random::<u128>() >> 32);
        let req = ResetRequest {
            task: input.task.to_string(),
            problem_id: input.problem.id.clone(),
            prompt: input.problem.prompt.clone(),
            answer: input.problem.answer.clone(),
            metadata: Default::default(),
            seed: input.seed,
            episode_id: proposed.clone(),
        };
        let mut guard = CloseUnlessKept {
            client: Some(self.client.clone()),
            id: proposed,
        };
        Box::pin(async move {
            let r = client
                .reset(req)
                .await
                .map_err(|s| self.failed("Reset", &s))?
                .into_inner();
            if r.episode_id.is_empty() || r.episode_id.len() > MAX_INFO_BYTES {
                return Err(garbage(format!(
                    "episode_id of {} bytes (1 to {MAX_INFO_BYTES})",
                    r.episode_id.len()
                )));
            }
            guard.id.clone_from(&r.episode_id);
            let observation = observation(r.observation)?
                .ok_or_else(|| garbage("Reset answered no first observation".into()))?;
            guard.keep();
            Ok(Started {
                episode_id: r.episode_id,
                observation,
            })
        })
    }

    fn step<'a>(
        &'a self,
        episode_id: &'a str,
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        let mut client = self.client.clone();
        let req = StepRequest {
            episode_id: episode_id.to_string(),
            message: turn.text.to_string(),
            token_ids: packed::pack_u32(turn.tokens),
            truncated: turn.truncated,
            turn: turn.index,
        };
        Box::pin(async move {
            let r = client
                .step(req)
                .await
                .map_err(|s| self.failed("Step", &s))?
                .into_inner();
            step_outcome(r)
        })
    }

    fn close<'a>(&'a self, episode_id: &'a str) -> BoxFuture<'a, ()> {
        let mut client = self.client.clone();
        let req = CloseRequest {
            episode_id: episode_id.to_string(),
        };
        Box::pin(async move {
            if let Err(s) = client.close(req).await {
                tracing::debug!("environment Close of {episode_id}: {s}");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_that_break_the_contract_are_refused_by_name() {
        let big = v1::Observation {
            messages: vec![v1::EnvMessage {
                role: "tool".into(),
                content: "x".repeat(MAX_OBSERVATION_BYTES + 1),
            }],
            ..Default::default()
        };
        assert_eq!(observation(Some(big)).unwrap_err().reason, "garbage");
        let ragged = v1::Observation {
            token_ids: vec![1u8, 2, 3].into(),
            ..Default::default()
        };
        assert!(
            observation(Some(ragged))
                .unwrap_err()
                .message
                .contains("token_ids")
        );
        let roleless = v1::Observation {
            messages: vec![v1::EnvMessage::default()],
            ..Default::default()
        };
        assert!(
            observation(Some(roleless))
                .unwrap_err()
                .message
                .contains("role")
        );
        let nan = v1::StepResponse {
            reward: f32::NAN,
            ..Default::default()
        };
        assert!(
            step_outcome(nan)
                .unwrap_err()
                .message
                .contains("not finite")
        );
        let chatty = v1::StepResponse {
            info: (0..20).map(|i| (i.to_string(), String::new())).collect(),
            ..Default::default()
        };
        assert!(step_outcome(chatty).unwrap_err().message.contains("info"));
        let ok = v1::StepResponse {
            observation: Some(v1::Observation {
                messages: vec![v1::EnvMessage {
                    role: "tool".into(),
                    content: "<result>4</result>".into(),
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let out = step_outcome(ok).unwrap();
        assert_eq!(
            out.observation,
            Some(Observation::Messages(vec![Message::new(
                "tool",
                "<result>4</result>"
            )]))
        );
    }
}
