//! Weights as a flat, versioned, checksummed byte stream: what the learner
//! broadcasts after an optimiser step and actors apply between tokens.
//!
//! The stream is a 32-byte header (magic, format version, policy version,
//! payload length, CRC32 of the payload) followed by the payload, Burn's
//! burnpack encoding of the module record. The header travels first, so a
//! receiver knows the size up front and can collect the payload in one
//! buffer of exactly that size (the one extra copy), then hand it to Burn
//! without copying again.

use burn::{module::Module, store::ModuleRecord, tensor::Bytes};

use crate::model::Transformer;

pub const MAGIC: &[u8; 8] = b"BAPOWTS1";
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_LEN: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WeightsError {
    #[error("weights header is {0} bytes, expected {HEADER_LEN}")]
    ShortHeader(usize),
    #[error("not a bapo weights stream (bad magic)")]
    BadMagic,
    #[error("weights format version {0} is not supported (this build reads {FORMAT_VERSION})")]
    UnsupportedFormat(u32),
    #[error("weights payload is {got} bytes, the header declares {declared} (truncated?)")]
    Length { declared: u64, got: u64 },
    #[error(
        "weights payload checksum {got:08x} does not match the header's {expected:08x} (corrupt)"
    )]
    Checksum { expected: u32, got: u32 },
    #[error("weights do not fit the model: {0}")]
    Record(String),
}

/// What the header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightsHeader {
    pub policy_version: u64,
    pub payload_len: u64,
    pub crc32: u32,
}

impl WeightsHeader {
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[12..20].copy_from_slice(&self.policy_version.to_le_bytes());
        h[20..28].copy_from_slice(&self.payload_len.to_le_bytes());
        h[28..32].copy_from_slice(&self.crc32.to_le_bytes());
        h
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self, WeightsError> {
        if b.len() != HEADER_LEN {
            return Err(WeightsError::ShortHeader(b.len()));
        }
        if &b[0..8] != MAGIC {
            return Err(WeightsError::BadMagic);
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let format = u32_at(8);
        if format != FORMAT_VERSION {
            return Err(WeightsError::UnsupportedFormat(format));
        }
        Ok(Self {
            policy_version: u64_at(12),
            payload_len: u64_at(20),
            crc32: u32_at(28),
        })
    }

    /// Checks a received payload against the header.
    pub fn verify(&self, payload: &[u8]) -> Result<(), WeightsError> {
        if payload.len() as u64 != self.payload_len {
            return Err(WeightsError::Length {
                declared: self.payload_len,
                got: payload.len() as u64,
            });
        }
        let got = crc32fast::hash(payload);
        if got != self.crc32 {
            return Err(WeightsError::Checksum {
                expected: self.crc32,
                got,
            });
        }
        Ok(())
    }
}

/// Encodes the weights of `model` as policy version `policy_version`.
/// The model's tensors are shared, not copied, until burnpack writes them.
pub fn encode(
    model: &Transformer,
    policy_version: u64,
) -> Result<(WeightsHeader, Bytes), WeightsError> {
    let payload = model
        .clone()
        .into_record()
        .into_bytes()
        .map_err(|e| WeightsError::Record(format!("{e:?}")))?;
    let header = WeightsHeader {
        policy_version,
        payload_len: payload.len() as u64,
        crc32: crc32fast::hash(&payload),
    };
    Ok((header, payload))
}

/// Verifies `payload` against `header` and loads it into `model`.
pub fn decode(
    header: &WeightsHeader,
    payload: Vec<u8>,
    model: Transformer,
) -> Result<Transformer, WeightsError> {
    header.verify(&payload)?;
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(payload))
        .map_err(|e| WeightsError::Record(format!("{e:?}")))?;
    model
        .try_load_record(record)
        .map_err(|e| WeightsError::Record(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::ModelConfig, policy::Policy};
    use burn::prelude::*;

    fn logits(model: &Transformer, p: &Policy) -> Vec<f32> {
        let t = Policy::tokens(&[vec![1, 2, 3]], &Device::flex());
        model
            .forward(t, &p.rope, None)
            .into_data()
            .try_into_vec()
            .unwrap()
    }

    #[test]
    fn round_trip_restores_the_weights_exactly() {
        let device = Device::flex();
        let cfg = ModelConfig::preset("tiny").unwrap();
        let src = Policy::init(cfg.clone(), &device);
        let (header, payload) = encode(&src.model, 42).unwrap();
        let wire = header.to_bytes();
        let back = WeightsHeader::from_bytes(&wire).unwrap();
        assert_eq!(back, header);
        assert_eq!(back.policy_version, 42);
        let fresh = Transformer::init(&cfg, &device);
        let loaded = decode(&back, payload.to_vec(), fresh).unwrap();
        assert_eq!(logits(&loaded, &src), logits(&src.model, &src));
    }

    #[test]
    fn truncation_and_corruption_are_refused_by_name() {
        let device = Device::flex();
        let cfg = ModelConfig::preset("tiny").unwrap();
        let src = Policy::init(cfg.clone(), &device);
        let (header, payload) = encode(&src.model, 1).unwrap();
        let mut bytes = payload.to_vec();
        let short = bytes[..bytes.len() - 10].to_vec();
        let err = decode(&header, short, Transformer::init(&cfg, &device)).unwrap_err();
        assert!(matches!(err, WeightsError::Length { .. }), "{err}");
        bytes[1000] ^= 1;
        let err = decode(&header, bytes, Transformer::init(&cfg, &device)).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        let mut wire = header.to_bytes();
        wire[8] = 9;
        assert_eq!(
            WeightsHeader::from_bytes(&wire),
            Err(WeightsError::UnsupportedFormat(9))
        );
        assert_eq!(
            WeightsHeader::from_bytes(&wire[..10]),
            Err(WeightsError::ShortHeader(10))
        );
    }
}
