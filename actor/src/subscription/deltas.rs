//! Weights that arrive as deltas: the subscriber keeps the payload of
//! the version in use (the bytes as they came, in the stream's encoding:
//! half the model's f32 size under bf16) and applies each delta to it
//! where it lies.
//!
//! What a subscriber is guaranteed: it loads a version from a delta only
//! when the bytes it built have the CRC32 the learner's header gives for
//! that version, and the delta named the bytes it was applied to. A
//! delta that was dropped, reordered, corrupted or made against other
//! bytes is refused; the kept payload is dropped and the subscriber
//! reconnects asking for the newest version whole, serving the version it
//! had until then.

use bapo_policy::{
    delta::{self, DeltaHeader},
    weights::{Payload, WeightsHeader},
};
use bapo_proto::v1::WeightUpdate;

use super::{TransferError, assembly::Assembly};

/// The payload of the version a subscriber serves (or, inside a chain,
/// of the last link it applied).
#[derive(Debug)]
pub struct Kept {
    pub version: u64,
    pub incarnation: u64,
    pub crc: u32,
    pub bytes: Vec<u8>,
}

/// The whole model's bytes of `a` as they came, kept for the deltas that
/// follow (a copy: loading consumes the payload); `None` for a LoRA base
/// or adapters, which never travel as deltas. The CRC32 is the header's:
/// loading checks the bytes against it, and nothing is kept when that
/// fails.
pub fn keepable(a: &Assembly) -> Option<Kept> {
    let (h, _, payload) = WeightsHeader::read_any(&a.update.header).ok()?;
    (payload == Payload::Model && !a.update.base).then(|| Kept {
        version: a.update.version,
        incarnation: a.update.incarnation,
        crc: h.crc32,
        bytes: a.payload.clone(),
    })
}

/// What a delta update made of the kept payload.
pub enum Applied {
    /// More links follow: nothing to load yet.
    Link(Kept),
    /// The last link: the kept payload, and the whole version to load
    /// (a copy of it, which the loader consumes).
    Whole(Kept, Assembly),
}

/// Applies the delta of `a` to `kept`, which must be the version it
/// names, of the same incarnation.
pub fn apply(kept: Option<Kept>, a: Assembly) -> Result<Applied, TransferError> {
    let u = a.update;
    let refused = |reason: &'static str, message: String| TransferError::Delta {
        version: u.version,
        reason,
        message,
    };
    let mut k = kept
        .filter(|k| k.version == u.delta_from && k.incarnation == u.incarnation)
        .ok_or_else(|| {
            refused(
                "base",
                format!(
                    "made against v{}, which this actor does not keep",
                    u.delta_from
                ),
            )
        })?;
    let h = DeltaHeader::read(&a.payload).map_err(|e| refused(e.reason(), e.to_string()))?;
    delta::apply_in_place_known(&mut k.bytes, k.crc, &a.payload)
        .map_err(|e| refused(e.reason(), e.to_string()))?;
    k.version = u.version;
    k.crc = h.result_crc;
    if u.deltas_after > 0 {
        return Ok(Applied::Link(k));
    }
    let whole = Assembly {
        update: WeightUpdate {
            delta: false,
            delta_from: 0,
            payload_len: k.bytes.len() as u64,
            ..u
        },
        payload: k.bytes.clone(),
    };
    Ok(Applied::Whole(k, whole))
}
