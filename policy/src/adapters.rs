//! The adapters' types: which projections, their rank and scale, the
//! factor pairs of each layer and how they apply to an activation. The
//! model holds and applies them (`model.rs`); attaching them to a model,
//! merging and fingerprinting its base are [`crate::lora`]'s. Why LoRA is
//! applied as it is, and its layout: [`crate::lora`].

use std::{collections::BTreeSet, fmt};

use burn::{
    module::{Module, Param},
    prelude::*,
    tensor::Distribution,
};
use serde::{Deserialize, Serialize};

use crate::{config::ModelConfig, kernels};

/// A projection an adapter can sit beside, by its HF module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Target {
    #[serde(rename = "q_proj")]
    Q,
    #[serde(rename = "k_proj")]
    K,
    #[serde(rename = "v_proj")]
    V,
    #[serde(rename = "o_proj")]
    O,
    #[serde(rename = "gate_proj")]
    Gate,
    #[serde(rename = "up_proj")]
    Up,
    #[serde(rename = "down_proj")]
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The HF (and PEFT) module name.
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The HF parent module: `self_attn` or `mlp`.
    pub fn block(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            Target::Gate | Target::Up | Target::Down => "mlp",
        }
    }

    /// `(in, out)` features of this projection in a model of `c`.
    pub fn shape(self, c: &ModelConfig) -> (usize, usize) {
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (
            c.num_attention_heads * c.head_dim(),
            c.kv_heads() * c.head_dim(),
        );
        match self {
            Target::Q => (h, q),
            Target::K | Target::V => (h, kv),
            Target::O => (q, h),
            Target::Gate | Target::Up => (h, f),
            Target::Down => (f, h),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rank, scale, dropout and placement of the adapters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// `r`, the inner dimension of every adapter.
    pub rank: usize,
    /// The update is scaled by `alpha / rank` (PEFT's `lora_alpha`).
    pub alpha: f64,
    /// Dropout on the adapters' input while training (0: none). Actors
    /// never apply it.
    pub dropout: f64,
    /// Which projections get an adapter, in every layer.
    pub targets: Vec<Target>,
}

impl Default for LoraConfig {
    /// All attention and MLP projections, r = 16, alpha = 32: "LoRA
    /// Without Regret" (Schulman et al., 2025) found LoRA matches full
    /// fine-tuning in RL even at small ranks once the MLP is adapted too.
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: Target::ALL.to_vec(),
        }
    }
}

/// A LoRA setting that cannot work, named by its key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("lora.{field}: {message}")]
pub struct LoraError {
    pub field: &'static str,
    pub message: String,
}

fn lora_err(field: &'static str, message: impl Into<String>) -> LoraError {
    LoraError {
        field,
        message: message.into(),
    }
}

impl LoraConfig {
    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    pub fn validate(&self) -> Result<(), LoraError> {
        if self.rank == 0 {
            return Err(lora_err("rank", "must be at least 1"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(lora_err("alpha", format!("{} is not positive", self.alpha)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(lora_err(
                "dropout",
                format!("{} is outside [0, 1)", self.dropout),
            ));
        }
        if self.targets.is_empty() {
            return Err(lora_err("targets", "names no projection"));
        }
        let unique: BTreeSet<_> = self.targets.iter().collect();
        if unique.len() != self.targets.len() {
            return Err(lora_err("targets", "names a projection twice"));
        }
        Ok(())
    }

    /// The same check against a model: a rank above a projection's
    /// smaller side is no longer low-rank.
    pub fn validate_for(&self, c: &ModelConfig) -> Result<(), LoraError> {
        self.validate()?;
        for t in &self.targets {
            let (i, o) = t.shape(c);
            if self.rank > i.min(o) {
                return Err(lora_err(
                    "rank",
                    format!("{} exceeds {t}'s smaller dimension {}", self.rank, i.min(o)),
                ));
            }
        }
        Ok(())
    }
}

/// One adapter: `x ↦ (x·a)·b`, `a` `[in, r]`, `b` `[r, out]`.
#[derive(Module, Debug)]
pub struct LoraPair {
    pub a: Param<Tensor<2>>,
    pub b: Param<Tensor<2>>,
}

impl LoraPair {
    /// PEFT's initialisation: `A` uniform in `±1/sqrt(in)` (Kaiming-uniform
    /// with `a = sqrt(5)`), `B` zero.
    pub fn init(d_in: usize, d_out: usize, rank: usize, device: &Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::random([d_in, rank], Distribution::Uniform(-bound, bound), device);
        Self {
            a: Param::from_tensor(a),
            b: Param::from_tensor(Tensor::zeros([rank, d_out], device)),
        }
    }

    pub fn rank(&self) -> usize {
        self.a.dims()[1]
    }
}

/// The adapters of one decoder layer, by projection.
#[derive(Module, Debug)]
pub struct LayerAdapters {
    pub q_proj: Option<LoraPair>,
    pub k_proj: Option<LoraPair>,
    pub v_proj: Option<LoraPair>,
    pub o_proj: Option<LoraPair>,
    pub gate_proj: Option<LoraPair>,
    pub up_proj: Option<LoraPair>,
    pub down_proj: Option<LoraPair>,
}

impl LayerAdapters {
    pub(crate) fn empty() -> Self {
        Self {
            q_proj: None,
            k_proj: None,
            v_proj: None,
            o_proj: None,
            gate_proj: None,
            up_proj: None,
            down_proj: None,
        }
    }

    pub fn get(&self, t: Target) -> Option<&LoraPair> {
        match t {
            Target::Q => self.q_proj.as_ref(),
            Target::K => self.k_proj.as_ref(),
            Target::V => self.v_proj.as_ref(),
            Target::O => self.o_proj.as_ref(),
            Target::Gate => self.gate_proj.as_ref(),
            Target::Up => self.up_proj.as_ref(),
            Target::Down => self.down_proj.as_ref(),
        }
    }

    /// The projections this layer adapts, in [`Target::ALL`]'s order.
    pub fn targets(&self) -> Vec<Target> {
        Target::ALL
            .into_iter()
            .filter(|&t| self.get(t).is_some())
            .collect()
    }

    pub(crate) fn set(&mut self, t: Target, pair: LoraPair) {
        *self.slot_mut(t) = Some(pair);
    }

    fn slot_mut(&mut self, t: Target) -> &mut Option<LoraPair> {
        match t {
            Target::Q => &mut self.q_proj,
            Target::K => &mut self.k_proj,
            Target::V => &mut self.v_proj,
            Target::O => &mut self.o_proj,
            Target::Gate => &mut self.gate_proj,
            Target::Up => &mut self.up_proj,
            Target::Down => &mut self.down_proj,
        }
    }

    /// Every adapter of this layer, mutably, with its projection.
    pub fn pairs_mut(&mut self) -> impl Iterator<Item = (Target, &mut LoraPair)> {
        [
            (Target::Q, &mut self.q_proj),
            (Target::K, &mut self.k_proj),
            (Target::V, &mut self.v_proj),
            (Target::O, &mut self.o_proj),
            (Target::Gate, &mut self.gate_proj),
            (Target::Up, &mut self.up_proj),
            (Target::Down, &mut self.down_proj),
        ]
        .into_iter()
        .filter_map(|(t, p)| p.as_mut().map(|p| (t, p)))
    }
}

/// Every adapter of a model, and how they are applied.
#[derive(Module, Debug)]
pub struct Adapters {
    pub layers: Vec<LayerAdapters>,
    /// `alpha / rank`.
    #[module(skip)]
    pub scale: f64,
    /// Dropout on the adapters' input, applied only where the adapters
    /// track gradients (the learner's training forward).
    #[module(skip)]
    pub dropout: f64,
    /// [`fingerprint`] of the base these adapters belong to (0: unknown),
    /// as the weight stream or a file named it: an engine that must hold
    /// that base reloads it when it changes.
    #[module(skip)]
    pub base: u64,
}

impl Adapters {
    /// Fresh adapters for a model of `model`'s shape.
    pub fn init(model: &ModelConfig, cfg: &LoraConfig, device: &Device) -> Self {
        let layers = (0..model.num_hidden_layers)
            .map(|_| {
                let mut layer = LayerAdapters::empty();
                for &t in &cfg.targets {
                    let (i, o) = t.shape(model);
                    layer.set(t, LoraPair::init(i, o, cfg.rank, device));
                }
                layer
            })
            .collect();
        Self {
            layers,
            scale: cfg.scale(),
            dropout: cfg.dropout,
            base: 0,
        }
    }

    /// Adapters of loaded layers (no dropout: they are for inference or
    /// to resume from; the learner sets its own).
    pub(crate) fn with_layers(layers: Vec<LayerAdapters>, scale: f64, base: u64) -> Self {
        Self {
            layers,
            scale,
            dropout: 0.0,
            base,
        }
    }

    /// The rank (of the first adapter; all share it).
    pub fn rank(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| Target::ALL.into_iter().filter_map(|t| l.get(t)))
            .map(LoraPair::rank)
            .next()
            .unwrap_or(0)
    }

    /// The projections adapted (those of the first layer; all share them).
    pub fn targets(&self) -> Vec<Target> {
        self.layers
            .first()
            .map_or_else(Vec::new, LayerAdapters::targets)
    }

    /// `s · ((dropout(x)·A)·B)`, in `x`'s dtype.
    pub fn delta(&self, pair: &LoraPair, x: Tensor<2>) -> Tensor<2> {
        let dt = x.dtype();
        let a = pair.a.val();
        let x = if self.dropout > 0.0 && a.is_require_grad() {
            let keep = 1.0 - self.dropout;
            let mask = Tensor::<2>::random(x.shape(), Distribution::Bernoulli(keep), &x.device());
            x * mask.cast(dt).div_scalar(keep)
        } else {
            x
        };
        let h = kernels::linear(x, a.cast(dt), None);
        kernels::linear(h, pair.b.val().cast(dt), None).mul_scalar(self.scale)
    }
}
