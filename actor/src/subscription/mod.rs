//! Following the learner's weight stream: each announced version is
//! reassembled from its chunks, checked against its header (length, CRC32,
//! version, encoding) and loaded into a fresh model, which then replaces
//! the current one for every generation of this actor. A vLLM actor takes
//! whole models as their payload instead ([`Form::Wire`]): the engine
//! computes, so no Burn model is built. A broken or
//! corrupt transfer is dropped whole (the current weights stay) and the
//! stream is reconnected with exponential backoff and jitter.
//!
//! A version may come as a delta from the one in use (`deltas.rs` says
//! what is checked): the actor keeps the payload of the version it
//! serves, in the wire encoding, for that.
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
    adapters::Adapters,
    burn::prelude::*,
    model::Transformer,
    weights::{self, Encoding, WeightsError},
};
use bapo_proto::{
    tls::{self, ClientTls},
    v1::{SubscribeRequest, weight_message::Kind, weight_source_client::WeightSourceClient},
};
use metrics::{counter, gauge, histogram};
use tokio::sync::watch;

use crate::{backoff::Backoff, metrics as names};

mod assembly;
mod deltas;

pub use assembly::{Assembly, Base, Loaded, TransferError};
use deltas::{Applied, Kept};

/// A version of the weights, the learner incarnation that published it
/// (versions are comparable only within one incarnation's lineage: a
/// resumed learner reuses version numbers), and the weights themselves.
#[derive(Debug)]
pub struct Versioned {
    pub version: u64,
    pub incarnation: u64,
    pub weights: Weights,
}

/// The weights of a version, in the form its user wants them.
#[derive(Debug)]
pub enum Weights {
    /// Loaded into a model to sample with: the Burn engine's form, and
    /// every LoRA version's.
    Model(Box<Policy>),
    /// A whole model's payload as it came, never decoded: a vLLM actor
    /// writes it into the engine (`bapo_policy::hf_layout`).
    Wire(Box<Wire>),
}

/// A whole model's payload, checked against its header's CRC32 (the
/// payload names its own dtype, `bapo_policy::hf_layout` reads it).
#[derive(Debug)]
pub struct Wire {
    pub config: ModelConfig,
    pub payload: Vec<u8>,
}

/// What [`follow`] loads versions into.
#[derive(Debug, Clone)]
pub struct Target {
    /// Where models are built, and the dtype they compute in.
    pub device: Device,
    pub precision: Precision,
    /// Whole-model versions as models or as payloads.
    pub form: Form,
}

impl Wire {
    /// `model` (of `config`) as the learner broadcasts it, version 0:
    /// what a vLLM actor receives.
    pub fn encode(
        config: &ModelConfig,
        model: &Transformer,
        encoding: Encoding,
    ) -> Result<Self, WeightsError> {
        let (_, payload) = weights::encode_as(model, 0, encoding)?;
        Ok(Self {
            config: config.clone(),
            payload: payload.to_vec(),
        })
    }
}

impl Target {
    /// Every version as a model on `device`, computing in `precision`.
    pub fn model(device: Device, precision: Precision) -> Self {
        Self {
            device,
            precision,
            form: Form::Model,
        }
    }
}

/// The form [`follow`] delivers whole-model versions in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Decoded into a model on the actor's device (Burn engine).
    Model,
    /// The payload as it came (vLLM engine).
    Wire,
}

impl Versioned {
    /// A version loaded into a model.
    pub fn new(version: u64, incarnation: u64, policy: Policy) -> Self {
        Self {
            version,
            incarnation,
            weights: Weights::Model(Box::new(policy)),
        }
    }

    /// A version as its payload.
    pub fn wire(version: u64, incarnation: u64, wire: Wire) -> Self {
        Self {
            version,
            incarnation,
            weights: Weights::Wire(Box::new(wire)),
        }
    }

    /// Whether `other` is a different set of weights from these.
    pub fn differs(&self, other: &Versioned) -> bool {
        self.version != other.version || self.incarnation != other.incarnation
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        match &self.weights {
            Weights::Model(p) => &p.config,
            Weights::Wire(w) => &w.config,
        }
    }

    /// The model, where these weights were loaded into one.
    pub fn policy(&self) -> Option<&Policy> {
        match &self.weights {
            Weights::Model(p) => Some(p),
            Weights::Wire(_) => None,
        }
    }

    /// The model, where these weights were loaded into one.
    pub fn into_policy(self) -> Option<Policy> {
        match self.weights {
            Weights::Model(p) => Some(*p),
            Weights::Wire(_) => None,
        }
    }

    /// The LoRA adapters, for a LoRA version.
    pub fn lora(&self) -> Option<&Adapters> {
        self.policy().and_then(|p| p.model.lora.as_ref())
    }
}

pub type PolicyCell = watch::Receiver<Option<Arc<Versioned>>>;

/// What a subscriber keeps across updates and reconnections.
#[derive(Debug, Default)]
struct Holdings {
    /// The LoRA base: a LoRA learner then sends adapters only.
    base: Option<Base>,
    /// The payload of the version in use, for deltas.
    kept: Option<Kept>,
    /// A delta was refused: ask for the newest version whole.
    want_snapshot: bool,
}

impl Holdings {
    /// The request that asks for what is newer than the version `serving`
    /// (a learner of another incarnation sends its weights whatever the
    /// version), as deltas where the kept payload is that version's.
    fn request(&mut self, actor_id: &str, serving: Option<(u64, u64)>) -> SubscribeRequest {
        if self
            .kept
            .as_ref()
            .is_some_and(|k| Some((k.version, k.incarnation)) != serving)
        {
            // A chain cut short: the kept bytes are ahead of what serves.
            self.kept = None;
        }
        let have = serving.filter(|_| !self.want_snapshot).unwrap_or((0, 0));
        SubscribeRequest {
            actor_id: actor_id.to_string(),
            have_version: have.0,
            have_incarnation: have.1,
            have_base: self.base.as_ref().map_or(0, |b| b.fingerprint),
            have_crc: self.kept.as_ref().map_or(0, |k| k.crc),
            takes_deltas: true,
        }
    }
}

/// Follows the learner at `url` until `stop` fires, publishing each loaded
/// version into `cell`. With `tls`, the certificate files are read again
/// at every reconnection (a rotated certificate is used from then on).
pub async fn follow(
    url: String,
    tls: Option<ClientTls>,
    actor_id: String,
    target: Target,
    cell: watch::Sender<Option<Arc<Versioned>>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut held = Holdings::default();
    loop {
        let result = tokio::select! {
            r = stream_once(&url, tls.as_ref(), &actor_id, &target, &cell, &mut held, &mut backoff) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        if let Err(e) = result {
            tracing::warn!(learner = %url, "weight stream: {e}; reconnecting");
            if let Some(TransferError::Delta { .. }) = e.downcast_ref() {
                // The snapshot is wanted now, not after a backoff.
                continue;
            }
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
    target: &Target,
    cell: &watch::Sender<Option<Arc<Versioned>>>,
    held: &mut Holdings,
    backoff: &mut Backoff,
) -> anyhow::Result<()> {
    let serving = cell.borrow().as_ref().map(|v| (v.version, v.incarnation));
    let request = held.request(actor_id, serving);
    let channel = tls::connector(url, tls)?.connect().await?;
    let mut client = WeightSourceClient::new(channel).max_decoding_message_size(64 << 20);
    let mut stream = client.subscribe(request).await?.into_inner();
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
        let Some(loaded) = load(assembly, target, held).await? else {
            continue;
        };
        histogram!(names::WEIGHT_APPLY_SECONDS).record(started.elapsed().as_secs_f64());
        gauge!(names::WEIGHT_VERSION).set(loaded.version as f64);
        gauge!(names::WEIGHT_CRC).set(f64::from(held.kept.as_ref().map_or(0, |k| k.crc)));
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

/// Verifies and loads one complete update, off the runtime: a policy to
/// serve, or `None` for a LoRA base or a link inside a delta chain. A
/// whole model's payload is kept for the deltas that follow.
async fn load(
    assembly: Assembly,
    target: &Target,
    held: &mut Holdings,
) -> anyhow::Result<Option<Versioned>> {
    let Target {
        device,
        precision,
        form,
    } = target.clone();
    let base = held.base.clone();
    let kept = held.kept.take();
    let is_delta = assembly.update().delta;
    let work = move || -> Result<_, TransferError> {
        let (kept, assembly) = if is_delta {
            match deltas::apply(kept, assembly)? {
                Applied::Link(k) => return Ok((Some(k), None)),
                Applied::Whole(k, whole) => (Some(k), whole),
            }
        } else {
            (None, assembly)
        };
        // A whole model's bytes as they came, for the next delta.
        let keep = kept.or_else(|| deltas::keepable(&assembly));
        if form == Form::Wire && assembly.is_whole_model() {
            let v = assembly.into_wire()?;
            return Ok((keep, Some(Loaded::Policy(Box::new(v)))));
        }
        let loaded = assembly.finish(&device, precision, base.as_ref())?;
        Ok((keep, Some(loaded)))
    };
    let (kept, loaded) = match tokio::task::spawn_blocking(work).await? {
        Ok(done) => done,
        Err(e) => {
            if let TransferError::Delta { reason, .. } = &e {
                counter!(names::WEIGHT_DELTAS_REFUSED, "reason" => *reason).increment(1);
                held.want_snapshot = true;
            }
            return Err(e.into());
        }
    };
    let kind = if is_delta { "delta" } else { "snapshot" };
    match loaded {
        None => held.kept = kept,
        Some(Loaded::Base(b)) => {
            tracing::info!(fingerprint = %format!("{:016x}", b.fingerprint), "LoRA base loaded");
            held.base = Some(*b);
        }
        Some(Loaded::Policy(v)) => {
            counter!(names::WEIGHT_UPDATES, "kind" => kind).increment(1);
            held.kept = kept;
            held.want_snapshot = false;
            return Ok(Some(*v));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(version: u64) -> Kept {
        Kept {
            version,
            incarnation: 9,
            crc: 0xabc,
            bytes: vec![1, 2],
        }
    }

    #[test]
    fn deltas_are_asked_for_only_from_the_bytes_that_serve() {
        let mut h = Holdings {
            kept: Some(kept(4)),
            ..Default::default()
        };
        let r = h.request("a", Some((4, 9)));
        assert_eq!(
            (r.have_version, r.have_crc, r.takes_deltas),
            (4, 0xabc, true)
        );
        // A chain cut short: the kept bytes are v5's, v4 serves. They are
        // dropped, and the next version comes whole.
        h.kept = Some(kept(5));
        let r = h.request("a", Some((4, 9)));
        assert_eq!((r.have_version, r.have_crc), (4, 0));
        assert!(h.kept.is_none());
        // After a refused delta: the newest whole, now.
        h.want_snapshot = true;
        let r = h.request("a", Some((4, 9)));
        assert_eq!((r.have_version, r.have_incarnation, r.have_crc), (0, 0, 0));
    }
}
