//! LoRA adapters: a trainable low-rank update `B A x · alpha/r` beside
//! each chosen projection of a frozen base model.
//!
//! Why not Burn's own `Module::apply_lora`: it reparameterises the weight,
//! so every forward materialises the merged `W + s·A·B` and the backward
//! computes a full-size weight gradient before projecting it onto the
//! factors. Here the update is applied as two thin matmuls on the
//! activations (`(x·A)·B`), so training never builds a merged weight and
//! the base's weight gradients are never formed.
//!
//! Layout: Burn keeps linear weights `[in, out]`, so `a` is `[in, r]` and
//! `b` is `[r, out]` (PEFT's `lora_A.weight` is `[r, in]` and
//! `lora_B.weight` `[out, r]`, transposed on export). Initialised as PEFT
//! does: `A` Kaiming-uniform (bound `1/sqrt(in)`), `B` zero, so a fresh
//! adapter leaves the model's outputs unchanged.

//!
//! The types live in [`crate::adapters`] (the model holds them; they know
//! nothing of it) and are re-exported here; this module is what acts on a
//! whole model.

use burn::{
    module::{Module, ModuleVisitor, Param},
    prelude::*,
    tensor::FloatDType,
};

pub use crate::adapters::{Adapters, LayerAdapters, LoraConfig, LoraError, LoraPair, Target};
use crate::{config::ModelConfig, model::Transformer};

/// `model` with fresh adapters beside its projections and its base
/// frozen: only the adapters require gradients (on an autodiff device,
/// the only parameters an optimiser then updates and keeps moments for).
pub fn attach(model: Transformer, config: &ModelConfig, cfg: &LoraConfig) -> Transformer {
    let device = model.embed_tokens.weight.val().device();
    let mut model = model.no_grad();
    let adapters = Adapters::init(config, cfg, &device).set_require_grad(true);
    model.lora = Some(adapters);
    model
}

/// `model`'s base: the same frozen weights with the adapters off (shared,
/// not copied). The learner's KL reference under LoRA.
pub fn base_of(model: &Transformer) -> Transformer {
    let mut base = model.clone();
    base.lora = None;
    base
}

/// A 64-bit fingerprint of a model's base weights (adapters excluded):
/// names, shapes and f32 values. Adapters name the base they were trained
/// on with it, and are refused on any other.
pub fn fingerprint(model: &Transformer) -> u64 {
    let mut v = Fingerprint {
        path: Vec::new(),
        names: crc32fast::Hasher::new(),
        values: crc32fast::Hasher::new(),
    };
    model.visit(&mut v);
    (u64::from(v.names.finalize()) << 32) | u64::from(v.values.finalize())
}

struct Fingerprint {
    path: Vec<String>,
    names: crc32fast::Hasher,
    values: crc32fast::Hasher,
}

impl ModuleVisitor for Fingerprint {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.path.first().is_some_and(|p| p == "lora") {
            return;
        }
        let t = param.val();
        self.names.update(self.path.join(".").as_bytes());
        for d in t.dims() {
            self.names.update(&(d as u64).to_le_bytes());
        }
        let data = t.cast(FloatDType::F32).into_data();
        self.values.update(data.as_bytes());
    }
}

/// `model` with the adapters merged into its weights (`W + s·A·B`) and
/// removed: a plain checkpoint any Llama/Qwen2 loader reads.
pub fn merge(mut model: Transformer) -> Transformer {
    let Some(adapters) = model.lora.take() else {
        return model;
    };
    let s = adapters.scale;
    for (layer, ad) in model.layers.iter_mut().zip(&adapters.layers) {
        for t in Target::ALL {
            let Some(pair) = ad.get(t) else { continue };
            let linear = match t {
                Target::Q => &mut layer.self_attn.q_proj,
                Target::K => &mut layer.self_attn.k_proj,
                Target::V => &mut layer.self_attn.v_proj,
                Target::O => &mut layer.self_attn.o_proj,
                Target::Gate => &mut layer.mlp.gate_proj,
                Target::Up => &mut layer.mlp.up_proj,
                Target::Down => &mut layer.mlp.down_proj,
            };
            let delta = pair.a.val().matmul(pair.b.val()).mul_scalar(s);
            let w = linear.weight.val();
            let merged = w.clone() + delta.cast(w.dtype());
            linear.weight = Param::from_tensor(merged.detach());
        }
    }
    model
}
