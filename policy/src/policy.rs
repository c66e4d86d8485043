//! A policy: configuration, weights and the derived rotary tables, on one
//! device. Immutable once built; share it (`Arc`) between generations.

use burn::prelude::*;

use crate::{
    config::ModelConfig, logprob::next_token_logprobs_and_entropy, model::Transformer, rope::Rope,
};

#[derive(Debug)]
pub struct Policy {
    pub config: ModelConfig,
    pub model: Transformer,
    pub rope: Rope,
}

impl Policy {
    /// Random weights.
    pub fn init(config: ModelConfig, device: &Device) -> Self {
        let model = Transformer::init(&config, device);
        Self::with_model(config, model, device)
    }

    pub fn with_model(config: ModelConfig, model: Transformer, device: &Device) -> Self {
        let rope = Rope::new(
            config.head_dim(),
            config.rope_theta(),
            config.max_position_embeddings,
            device,
        );
        Self {
            config,
            model,
            rope,
        }
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.model.embed_tokens.weight.val().device()
    }

    /// `[batch, seq]` token ids as a tensor.
    pub fn tokens(rows: &[Vec<u32>], device: &Device) -> Tensor<2, Int> {
        let t = rows.first().map_or(0, Vec::len);
        assert!(
            rows.iter().all(|r| r.len() == t),
            "rows must have equal length"
        );
        let flat: Vec<i64> = rows.iter().flatten().map(|&x| x as i64).collect();
        Tensor::from_data(TensorData::new(flat, [rows.len(), t]), device)
    }

    /// Training forward: log-probs of each next token (under temperature
    /// `temperature`) and the entropy of each position, `[batch, seq − 1]`.
    pub fn token_logprobs(
        &self,
        tokens: Tensor<2, Int>,
        temperature: f32,
    ) -> (Tensor<2>, Tensor<2>) {
        let logits = self.model.forward(tokens.clone(), &self.rope, None);
        next_token_logprobs_and_entropy(logits, tokens, temperature)
    }
}
