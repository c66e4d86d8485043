//! Model configuration: read from a Hugging Face `config.json` (Llama and
//! Qwen2 families) or from a TOML preset for the built-in tiny models.

use std::path::Path;

use serde::{Deserialize, Serialize};

fn default_model_type() -> String {
    "llama".into()
}
pub(crate) fn default_theta() -> f64 {
    10_000.0
}
fn default_eps() -> f64 {
    1e-6
}
fn default_max_positions() -> usize {
    2048
}

/// The fields of a HF `config.json` this model uses; others are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Grouped-query attention; equal to the query heads when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// transformers < 5 writes `rope_theta` here; 5.x writes
    /// `rope_parameters`. Read through [`ModelConfig::rope_theta`].
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections: Qwen2 has it without saying so.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
}

/// transformers 5.x's RoPE block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

/// A configuration that cannot describe a working model, named.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {message}")]
    Parse { path: String, message: String },
    #[error("model config: {0}")]
    Invalid(String),
}

impl ModelConfig {
    /// Reads a HF `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self, ConfigError> {
        let text = read(path)?;
        let cfg: Self = serde_json::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a TOML preset (same keys as `config.json`).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<preset>".into(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// A built-in preset by name: `tiny` (CI and `bapo run`) or `small`
    /// (~25M parameters, for benchmarks).
    pub fn preset(name: &str) -> Result<Self, ConfigError> {
        let text = match name {
            "tiny" => include_str!("../presets/tiny.toml"),
            "small" => include_str!("../presets/small.toml"),
            other => {
                return Err(ConfigError::Invalid(format!(
                    "unknown preset {other:?} (known: tiny, small)"
                )));
            }
        };
        Self::from_toml_str(text)
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or_else(default_theta)
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(self.model_type == "qwen2")
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !matches!(self.model_type.as_str(), "llama" | "qwen2" | "mistral") {
            return bad(format!(
                "model_type {:?} is not of the Llama/Qwen2 family",
                self.model_type
            ));
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} must be positive"));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.kv_heads() == 0 || !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if let Some(s) = &self.rope_scaling
            && !s.is_null()
        {
            return bad(format!("rope_scaling {s} is not supported"));
        }
        if let Some(t) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
            && t != "default"
        {
            return bad(format!(
                "rope_type {t:?} is not supported (only \"default\")"
            ));
        }
        Ok(())
    }

    /// The config as transformers writes it (`config.json`), with every
    /// derived value spelled out.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let arch = match self.model_type.as_str() {
            "qwen2" => "Qwen2ForCausalLM",
            "mistral" => "MistralForCausalLM",
            _ => "LlamaForCausalLM",
        };
        serde_json::json!({
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.kv_heads(),
            "head_dim": self.head_dim(),
            "hidden_act": "silu",
            "rope_theta": self.rope_theta(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias(),
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": "float32",
        })
    }

    /// Parameters, counting a tied head once.
    pub fn num_params(&self) -> usize {
        let (h, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim(),
            self.kv_heads() * self.head_dim(),
        );
        let bias = if self.qkv_bias() { q + 2 * kv } else { 0 };
        let attn = h * q + 2 * h * kv + q * h + bias;
        let layer = attn + 3 * h * f + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid() {
        let tiny = ModelConfig::preset("tiny").unwrap();
        assert!(tiny.num_params() < 2_000_000, "{}", tiny.num_params());
        let small = ModelConfig::preset("small").unwrap();
        let n = small.num_params();
        assert!((20_000_000..30_000_000).contains(&n), "{n}");
    }

    #[test]
    fn rope_theta_is_read_from_either_place() {
        let v4 = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500.0}"#;
        let v5 = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}"#;
        let a: ModelConfig = serde_json::from_str(v4).unwrap();
        let b: ModelConfig = serde_json::from_str(v5).unwrap();
        assert_eq!((a.rope_theta(), b.rope_theta()), (500.0, 1e6));
        let yarn = v5.replace("\"default\"", "\"yarn\"");
        let c: ModelConfig = serde_json::from_str(&yarn).unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("yarn"));
    }

    #[test]
    fn qwen2_has_qkv_bias_and_bad_configs_are_named() {
        let json = r#"{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "tie_word_embeddings": true, "torch_dtype": "float32"}"#;
        let cfg: ModelConfig = serde_json::from_str(json).unwrap();
        cfg.validate().unwrap();
        assert!(cfg.qkv_bias());
        assert_eq!(cfg.head_dim(), 4);
        let bad = ModelConfig {
            num_key_value_heads: Some(3),
            ..cfg.clone()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("num_key_value_heads")
        );
        let bad = ModelConfig {
            model_type: "gpt2".into(),
            ..cfg
        };
        assert!(bad.validate().unwrap_err().to_string().contains("gpt2"));
    }
}
