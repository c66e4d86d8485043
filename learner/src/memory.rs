//! What a training step holds on its device, estimated before the first
//! step, so that a configuration the device cannot hold is refused at
//! start, by name and with the numbers, rather than failing an hour in
//! when the first long batch arrives.
//!
//! The estimate counts what lives through a step: the f32 master weights,
//! their compute-dtype copies (cast at use and kept by autodiff for the
//! backward pass), the gradients (the accumulator's and one micro-batch's
//! at once), AdamW's two moments, frozen copies (a KL reference, ReMix's
//! policies), and the activations one forward/backward pass keeps. The
//! pass is the bound `micro_batch_tokens` sets, or `micro_batch_seqs`
//! sequences of the model's longest. Per token and layer, autodiff keeps
//! the inputs of every matmul and of the fused kernels (see
//! `policy/src/model.rs`): the two norms' f32 inputs and outputs, q, k, v
//! before and after RoPE, the attention output and its log-sum-exp, the
//! MLP's gate, up and gated product; at the head, the logits in the
//! compute dtype and in f32, and their gradient. Attention keeps no
//! `T × T` scores on the CPU (fused kernel) but the composed fallback on
//! other devices does, and the estimate counts them there.
//!
//! It is an estimate: allocators round up and keep freed blocks, and a
//! backend may hold workspace. `bapo bench learner` prints it beside the
//! measured peak (docs/gpu.md has the measured ratios).

use bapo_policy::{ModelConfig, Precision, lora::LoraConfig};

use crate::LearnerConfig;

/// Bytes of each part of a step, and their sum.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MemoryEstimate {
    /// f32 master weights (every parameter, frozen ones too).
    pub weights: u64,
    /// Compute-dtype copies of the weights (0 in f32).
    pub weight_casts: u64,
    /// Gradients of the trainable weights.
    pub gradients: u64,
    /// AdamW's moments of the trainable weights.
    pub optimizer: u64,
    /// Frozen whole-model copies (KL reference, ReMix's policies).
    pub frozen: u64,
    /// What one forward/backward pass keeps.
    pub activations: u64,
    /// Tokens (padded) of the largest pass, which `activations` is for.
    pub pass_tokens: u64,
}

impl MemoryEstimate {
    pub fn total(&self) -> u64 {
        self.weights
            + self.weight_casts
            + self.gradients
            + self.optimizer
            + self.frozen
            + self.activations
    }

    /// The parts in GiB, for an error or a log line.
    pub fn describe(&self) -> String {
        format!(
            "{:.2} GiB = weights {:.2} + casts {:.2} + gradients {:.2} + AdamW {:.2} + \
             frozen copies {:.2} + activations {:.2} (a pass of {} tokens)",
            gib(self.total()),
            gib(self.weights),
            gib(self.weight_casts),
            gib(self.gradients),
            gib(self.optimizer),
            gib(self.frozen),
            gib(self.activations),
            self.pass_tokens
        )
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `gib` GiB in bytes (a capacity from the config).
pub fn bytes(gib: f64) -> u64 {
    (gib * (1u64 << 30) as f64) as u64
}

/// Whether attention keeps its `T × T` scores for the backward pass: yes
/// on every device but the CPU, whose fused kernel recomputes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attention {
    Fused,
    Scores,
}

impl Attention {
    /// What a model computing in `precision` on `device` runs.
    pub fn on(device: &bapo_policy::burn::prelude::Device, precision: Precision) -> Self {
        match bapo_policy::kernels::serve(device, precision) {
            true => Self::Fused,
            false => Self::Scores,
        }
    }
}

/// Trainable parameters under `lora` (all of them without).
pub fn trainable_params(model: &ModelConfig, lora: Option<&LoraConfig>) -> u64 {
    let Some(l) = lora else {
        return model.num_params() as u64;
    };
    let per_layer: usize = l
        .targets
        .iter()
        .map(|t| {
            let (d_in, d_out) = t.shape(model);
            l.rank * (d_in + d_out)
        })
        .sum();
    (per_layer * model.num_hidden_layers) as u64
}

/// Tokens of the largest forward/backward pass the config allows: the
/// budget (a longer sequence is refused by name), or without one
/// `micro_batch_seqs` sequences of the model's longest.
pub fn pass_tokens(model: &ModelConfig, cfg: &LearnerConfig) -> u64 {
    match cfg.micro_batch_tokens {
        0 => (cfg.micro_batch_seqs * model.max_position_embeddings) as u64,
        budget => budget as u64,
    }
}

/// Bytes one pass of `tokens` tokens (in sequences of at most `seq`)
/// keeps for its backward pass.
pub fn activation_bytes(
    model: &ModelConfig,
    precision: Precision,
    attention: Attention,
    tokens: u64,
    seq: u64,
) -> u64 {
    let c = dtype_bytes(precision);
    let (h, f) = (model.hidden_size as u64, model.intermediate_size as u64);
    let (nh, nkv) = (model.num_attention_heads as u64, model.kv_heads() as u64);
    let hd = model.head_dim() as u64;
    let (q, kv) = (nh * hd, nkv * hd);
    // Two norms: f32 input and compute-dtype output each.
    let norms = 2 * (4 * h + c * h);
    // q, k before and after RoPE, v, the attention output, its lse.
    let attn = c * (2 * (q + kv) + kv + q) + 4 * nh;
    // gate, up and their gated product.
    let mlp = 3 * c * f;
    let mut per_layer = tokens * (norms + attn + mlp);
    if attention == Attention::Scores {
        // Scores and probabilities, `heads × seq` per token, in f32.
        per_layer += tokens * 2 * 4 * nh * seq;
    }
    let v = model.vocab_size as u64;
    // Logits in the compute dtype and in f32, and their f32 gradient.
    let head = tokens * (c + 8) * v + tokens * 4 * h;
    model.num_hidden_layers as u64 * per_layer + head
}

/// The estimate for training `model` under `cfg`, computing in
/// `precision`.
pub fn estimate(
    model: &ModelConfig,
    cfg: &LearnerConfig,
    precision: Precision,
    attention: Attention,
) -> MemoryEstimate {
    let n = model.num_params() as u64;
    let trainable = trainable_params(model, cfg.lora.as_ref());
    let casts = match precision {
        Precision::F32 => 0,
        p => n * dtype_bytes(p),
    };
    let copies = u64::from(cfg.kl_coef > 0.0 && cfg.lora.is_none())
        + if cfg.algo == "remix" { 2 } else { 0 };
    let tokens = pass_tokens(model, cfg);
    let seq = (model.max_position_embeddings as u64).min(tokens);
    let mut activations = activation_bytes(model, precision, attention, tokens, seq);
    if cfg.checkpoint_layers {
        // Each layer's input, and one layer's activations at a time.
        let layers = model.num_hidden_layers as u64;
        let head = activation_bytes(&no_layers(model), precision, attention, tokens, seq);
        let one_layer = (activations - head) / layers.max(1);
        let inputs = layers * tokens * model.hidden_size as u64 * dtype_bytes(precision);
        activations = inputs + one_layer + head;
    }
    MemoryEstimate {
        weights: 4 * n,
        weight_casts: casts,
        // The accumulated gradients and one micro-batch's, at once.
        gradients: 2 * 4 * trainable,
        optimizer: 2 * 4 * trainable,
        frozen: copies * 4 * n,
        activations,
        pass_tokens: tokens,
    }
}

/// `model` without its layers: what the head alone keeps.
fn no_layers(model: &ModelConfig) -> ModelConfig {
    ModelConfig {
        num_hidden_layers: 0,
        ..model.clone()
    }
}

fn dtype_bytes(p: Precision) -> u64 {
    match p {
        Precision::F32 => 4,
        Precision::Bf16 | Precision::F16 => 2,
    }
}

/// Refuses an estimate over `capacity` bytes, naming the setting to
/// change and the largest token budget that would fit. Without a token
/// budget nothing bounds a pass but the longest sequence the model takes,
/// so only the part that does not depend on the batch is checked (the
/// error of a pass too large then comes from the device, mid-step: set a
/// budget to have it refused here).
pub fn check(
    est: &MemoryEstimate,
    cfg: &LearnerConfig,
    capacity: u64,
    model: &ModelConfig,
    precision: Precision,
    attention: Attention,
) -> Result<(), String> {
    let bounded = cfg.micro_batch_tokens > 0;
    let need = if bounded {
        est.total()
    } else {
        est.total() - est.activations
    };
    if need <= capacity {
        return Ok(());
    }
    let fixed = est.total() - est.activations;
    let mut msg = format!(
        "a training step needs an estimated {}, more than the device's {:.2} GiB \
         (learner.device_memory_gib)",
        est.describe(),
        gib(capacity)
    );
    let per_token = activation_bytes(model, precision, attention, 1, 1).max(1);
    if fixed < capacity {
        let fits = (capacity - fixed) / per_token;
        msg += &format!(
            "; set learner.micro_batch_tokens to at most {fits} (about what fits beside the \
             weights, gradients and optimiser state), or use LoRA or a smaller model"
        );
    } else {
        msg += "; the weights, gradients and optimiser state alone do not fit: use LoRA, \
                 a lower precision or a smaller model";
    }
    Err(msg)
}

/// Refuses a step with one tensor larger than the device's largest
/// buffer (`max_buffer`, wgpu's limit; the CPU and CUDA have none): the
/// f32 embedding (an untied head is the same size), or, under a token
/// budget, a pass's f32 logits `[tokens, vocab]`. Why: wgpu cannot bind
/// such a tensor however much memory is free, and fails mid-step
/// (Qwen2.5-7B's embedding on an H200, docs/notes/2026-11-28-h200-learner.md).
/// Without a budget a pass's size is unknown until it comes.
pub fn check_buffers(
    model: &ModelConfig,
    cfg: &LearnerConfig,
    max_buffer: u64,
) -> Result<(), String> {
    let (v, h) = (model.vocab_size as u64, model.hidden_size as u64);
    let limit = format!(
        "the largest buffer the device gives one tensor ({max_buffer} bytes, wgpu's limit on this adapter)"
    );
    let embedding = 4 * v * h;
    if embedding > max_buffer {
        return Err(format!(
            "the f32 embedding ({v} × {h}) takes {embedding} bytes, more than {limit}: \
             this model cannot train on wgpu; use a CUDA build"
        ));
    }
    let tokens = cfg.micro_batch_tokens as u64;
    if tokens > 0 && 4 * v * tokens > max_buffer {
        return Err(format!(
            "a pass of {tokens} tokens (learner.micro_batch_tokens) has f32 logits of {} bytes \
             ({tokens} × {v}), more than {limit}; set learner.micro_batch_tokens to at most {}",
            4 * v * tokens,
            max_buffer / (4 * v)
        ));
    }
    Ok(())
}

/// The memory of this machine (or of the cgroup it runs in, if lower),
/// in bytes: the CPU device's capacity.
pub fn host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let total = kb * 1024;
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    Some(cgroup.map_or(total, |c| c.min(total)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-0.5B's shape, from its committed config.json.
    fn qwen_05b() -> ModelConfig {
        ModelConfig::from_hf_json(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/device/configs/qwen2.5-0.5b.json"
        )))
        .unwrap()
    }

    #[test]
    fn the_parts_are_counted_by_hand_on_a_tiny_shape() {
        let mut m = ModelConfig::preset("tiny").unwrap();
        (m.hidden_size, m.intermediate_size, m.vocab_size) = (8, 16, 10);
        (m.num_hidden_layers, m.num_attention_heads) = (1, 2);
        (m.num_key_value_heads, m.max_position_embeddings) = (Some(1), 4);
        m.tie_word_embeddings = true;
        // head_dim 4: q 8, kv 4. Per token and layer, f32 (c = 4):
        // norms 2 (32 + 32) = 128; attn 4 (2 (8 + 4) + 4 + 8) + 8 = 152;
        // mlp 3 * 4 * 16 = 192: 472. Head (4 + 8) 10 + 4 * 8 = 152.
        let a = activation_bytes(&m, Precision::F32, Attention::Fused, 1, 1);
        assert_eq!(a, 472 + 152);
        // Scores add 2 * 4 * heads * seq per token and layer.
        let s = activation_bytes(&m, Precision::F32, Attention::Scores, 3, 4);
        assert_eq!(s, 3 * (472 + 2 * 4 * 2 * 4) + 3 * 152);
        let cfg = LearnerConfig {
            micro_batch_seqs: 2,
            ..Default::default()
        };
        let e = estimate(&m, &cfg, Precision::F32, Attention::Fused);
        let n = m.num_params() as u64;
        assert_eq!(e.pass_tokens, 8);
        assert_eq!(e.weights, 4 * n);
        assert_eq!((e.gradients, e.optimizer), (8 * n, 8 * n));
        assert_eq!((e.weight_casts, e.frozen), (0, 0));
        assert_eq!(e.activations, 8 * (472 + 152));
    }

    #[test]
    fn checkpointing_keeps_layer_inputs_and_one_layer() {
        let m = qwen_05b();
        let cfg = LearnerConfig {
            micro_batch_tokens: 4096,
            ..Default::default()
        };
        let (p, a) = (Precision::F16, Attention::Scores);
        let full = estimate(&m, &cfg, p, a).activations;
        let ck = estimate(
            &m,
            &LearnerConfig {
                checkpoint_layers: true,
                ..cfg.clone()
            },
            p,
            a,
        )
        .activations;
        let head = activation_bytes(&no_layers(&m), p, a, 4096, 4096);
        let layer = (full - head) / 24;
        assert_eq!(ck, 24 * 4096 * 896 * 2 + layer + head);
        assert!(ck < full / 3, "{ck} vs {full}");
    }

    #[test]
    fn lora_trains_only_the_adapters() {
        let m = qwen_05b();
        let lora = LoraConfig::default();
        // r 16 on q (896→896), k, v (896→128), o (896→896), gate, up
        // (896→4864), down (4864→896), 24 layers.
        let per_layer = 16 * ((896 + 896) * 2 + (896 + 128) * 2 + (896 + 4864) * 3);
        assert_eq!(trainable_params(&m, Some(&lora)), 24 * per_layer as u64);
        let cfg = LearnerConfig {
            lora: Some(lora),
            micro_batch_tokens: 4096,
            ..Default::default()
        };
        let e = estimate(&m, &cfg, Precision::F16, Attention::Scores);
        assert_eq!(e.gradients, 8 * 24 * per_layer as u64);
        assert_eq!(e.weight_casts, 2 * m.num_params() as u64);
        assert_eq!(e.pass_tokens, 4096, "the budget bounds a pass");
    }

    #[test]
    fn a_step_that_cannot_fit_is_refused_with_the_budget_that_would() {
        let m = qwen_05b();
        let cfg = LearnerConfig {
            micro_batch_tokens: 32_768,
            ..Default::default()
        };
        let (p, a) = (Precision::F32, Attention::Fused);
        let e = estimate(&m, &cfg, p, a);
        // About 0.5 B parameters: 2 + 4 + 4 GB of weights, gradients and
        // moments before any activation.
        assert!(gib(e.total() - e.activations) > 7.0, "{}", e.describe());
        assert!(check(&e, &cfg, e.total(), &m, p, a).is_ok());
        let err = check(&e, &cfg, 16 << 30, &m, p, a).unwrap_err();
        assert!(
            err.contains("micro_batch_tokens to at most")
                && err.contains("16.00 GiB")
                && err.contains("learner.device_memory_gib"),
            "{err}"
        );
        // The budget it names fits.
        let fits: usize = err
            .split("at most ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap();
        let smaller = LearnerConfig {
            micro_batch_tokens: fits,
            ..cfg.clone()
        };
        let e2 = estimate(&m, &smaller, p, a);
        assert!(
            check(&e2, &smaller, 16 << 30, &m, p, a).is_ok(),
            "{}",
            e2.describe()
        );
        let over = LearnerConfig {
            micro_batch_tokens: fits + 64,
            ..cfg.clone()
        };
        assert!(check(&estimate(&m, &over, p, a), &over, 16 << 30, &m, p, a).is_err());
        let err = check(&e, &cfg, 4 << 30, &m, p, a).unwrap_err();
        assert!(err.contains("alone do not fit"), "{err}");
    }

    /// Without a budget only the batch-independent part is checked: the
    /// default of 64 sequences of 32k tokens is not refused for its
    /// worst case, but weights that cannot fit are.
    #[test]
    fn without_a_budget_only_the_fixed_part_is_checked() {
        let m = qwen_05b();
        let cfg = LearnerConfig::default();
        let (p, a) = (Precision::F32, Attention::Fused);
        let e = estimate(&m, &cfg, p, a);
        assert!(gib(e.activations) > 1000.0, "{}", e.describe());
        assert!(check(&e, &cfg, 16 << 30, &m, p, a).is_ok());
        assert!(check(&e, &cfg, 4 << 30, &m, p, a).is_err());
    }

    #[test]
    fn a_tensor_over_the_devices_largest_buffer_is_refused() {
        // wgpu's limit on NVIDIA's Vulkan driver, as an H200 reported it.
        let max = 2_147_483_644;
        let mut seven_b = qwen_05b();
        seven_b.hidden_size = 3584;
        seven_b.vocab_size = 152_064;
        let cfg = LearnerConfig::default();
        let err = check_buffers(&seven_b, &cfg, max).unwrap_err();
        assert!(
            err.contains("152064 × 3584") && err.contains("2179989504"),
            "{err}"
        );
        let m = qwen_05b();
        assert!(check_buffers(&m, &cfg, max).is_ok());
        let budget = LearnerConfig {
            micro_batch_tokens: 4096,
            ..Default::default()
        };
        let err = check_buffers(&m, &budget, max).unwrap_err();
        let fits = max / (4 * m.vocab_size as u64);
        assert!(err.contains(&format!("at most {fits}")), "{err}");
        let at_fits = LearnerConfig {
            micro_batch_tokens: fits as usize,
            ..Default::default()
        };
        assert!(check_buffers(&m, &at_fits, max).is_ok());
    }
}
