//! The `[actor.vllm]` table: which vLLM server generates, or how to start
//! one, and where the weights it reloads are written.

use std::{collections::BTreeMap, path::PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VllmConfig {
    /// An existing server (e.g. a sidecar: `http://127.0.0.1:8000`) that
    /// was started with bapo's worker extension. Empty: the actor starts
    /// one itself with `python` and supervises it.
    pub url: String,
    /// Plain HTTP to a server off this host carries prompts and weight
    /// paths unauthenticated; refused unless this says it is meant.
    pub allow_remote: bool,
    /// Where each weight version is written for the server to reload (an
    /// HF safetensors directory per version); the same path must be
    /// visible to the server. Empty: a directory of the actor's own.
    pub weights_dir: PathBuf,
    /// The server's `--served-model-name`.
    pub served_model_name: String,
    /// The Python of a venv with vLLM (scripts/vllm-env.sh makes one),
    /// used when the actor starts the server.
    pub python: PathBuf,
    /// The model directory the server starts from (default: `[model]
    /// hf_dir`); it must be the learner's architecture.
    pub model_dir: Option<PathBuf>,
    /// `--dtype` of a started server: "float32", "bfloat16", "float16".
    pub dtype: String,
    /// GiB of KV cache of a started server on the CPU
    /// (`VLLM_CPU_KVCACHE_SPACE`).
    pub cpu_kv_cache_gib: u32,
    /// Further arguments of a started server.
    pub extra_args: Vec<String>,
    /// Further environment of a started server.
    pub env: BTreeMap<String, String>,
    /// How long a started server may take to answer `/health`.
    pub start_timeout_s: f64,
    /// How long one generation request may take.
    pub request_timeout_s: f64,
    /// How long a weight reload may take before it counts as hung.
    pub reload_timeout_s: f64,
    /// Restarts of a started server that died, before the actor gives up
    /// and exits non-zero (the count resets after an hour of health).
    pub max_restarts: u32,
    /// The learner trains LoRA adapters of this rank (`[learner.lora]`;
    /// `bapo run` copies it): a started server gets runtime LoRA loading
    /// and each version is loaded as an adapter. 0: full weights.
    pub lora_rank: usize,
    /// Each version after the first goes into the engine in place, as
    /// what changed, through vLLM's weight-transfer API (bapo's
    /// `bapo_shm` engine; a server at `url` needs `--weight-transfer-config
    /// '{"backend": "bapo_shm"}'`). false: every version is reloaded from
    /// a file.
    pub weight_transfer: bool,
}

impl Default for VllmConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            allow_remote: false,
            weights_dir: PathBuf::new(),
            served_model_name: "bapo".into(),
            python: default_python(),
            model_dir: None,
            dtype: "float32".into(),
            cpu_kv_cache_gib: 2,
            extra_args: Vec::new(),
            env: BTreeMap::new(),
            start_timeout_s: 600.0,
            request_timeout_s: 600.0,
            reload_timeout_s: 120.0,
            max_restarts: 3,
            lora_rank: 0,
            weight_transfer: true,
        }
    }
}

/// The venv scripts/vllm-env.sh makes, or `BAPO_VLLM_VENV`'s.
fn default_python() -> PathBuf {
    let venv = std::env::var_os("BAPO_VLLM_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/bapo/vllm-venv"))
        });
    venv.unwrap_or_default().join("bin/python")
}

/// A `[actor.vllm]` setting that cannot mean what it says, named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VllmConfigError {
    #[error(
        "actor.vllm.url = {0:?}: plain HTTP to a server off this host is \
         unauthenticated; set actor.vllm.allow_remote = true if that is meant"
    )]
    Remote(String),
    #[error("actor.vllm.url = {0:?}: expected http://host:port")]
    Url(String),
    #[error("actor.vllm.dtype = {0:?}: expected float32, bfloat16 or float16")]
    Dtype(String),
    #[error("actor.vllm.{0} = {1}: must be a finite number of seconds > 0")]
    Seconds(&'static str, f64),
    #[error(
        "actor.vllm: a started server needs a model directory \
         (actor.vllm.model_dir or [model] hf_dir); bapo's built-in presets are not \
         HF models vLLM can load"
    )]
    NoModel,
    #[error("actor.vllm.lora_rank = {0}: vLLM serves ranks up to {max}", max = VLLM_LORA_RANKS[VLLM_LORA_RANKS.len() - 1])]
    LoraRank(usize),
}

/// The values vLLM 0.32 accepts for `--max-lora-rank`.
pub const VLLM_LORA_RANKS: [usize; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];

/// The smallest `--max-lora-rank` vLLM accepts that holds rank `r`.
pub fn vllm_max_lora_rank(r: usize) -> Option<usize> {
    VLLM_LORA_RANKS.into_iter().find(|&m| m >= r)
}

impl VllmConfig {
    /// Whether the actor starts the server itself.
    pub fn starts_server(&self) -> bool {
        self.url.is_empty()
    }

    pub fn validate(&self) -> Result<(), VllmConfigError> {
        if !self.url.is_empty() {
            if !self.url.starts_with("http://") {
                return Err(VllmConfigError::Url(self.url.clone()));
            }
            if !self.allow_remote && !bapo_proto::tls::is_loopback_url(&self.url) {
                return Err(VllmConfigError::Remote(self.url.clone()));
            }
        }
        if !["float32", "bfloat16", "float16"].contains(&self.dtype.as_str()) {
            return Err(VllmConfigError::Dtype(self.dtype.clone()));
        }
        if vllm_max_lora_rank(self.lora_rank).is_none() {
            return Err(VllmConfigError::LoraRank(self.lora_rank));
        }
        for (name, s) in [
            ("start_timeout_s", self.start_timeout_s),
            ("request_timeout_s", self.request_timeout_s),
            ("reload_timeout_s", self.reload_timeout_s),
        ] {
            if !(s.is_finite() && s > 0.0) {
                return Err(VllmConfigError::Seconds(name, s));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut VllmConfig)) -> Result<(), VllmConfigError> {
        let mut c = VllmConfig::default();
        f(&mut c);
        c.validate()
    }

    #[test]
    fn what_cannot_mean_what_it_says_is_refused_by_name() {
        assert_eq!(with(|_| {}), Ok(()));
        assert_eq!(with(|c| c.url = "http://127.0.0.1:8000".into()), Ok(()));
        let remote = with(|c| c.url = "http://vllm:8000".into()).unwrap_err();
        assert!(remote.to_string().contains("allow_remote"), "{remote}");
        assert_eq!(
            with(|c| {
                c.url = "http://vllm:8000".into();
                c.allow_remote = true;
            }),
            Ok(())
        );
        assert!(matches!(
            with(|c| c.url = "https://x".into()),
            Err(VllmConfigError::Url(_))
        ));
        assert!(matches!(
            with(|c| c.dtype = "f32".into()),
            Err(VllmConfigError::Dtype(_))
        ));
        assert!(matches!(
            with(|c| c.reload_timeout_s = 0.0),
            Err(VllmConfigError::Seconds("reload_timeout_s", _))
        ));
        let rank = with(|c| c.lora_rank = 600).unwrap_err();
        assert!(rank.to_string().contains("actor.vllm.lora_rank"), "{rank}");
    }

    #[test]
    fn a_lora_rank_maps_to_the_smallest_max_rank_vllm_accepts() {
        let m = |r| vllm_max_lora_rank(r);
        assert_eq!(
            [m(0), m(1), m(2), m(16), m(17), m(512)],
            [Some(1), Some(1), Some(8), Some(16), Some(32), Some(512)]
        );
        assert_eq!(m(513), None);
    }
}
