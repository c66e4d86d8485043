//! A LoRA learner's checkpoint: the adapters in each step's directory,
//! the frozen base once beside them (`checkpoints/base-<fingerprint>.bin`),
//! named by its fingerprint in `state.json`. A step directory then costs
//! megabytes, not a model; a base that is missing, corrupt or not the one
//! the adapters were trained on is refused by name.

use std::{fs, path::Path};

use bapo_policy::{
    ModelConfig,
    burn::{module::Module, prelude::*, store::ModuleRecord, tensor::Bytes},
    lora::{self, Adapters, LoraConfig, Target},
    model::Transformer,
    weights::{self, HEADER_LEN, WeightsHeader},
};
use serde::{Deserialize, Serialize};

use super::{CheckpointError, FileSum, invalid, io, write_synced};

/// The adapters (Burn's record: parameter ids kept, so the optimiser's
/// moments find their tensors again on resume).
pub const ADAPTERS_FILE: &str = "adapters.bpk";

/// What `state.json` says of a LoRA checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraState {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<Target>,
    /// [`lora::fingerprint`] of the base, hex.
    pub base_fingerprint: String,
    /// The base's file in the checkpoints directory, and its sum.
    pub base_file: String,
    pub base_sum: FileSum,
}

fn base_file(fingerprint: u64) -> String {
    format!("base-{fingerprint:016x}.bin")
}

/// Writes `model`'s base into `root` unless it is there already; returns
/// the state naming it. The write is atomic (temporary file, rename).
pub fn save_base(
    root: &Path,
    model: &Transformer,
    fingerprint: u64,
    version: u64,
) -> Result<LoraState, CheckpointError> {
    let adapters = model
        .lora
        .as_ref()
        .ok_or_else(|| invalid(root, "a LoRA checkpoint of a model without adapters"))?;
    let name = base_file(fingerprint);
    let path = root.join(&name);
    let base_sum = if path.exists() {
        let bytes = fs::read(&path).map_err(io(&path))?;
        FileSum {
            len: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        }
    } else {
        let (header, payload) = weights::encode(&lora::base_of(model), version)
            .map_err(|e| invalid(root, format!("encoding {name}: {e}")))?;
        let mut bytes = header.to_bytes().to_vec();
        bytes.extend_from_slice(&payload);
        let tmp = root.join(format!(".tmp-{name}"));
        let sum = write_synced(&tmp, &bytes)?;
        fs::rename(&tmp, &path).map_err(io(&path))?;
        sum
    };
    Ok(LoraState {
        rank: adapters.rank(),
        alpha: adapters.scale * adapters.rank() as f64,
        targets: adapters.targets(),
        base_fingerprint: format!("{fingerprint:016x}"),
        base_file: name,
        base_sum,
    })
}

/// The adapters' record bytes.
pub fn encode_adapters(model: &Transformer, dest: &Path) -> Result<Bytes, CheckpointError> {
    let adapters = model
        .lora
        .clone()
        .ok_or_else(|| invalid(dest, "a LoRA checkpoint of a model without adapters"))?;
    adapters
        .into_record()
        .into_bytes()
        .map_err(|e| invalid(dest, format!("encoding {ADAPTERS_FILE}: {e:?}")))
}

/// The base named by `state`, from the checkpoints directory above `dir`,
/// verified (sum and fingerprint), with the adapters of `adapter_bytes`.
pub fn load_model(
    dir: &Path,
    state: &LoraState,
    adapter_bytes: Vec<u8>,
    config: &ModelConfig,
    device: &Device,
) -> Result<Transformer, CheckpointError> {
    let root = dir.parent().unwrap_or(dir);
    let path = root.join(&state.base_file);
    let bytes = fs::read(&path).map_err(|e| {
        invalid(
            dir,
            format!("its LoRA base {} cannot be read: {e}", path.display()),
        )
    })?;
    if bytes.len() as u64 != state.base_sum.len || crc32fast::hash(&bytes) != state.base_sum.crc32 {
        return Err(invalid(
            dir,
            format!("its LoRA base {} fails its checksum", path.display()),
        ));
    }
    let header = WeightsHeader::from_bytes(&bytes[..HEADER_LEN.min(bytes.len())])
        .map_err(|e| invalid(dir, format!("{}: {e}", state.base_file)))?;
    let mut model = weights::decode(
        &header,
        bytes[HEADER_LEN..].to_vec(),
        Transformer::init(config, device),
    )
    .map_err(|e| invalid(dir, format!("{}: {e}", state.base_file)))?;
    let found = format!("{:016x}", lora::fingerprint(&model));
    if found != state.base_fingerprint {
        return Err(invalid(
            dir,
            format!(
                "the adapters were trained on base {}, {} is {found}",
                state.base_fingerprint, state.base_file
            ),
        ));
    }
    let cfg = LoraConfig {
        rank: state.rank,
        alpha: state.alpha,
        dropout: 0.0,
        targets: state.targets.clone(),
    };
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(adapter_bytes))
        .map_err(|e| invalid(dir, format!("{ADAPTERS_FILE}: {e:?}")))?;
    let mut adapters = Adapters::init(config, &cfg, device)
        .try_load_record(record)
        .map_err(|e| invalid(dir, format!("{ADAPTERS_FILE}: {e:?}")))?;
    // Verified above: the trainer takes it instead of hashing the base again.
    adapters.base = u64::from_str_radix(&found, 16)
        .map_err(|e| invalid(dir, format!("base fingerprint {found}: {e}")))?;
    model.lora = Some(adapters);
    Ok(model)
}
