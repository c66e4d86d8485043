//! Hugging Face checkpoints: a directory with `config.json` and
//! `model.safetensors` (or sharded `model-*.safetensors` with
//! `model.safetensors.index.json`), tensors named as transformers names
//! them. Linear weights are transposed on the way in (PyTorch `[out, in]`,
//! Burn `[in, out]`), norm `weight` becomes Burn's `gamma`, and the `model.`
//! prefix is dropped.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use burn::{
    prelude::*,
    store::{
        BurnToPyTorchAdapter, KeyRemapper, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore,
    },
};

use crate::{config::ModelConfig, model::Transformer, policy::Policy};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoWeights { dir: String },
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("checkpoint lacks {count} tensors the model needs, e.g. {examples}")]
    Missing { count: usize, examples: String },
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> LoadError {
    LoadError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// The weight files of a checkpoint directory.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(LoadError::NoWeights {
            dir: dir.display().to_string(),
        });
    }
    let text = std::fs::read_to_string(&index).map_err(|e| file_err(&index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_err(&index, e))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| file_err(&index, "no \"weight_map\" object"))?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    Ok(shards.into_iter().map(|s| dir.join(s)).collect())
}

/// Loads a checkpoint directory onto `device`.
pub fn load(dir: &Path, device: &Device) -> Result<Policy, LoadError> {
    let config = ModelConfig::from_hf_json(&dir.join("config.json"))?;
    let mut model = Transformer::init(&config, device);
    let mut applied = BTreeSet::new();
    let mut needed = BTreeSet::new();
    for file in weight_files(dir)? {
        let remap = KeyRemapper::from_patterns(vec![("^model\\.(.*)$", "$1")])
            .map_err(|e| file_err(&file, e))?;
        let mut store = SafetensorsStore::from_file(&file)
            .with_from_adapter(PyTorchToBurnAdapter)
            .remap(remap)
            .allow_partial(true);
        let result = model
            .load_from(&mut store)
            .map_err(|e| file_err(&file, e))?;
        if let Some(e) = result.errors.first() {
            return Err(file_err(&file, format!("{e:?}")));
        }
        needed.extend(result.applied.iter().cloned());
        needed.extend(result.missing.iter().map(|(p, _)| p.clone()));
        applied.extend(result.applied);
    }
    let missing: Vec<&String> = needed.difference(&applied).collect();
    if !missing.is_empty() {
        return Err(LoadError::Missing {
            count: missing.len(),
            examples: missing
                .iter()
                .take(3)
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    // Hub checkpoints are mostly bf16 (or f16): loaded as stored, then
    // widened to the compute dtype the kernels expect.
    let model = crate::weights::to_compute_dtype(model);
    Ok(Policy::with_model(config, model, device))
}

/// Writes `config.json` and `model.safetensors` in transformers' names and
/// layout, so vLLM or transformers can serve the trained policy. LoRA
/// adapters are merged into the weights first (see also
/// [`crate::peft::write_dir`] for the adapters alone). Streams to the
/// file: no second copy of the weights in memory.
pub fn save(policy: &Policy, dir: &Path) -> Result<(), LoadError> {
    write_config(&policy.config, dir)?;
    let path = dir.join("model.safetensors");
    let store = SafetensorsStore::from_file(&path);
    export(policy, store).map_err(|e| file_err(&path, e))?;
    Ok(())
}

/// [`save`] of weights already exported, by [`to_safetensors`] or
/// [`crate::hf_layout::Layout::export`], for a model of `config`.
pub fn save_bytes(config: &ModelConfig, dir: &Path, safetensors: &[u8]) -> Result<(), LoadError> {
    write_config(config, dir)?;
    let path = dir.join("model.safetensors");
    std::fs::write(&path, safetensors).map_err(|e| file_err(&path, e))
}

/// The weights as one safetensors file in transformers' names and layout
/// (LoRA adapters merged), in memory: what [`save`] writes.
pub fn to_safetensors(policy: &Policy) -> Result<Vec<u8>, String> {
    let store = export(policy, SafetensorsStore::from_bytes(None))?;
    store.get_bytes().map_err(|e| e.to_string())
}

fn write_config(config: &ModelConfig, dir: &Path) -> Result<(), LoadError> {
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
    let config = config.to_hf_json();
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(|e| file_err(&path, e))?;
    std::fs::write(&path, text).map_err(|e| file_err(&path, e))
}

/// Saves the weights into `store` in transformers' names and layout.
fn export(policy: &Policy, store: SafetensorsStore) -> Result<SafetensorsStore, String> {
    let remap =
        KeyRemapper::from_patterns(vec![("^(embed_tokens|layers|norm)(.*)$", "model.$1$2")])
            .map_err(|e| e.to_string())?;
    let mut store = store.with_to_adapter(BurnToPyTorchAdapter).remap(remap);
    let merged;
    let model = match policy.model.lora {
        Some(_) => {
            merged = crate::lora::merge(policy.model.clone());
            &merged
        }
        None => &policy.model,
    };
    model.save_into(&mut store).map_err(|e| e.to_string())?;
    Ok(store)
}
