//! The newest published weights, shared with every subscriber.
//!
//! Weights go out in the learner's `broadcast_dtype`: f32, or bf16 at half
//! the bytes (see `bapo_policy::weights`).
//!
//! Publishing replaces one slot (a `watch` channel): it never waits for a
//! subscriber, so a slow or dead actor cannot hold the learner back, and a
//! subscriber that falls behind skips straight to the newest version. The
//! encoded payload is held once (`Bytes`) and sliced into chunks per
//! subscriber without copying.
//!
//! A LoRA learner's hub encodes its frozen base once and then publishes
//! adapters only ([`WeightHub::publish_adapters`]): a few megabytes per version instead of the
//! whole model. Each adapter publish names the base, and the server sends
//! the base first to a subscriber that does not hold it.
//!
//! Whole-model versions also travel as deltas ([`crate::delta_chain`]):
//! each publish diffs the new payload against the one before, in the wire
//! encoding, and a subscriber that holds a recent version is sent the
//! words that changed (a few percent of the bytes at small learning
//! rates) instead of the whole model. Diffing costs one pass over both
//! payloads per publish, on the learner, once for all subscribers.
//!
//! A hub publishes as one learner incarnation (see [`crate::lineage`]):
//! every update carries its id, so a subscriber holding weights of another
//! incarnation is sent the newest at once, whatever the version numbers.

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use bapo_policy::{
    ModelConfig,
    burn::tensor::Bytes as BurnBytes,
    delta,
    model::Transformer,
    weights::{self, Encoding, WeightsError},
};
use bytes::Bytes;
use metrics::gauge;
use tokio::sync::watch;

use crate::{
    delta_chain::{Chain, Link},
    lineage, metrics as names,
};

/// One published version.
#[derive(Debug)]
pub struct Published {
    pub version: u64,
    /// The learner incarnation that published it.
    pub incarnation: u64,
    /// The 32-byte weights header.
    pub header: Bytes,
    pub payload: Bytes,
    /// HF `config.json` of the model.
    pub config_json: String,
    pub at: Instant,
    /// What a subscriber must hold first: the frozen base of an adapter
    /// publish (itself a publish with `fingerprint` set and no base).
    pub base: Option<Arc<Published>>,
    /// A base's own fingerprint, or the base an adapter publish applies
    /// to; 0 for a whole model.
    pub fingerprint: u64,
    /// How the float weights travel, and the payload's CRC32.
    pub encoding: Encoding,
    pub crc: u32,
    /// The delta chain ending at this version (empty: snapshots only).
    pub links: Arc<[Arc<Link>]>,
}

impl Published {
    /// Whether this is a LoRA base (held by subscribers, not sampled).
    pub fn is_base(&self) -> bool {
        self.fingerprint != 0 && self.base.is_none()
    }
}

#[derive(Clone)]
pub struct WeightHub {
    /// This learner process's incarnation id.
    incarnation: u64,
    tx: Arc<watch::Sender<Option<Arc<Published>>>>,
    /// Set when the learner stops: subscriber streams end, so the server's
    /// graceful shutdown does not wait on streams that never finish.
    closed: Arc<watch::Sender<bool>>,
    /// The frozen base adapters are published against (LoRA only).
    base: Arc<Mutex<Option<Arc<Published>>>>,
    /// Recent versions as deltas; `None` when deltas are off.
    chain: Option<Arc<Mutex<Chain>>>,
}

impl Default for WeightHub {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightHub {
    /// A hub for a new learner incarnation, with a freshly drawn id: make
    /// one per learner process.
    pub fn new() -> Self {
        Self::with_incarnation(lineage::draw_id())
    }

    /// A hub publishing as incarnation `id` (tests pick theirs).
    pub fn with_incarnation(id: u64) -> Self {
        Self {
            incarnation: id,
            tx: Arc::new(watch::channel(None).0),
            closed: Arc::new(watch::channel(false).0),
            base: Arc::default(),
            chain: Some(Arc::default()),
        }
    }

    /// Whether whole-model versions also go out as deltas (`[learner]
    /// broadcast_deltas`; on by default). Off, every subscriber is sent
    /// every version whole and the learner keeps no chain.
    pub fn with_deltas(mut self, on: bool) -> Self {
        self.chain = on.then(Arc::default);
        self
    }

    /// The incarnation id every update from this hub carries.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Encodes `model` as `version`, its weights in f32, and makes it the
    /// newest.
    pub fn publish(
        &self,
        model: &Transformer,
        config: &ModelConfig,
        version: u64,
    ) -> Result<Arc<Published>, WeightsError> {
        self.publish_as(model, config, version, Encoding::F32)
    }

    /// Encodes `model` as `version`, its float weights in `encoding` (the
    /// learner's `broadcast_dtype`; `model` itself is unchanged), and
    /// makes it the newest. The header names the encoding and its CRC32
    /// covers the payload as sent.
    pub fn publish_as(
        &self,
        model: &Transformer,
        config: &ModelConfig,
        version: u64,
        encoding: Encoding,
    ) -> Result<Arc<Published>, WeightsError> {
        let (header, payload) = weights::encode_as(model, version, encoding)?;
        let wire = (&header.to_bytes_as(encoding)[..], header.crc32, encoding);
        let mut published = self.published(version, wire, payload, config, None, 0);
        published.links = self.chained(&published);
        gauge!(names::WEIGHT_PAYLOAD_BYTES).set(published.payload.len() as f64);
        gauge!(names::WEIGHT_DELTA_BYTES)
            .set(published.links.last().map_or(0, |l| l.delta.len()) as f64);
        gauge!(names::WEIGHT_CRC).set(f64::from(published.crc));
        gauge!(names::WEIGHT_VERSION).set(version as f64);
        let published = Arc::new(published);
        self.tx.send_replace(Some(published.clone()));
        Ok(published)
    }

    /// Adds the delta from the newest version to `p` to the chain and
    /// returns the chain ending at `p`: empty when deltas are off, for f32
    /// payloads, when there is no whole-model version before it in the
    /// same encoding, or when the delta is no smaller than `p` itself.
    fn chained(&self, p: &Published) -> Arc<[Arc<Link>]> {
        let Some(chain) = &self.chain else {
            return Arc::new([]);
        };
        let mut chain = chain.lock().expect("delta chain lock");
        if p.encoding == Encoding::F32 {
            // AdamW moves every f32 weight each step: an f32 delta is
            // 1.25x the payload (docs/notes/2026-11-28-weight-deltas.md),
            // so the diff pass would be spent for nothing.
            chain.clear();
            return chain.links();
        }
        let prev = self
            .latest()
            .filter(|q| q.fingerprint == 0 && q.encoding == p.encoding && q.version < p.version);
        let word = p.encoding.word_bytes();
        let made = prev
            .as_ref()
            .map(|q| delta::diff_known(&q.payload, q.crc, &p.payload, p.crc, word).map(|d| (q, d)));
        match made {
            Some(Ok((q, d))) => chain.push(
                Link {
                    from_version: q.version,
                    from_crc: q.crc,
                    version: p.version,
                    header: p.header.clone(),
                    delta: Bytes::from(d),
                },
                p.payload.len(),
            ),
            Some(Err(e)) => {
                tracing::debug!("no delta for weights v{}: {e}", p.version);
                chain.clear();
            }
            None => chain.clear(),
        }
        chain.links()
    }

    /// Encodes the adapters of `model` (a LoRA learner's, its base of
    /// fingerprint `fingerprint`) as `version`, factors in `encoding`, and
    /// makes them the newest. The base is encoded the first time (and
    /// again only if the fingerprint changes); every subscriber without it
    /// is sent it first.
    pub fn publish_adapters(
        &self,
        model: &Transformer,
        config: &ModelConfig,
        version: u64,
        encoding: Encoding,
        fingerprint: u64,
    ) -> Result<Arc<Published>, WeightsError> {
        let adapters = model
            .lora
            .as_ref()
            .ok_or_else(|| WeightsError::Record("a model without adapters".into()))?;
        let base = self.base(model, config, fingerprint, encoding)?;
        let (header, payload) = weights::encode_adapters(adapters, version, encoding, fingerprint)?;
        let wire = (
            &header.to_bytes_adapters(encoding)[..],
            header.crc32,
            encoding,
        );
        let published = self.published(version, wire, payload, config, Some(base), fingerprint);
        let published = Arc::new(published);
        self.tx.send_replace(Some(published.clone()));
        Ok(published)
    }

    /// The encoded base of `model`, made once per fingerprint.
    fn base(
        &self,
        model: &Transformer,
        config: &ModelConfig,
        fingerprint: u64,
        encoding: Encoding,
    ) -> Result<Arc<Published>, WeightsError> {
        let mut held = self.base.lock().expect("base lock");
        if let Some(b) = held.as_ref().filter(|b| b.fingerprint == fingerprint) {
            return Ok(b.clone());
        }
        let base = bapo_policy::lora::base_of(model);
        let (header, payload) = weights::encode_as(&base, 0, encoding)?;
        let wire = (&header.to_bytes_as(encoding)[..], header.crc32, encoding);
        let base = Arc::new(self.published(0, wire, payload, config, None, fingerprint));
        *held = Some(base.clone());
        Ok(base)
    }

    /// A version as published: `wire` is its header as sent, the
    /// payload's CRC32 (the header's) and its encoding.
    fn published(
        &self,
        version: u64,
        (header, crc, encoding): (&[u8], u32, Encoding),
        payload: BurnBytes,
        config: &ModelConfig,
        base: Option<Arc<Published>>,
        fingerprint: u64,
    ) -> Published {
        Published {
            version,
            incarnation: self.incarnation,
            header: Bytes::copy_from_slice(header),
            crc,
            payload: to_bytes(payload),
            config_json: config.to_hf_json().to_string(),
            at: Instant::now(),
            base,
            fingerprint,
            encoding,
            links: Arc::new([]),
        }
    }

    pub fn latest(&self) -> Option<Arc<Published>> {
        self.tx.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Published>>> {
        self.tx.subscribe()
    }

    /// Ends every subscriber stream (and refuses new ones).
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    pub fn closed(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }
}

/// Burn's byte buffer as a reference-counted one, without copying it: the
/// encoded weights are the only copy, shared by every subscriber (at 7B a
/// second copy was 28 GB of memory traffic per publish).
pub fn to_bytes(b: BurnBytes) -> Bytes {
    Bytes::from_owner(Owned(b))
}

/// Burn's bytes, owned by a `bytes::Bytes`.
struct Owned(BurnBytes);

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}
