//! The few routes of vLLM's HTTP server bapo uses (vLLM >= 0.32, started
//! with `VLLM_SERVER_DEV_MODE=1`, `--enable-scale-out` and bapo's worker
//! extension): token ids in, token ids, log-probs and per-token weight
//! versions out, and the pause / reload / version / resume dance of a
//! weight update. Knows nothing of leases or rollouts.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A vLLM server's base URL and the model name it serves.
#[derive(Clone)]
pub struct Api {
    http: crate::http::Http,
    base: String,
    /// Where the server is, for people: the URL, or `unix:<path>`.
    at: String,
    model: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Not answered: refused, reset, or past the deadline.
    #[error("vLLM {route}: {why}")]
    Unreachable { route: String, why: String },
    #[error("vLLM {route}: HTTP {status}: {body}")]
    Status {
        route: String,
        status: u16,
        body: String,
    },
    #[error("vLLM {route}: unexpected answer: {why}")]
    Answer { route: String, why: String },
}

/// One group's request: `n` samples of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct SamplingParams {
    pub n: usize,
    pub temperature: f32,
    pub seed: u64,
    pub max_tokens: usize,
    /// Only the sampled token's log-prob (`processed_logprobs` mode: of the
    /// temperature-scaled distribution the token was drawn from).
    pub logprobs: u32,
    pub stop_token_ids: Vec<u32>,
    /// The actor's stop tokens, not the model's generation config, end a
    /// response: the same rule as bapo's own generation.
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Generated {
    pub choices: Vec<Choice>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub index: usize,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<Logprobs>,
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub weight_versions: Vec<VersionSpan>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Logprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TokenLogprob {
    pub logprob: f32,
}

/// Output tokens `start..end` of a choice were made by weights `version`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VersionSpan {
    pub version: String,
    pub start: usize,
    pub end: usize,
}

/// Largest answer read from the engine: a completion's text, token ids and
/// log-probs are about 100 bytes a token, so 64 MiB holds n = 16 samples of
/// 32k tokens; a bigger answer is an error, not an allocation.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// How `/pause` treats requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// Freeze them with their KV cache; they go on after `/resume` with
    /// whatever weights are loaded then (partial rollouts).
    Keep,
    /// End them now; they return what they generated so far.
    Abort,
}

impl Api {
    pub fn new(base: &str, model: &str) -> Self {
        let base = base.trim_end_matches('/').to_string();
        Self {
            http: crate::http::Http::new(MAX_RESPONSE_BYTES),
            at: base.clone(),
            base,
            model: model.to_string(),
        }
    }

    /// A server listening on the Unix socket at `path`.
    pub fn unix(path: &std::path::Path, model: &str) -> Self {
        Self {
            http: crate::http::Http::unix(path, MAX_RESPONSE_BYTES),
            base: "http://localhost".into(),
            at: format!("unix:{}", path.display()),
            model: model.to_string(),
        }
    }

    /// Where the server is: its URL, or `unix:<socket path>`.
    pub fn at(&self) -> &str {
        &self.at
    }

    /// `GET /health` answered 200 within `timeout`. (A healthy server
    /// may still have lost its weights to a failed plain reload: bapo's
    /// extension restores them, see `reload`.)
    pub async fn healthy(&self, timeout: Duration) -> bool {
        matches!(
            self.call("GET", "/health", None, timeout).await,
            Ok((200, _))
        )
    }

    /// `params.n` samples of `prompt` from the served model, or from LoRA
    /// adapter `adapter` on it.
    pub async fn generate(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        adapter: Option<&str>,
        timeout: Duration,
    ) -> Result<Generated, ApiError> {
        let model = adapter.unwrap_or(&self.model);
        let body = json!({"model": model, "token_ids": prompt, "sampling_params": params});
        let v = self
            .post("/inference/v1/generate", Some(body), timeout)
            .await?;
        serde_json::from_value(v).map_err(|e| ApiError::Answer {
            route: "/inference/v1/generate".into(),
            why: e.to_string(),
        })
    }

    pub async fn pause(&self, mode: Pause, timeout: Duration) -> Result<(), ApiError> {
        let mode = match mode {
            Pause::Keep => "keep",
            Pause::Abort => "abort",
        };
        self.post(&format!("/pause?mode={mode}"), None, timeout)
            .await
            .map(drop)
    }

    pub async fn resume(&self, timeout: Duration) -> Result<(), ApiError> {
        self.post("/resume", None, timeout).await.map(drop)
    }

    /// Loads the HF safetensors directory `dir` in place (bapo's worker
    /// extension, which also re-ties a tied LM head).
    pub async fn reload(&self, dir: &str, timeout: Duration) -> Result<(), ApiError> {
        self.rpc("reload_hf_dir", json!([dir]), timeout)
            .await
            .map(drop)
    }

    /// Sets up the server's weight-transfer engine (bapo's `bapo_shm`,
    /// `--weight-transfer-config`); refused by a server started without it
    /// or one that cannot patch in place.
    pub async fn init_transfer(&self, timeout: Duration) -> Result<(), ApiError> {
        let body = json!({"init_info": {}});
        self.post("/init_weight_transfer_engine", Some(body), timeout)
            .await
            .map(drop)
    }

    /// One weight update through the transfer engine: the patch file at
    /// `path` written in place, then the tokens made from now on labelled
    /// `label` (`/finish_weight_update` sets the version).
    pub async fn transfer(
        &self,
        path: &str,
        label: &str,
        timeout: Duration,
    ) -> Result<(), ApiError> {
        self.post("/start_weight_update", None, timeout).await?;
        let body = json!({"update_info": {"path": path}});
        self.post("/update_weights", Some(body), timeout).await?;
        let body = json!({"weight_version": label});
        self.post("/finish_weight_update", Some(body), timeout)
            .await
            .map(drop)
    }

    /// Loads the PEFT adapter directory `dir` (absolute) as `name`
    /// (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` and `--enable-lora`).
    pub async fn load_lora(
        &self,
        name: &str,
        dir: &str,
        timeout: Duration,
    ) -> Result<(), ApiError> {
        let body = json!({"lora_name": name, "lora_path": dir});
        self.post_text("/v1/load_lora_adapter", body, timeout).await
    }

    /// Unloads adapter `name`.
    pub async fn unload_lora(&self, name: &str, timeout: Duration) -> Result<(), ApiError> {
        let body = json!({"lora_name": name});
        self.post_text("/v1/unload_lora_adapter", body, timeout)
            .await
    }

    /// A POST whose success answer is plain text (the LoRA routes).
    async fn post_text(&self, route: &str, body: Value, timeout: Duration) -> Result<(), ApiError> {
        let (status, text) = self.call("POST", route, Some(body), timeout).await?;
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(ApiError::Status {
            route: route.to_string(),
            status,
            body: text.chars().take(2000).collect(),
        })
    }

    /// The served model's architecture as the worker sees it (bapo's
    /// worker extension): vocabulary, layers, heads, tied embeddings.
    pub async fn describe(&self, timeout: Duration) -> Result<Value, ApiError> {
        let v = self.rpc("describe_model", json!([]), timeout).await?;
        let text = v.as_str().unwrap_or_default();
        serde_json::from_str(text).map_err(|e| ApiError::Answer {
            route: "/collective_rpc describe_model".into(),
            why: format!("{e}: {v}"),
        })
    }

    /// Labels the tokens generated from now on.
    pub async fn set_version(&self, label: &str, timeout: Duration) -> Result<(), ApiError> {
        let body = json!({"new_version": label});
        self.post("/update_weight_version", Some(body), timeout)
            .await
            .map(drop)
    }

    /// Drops cached prefixes computed by older weights, so a new request
    /// for a known prompt is computed by the new ones.
    pub async fn reset_prefix_cache(&self, timeout: Duration) -> Result<(), ApiError> {
        self.post("/reset_prefix_cache", None, timeout)
            .await
            .map(drop)
    }

    /// A worker method through `/collective_rpc`; the first worker's answer.
    async fn rpc(&self, method: &str, args: Value, timeout: Duration) -> Result<Value, ApiError> {
        let body = json!({"method": method, "args": args, "timeout": timeout.as_secs_f64()});
        let mut v = self.post("/collective_rpc", Some(body), timeout).await?;
        match v.get_mut("results").and_then(|r| r.get_mut(0)) {
            Some(first) => Ok(first.take()),
            None => Err(ApiError::Answer {
                route: format!("/collective_rpc {method}"),
                why: format!("no results in {v}"),
            }),
        }
    }

    async fn post(
        &self,
        route: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let (status, text) = self.call("POST", route, body, timeout).await?;
        if !(200..300).contains(&status) {
            return Err(ApiError::Status {
                route: route.to_string(),
                status,
                body: text.chars().take(2000).collect(),
            });
        }
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| ApiError::Answer {
            route: route.to_string(),
            why: format!("{e}: {}", text.chars().take(200).collect::<String>()),
        })
    }

    /// One HTTP exchange: the status and the body as text.
    async fn call(
        &self,
        method: &str,
        route: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<(u16, String), ApiError> {
        let url = format!("{}{route}", self.base);
        self.http
            .exchange(method, &url, body, timeout)
            .await
            .map_err(|why| ApiError::Unreachable {
                route: route.to_string(),
                why,
            })
    }
}
