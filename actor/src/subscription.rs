//! Following the learner's weight stream: each announced version is
//! reassembled from its chunks, checked against its header (length, CRC32,
//! version, encoding) and loaded into a fresh model, which then replaces
//! the current one for every generation of this actor. A broken or
//! corrupt transfer is dropped whole (the current weights stay) and the
//! stream is reconnected with exponential backoff and jitter.
//!
//! A bf16 stream is widened back to the device's compute dtype (f32 on
//! the CPU) as it loads: the actor samples, and records its behaviour
//! log-probs, with the bf16-rounded weights, and the learner's importance
//! ratio is taken against exactly those log-probs.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bapo_policy::{
    ModelConfig, Policy, Precision,
    burn::prelude::*,
    model::Transformer,
    weights::{self, Payload, WeightsHeader},
};
use bapo_proto::{
    tls::{self, ClientTls},
    v1::{
        SubscribeRequest, WeightUpdate, weight_message::Kind,
        weight_source_client::WeightSourceClient,
    },
};
use metrics::{counter, gauge, histogram};
use tokio::sync::watch;

use crate::{backoff::Backoff, metrics as names};

/// A policy, the version it is, and the learner incarnation that
/// published it (versions are comparable only within one incarnation's
/// lineage: a resumed learner reuses version numbers).
#[derive(Debug)]
pub struct Versioned {
    pub version: u64,
    pub incarnation: u64,
    pub policy: Policy,
}

impl Versioned {
    /// Whether `other` is a different set of weights from these.
    pub fn differs(&self, other: &Versioned) -> bool {
        self.version != other.version || self.incarnation != other.incarnation
    }
}

pub type PolicyCell = watch::Receiver<Option<Arc<Versioned>>>;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("weights v{version}: chunk stream ended after {got} of {want} bytes")]
    Incomplete { version: u64, got: usize, want: u64 },
    #[error("weights v{version}: {message}")]
    Invalid { version: u64, message: String },
    #[error("weight stream: chunk without an announced update")]
    Orphan,
}

/// Assembles one update's payload from its chunks.
pub struct Assembly {
    update: WeightUpdate,
    payload: Vec<u8>,
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
        Ok(Loaded::Policy(Box::new(Versioned {
            version,
            incarnation,
            policy: Policy::with_model(config, model, device),
        })))
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

/// Follows the learner at `url` until `stop` fires, publishing each loaded
/// version into `cell`. With `tls`, the certificate files are read again
/// at every reconnection (a rotated certificate is used from then on).
pub async fn follow(
    url: String,
    tls: Option<ClientTls>,
    actor_id: String,
    device: Device,
    precision: Precision,
    cell: watch::Sender<Option<Arc<Versioned>>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    // Kept across reconnections: a LoRA learner then sends adapters only.
    let mut base: Option<Base> = None;
    loop {
        let result = tokio::select! {
            r = stream_once(&url, tls.as_ref(), &actor_id, (&device, precision), &cell, &mut base, &mut backoff) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        if let Err(e) = result {
            tracing::warn!(learner = %url, "weight stream: {e}; reconnecting");
        }
        counter!(names::RECONNECTS, "peer" => "learner").increment(1);
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn stream_once(
    url: &str,
    tls: Option<&ClientTls>,
    actor_id: &str,
    (device, precision): (&Device, Precision),
    cell: &watch::Sender<Option<Arc<Versioned>>>,
    base: &mut Option<Base>,
    backoff: &mut Backoff,
) -> anyhow::Result<()> {
    // What we hold, so the learner sends only what is newer; a learner
    // of another incarnation sends its weights whatever the version.
    let have = cell
        .borrow()
        .as_ref()
        .map_or((0, 0), |v| (v.version, v.incarnation));
    let channel = tls::connector(url, tls)?.connect().await?;
    let mut client = WeightSourceClient::new(channel).max_decoding_message_size(64 << 20);
    let mut stream = client
        .subscribe(SubscribeRequest {
            actor_id: actor_id.to_string(),
            have_version: have.0,
            have_incarnation: have.1,
            have_base: base.as_ref().map_or(0, |b| b.fingerprint),
        })
        .await?
        .into_inner();
    backoff.reset();
    let mut current: Option<(Assembly, Instant)> = None;
    while let Some(msg) = stream.message().await? {
        match msg.kind {
            Some(Kind::Update(u)) => {
                let empty = u.payload_len == 0;
                current = Some((Assembly::new(u), Instant::now()));
                if !empty {
                    continue;
                }
            }
            Some(Kind::Chunk(c)) => {
                let Some((a, _)) = current.as_mut() else {
                    return Err(TransferError::Orphan.into());
                };
                if !a.push(&c)? {
                    continue;
                }
            }
            None => continue,
        }
        let (assembly, started) = current.take().expect("an update is being assembled");
        let device = device.clone();
        let held = base.clone();
        let loaded =
            tokio::task::spawn_blocking(move || assembly.finish(&device, precision, held.as_ref()))
                .await??;
        let loaded = match loaded {
            Loaded::Policy(v) => *v,
            Loaded::Base(b) => {
                tracing::info!(fingerprint = %format!("{:016x}", b.fingerprint), "LoRA base loaded");
                *base = Some(*b);
                continue;
            }
        };
        histogram!(names::WEIGHT_APPLY_SECONDS).record(started.elapsed().as_secs_f64());
        gauge!(names::WEIGHT_VERSION).set(loaded.version as f64);
        tracing::debug!(
            version = loaded.version,
            incarnation = loaded.incarnation,
            "weights loaded"
        );
        cell.send_replace(Some(Arc::new(loaded)));
    }
    if let Some((a, _)) = current {
        return Err(TransferError::Incomplete {
            version: a.update.version,
            got: a.payload.len(),
            want: a.update.payload_len,
        }
        .into());
    }
    anyhow::bail!("learner closed the weight stream")
}
