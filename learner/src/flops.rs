//! Model FLOPs per trained token: the numerator of model FLOPs
//! utilisation (MFU), counted as the PyTorch reference counts them
//! (scripts/device/torch_learner.py), so the two are compared on the same
//! work. `6 N` for trained matmul weights (forward, input gradient,
//! weight gradient), `4 N` for frozen ones (no weight gradient), plus
//! attention's `12 L H d T` (PaLM's appendix B, not halved for the causal
//! mask). Embedding lookups, norms and biases are left out; a tied head
//! counts as a matmul. Recomputation (`checkpoint_layers`) is not model
//! work and is not counted.

use bapo_policy::{ModelConfig, lora::LoraConfig};

use crate::memory::trainable_params;

/// Weights of every matmul of the model: projections and the LM head.
pub fn matmul_params(c: &ModelConfig) -> u64 {
    let (h, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let q = c.num_attention_heads * c.head_dim();
    let kv = c.kv_heads() * c.head_dim();
    (c.num_hidden_layers * (2 * h * q + 2 * h * kv + 3 * h * f) + v * h) as u64
}

/// FLOPs per token of a training step on sequences of `seq` tokens.
pub fn per_token(c: &ModelConfig, lora: Option<&LoraConfig>, seq: usize) -> f64 {
    let linear = matmul_params(c) as f64;
    let q = c.num_attention_heads * c.head_dim();
    let attention = (12 * c.num_hidden_layers * q * seq) as f64;
    match lora {
        None => 6.0 * linear + attention,
        Some(l) => 4.0 * linear + 6.0 * trainable_params(c, Some(l)) as f64 + attention,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-0.5B: the PyTorch reference counts 493,961,216 matmul
    /// weights (its nn.Linear layers, the tied head included).
    #[test]
    fn qwen_05b_matches_the_reference_count() {
        let c = ModelConfig::from_hf_json(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/device/configs/qwen2.5-0.5b.json"
        )))
        .unwrap();
        assert_eq!(matmul_params(&c), 493_961_216);
        // 6 N + 12 · 24 · 896 · 272 at 16 + 256 tokens: 3.03 GFLOP.
        let f = per_token(&c, None, 272);
        assert_eq!(f, 6.0 * 493_961_216.0 + (12 * 24 * 896 * 272) as f64);
        let lora = LoraConfig::default();
        let l = per_token(&c, Some(&lora), 272);
        assert!(l < f && l > 4.0 * 493_961_216.0, "{l}");
    }
}
