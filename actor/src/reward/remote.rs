//! A user's `bapo.v1.RewardService`, called once per group.
//!
//! The server declares its reward range once (`Describe`, asked before the
//! first Score and again after a failed call, since a restarted server may
//! be another version); every answer is checked against the contract
//! before any reward is used: one score per completion, finite values,
//! rewards within the declared range, per-token rewards one per token.
//! Calls are bounded by `[reward] timeout_ms` and, per actor, by
//! `[reward] concurrency`.

use std::{sync::Mutex, time::Duration};

use bapo_proto::{
    packed,
    v1::{
        DescribeRequest, ScoreItem, ScoreRequest, ScoreResponse,
        reward_service_client::RewardServiceClient,
    },
};
use tokio::sync::Semaphore;

use super::{BoxFuture, Group, RewardConfig, RewardError, Scored, Verifier};
use crate::grpc_endpoint::{AuthedChannel, Target};

/// Sub-scores per completion, at most (each becomes a metadata entry).
const MAX_SUB_SCORES: usize = 16;
const MAX_SUB_SCORE_NAME: usize = 64;

pub struct Remote {
    client: RewardServiceClient<AuthedChannel>,
    url: String,
    timeout: Duration,
    send_tokens: bool,
    permits: Semaphore,
    /// The declared `(min, max)` and name, once asked; cleared by a failed
    /// call.
    declared: Mutex<Option<Declared>>,
}

#[derive(Debug, Clone)]
struct Declared {
    name: String,
    min: f32,
    max: f32,
}

fn status_error(what: &str, s: &tonic::Status, timeout: Duration) -> RewardError {
    // Every failure is retried (`[reward] retries`); the name is the one
    // environments use for the same status.
    let (reason, _) = crate::grpc_endpoint::failure(s.code());
    let hint = if reason == "timeout" {
        format!(" (timeout {} ms)", timeout.as_millis())
    } else {
        String::new()
    };
    RewardError::new(
        reason,
        format!("{what}: {:?}: {}{hint}", s.code(), s.message()),
    )
}

impl Remote {
    pub fn new(cfg: &RewardConfig, url: &str, tls: bool) -> anyhow::Result<Self> {
        let target = Target {
            url: url.to_string(),
            tls,
        };
        let channel = cfg.grpc().connect_lazy(&target)?;
        Ok(Self {
            client: RewardServiceClient::new(channel),
            url: url.to_string(),
            timeout: cfg.timeout(),
            send_tokens: cfg.send_tokens,
            permits: Semaphore::new(cfg.concurrency),
            declared: Mutex::new(None),
        })
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(self.timeout);
        req
    }

    /// Bounds a call by the timeout even if the server never answers the
    /// HTTP/2 deadline.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, RewardError> {
        match tokio::time::timeout(self.timeout + Duration::from_millis(100), call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(status_error(
                &format!("{what} {}", self.url),
                &s,
                self.timeout,
            )),
            Err(_) => Err(RewardError::new(
                "timeout",
                format!(
                    "{what} {}: no answer within {} ms",
                    self.url,
                    self.timeout.as_millis()
                ),
            )),
        }
    }

    async fn declared(&self) -> Result<Declared, RewardError> {
        if let Some(d) = self.declared.lock().expect("declared lock").clone() {
            return Ok(d);
        }
        let mut client = self.client.clone();
        let info = self
            .bounded(
                "Describe",
                client.describe(self.request(DescribeRequest {})),
            )
            .await?;
        let ok = info.min_reward.is_finite() && info.max_reward.is_finite();
        if !ok || info.min_reward > info.max_reward {
            return Err(RewardError::new(
                "bad_range",
                format!(
                    "{} declares the reward range [{}, {}], which holds no finite reward",
                    self.url, info.min_reward, info.max_reward
                ),
            ));
        }
        let d = Declared {
            name: if info.name.is_empty() {
                self.url.clone()
            } else {
                info.name
            },
            min: info.min_reward,
            max: info.max_reward,
        };
        *self.declared.lock().expect("declared lock") = Some(d.clone());
        tracing::info!(name = %d.name, min = d.min, max = d.max, url = %self.url, "reward service");
        Ok(d)
    }

    fn items(&self, group: Group<'_>) -> Vec<ScoreItem> {
        group
            .completions
            .iter()
            .map(|c| ScoreItem {
                problem_id: group.problem.id.clone(),
                task: group.task.to_string(),
                prompt: group.problem.prompt.clone(),
                completion: c.text.clone(),
                answer: group.problem.answer.clone(),
                metadata: Default::default(),
                completion_tokens: if self.send_tokens {
                    packed::pack_u32(&c.tokens)
                } else {
                    Default::default()
                },
                truncated: c.truncated,
            })
            .collect()
    }

    async fn call(&self, group: Group<'_>) -> Result<Vec<Scored>, RewardError> {
        let _permit = self.permits.acquire().await.expect("never closed");
        let declared = self.declared().await?;
        let mut client = self.client.clone();
        let req = ScoreRequest {
            items: self.items(group),
            request_id: group.problem.id.clone(),
        };
        let resp = self
            .bounded("Score", client.score(self.request(req)))
            .await?;
        check(&resp, group, &declared)
    }
}

/// Checks an answer against the contract and turns it into scores.
fn check(resp: &ScoreResponse, group: Group<'_>, d: &Declared) -> Result<Vec<Scored>, RewardError> {
    let n = group.completions.len();
    if resp.scores.len() != n {
        return Err(RewardError::new(
            "bad_answer",
            format!(
                "{} returned {} scores for {n} completions",
                d.name,
                resp.scores.len()
            ),
        ));
    }
    resp.scores
        .iter()
        .zip(group.completions)
        .enumerate()
        .map(|(i, (s, c))| {
            if !s.reward.is_finite() {
                return Err(RewardError::new(
                    "not_finite",
                    format!("{} gave completion {i} the reward {}", d.name, s.reward),
                ));
            }
            if s.reward < d.min || s.reward > d.max {
                return Err(RewardError::new(
                    "out_of_range",
                    format!(
                        "{} gave completion {i} the reward {}, outside the range [{}, {}] it declared",
                        d.name, s.reward, d.min, d.max
                    ),
                ));
            }
            Ok(Scored {
                reward: s.reward,
                well_formed: false,
                token_rewards: token_rewards(&s.token_rewards, c.tokens.len(), i, &d.name)?,
                sub_scores: sub_scores(&s.sub_scores, i, &d.name)?,
            })
        })
        .collect()
}

fn token_rewards(bytes: &[u8], n: usize, i: usize, who: &str) -> Result<Vec<f32>, RewardError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let bad = |why: String| RewardError::new("bad_answer", format!("{who}, completion {i}: {why}"));
    let v = packed::unpack_f32(bytes).map_err(|e| bad(format!("token_rewards: {e}")))?;
    if v.len() != n {
        return Err(bad(format!("{} token rewards for {n} tokens", v.len())));
    }
    if let Some(x) = v.iter().find(|x| !x.is_finite()) {
        return Err(bad(format!("a token reward is {x}")));
    }
    Ok(v)
}

fn sub_scores(
    m: &std::collections::HashMap<String, f32>,
    i: usize,
    who: &str,
) -> Result<std::collections::BTreeMap<String, f32>, RewardError> {
    let bad = |why: String| RewardError::new("bad_answer", format!("{who}, completion {i}: {why}"));
    if m.len() > MAX_SUB_SCORES {
        return Err(bad(format!(
            "{} sub-scores (at most {MAX_SUB_SCORES})",
            m.len()
        )));
    }
    for (k, v) in m {
        let ok_name = !k.is_empty()
            && k.len() <= MAX_SUB_SCORE_NAME
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok_name {
            return Err(bad(format!(
                "sub-score name {:?} (1-{MAX_SUB_SCORE_NAME} of [A-Za-z0-9_])",
                k.chars().take(80).collect::<String>()
            )));
        }
        if !v.is_finite() {
            return Err(bad(format!("sub-score {k} is {v}")));
        }
    }
    Ok(m.iter().map(|(k, v)| (k.clone(), *v)).collect())
}

impl Verifier for Remote {
    fn name(&self) -> String {
        // The declared name once Describe answered, the URL before.
        match &*self.declared.lock().expect("declared lock") {
            Some(d) => d.name.clone(),
            None => self.url.clone(),
        }
    }

    fn score<'a>(&'a self, group: Group<'a>) -> BoxFuture<'a, Result<Vec<Scored>, RewardError>> {
        Box::pin(async move {
            let r = self.call(group).await;
            if r.is_err() {
                // Ask again: the server may have restarted as another one.
                *self.declared.lock().expect("declared lock") = None;
            }
            r
        })
    }
}
