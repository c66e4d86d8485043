//! vLLM as the actor's generator (`[actor] engine = "vllm"`).
//!
//! The actor keeps everything it does with its own generation (leases,
//! rewards, pushes, partial and restart modes, metrics, mutual TLS to the
//! buffer and the learner) and sends each group to a vLLM server as one
//! token-id request with `n = K`. The actor's tokenizer and chat template
//! stay the source of truth: prompts go as token ids, and completions come
//! back as token ids with the log-prob of each sampled token.
//!
//! How the version guarantees hold (docs/architecture.md, "Engine
//! actors"): the engine labels every token it makes with the weight
//! version it holds (vLLM's per-token version spans); the actor sets that
//! label only after a reload succeeded, and to [`group::UNKNOWN`] before
//! one starts, so a token's version is always weights the engine held.
//! The label carries the learner incarnation, so a group across two
//! lineages is generated again, as in the Burn path. In restart mode a
//! weight update aborts the requests in flight and their groups are
//! generated again under the new version; in partial mode they are
//! paused with their KV cache and go on with the new weights (the spans
//! say where the version changed). Under LoRA each version is an adapter
//! loaded beside the base and each request names the one it runs on; vLLM
//! keeps a request on its adapter to the end, so every token of it is that
//! version (in restart mode an update still aborts what is in flight).
//! Leases and staleness are unchanged:
//! the slots see a version (for the lease's weight wait and the
//! versions-behind gauge) only once the engine serves it.

pub mod api;
pub mod config;
pub mod group;
pub mod server;
pub mod sync;
pub mod weights_dir;

use std::{
    path::PathBuf,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use bapo_policy::SamplingParams;
use metrics::counter;
use tokio::{sync::watch, task::JoinHandle};

pub use config::{VllmConfig, VllmConfigError};

use crate::{
    metrics as names, rollout::Outcome, subscription::PolicyCell, update_mode::UpdateMode,
};
use api::Api;

/// A group is generated again at most this often (weight updates in
/// restart mode, a new learner incarnation) before the slot gives up on
/// its problem and takes the next one.
const MAX_ATTEMPTS: usize = 8;

/// The generation side of an engine actor: what a slot calls.
pub struct Client {
    api: Api,
    request_timeout: Duration,
    /// What the engine serves: under LoRA, which adapter a request names.
    serving: PolicyCell,
    /// Keeps a weights directory of the actor's own alive.
    _own_dir: Option<tempfile::TempDir>,
}

/// Why a group could not be generated.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The server is down or restarting; the slot waits for it.
    #[error("{0}")]
    Down(api::ApiError),
    /// The server refused the request (e.g. a prompt too long for it).
    #[error("{0}")]
    Refused(api::ApiError),
    #[error("generated {MAX_ATTEMPTS} times without one usable group (last: {0})")]
    Unsettled(group::ChoiceError),
}

/// How long a slot waits after the server was found down before it takes
/// its next problem (or episode): long enough that it does not run through
/// its problems, and open an environment session for each episode, faster
/// than the loader notices the server is back.
pub const DOWN_WAIT: Duration = Duration::from_secs(1);

impl GenerateError {
    /// Counts a generation the engine could not make by its cause, waits
    /// [`DOWN_WAIT`] while the server is down, and returns the cause's
    /// label. Single-turn groups and episode turns both come here, so an
    /// engine outage reads the same in both.
    pub fn settle(&self) -> &'static str {
        let label = match self {
            Self::Down(_) => {
                counter!(names::ENGINE_DOWN_GROUPS).increment(1);
                std::thread::sleep(DOWN_WAIT);
                return "engine_down";
            }
            Self::Refused(_) => "engine_refused",
            Self::Unsettled(_) => "engine_unsettled",
        };
        counter!(names::PROBLEMS_SKIPPED, "reason" => label).increment(1);
        label
    }
}

/// The engine, the cell of the weights it serves (what the slots follow
/// instead of the subscription), and its background work, which ends with
/// an error only when the engine can never serve (the actor then exits).
pub struct Started {
    pub engine: Arc<Client>,
    pub serving: PolicyCell,
    pub background: JoinHandle<anyhow::Result<()>>,
}

/// Starts (or connects to) the server and the loader that keeps it on the
/// subscription's newest weights.
pub fn start(
    cfg: &VllmConfig,
    mode: UpdateMode,
    model_dir: Option<PathBuf>,
    weights: PolicyCell,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Started> {
    cfg.validate()?;
    // The actor's own private directory: the weights when no
    // `weights_dir` is set, and a started server's socket.
    let own_dir = if cfg.starts_server() || cfg.weights_dir.as_os_str().is_empty() {
        Some(weights_dir::own_temporary()?)
    } else {
        None
    };
    let weights_dir = match (&own_dir, cfg.weights_dir.as_os_str().is_empty()) {
        (Some(d), true) => d.path().to_path_buf(),
        _ => {
            weights_dir::claim(&cfg.weights_dir)?;
            cfg.weights_dir.clone()
        }
    };
    let (up_tx, up_rx) = watch::channel(false);
    let (ready_tx, ready_rx) = watch::channel(None);
    let (server, api) = match &own_dir {
        Some(own) if cfg.starts_server() => {
            let model_dir = cfg
                .model_dir
                .clone()
                .or(model_dir)
                .ok_or(VllmConfigError::NoModel)?;
            let launch = server::Launch {
                cfg: cfg.clone(),
                model_dir,
                socket: server::socket_in(own.path())?,
                ext_dir: server::ext_dir(&weights_dir),
                log: weights_dir.join("vllm.log"),
            };
            let api = Api::unix(&launch.socket, &cfg.served_model_name);
            let task = tokio::spawn(server::supervise(launch, up_tx, stop.clone()));
            (Some(task), api)
        }
        _ => {
            let api = Api::new(&cfg.url, &cfg.served_model_name);
            tokio::spawn(server::follow_health(api.clone(), up_tx, stop.clone()));
            (None, api)
        }
    };
    let loader = sync::Loader {
        api: api.clone(),
        weights_dir,
        mode,
        reload_timeout: Duration::from_secs_f64(cfg.reload_timeout_s),
        lora_rank: cfg.lora_rank,
        lora: sync::LoraState::default(),
        transfer: sync::Transfer::default(),
        weight_transfer: cfg.weight_transfer,
    };
    let loading = tokio::spawn(sync::follow(loader, weights, up_rx, ready_tx, stop));
    let background = tokio::spawn(async move {
        match server {
            Some(server) => tokio::select! {
                r = server => r?.map_err(anyhow::Error::new),
                r = loading => r?.map_err(anyhow::Error::new),
            },
            None => loading.await?.map_err(anyhow::Error::new),
        }
    });
    Ok(Started {
        engine: Arc::new(Client {
            api,
            request_timeout: Duration::from_secs_f64(cfg.request_timeout_s),
            serving: ready_rx.clone(),
            _own_dir: own_dir,
        }),
        serving: ready_rx,
        background,
    })
}

impl Client {
    /// Under LoRA, the name of the adapter the engine serves (its version's
    /// label); `None` for full weights.
    fn adapter(&self) -> Option<String> {
        let v = self.serving.borrow();
        v.as_ref()
            .filter(|v| v.lora().is_some())
            .map(|v| group::label(v.incarnation, v.version))
    }

    /// Where the server is: its URL, or `unix:<socket>` for one the actor
    /// started.
    pub fn url(&self) -> &str {
        self.api.at()
    }

    /// `k` responses to `prompt`, each token with the version the engine
    /// made it with; generated again when a weight update aborted it or
    /// its tokens span two learner incarnations.
    pub async fn generate(
        &self,
        prompt: &[u32],
        k: usize,
        params: &SamplingParams,
        abort: &AtomicBool,
    ) -> Result<Outcome, GenerateError> {
        let request = api::SamplingParams {
            n: k,
            temperature: params.temperature,
            seed: params.seed,
            max_tokens: params.max_new_tokens,
            logprobs: 0,
            stop_token_ids: params.stop_tokens.clone(),
            ignore_eos: true,
        };
        let mut last = None;
        for _ in 0..MAX_ATTEMPTS {
            if abort.load(std::sync::atomic::Ordering::Relaxed) {
                return Ok(Outcome::Aborted);
            }
            let adapter = self.adapter();
            let generated = self
                .api
                .generate(prompt, &request, adapter.as_deref(), self.request_timeout)
                .await;
            let mut generated = match generated {
                Ok(g) => g,
                // The adapter picked was unloaded before the request
                // arrived: pick again.
                Err(e @ api::ApiError::Status { status: 404, .. }) if adapter.is_some() => {
                    last = Some(group::ChoiceError::Malformed(e.to_string()));
                    continue;
                }
                Err(e @ api::ApiError::Status { status: 400, .. }) => {
                    return Err(GenerateError::Refused(e));
                }
                Err(e) => return Err(GenerateError::Down(e)),
            };
            if let Some(name) = &adapter {
                group::label_by_adapter(&mut generated.choices, name);
            }
            match group::responses(generated.choices) {
                Ok((responses, incarnation)) if responses.len() == k => {
                    return Ok(Outcome::Done {
                        responses,
                        incarnation,
                    });
                }
                Ok((responses, _)) => {
                    last = Some(group::ChoiceError::Malformed(format!(
                        "{} choices for n = {k}",
                        responses.len()
                    )));
                }
                Err(e) => last = Some(e),
            }
            counter!(names::ABORTED_GROUPS).increment(1);
            tracing::debug!("group generated again: {:?}", last);
        }
        Err(GenerateError::Unsettled(last.unwrap_or(
            group::ChoiceError::Malformed("no attempt".into()),
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn api_error() -> api::ApiError {
        api::ApiError::Unreachable {
            route: "/v1/completions".into(),
            why: "connection refused".into(),
        }
    }

    #[test]
    fn a_failure_is_labelled_by_cause_and_an_outage_waits() {
        assert_eq!(
            GenerateError::Refused(api_error()).settle(),
            "engine_refused"
        );
        let unsettled = GenerateError::Unsettled(group::ChoiceError::Malformed("x".into()));
        assert_eq!(unsettled.settle(), "engine_unsettled");
        let t0 = Instant::now();
        assert_eq!(GenerateError::Down(api_error()).settle(), "engine_down");
        assert!(t0.elapsed() >= DOWN_WAIT, "an outage waits for the loader");
    }
}
