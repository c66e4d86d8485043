//! Adapters in PEFT's on-disk format: `adapter_model.safetensors` with
//! PEFT's tensor names (`base_model.model.model.layers.N.self_attn.q_proj.
//! lora_A.weight`, `[r, in]`; `lora_B.weight`, `[out, r]`) and
//! `adapter_config.json`.
//!
//! One format for three uses: the learner's weight stream carries these
//! bytes when LoRA is on (a Burn actor builds [`Adapters`] from them, an
//! engine actor hands the directory to vLLM's runtime LoRA loading),
//! checkpoints hold them, and `bapo export` writes them for PEFT. The
//! safetensors metadata records what PEFT keeps in the JSON (alpha) and
//! the fingerprint of the base the adapters were trained on.

use std::{collections::HashMap, path::Path};

use burn::{
    module::Param,
    prelude::*,
    tensor::{DType, FloatDType},
};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::{
    config::ModelConfig,
    lora::{Adapters, LayerAdapters, LoraConfig, LoraPair, Target},
};

pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
pub const CONFIG_FILE: &str = "adapter_config.json";
const PREFIX: &str = "base_model.model.model.layers.";
const META_ALPHA: &str = "bapo.lora_alpha";
const META_BASE: &str = "bapo.base_fingerprint";

#[derive(Debug, thiserror::Error)]
pub enum PeftError {
    #[error("adapter file: {0}")]
    Format(String),
    #[error("adapter tensor {name}: {message}")]
    Tensor { name: String, message: String },
    #[error("{path}: {message}")]
    File { path: String, message: String },
}

fn tensor_err(name: &str, message: impl Into<String>) -> PeftError {
    PeftError::Tensor {
        name: name.to_string(),
        message: message.into(),
    }
}

/// What travels beside the adapter tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterMeta {
    pub alpha: f64,
    /// [`crate::lora::fingerprint`] of the base (0: unknown, as in a file
    /// PEFT wrote).
    pub base: u64,
}

/// PEFT's name of adapter factor `factor` (`"A"` or `"B"`).
pub fn tensor_name(layer: usize, t: Target, factor: char) -> String {
    format!(
        "{PREFIX}{layer}.{}.{}.lora_{factor}.weight",
        t.block(),
        t.name()
    )
}

/// The safetensors bytes of `adapters`, factors in `dtype` (f32 or bf16).
pub fn encode(
    adapters: &Adapters,
    meta: AdapterMeta,
    dtype: FloatDType,
) -> Result<Vec<u8>, PeftError> {
    let mut tensors = Vec::new();
    for (i, layer) in adapters.layers.iter().enumerate() {
        for t in Target::ALL {
            let Some(pair) = layer.get(t) else { continue };
            // Burn's `[in, r]`/`[r, out]` are torch's transposes.
            tensors.push((tensor_name(i, t, 'A'), pair.a.val().transpose()));
            tensors.push((tensor_name(i, t, 'B'), pair.b.val().transpose()));
        }
    }
    let st_dtype = match dtype {
        FloatDType::BF16 => Dtype::BF16,
        FloatDType::F16 => Dtype::F16,
        _ => Dtype::F32,
    };
    let data: Vec<(String, Vec<usize>, TensorData)> = tensors
        .into_iter()
        .map(|(n, t)| (n, t.dims().to_vec(), t.cast(dtype).into_data()))
        .collect();
    let views = data
        .iter()
        .map(|(n, shape, d)| {
            TensorView::new(st_dtype, shape.clone(), d.as_bytes())
                .map(|v| (n.clone(), v))
                .map_err(|e| tensor_err(n, e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (META_ALPHA.to_string(), meta.alpha.to_string()),
        (META_BASE.to_string(), format!("{:016x}", meta.base)),
    ]);
    safetensors::serialize(views, Some(metadata)).map_err(|e| PeftError::Format(e.to_string()))
}

/// `(layer, target, factor)` of a PEFT tensor name.
fn parse_name(name: &str) -> Option<(usize, Target, char)> {
    let rest = name.strip_prefix(PREFIX)?;
    let mut parts = rest.split('.');
    let layer = parts.next()?.parse().ok()?;
    let block = parts.next()?;
    let target = Target::from_name(parts.next()?)?;
    let factor = match parts.next()? {
        "lora_A" => 'A',
        "lora_B" => 'B',
        _ => return None,
    };
    (block == target.block() && parts.next() == Some("weight") && parts.next().is_none())
        .then_some((layer, target, factor))
}

/// One factor as a Burn tensor in f32, shape checked against `want`
/// (torch's layout) and transposed to Burn's.
fn factor(
    name: &str,
    view: &TensorView<'_>,
    want: [usize; 2],
    device: &Device,
) -> Result<Tensor<2>, PeftError> {
    if view.shape() != want {
        return Err(tensor_err(
            name,
            format!("shape {:?}, the model needs {want:?}", view.shape()),
        ));
    }
    let dtype = match view.dtype() {
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        other => return Err(tensor_err(name, format!("dtype {other:?} is not a float"))),
    };
    let data = TensorData::from_bytes_vec(view.data().to_vec(), want, dtype);
    let t: Tensor<2> = Tensor::from_data(data, device);
    let t = t.cast(FloatDType::F32).transpose();
    if !t.clone().is_finite().all().into_scalar::<bool>() {
        return Err(tensor_err(name, "holds a non-finite value"));
    }
    Ok(t)
}

/// Adapters for a model of `model`'s shape from safetensors `bytes`.
/// `alpha` overrides the file's (PEFT keeps it in `adapter_config.json`).
pub fn decode(
    bytes: &[u8],
    model: &ModelConfig,
    alpha: Option<f64>,
    device: &Device,
) -> Result<(Adapters, AdapterMeta), PeftError> {
    let (_, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| PeftError::Format(e.to_string()))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| PeftError::Format(e.to_string()))?;
    let meta_map = metadata.metadata().clone().unwrap_or_default();
    let alpha = match alpha {
        Some(a) => a,
        None => meta_map
            .get(META_ALPHA)
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| PeftError::Format(format!("no {META_ALPHA} in its metadata")))?,
    };
    let base = meta_map
        .get(META_BASE)
        .map_or(Ok(0), |b| u64::from_str_radix(b, 16))
        .map_err(|e| PeftError::Format(format!("{META_BASE}: {e}")))?;
    let (layers, rank) = collect_layers(&st, model, device)?;
    let meta = AdapterMeta { alpha, base };
    let cfg = LoraConfig {
        rank,
        alpha,
        dropout: 0.0,
        targets: Target::ALL.to_vec(),
    };
    cfg.validate()
        .map_err(|e| PeftError::Format(e.to_string()))?;
    Ok((Adapters::with_layers(layers, cfg.scale(), base), meta))
}

/// Every layer's pairs, checked complete and of one rank.
fn collect_layers(
    st: &SafeTensors<'_>,
    model: &ModelConfig,
    device: &Device,
) -> Result<(Vec<LayerAdapters>, usize), PeftError> {
    let mut names: Vec<(String, (usize, Target))> = Vec::new();
    let mut rank = None;
    for name in st.names() {
        let (layer, t, f) = parse_name(name)
            .ok_or_else(|| tensor_err(name, "not a LoRA factor of a projection"))?;
        if layer >= model.num_hidden_layers {
            return Err(tensor_err(
                name,
                format!("layer {layer}, the model has {}", model.num_hidden_layers),
            ));
        }
        let view = st
            .tensor(name)
            .map_err(|e| tensor_err(name, e.to_string()))?;
        let r = if f == 'A' {
            view.shape()[0]
        } else {
            view.shape().get(1).copied().unwrap_or(0)
        };
        if *rank.get_or_insert(r) != r {
            return Err(tensor_err(name, format!("rank {r}, others have {rank:?}")));
        }
        if f == 'A' {
            names.push((name.to_string(), (layer, t)));
        }
    }
    let rank = rank.ok_or_else(|| PeftError::Format("holds no adapter".into()))?;
    let mut layers: Vec<LayerAdapters> = (0..model.num_hidden_layers)
        .map(|_| LayerAdapters::empty())
        .collect();
    for (a_name, (layer, t)) in &names {
        let b_name = tensor_name(*layer, *t, 'B');
        let (i, o) = t.shape(model);
        let a_view = st
            .tensor(a_name)
            .map_err(|e| tensor_err(a_name, e.to_string()))?;
        let b_view = st
            .tensor(&b_name)
            .map_err(|_| tensor_err(&b_name, "missing (its lora_A is there)"))?;
        let pair = LoraPair {
            a: Param::from_tensor(factor(a_name, &a_view, [rank, i], device)?),
            b: Param::from_tensor(factor(&b_name, &b_view, [o, rank], device)?),
        };
        layers[*layer].set(*t, pair);
    }
    let first = layers[0].targets();
    if let Some((i, l)) = layers
        .iter()
        .enumerate()
        .find(|(_, l)| l.targets() != first)
    {
        return Err(PeftError::Format(format!(
            "layer {i} adapts {:?}, layer 0 {first:?}: bapo adapts the same projections in every layer",
            l.targets()
        )));
    }
    Ok((layers, rank))
}

/// PEFT's `adapter_config.json` for `adapters`.
pub fn config_json(adapters: &Adapters, meta: AdapterMeta, base_model: &str) -> serde_json::Value {
    let targets: Vec<&str> = adapters.targets().iter().map(|t| t.name()).collect();
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapters.rank(),
        "lora_alpha": meta.alpha,
        "lora_dropout": adapters.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "bapo_base_fingerprint": format!("{:016x}", meta.base),
    })
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> PeftError {
    PeftError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Writes `dir/adapter_model.safetensors` (f32) and `dir/adapter_config.json`.
pub fn write_dir(
    dir: &Path,
    adapters: &Adapters,
    meta: AdapterMeta,
    base_model: &str,
) -> Result<(), PeftError> {
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
    let bytes = encode(adapters, meta, FloatDType::F32)?;
    let weights = dir.join(WEIGHTS_FILE);
    std::fs::write(&weights, bytes).map_err(|e| file_err(&weights, e))?;
    let config = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&config_json(adapters, meta, base_model))
        .map_err(|e| file_err(&config, e))?;
    std::fs::write(&config, text).map_err(|e| file_err(&config, e))
}

/// Reads a PEFT adapter directory (alpha from its `adapter_config.json`).
pub fn read_dir(
    dir: &Path,
    model: &ModelConfig,
    device: &Device,
) -> Result<(Adapters, AdapterMeta), PeftError> {
    let config = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&config).map_err(|e| file_err(&config, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_err(&config, e))?;
    let alpha = json
        .get("lora_alpha")
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| file_err(&config, "no numeric lora_alpha"))?;
    if json.get("use_rslora").and_then(serde_json::Value::as_bool) == Some(true) {
        return Err(file_err(&config, "use_rslora is not supported"));
    }
    let weights = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&weights).map_err(|e| file_err(&weights, e))?;
    decode(&bytes, model, Some(alpha), device)
}
