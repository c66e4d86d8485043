//! One weight update reassembled from its chunks, checked against its
//! header, and loaded: a policy to sample with, or a LoRA base to hold.

use bapo_policy::{
    ModelConfig, Policy, Precision,
    burn::prelude::*,
    model::Transformer,
    weights::{self, Encoding, Payload, WeightsHeader},
};
use bapo_proto::v1::WeightUpdate;

use super::{Versioned, Weights, Wire};

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("weights v{version}: chunk stream ended after {got} of {want} bytes")]
    Incomplete { version: u64, got: usize, want: u64 },
    #[error("weights v{version}: {message}")]
    Invalid { version: u64, message: String },
    #[error("weight stream: chunk without an announced update")]
    Orphan,
    /// A delta that cannot build the version it names; the subscriber
    /// drops what it kept and asks for the version whole.
    #[error("weights v{version}: delta refused ({message}); asking for a snapshot")]
    Delta {
        version: u64,
        reason: &'static str,
        message: String,
    },
}

/// Assembles one update's payload from its chunks.
pub struct Assembly {
    pub(super) update: WeightUpdate,
    pub(super) payload: Vec<u8>,
}

impl Assembly {
    pub fn new(update: WeightUpdate) -> Self {
        // Trust the announced length only so far: a bogus one must not
        // allocate the machine away before the first chunk arrives.
        let cap = update.payload_len.min(256 << 20) as usize;
        Self {
            update,
            payload: Vec::with_capacity(cap),
        }
    }

    /// The update this assembles.
    pub fn update(&self) -> &WeightUpdate {
        &self.update
    }

    /// Adds a chunk; `true` once the payload is complete.
    pub fn push(&mut self, chunk: &[u8]) -> Result<bool, TransferError> {
        self.payload.extend_from_slice(chunk);
        if self.payload.len() as u64 > self.update.payload_len {
            return Err(TransferError::Invalid {
                version: self.update.version,
                message: format!(
                    "{} payload bytes received, {} announced",
                    self.payload.len(),
                    self.update.payload_len
                ),
            });
        }
        Ok(self.payload.len() as u64 == self.update.payload_len)
    }

    /// The header's reading, checked against the update, and the model
    /// config it carries.
    fn checked(&self) -> Result<(WeightsHeader, Encoding, Payload, ModelConfig), TransferError> {
        let version = self.update.version;
        let invalid = |message: String| TransferError::Invalid { version, message };
        let (header, encoding, payload) =
            WeightsHeader::read_any(&self.update.header).map_err(|e| invalid(e.to_string()))?;
        // A base travels under the version of the adapters that follow.
        if header.policy_version != version && !self.update.base {
            return Err(invalid(format!(
                "header says version {}, update says {version}",
                header.policy_version
            )));
        }
        let config: ModelConfig = serde_json::from_str(&self.update.model_config_json)
            .map_err(|e| invalid(format!("model config: {e}")))?;
        config
            .validate()
            .map_err(|e| invalid(format!("model config: {e}")))?;
        Ok((header, encoding, payload, config))
    }

    /// Whether this update is a whole model to serve (not a LoRA base or
    /// adapters).
    pub fn is_whole_model(&self) -> bool {
        !self.update.base
            && WeightsHeader::read_any(&self.update.header)
                .is_ok_and(|(_, _, p)| p == Payload::Model)
    }

    /// A whole model's payload, verified against its header and handed
    /// on as it came: no model is built ([`super::Form::Wire`]).
    pub fn into_wire(self) -> Result<Versioned, TransferError> {
        let (header, _, _, config) = self.checked()?;
        let version = self.update.version;
        header
            .verify(&self.payload)
            .map_err(|e| TransferError::Invalid {
                version,
                message: e.to_string(),
            })?;
        Ok(Versioned {
            version,
            incarnation: self.update.incarnation,
            weights: Weights::Wire(Box::new(Wire {
                config,
                payload: self.payload,
            })),
        })
    }

    /// Verifies and loads the weights on `device`, computing in (and
    /// holding its weights in) `precision`: a new policy, or the LoRA base
    /// later adapters apply to. Adapters need `base`, the one held.
    pub fn finish(
        self,
        device: &Device,
        precision: Precision,
        base: Option<&Base>,
    ) -> Result<Loaded, TransferError> {
        let version = self.update.version;
        let invalid = |message: String| TransferError::Invalid { version, message };
        let (header, encoding, payload, config) = self.checked()?;
        let incarnation = self.update.incarnation;
        let model = match payload {
            Payload::Model => {
                let fresh = Transformer::init(&config, device);
                let model = weights::decode_as(&header, encoding, self.payload, fresh)
                    .map_err(|e| invalid(e.to_string()))?;
                let model = weights::for_inference(model, precision);
                if self.update.base {
                    return Ok(Loaded::Base(Box::new(Base {
                        fingerprint: self.update.base_fingerprint,
                        config,
                        model,
                    })));
                }
                model
            }
            Payload::Adapters => {
                let want = self.update.base_fingerprint;
                let base = base.filter(|b| b.fingerprint == want).ok_or_else(|| {
                    invalid(format!(
                        "adapters for base {want:016x}, which this actor does not hold"
                    ))
                })?;
                let (adapters, meta) =
                    weights::decode_adapters(&header, &self.payload, &base.config, device)
                        .map_err(|e| invalid(e.to_string()))?;
                if meta.base != want {
                    return Err(invalid(format!(
                        "adapter payload names base {:016x}, the update {want:016x}",
                        meta.base
                    )));
                }
                let mut model = base.model.clone();
                model.lora = Some(adapters);
                weights::for_inference(model, precision)
            }
        };
        Ok(Loaded::Policy(Box::new(Versioned::new(
            version,
            incarnation,
            Policy::with_model(config, model, device),
        ))))
    }
}

impl Loaded {
    /// The policy loaded; an error naming the version for a base.
    pub fn policy(self) -> Result<Versioned, TransferError> {
        match self {
            Loaded::Policy(v) => Ok(*v),
            Loaded::Base(_) => Err(TransferError::Invalid {
                version: 0,
                message: "a LoRA base, not a policy".into(),
            }),
        }
    }
}

/// The frozen base a LoRA learner sent, which its adapters apply to.
#[derive(Debug, Clone)]
pub struct Base {
    pub fingerprint: u64,
    pub config: ModelConfig,
    /// In the actor's compute dtype; shared by every adapted policy.
    pub model: Transformer,
}

/// What one update loaded.
#[derive(Debug)]
pub enum Loaded {
    /// Weights to sample with.
    Policy(Box<Versioned>),
    /// A LoRA base to hold until its adapters arrive.
    Base(Box<Base>),
}
