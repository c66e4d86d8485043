//! Checkpoints of the training state: weights, optimiser moments, step,
//! policy version and the weights' provenance (buffer cursor, lineage,
//! group draws trained), in one directory per step.
//!
//! A checkpoint is written to a hidden temporary directory, every file
//! fsynced, and renamed into place, so a crash mid-write leaves either the
//! previous checkpoint or the new one, never half of one. `state.json` holds
//! the length and CRC32 of every other file; loading checks them and refuses
//! a truncated or corrupt checkpoint by name rather than training on it.

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use bapo_policy::{
    ModelConfig, Policy,
    burn::prelude::*,
    model::Transformer,
    weights::{self, HEADER_LEN, WeightsHeader},
};
use serde::{Deserialize, Serialize};

use crate::{LearnerConfig, Trainer, lineage::Lineage, trainer::TrainError};

mod adapters;

pub use adapters::LoraState;

pub const STATE_FILE: &str = "state.json";
const FORMAT: u32 = 1;
const MODEL_FILE: &str = "model.bin";
const OPTIM_FILE: &str = "optimizer.bpk";
const CONFIG_FILE: &str = "config.json";
/// SPEAR's and ReMix's memories and the batch count (CBOR).
const ALGO_FILE: &str = "algo.cbor";

/// The file of frozen policy `name` (the KL reference, ReMix's).
fn frozen_file(name: &str) -> String {
    format!("{name}.bin")
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}: {source}")]
    Train {
        path: PathBuf,
        #[source]
        source: TrainError,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileSum {
    pub len: u64,
    pub crc32: u32,
}

/// What the weights were trained on and descend from, beyond their
/// version: kept in `state.json` next to them, and handed to
/// [`crate::run::run`] so a resumed learner carries on from it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// Sequence number of the last group the learner consumed.
    pub data_cursor: u64,
    /// The incarnations the weights descend from. Absent in checkpoints
    /// written before incarnations existed: empty.
    #[serde(default)]
    pub lineage: Lineage,
    /// Group draws the weights account for: every group the learner took
    /// from the buffer before them, trained or refused. The buffer counts
    /// the draws it handed out beyond this as lost to a rollback. Absent in
    /// older checkpoints: 0.
    #[serde(default)]
    pub groups_trained: u64,
}

/// `state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    pub format: u32,
    /// Optimiser steps taken.
    pub step: u64,
    pub policy_version: u64,
    #[serde(flatten)]
    pub provenance: Provenance,
    /// The learner's seed; training itself draws no random numbers (no
    /// dropout), evaluation seeds derive from it and the step.
    pub seed: u64,
    pub files: BTreeMap<String, FileSum>,
    /// A LoRA learner's: its adapters are in `adapters.bpk` (instead of
    /// `model.bin`), its base named here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraState>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<FileSum, CheckpointError> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))?;
    Ok(FileSum {
        len: bytes.len() as u64,
        crc32: crc32fast::hash(bytes),
    })
}

/// The directory name of step `step`; zero-padded so names sort by step.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Writes the trainer's state and `provenance` under `root` atomically;
/// returns its path.
pub fn save(
    root: &Path,
    trainer: &Trainer,
    provenance: &Provenance,
) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(root).map_err(io(root))?;
    let step = trainer.steps_done();
    let dest = step_dir(root, step);
    let tmp = root.join(format!(".tmp-step-{step:08}"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let lora = match trainer.config().lora {
        Some(_) => Some(adapters::save_base(
            root,
            &trainer.model().valid(),
            trainer.base_fingerprint(),
            trainer.version(),
        )?),
        None => None,
    };
    let files = write_files(&tmp, &dest, trainer)?;
    let state = CheckpointState {
        format: FORMAT,
        step,
        policy_version: trainer.version(),
        provenance: provenance.clone(),
        seed: trainer.config().seed,
        files,
        lora,
    };
    let text = serde_json::to_vec_pretty(&state).map_err(|e| invalid(&dest, e.to_string()))?;
    write_synced(&tmp.join(STATE_FILE), &text)?;
    if dest.exists() {
        fs::remove_dir_all(&dest).map_err(io(&dest))?;
    }
    fs::rename(&tmp, &dest).map_err(io(&dest))?;
    fs::File::open(root)
        .and_then(|d| d.sync_all())
        .map_err(io(root))?;
    Ok(dest)
}

/// Writes the weights, optimiser state and model config into `tmp`;
/// returns their sums. Errors name `dest`, the checkpoint being written.
fn write_files(
    tmp: &Path,
    dest: &Path,
    trainer: &Trainer,
) -> Result<BTreeMap<String, FileSum>, CheckpointError> {
    let mut files = BTreeMap::new();
    let current = trainer.model().valid();
    let main = match trainer.config().lora {
        Some(_) => {
            let bytes = adapters::encode_adapters(&current, dest)?;
            let name = adapters::ADAPTERS_FILE;
            files.insert(name.to_string(), write_synced(&tmp.join(name), &bytes)?);
            None
        }
        None => Some((MODEL_FILE.to_string(), current)),
    };
    let models = main.into_iter().chain(
        trainer
            .frozen()
            .into_iter()
            .map(|(name, m)| (frozen_file(name), m)),
    );
    for (name, model) in models {
        let (header, payload) = weights::encode(&model, trainer.version())
            .map_err(|e| invalid(dest, format!("encoding {name}: {e}")))?;
        let mut bytes = header.to_bytes().to_vec();
        bytes.extend_from_slice(&payload);
        files.insert(name.clone(), write_synced(&tmp.join(&name), &bytes)?);
    }
    let mut algo = Vec::new();
    ciborium::into_writer(&trainer.algo_state(), &mut algo)
        .map_err(|e| invalid(dest, format!("encoding {ALGO_FILE}: {e}")))?;
    files.insert(
        ALGO_FILE.to_string(),
        write_synced(&tmp.join(ALGO_FILE), &algo)?,
    );
    let optim = trainer
        .optimizer_state()
        .map_err(|e| invalid(dest, format!("encoding {OPTIM_FILE}: {e}")))?;
    files.insert(
        OPTIM_FILE.to_string(),
        write_synced(&tmp.join(OPTIM_FILE), &optim)?,
    );
    let config = serde_json::to_vec_pretty(&trainer.model_config().to_hf_json())
        .map_err(|e| invalid(dest, e.to_string()))?;
    files.insert(
        CONFIG_FILE.to_string(),
        write_synced(&tmp.join(CONFIG_FILE), &config)?,
    );
    Ok(files)
}

/// The newest complete checkpoint under `root` (temporary directories of
/// interrupted writes are ignored), if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if !root.exists() {
        return Ok(None);
    }
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in fs::read_dir(root).map_err(io(root))? {
        let path = entry.map_err(io(root))?.path();
        let Some(step) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, path));
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// Deletes all but the newest `keep` checkpoints.
pub fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(root)
        .map_err(io(root))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step-"))
        })
        .collect();
    dirs.sort();
    let n = dirs.len().saturating_sub(keep.max(1));
    for d in &dirs[..n] {
        fs::remove_dir_all(d).map_err(io(d))?;
    }
    Ok(())
}

/// Reads and verifies a checkpoint's `state.json` and files.
pub fn read_state(dir: &Path) -> Result<CheckpointState, CheckpointError> {
    let state_path = dir.join(STATE_FILE);
    let text = fs::read(&state_path).map_err(io(&state_path))?;
    let state: CheckpointState = serde_json::from_slice(&text)
        .map_err(|e| invalid(dir, format!("{STATE_FILE} is not valid: {e}")))?;
    if state.format != FORMAT {
        return Err(invalid(
            dir,
            format!(
                "{STATE_FILE}: format {} is not supported (this build reads {FORMAT})",
                state.format
            ),
        ));
    }
    let weights = match state.lora {
        Some(_) => adapters::ADAPTERS_FILE,
        None => MODEL_FILE,
    };
    for name in [weights, OPTIM_FILE, CONFIG_FILE] {
        if !state.files.contains_key(name) {
            return Err(invalid(dir, format!("{STATE_FILE} does not list {name}")));
        }
    }
    state
        .provenance
        .lineage
        .check(state.policy_version)
        .map_err(|e| invalid(dir, format!("{STATE_FILE}: {e}")))?;
    Ok(state)
}

fn read_verified(
    dir: &Path,
    state: &CheckpointState,
    name: &str,
) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(name);
    let bytes = fs::read(&path).map_err(io(&path))?;
    let want = &state.files[name];
    if bytes.len() as u64 != want.len {
        return Err(invalid(
            dir,
            format!(
                "{name} is {} bytes, {STATE_FILE} says {} (truncated?)",
                bytes.len(),
                want.len
            ),
        ));
    }
    let crc = crc32fast::hash(&bytes);
    if crc != want.crc32 {
        return Err(invalid(
            dir,
            format!(
                "{name} fails its checksum ({crc:08x}, expected {:08x}): corrupt",
                want.crc32
            ),
        ));
    }
    Ok(bytes)
}

/// The policy stored in a checkpoint, on `device` (for evaluation and
/// export; no optimiser state).
pub fn load_policy(
    dir: &Path,
    device: &Device,
) -> Result<(Policy, CheckpointState), CheckpointError> {
    let state = read_state(dir)?;
    read_verified(dir, &state, CONFIG_FILE)?;
    let config_path = dir.join(CONFIG_FILE);
    let config = ModelConfig::from_hf_json(&config_path)
        .map_err(|e| invalid(dir, format!("{CONFIG_FILE}: {e}")))?;
    let model = match &state.lora {
        Some(lora) => {
            let bytes = read_verified(dir, &state, adapters::ADAPTERS_FILE)?;
            adapters::load_model(dir, lora, bytes, &config, device)?
        }
        None => read_model(dir, &state, MODEL_FILE, &config, device)?,
    };
    Ok((Policy::with_model(config, model, device), state))
}

/// Weights file `name` of a checkpoint, verified and decoded.
fn read_model(
    dir: &Path,
    state: &CheckpointState,
    name: &str,
    config: &ModelConfig,
    device: &Device,
) -> Result<Transformer, CheckpointError> {
    let bytes = read_verified(dir, state, name)?;
    if bytes.len() < HEADER_LEN {
        return Err(invalid(dir, format!("{name} is shorter than its header")));
    }
    let header = WeightsHeader::from_bytes(&bytes[..HEADER_LEN])
        .map_err(|e| invalid(dir, format!("{name}: {e}")))?;
    weights::decode(
        &header,
        bytes[HEADER_LEN..].to_vec(),
        Transformer::init(config, device),
    )
    .map_err(|e| invalid(dir, format!("{name}: {e}")))
}

/// A trainer that continues exactly where the checkpoint left off; the
/// state's [`Provenance`] is for [`crate::run::run`].
pub fn load(
    dir: &Path,
    cfg: LearnerConfig,
    device: &Device,
) -> Result<(Trainer, CheckpointState), CheckpointError> {
    let (policy, state) = load_policy(dir, device)?;
    let optim = read_verified(dir, &state, OPTIM_FILE)?;
    let config = policy.config.clone();
    let mut trainer = Trainer::restore(cfg, policy, state.policy_version, state.step, optim)
        .map_err(|e| match e {
            TrainError::OptimizerState(m) => invalid(dir, format!("{OPTIM_FILE}: {m}")),
            source => CheckpointError::Train {
                path: dir.to_path_buf(),
                source,
            },
        })?;
    restore_algo(dir, &state, &mut trainer, &config, device)?;
    Ok((trainer, state))
}

/// The batch count, SPEAR's and ReMix's memories and the frozen policies
/// (KL reference, ReMix's). A checkpoint written before they were saved
/// lacks them: the run goes on with the checkpoint's weights in their
/// place, and says so.
fn restore_algo(
    dir: &Path,
    state: &CheckpointState,
    trainer: &mut Trainer,
    config: &ModelConfig,
    device: &Device,
) -> Result<(), CheckpointError> {
    if state.files.contains_key(ALGO_FILE) {
        let bytes = read_verified(dir, state, ALGO_FILE)?;
        let algo = ciborium::from_reader(bytes.as_slice())
            .map_err(|e| invalid(dir, format!("{ALGO_FILE}: {e}")))?;
        trainer
            .restore_algo_state(algo)
            .map_err(|e| invalid(dir, format!("{ALGO_FILE}: {e}")))?;
    }
    for name in trainer.frozen_names() {
        let file = frozen_file(name);
        if state.files.contains_key(&file) {
            let model = read_model(dir, state, &file, config, device)?;
            trainer.set_frozen(name, model);
        } else if name != "remix-previous" {
            tracing::warn!(
                checkpoint = %dir.display(),
                "{file} is missing (written before it was saved): {name} restarts from the \
                 checkpoint's weights"
            );
        }
    }
    Ok(())
}
