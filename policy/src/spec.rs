//! Where a policy comes from: a built-in preset with fresh weights (and
//! the built-in character tokenizer), or a HF-format directory
//! (`config.json`, safetensors, `tokenizer.json`), which is also what
//! `bapo sft` and the learner's final export write.

use std::path::PathBuf;

use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{
    config::ModelConfig,
    device::{ComputeDevice, DeviceError, Precision},
    hf,
    policy::Policy,
    tokenizer::TextTokenizer,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSpec {
    /// Built-in preset (`tiny`, `small`), used when `hf_dir` is not set.
    pub preset: String,
    /// A HF-format model directory; wins over `preset`.
    pub hf_dir: Option<PathBuf>,
    /// A `tokenizer.json`; default: the one in `hf_dir`, else the built-in
    /// character tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Seed of a preset's random initial weights.
    pub seed: u64,
    /// The backend every command runs the model on: `cpu`, `wgpu`, `cuda`.
    pub device: ComputeDevice,
    /// The compute dtype of generation and of the learner's forward and
    /// backward: `f32`, `bf16`, `f16` (weights and optimiser stay f32).
    pub precision: Precision,
}

impl Default for ModelSpec {
    fn default() -> Self {
        Self {
            preset: "tiny".into(),
            hf_dir: None,
            tokenizer: None,
            seed: 0,
            device: ComputeDevice::Cpu,
            precision: Precision::F32,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("model: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("model: {0}")]
    Load(#[from] hf::LoadError),
    #[error("model: {0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("model: {0}")]
    Device(#[from] DeviceError),
    #[error("model: tokenizer has {tokenizer} tokens but the model only {model}")]
    VocabMismatch { tokenizer: usize, model: usize },
}

impl ModelSpec {
    pub fn from_dir(dir: PathBuf) -> Self {
        Self {
            hf_dir: Some(dir),
            ..Self::default()
        }
    }

    /// The model in `dir`, on this spec's device and precision (a warm
    /// start or a checkpoint keeps where and how the run computes).
    pub fn at_dir(&self, dir: PathBuf) -> Self {
        Self {
            device: self.device,
            precision: self.precision,
            ..Self::from_dir(dir)
        }
    }

    /// The Burn device of `self.device`, refused by name when this binary
    /// lacks its backend or the backend (or its adapter) lacks
    /// `self.precision`.
    pub fn burn_device(&self) -> Result<Device, SpecError> {
        Ok(self.device.device_for(self.precision)?)
    }

    pub fn tokenizer(&self) -> Result<TextTokenizer, SpecError> {
        let path = self
            .tokenizer
            .clone()
            .or_else(|| self.hf_dir.as_ref().map(|d| d.join("tokenizer.json")));
        Ok(match path {
            Some(p) if p.exists() || self.tokenizer.is_some() => TextTokenizer::from_file(&p)?,
            _ => TextTokenizer::char_level(),
        })
    }

    pub fn load(&self, device: &Device) -> Result<(Policy, TextTokenizer), SpecError> {
        let mut policy = match &self.hf_dir {
            Some(dir) => hf::load(dir, device)?,
            None => {
                device.seed(self.seed);
                Policy::init(ModelConfig::preset(&self.preset)?, device)
            }
        };
        policy.model = policy.model.with_precision(self.precision);
        let tokenizer = self.tokenizer()?;
        if tokenizer.vocab_size() > policy.config.vocab_size {
            return Err(SpecError::VocabMismatch {
                tokenizer: tokenizer.vocab_size(),
                model: policy.config.vocab_size,
            });
        }
        Ok((policy, tokenizer))
    }
}
