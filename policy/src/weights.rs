//! Weights as a flat, versioned, checksummed byte stream: what the learner
//! broadcasts after an optimiser step, actors apply between tokens, and
//! checkpoints hold.
//!
//! The stream is a 32-byte header followed by the payload, Burn's burnpack
//! encoding of the module record. The header travels first, so a receiver
//! knows the size up front and can collect the payload in one buffer of
//! exactly that size (the one extra copy), then hand it to Burn without
//! copying again.
//!
//! Header (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `BAPOWTS1` |
//! | 8..10 | format version, 1, 2 or 3 |
//! | 10..12 | payload [`Encoding`] code (format 2; zero in format 1) |
//! | 12..20 | policy version |
//! | 20..28 | payload length |
//! | 28..32 | CRC32 of the payload: the bytes sent, whatever the encoding |
//!
//! Format 1 is the header of builds before bf16 publishing, which wrote
//! the format as a `u32` 1: its upper half, the encoding, reads 0 = f32.
//! An f32 payload is still written as format 1, byte for byte as before,
//! so checkpoints and older actors read it unchanged. A bf16 payload is
//! written as format 2 with its encoding; an older reader sees the format
//! word `0x0001_0002` and refuses it as an unsupported format instead of
//! misreading it.
//!
//! Format 3 (LoRA) carries adapters only, in PEFT's safetensors layout
//! (`peft.rs`), its encoding field as format 2; builds before it refuse it
//! as an unsupported format.
//!
//! In both encodings a model payload is burnpack. Under [`Encoding::Bf16`]
//! every float parameter is stored as bf16, rounded to nearest even from
//! the f32 master weights (half the bytes); the receiver loads it and
//! casts back to its compute dtype (the device's default float dtype, f32
//! on the CPU). The decoder checks that every float tensor of the payload
//! has the dtype the header announces.

use std::fmt;

use burn::{
    module::{Module, ModuleMapper, Param},
    store::ModuleRecord,
    tensor::{Bytes, DType, FloatDType, Tensor},
};

use crate::{
    config::ModelConfig,
    device::Precision,
    lora::Adapters,
    model::Transformer,
    peft::{self, AdapterMeta},
};

pub const MAGIC: &[u8; 8] = b"BAPOWTS1";
/// The newest header format of a whole model, the one that names the
/// encoding (bf16 payloads are written so); f32 payloads keep format 1.
/// Both are read.
pub const FORMAT_VERSION: u32 = 2;
/// The format of a LoRA adapter payload (PEFT safetensors, `peft.rs`),
/// its encoding field as in format 2. Builds before LoRA refuse it as an
/// unsupported format rather than load it as a model.
const FORMAT_ADAPTERS: u16 = 3;
/// The format of f32 payloads: no encoding field, so every build reads it.
const FORMAT_F32: u16 = 1;
pub const HEADER_LEN: usize = 32;

/// How the float parameters travel in the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Encoding {
    /// f32, the learner's master weights as they are.
    #[default]
    F32,
    /// bf16, each f32 weight rounded to nearest even: half the bytes of
    /// f32. Actors then sample, and record their behaviour log-probs, with
    /// the rounded weights, while the learner keeps and differentiates the
    /// f32 ones. The rounding is one more source of the behaviour/learner
    /// mismatch the importance ratio already carries: the learner weighs
    /// each token by `π_θ / π_behav` (or, with a recomputed proximal
    /// policy, corrects `π_old / π_behav`) with the log-probs the actor
    /// recorded, which are those of the bf16 weights actually used, so
    /// nothing is silently treated as on-policy. Expect the ratios of
    /// tokens sampled from the current version to sit near 1 rather than
    /// at exactly 1 (within about 1% on the tiny model: see the tests).
    Bf16,
}

impl Encoding {
    pub const ALL: [Encoding; 2] = [Encoding::F32, Encoding::Bf16];

    /// The name in the config file and in messages: `f32`, `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::F32 => "f32",
            Encoding::Bf16 => "bf16",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }

    /// The code in the header.
    fn code(self) -> u16 {
        match self {
            Encoding::F32 => 0,
            Encoding::Bf16 => 1,
        }
    }

    fn from_code(code: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.code() == code)
    }

    /// The dtype of the payload's float tensors.
    pub fn dtype(self) -> FloatDType {
        match self {
            Encoding::F32 => FloatDType::F32,
            Encoding::Bf16 => FloatDType::BF16,
        }
    }

    /// Bytes per float word: the word size a delta of this payload uses.
    pub fn word_bytes(self) -> usize {
        match self {
            Encoding::F32 => 4,
            Encoding::Bf16 => 2,
        }
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WeightsError {
    #[error("weights header is {0} bytes, expected {HEADER_LEN}")]
    ShortHeader(usize),
    #[error("not a bapo weights stream (bad magic)")]
    BadMagic,
    #[error(
        "weights format version {0} is not supported (this build reads 1, {FORMAT_VERSION} and 3)"
    )]
    UnsupportedFormat(u32),
    #[error("weights encoding {0} is unknown (this build reads 0 = f32 and 1 = bf16)")]
    UnknownEncoding(u16),
    #[error("weights payload holds {found:?} tensors ({tensor}), the header announces {announced}")]
    EncodingMismatch {
        announced: Encoding,
        tensor: String,
        found: DType,
    },
    #[error("weights payload is {got} bytes, the header declares {declared} (truncated?)")]
    Length { declared: u64, got: u64 },
    #[error(
        "weights payload checksum {got:08x} does not match the header's {expected:08x} (corrupt)"
    )]
    Checksum { expected: u32, got: u32 },
    #[error("weights do not fit the model: {0}")]
    Record(String),
}

/// What a payload holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// A whole model, Burn's burnpack record.
    Model,
    /// LoRA adapters only, in PEFT's safetensors layout: applied to a base
    /// the receiver already holds.
    Adapters,
}

/// What the header says besides the encoding (see [`WeightsHeader::read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightsHeader {
    pub policy_version: u64,
    pub payload_len: u64,
    pub crc32: u32,
}

impl WeightsHeader {
    /// The header of an f32 payload (format 1).
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        self.to_bytes_as(Encoding::F32)
    }

    /// The header of a payload in `encoding`: format 1 for f32, format 2
    /// naming the encoding otherwise.
    pub fn to_bytes_as(&self, encoding: Encoding) -> [u8; HEADER_LEN] {
        let format = match encoding {
            Encoding::F32 => FORMAT_F32,
            _ => FORMAT_VERSION as u16,
        };
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(MAGIC);
        h[8..10].copy_from_slice(&format.to_le_bytes());
        h[10..12].copy_from_slice(&encoding.code().to_le_bytes());
        h[12..20].copy_from_slice(&self.policy_version.to_le_bytes());
        h[20..28].copy_from_slice(&self.payload_len.to_le_bytes());
        h[28..32].copy_from_slice(&self.crc32.to_le_bytes());
        h
    }

    /// The header of an adapter payload in `encoding` (format 3).
    pub fn to_bytes_adapters(&self, encoding: Encoding) -> [u8; HEADER_LEN] {
        let mut h = self.to_bytes_as(encoding);
        h[8..10].copy_from_slice(&FORMAT_ADAPTERS.to_le_bytes());
        h
    }

    /// The header of a model payload and the encoding it announces, from
    /// format 1 or 2; an adapter payload is refused by name.
    pub fn read(b: &[u8]) -> Result<(Self, Encoding), WeightsError> {
        match Self::read_any(b)? {
            (h, e, Payload::Model) => Ok((h, e)),
            (_, _, Payload::Adapters) => Err(WeightsError::Record(
                "the payload holds LoRA adapters, not a model".into(),
            )),
        }
    }

    /// The header, its encoding and what the payload holds, any format.
    pub fn read_any(b: &[u8]) -> Result<(Self, Encoding, Payload), WeightsError> {
        if b.len() != HEADER_LEN {
            return Err(WeightsError::ShortHeader(b.len()));
        }
        if &b[0..8] != MAGIC {
            return Err(WeightsError::BadMagic);
        }
        let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().expect("2 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let (format, code) = (u16_at(8), u16_at(10));
        let encoding = match format {
            // Format 1 has no encoding field: the word is the format, and
            // anything in its upper half is another format.
            FORMAT_F32 if code == 0 => Encoding::F32,
            2 | FORMAT_ADAPTERS => {
                Encoding::from_code(code).ok_or(WeightsError::UnknownEncoding(code))?
            }
            _ => return Err(WeightsError::UnsupportedFormat(u32_at(8))),
        };
        let payload = match format {
            FORMAT_ADAPTERS => Payload::Adapters,
            _ => Payload::Model,
        };
        let header = Self {
            policy_version: u64_at(12),
            payload_len: u64_at(20),
            crc32: u32_at(28),
        };
        Ok((header, encoding, payload))
    }

    /// [`read`](Self::read) without the encoding, for an f32 reader
    /// ([`decode`]), which refuses a payload of another encoding by name.
    pub fn from_bytes(b: &[u8]) -> Result<Self, WeightsError> {
        Self::read(b).map(|(h, _)| h)
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

/// Encodes the f32 weights of `model` as policy version `policy_version`
/// (write the header with [`WeightsHeader::to_bytes`]).
pub fn encode(
    model: &Transformer,
    policy_version: u64,
) -> Result<(WeightsHeader, Bytes), WeightsError> {
    encode_as(model, policy_version, Encoding::F32)
}

/// Encodes the weights of `model` as policy version `policy_version`, its
/// float parameters in `encoding`; write the header with
/// [`WeightsHeader::to_bytes_as`] and the same encoding. The model's
/// tensors are shared, not copied, until burnpack writes them (f32) or
/// they are rounded (bf16, one half-size copy); the model is unchanged.
pub fn encode_as(
    model: &Transformer,
    policy_version: u64,
    encoding: Encoding,
) -> Result<(WeightsHeader, Bytes), WeightsError> {
    let model = match encoding {
        Encoding::F32 => model.clone(),
        Encoding::Bf16 => model.clone().map(&mut CastFloats::to(encoding.dtype())),
    };
    let payload = model
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

/// Verifies an f32 `payload` against `header` and loads it into `model`.
pub fn decode(
    header: &WeightsHeader,
    payload: Vec<u8>,
    model: Transformer,
) -> Result<Transformer, WeightsError> {
    decode_as(header, Encoding::F32, payload, model)
}

/// Verifies `payload` against `header`, checks that its float tensors are
/// in `encoding` (the one the header announced), and loads them into
/// `model`, each cast to the compute dtype of its device.
pub fn decode_as(
    header: &WeightsHeader,
    encoding: Encoding,
    payload: Vec<u8>,
    model: Transformer,
) -> Result<Transformer, WeightsError> {
    header.verify(&payload)?;
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(payload))
        .map_err(|e| WeightsError::Record(format!("{e:?}")))?;
    // Loaded as recorded (bf16 stays bf16), then cast: asking the record
    // to cast on load would first initialise every parameter of `model`
    // just to read its dtype.
    let model = model
        .try_load_record(record)
        .map_err(|e| WeightsError::Record(format!("{e:?}")))?;
    let mut cast = CastFloats::to_compute_dtype(encoding.dtype());
    let model = model.map(&mut cast);
    match cast.mismatch {
        Some((tensor, found)) => Err(WeightsError::EncodingMismatch {
            announced: encoding,
            tensor,
            found,
        }),
        None => Ok(model),
    }
}

/// Encodes `adapters` (trained on the base of fingerprint `base`) as
/// policy version `policy_version`, factors in `encoding`; write the
/// header with [`WeightsHeader::to_bytes_adapters`].
pub fn encode_adapters(
    adapters: &Adapters,
    policy_version: u64,
    encoding: Encoding,
    base: u64,
) -> Result<(WeightsHeader, Bytes), WeightsError> {
    let meta = AdapterMeta {
        alpha: adapters.scale * adapters.rank() as f64,
        base,
    };
    let payload = peft::encode(adapters, meta, encoding.dtype())
        .map_err(|e| WeightsError::Record(e.to_string()))?;
    let header = WeightsHeader {
        policy_version,
        payload_len: payload.len() as u64,
        crc32: crc32fast::hash(&payload),
    };
    Ok((header, Bytes::from_bytes_vec(payload)))
}

/// Verifies an adapter `payload` against `header` and builds the adapters
/// for a model of `config`'s shape on `device`, with the base fingerprint
/// they name.
pub fn decode_adapters(
    header: &WeightsHeader,
    payload: &[u8],
    config: &ModelConfig,
    device: &burn::prelude::Device,
) -> Result<(Adapters, AdapterMeta), WeightsError> {
    header.verify(payload)?;
    peft::decode(payload, config, None, device).map_err(|e| WeightsError::Record(e.to_string()))
}

/// `model` computing in `precision`, its weights stored in that dtype:
/// what an actor, which only generates, holds (half the memory and no
/// cast per step at bf16/f16). The learner keeps f32 weights instead and
/// casts at use ([`Transformer::with_precision`]).
pub fn for_inference(model: Transformer, precision: Precision) -> Transformer {
    let model = match precision {
        Precision::F32 => model,
        p => model.map(&mut CastFloats::to(p.dtype())),
    };
    model.with_precision(precision)
}

/// `model` with every float parameter in its device's compute dtype
/// (weights loaded as stored: a bf16 or f16 checkpoint, widened exactly).
pub fn to_compute_dtype(model: Transformer) -> Transformer {
    model.map(&mut CastFloats {
        to: None,
        expect: None,
        path: Vec::new(),
        mismatch: None,
    })
}

/// Casts every float parameter, optionally checking first that it has the
/// dtype the payload announced.
struct CastFloats {
    /// `None`: the default float dtype of the parameter's device.
    to: Option<FloatDType>,
    expect: Option<FloatDType>,
    path: Vec<String>,
    /// The first parameter not of the expected dtype, and its dtype.
    mismatch: Option<(String, DType)>,
}

impl CastFloats {
    fn to(dtype: FloatDType) -> Self {
        Self {
            to: Some(dtype),
            expect: None,
            path: Vec::new(),
            mismatch: None,
        }
    }

    fn to_compute_dtype(expect: FloatDType) -> Self {
        Self {
            to: None,
            expect: Some(expect),
            path: Vec::new(),
            mismatch: None,
        }
    }
}

impl ModuleMapper for CastFloats {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = param.val().dtype();
        if let Some(expect) = self.expect
            && dtype != DType::from(expect)
        {
            if self.mismatch.is_none() {
                self.mismatch = Some((self.path.join("."), dtype));
            }
            return param;
        }
        let to = self
            .to
            .unwrap_or_else(|| param.lazy_device().settings().float_dtype);
        if dtype == DType::from(to) {
            return param;
        }
        param.map(|t| t.cast(to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::ModelConfig, policy::Policy};
    use burn::{module::ModuleVisitor, prelude::*};
    use half::bf16;

    fn logits(model: &Transformer, p: &Policy) -> Vec<f32> {
        let t = Policy::tokens(&[vec![1, 2, 3, 40, 41, 7, 99, 5]], &Device::flex());
        model
            .forward(t, &p.rope, None)
            .into_data()
            .try_into_vec()
            .unwrap()
    }

    /// Every float parameter by path, with its dtype and values as f32.
    #[derive(Default)]
    struct Floats {
        path: Vec<String>,
        params: Vec<(String, DType, Vec<f32>)>,
    }

    impl ModuleVisitor for Floats {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            let dtype = t.dtype();
            let values = t.cast(FloatDType::F32).into_data().try_into_vec().unwrap();
            self.params.push((self.path.join("."), dtype, values));
        }
    }

    fn floats(model: &Transformer) -> Vec<(String, DType, Vec<f32>)> {
        let mut v = Floats::default();
        model.visit(&mut v);
        v.params
    }

    fn tiny() -> (ModelConfig, Policy) {
        let p = crate::testing::tiny_policy(21);
        (p.config.clone(), p)
    }

    /// Encodes as `encoding`, sends the header as bytes, reads it back
    /// and decodes into a fresh model.
    fn round_trip(src: &Transformer, cfg: &ModelConfig, encoding: Encoding) -> (Transformer, u64) {
        let (header, payload) = encode_as(src, 5, encoding).unwrap();
        let (back, announced) = WeightsHeader::read(&header.to_bytes_as(encoding)).unwrap();
        assert_eq!((back, announced), (header, encoding));
        let fresh = Transformer::init(cfg, &Device::flex());
        let model = decode_as(&back, announced, payload.to_vec(), fresh).unwrap();
        (model, header.payload_len)
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

    /// A bf16 stream carries each weight rounded to nearest even, and
    /// decodes to exactly those values in f32 (the bf16 -> f32 widening
    /// is exact), in half the bytes.
    #[test]
    fn a_bf16_round_trip_gives_the_weights_rounded_to_bf16_exactly() {
        let (cfg, src) = tiny();
        let (loaded, bf16_len) = round_trip(&src.model, &cfg, Encoding::Bf16);
        let (want, got) = (floats(&src.model), floats(&loaded));
        assert_eq!(want.len(), got.len());
        let (mut n, mut changed) = (0, 0);
        for ((path, _, w), (got_path, dtype, g)) in want.iter().zip(&got) {
            assert_eq!(path, got_path);
            assert_eq!(*dtype, DType::F32, "{path} is decoded to the compute dtype");
            assert_eq!(w.len(), g.len(), "{path}");
            for (i, (&x, &y)) in w.iter().zip(g).enumerate() {
                let rounded = bf16::from_f32(x).to_f32();
                assert_eq!(rounded.to_bits(), y.to_bits(), "{path}[{i}]: {x} -> {y}");
                changed += usize::from(x != y);
            }
            n += w.len();
        }
        assert_eq!(n, cfg.num_params());
        assert!(
            changed > n / 2,
            "the weights were rounded ({changed} of {n})"
        );
        let (_, f32_len) = round_trip(&src.model, &cfg, Encoding::F32);
        // Half the tensor bytes, plus burnpack's index and alignment.
        let tensor_bytes = 2 * n as u64;
        assert!(
            bf16_len >= tensor_bytes && bf16_len < tensor_bytes + tensor_bytes / 10,
            "bf16 payload {bf16_len} bytes for {n} parameters"
        );
        assert!(
            bf16_len * 2 <= f32_len + 4096,
            "f32 {f32_len}, bf16 {bf16_len}"
        );
        // The learner's master weights are untouched by encoding.
        assert!(floats(&src.model).iter().all(|(_, d, _)| *d == DType::F32));
    }

    /// Ties round to the even neighbour, not away from zero: 1 + 2^-8 lies
    /// halfway between bf16's 1 and 1 + 2^-7, and goes to 1.
    #[test]
    fn bf16_ties_round_to_even() {
        let (cfg, mut src) = tiny();
        let h = cfg.hidden_size;
        let ulp = 2f32.powi(-7); // bf16's spacing in [1, 2)
        let pattern = [
            (1.0 + ulp / 2.0, 1.0),                   // tie, 1 is even
            (1.0 + 3.0 * ulp / 2.0, 1.0 + 2.0 * ulp), // tie, 1 + 2 ulp is even
            (-(1.0 + ulp / 2.0), -1.0),
            (1.0 + ulp / 2.0 + 1e-6, 1.0 + ulp), // above the tie
            (1.0 + ulp / 2.0 - 1e-6, 1.0),       // below it
        ];
        let values: Vec<f32> = (0..h).map(|i| pattern[i % pattern.len()].0).collect();
        let device = Device::flex();
        src.model.norm.gamma =
            Param::from_tensor(Tensor::from_data(TensorData::new(values, [h]), &device));
        let (loaded, _) = round_trip(&src.model, &cfg, Encoding::Bf16);
        let got: Vec<f32> = loaded.norm.gamma.val().into_data().try_into_vec().unwrap();
        for (i, g) in got.iter().enumerate() {
            let (x, want) = pattern[i % pattern.len()];
            assert_eq!(*g, want, "{x:e}");
            assert_eq!(*g, bf16::from_f32(x).to_f32());
        }
    }

    /// bf16 keeps 8 significant bits: each weight moves by at most
    /// u = 2^-9 (0.2%) of itself. The tied head computes logit_j =
    /// Σ_k ĥ_k·E_jk with both factors off by up to u (ĥ normalises a
    /// residual stream that starts as a rounded embedding row), so to
    /// first order |Δlogit_j| ≤ 2u·Σ_k |ĥ_k·E_jk|. For the largest logit,
    /// the input token's own (ĥ ∝ its embedding row, every term positive),
    /// that sum is the logit itself: the bound is 2u·|logit|, and the
    /// layers add a little (random-init blocks write little into the
    /// stream; measured 2.2u of the largest |logit|). We allow 4u of the
    /// largest |logit| (0.8%). The exact values are pinned by the test
    /// above (truncating instead of rounding gives 2.8u here, inside this
    /// bound); this one checks that the decoded model computes the same
    /// function (a byte-order slip or a tensor left at its random
    /// initialisation is off by orders of magnitude). Log-softmax moves by at most twice the largest logit
    /// change (the log-sum-exp moves by at most the largest), so the
    /// behaviour log-probs move by under 8u·|logit|: ratio changes well
    /// under 1%, against clip ranges of 20%.
    #[test]
    fn bf16_logits_stay_close_to_the_f32_ones() {
        let (cfg, src) = tiny();
        let (loaded, _) = round_trip(&src.model, &cfg, Encoding::Bf16);
        let want = logits(&src.model, &src);
        let got = logits(&loaded, &src);
        let max_abs = |v: &mut dyn Iterator<Item = f32>| v.fold(0f32, |m, x| m.max(x.abs()));
        let scale = max_abs(&mut want.iter().copied());
        let worst = max_abs(&mut want.iter().zip(&got).map(|(a, b)| a - b));
        let u = 2f32.powi(-9);
        assert!(worst > 0.0, "the weights were rounded");
        assert!(
            worst <= 4.0 * u * scale,
            "max |Δlogit| {worst:e} is {:.2}u of the logit scale {scale:e}",
            worst / scale / u
        );
        let log_softmax = |l: &[f32]| -> Vec<f32> {
            l.chunks(cfg.vocab_size)
                .flat_map(|row| {
                    let m = row.iter().fold(f32::MIN, |m, x| m.max(*x));
                    let z = row.iter().map(|x| (x - m).exp()).sum::<f32>().ln() + m;
                    row.iter().map(move |x| x - z)
                })
                .collect()
        };
        let (lp_want, lp_got) = (log_softmax(&want), log_softmax(&got));
        let dlp = max_abs(&mut lp_want.iter().zip(&lp_got).map(|(a, b)| a - b));
        assert!(
            dlp <= 2.0 * worst * (1.0 + 1e-3),
            "max |Δ log-prob| {dlp:e}"
        );
    }

    /// A stream of a learner before bf16 publishing: format written as a
    /// u32 1, no encoding. It still reads as f32, and an f32 header is
    /// still written byte for byte that way.
    #[test]
    fn an_f32_stream_of_an_older_learner_still_decodes() {
        let (cfg, src) = tiny();
        let (header, payload) = encode(&src.model, 9).unwrap();
        let mut old = Vec::new();
        old.extend_from_slice(b"BAPOWTS1");
        old.extend_from_slice(&1u32.to_le_bytes());
        old.extend_from_slice(&9u64.to_le_bytes());
        old.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        old.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        assert_eq!(header.to_bytes().as_slice(), old.as_slice());
        assert_eq!(header.to_bytes_as(Encoding::F32), header.to_bytes());
        let (back, encoding) = WeightsHeader::read(&old).unwrap();
        assert_eq!(encoding, Encoding::F32);
        let fresh = Transformer::init(&cfg, &Device::flex());
        let loaded = decode_as(&back, encoding, payload.to_vec(), fresh).unwrap();
        assert_eq!(logits(&loaded, &src), logits(&src.model, &src));
    }

    #[test]
    fn unknown_encodings_and_formats_are_refused_by_name() {
        let (_, src) = tiny();
        let (header, _) = encode_as(&src.model, 1, Encoding::Bf16).unwrap();
        let wire = header.to_bytes_as(Encoding::Bf16);
        assert_eq!(&wire[8..12], &[2, 0, 1, 0]);
        let mut unknown = wire;
        unknown[10] = 7;
        let err = WeightsHeader::read(&unknown).unwrap_err();
        assert_eq!(err, WeightsError::UnknownEncoding(7));
        assert!(err.to_string().contains("encoding 7 is unknown"), "{err}");
        assert_eq!(
            WeightsHeader::from_bytes(&unknown),
            Err(WeightsError::UnknownEncoding(7))
        );
        // Format 1 has no encoding field: a non-zero upper half is another
        // format, as an older build reads it.
        let mut v1 = wire;
        v1[8] = 1;
        assert_eq!(
            WeightsHeader::read(&v1),
            Err(WeightsError::UnsupportedFormat(0x0001_0001))
        );
        // An older build reads the bf16 header's format word as one u32.
        assert_eq!(
            u32::from_le_bytes(wire[8..12].try_into().unwrap()),
            0x0001_0002
        );
        // Format 3 is an adapter payload: a model reader refuses it by
        // what it holds; format 4 is unknown.
        let mut v3 = wire;
        v3[8] = 3;
        let err = WeightsHeader::read(&v3).unwrap_err();
        assert!(err.to_string().contains("LoRA adapters"), "{err}");
        assert!(matches!(
            WeightsHeader::read_any(&v3),
            Ok((_, Encoding::Bf16, Payload::Adapters))
        ));
        let mut v4 = wire;
        v4[8] = 4;
        assert!(matches!(
            WeightsHeader::read_any(&v4),
            Err(WeightsError::UnsupportedFormat(_))
        ));
        assert_eq!(Encoding::from_name("bf16"), Some(Encoding::Bf16));
        assert_eq!(Encoding::from_name("f32"), Some(Encoding::F32));
        assert_eq!(Encoding::from_name("fp8"), None);
    }

    /// A payload whose tensors are not in the encoding the header names
    /// is refused, naming a tensor: a bf16 payload read as f32 (a
    /// checkpoint reader given a broadcast) and an f32 one announced bf16.
    #[test]
    fn a_payload_not_in_the_announced_encoding_is_refused() {
        let (cfg, src) = tiny();
        let fresh = || Transformer::init(&cfg, &Device::flex());
        let (h, payload) = encode_as(&src.model, 1, Encoding::Bf16).unwrap();
        let err = decode(&h, payload.to_vec(), fresh()).unwrap_err();
        let WeightsError::EncodingMismatch {
            announced, found, ..
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!((*announced, *found), (Encoding::F32, DType::BF16));
        assert!(err.to_string().contains("embed_tokens.weight"), "{err}");
        let (h, payload) = encode(&src.model, 1).unwrap();
        let err = decode_as(&h, Encoding::Bf16, payload.to_vec(), fresh()).unwrap_err();
        assert!(
            matches!(
                err,
                WeightsError::EncodingMismatch {
                    found: DType::F32,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn truncation_and_corruption_are_refused_by_name() {
        let device = Device::flex();
        let cfg = ModelConfig::preset("tiny").unwrap();
        let src = Policy::init(cfg.clone(), &device);
        for encoding in Encoding::ALL {
            let (header, payload) = encode_as(&src.model, 1, encoding).unwrap();
            let mut bytes = payload.to_vec();
            let short = bytes[..bytes.len() - 10].to_vec();
            let fresh = || Transformer::init(&cfg, &device);
            let err = decode_as(&header, encoding, short, fresh()).unwrap_err();
            assert!(matches!(err, WeightsError::Length { .. }), "{err}");
            bytes[1000] ^= 1;
            let err = decode_as(&header, encoding, bytes, fresh()).unwrap_err();
            assert!(err.to_string().contains("checksum"), "{err}");
        }
        let (header, _) = encode(&src.model, 1).unwrap();
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

    /// What an actor holds: every float weight in the compute dtype (half
    /// the memory at bf16/f16), f32 left as it is.
    #[test]
    fn weights_for_inference_are_stored_in_the_compute_dtype() {
        let (_, p) = tiny();
        for precision in [Precision::Bf16, Precision::F16, Precision::F32] {
            let model = for_inference(p.model.clone(), precision);
            assert_eq!(model.compute, precision);
            let want = DType::from(precision.dtype());
            for (path, dtype, _) in floats(&model) {
                assert_eq!(dtype, want, "{path} in {precision}");
            }
        }
    }
}
