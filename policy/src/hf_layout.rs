//! A model payload of the weight stream (burnpack, [`crate::weights`])
//! read as the transformers checkpoint it stands for, without building a
//! Burn model: which bytes of the payload hold which HF tensor, and in
//! what order. A vLLM actor uses it to write the reload directory
//! ([`Layout::export`]) and to patch the engine in place with what
//! changed since the version it holds ([`Layout::patch`]): no decode into
//! a model and no export per version.
//!
//! The names and layout are the ones [`crate::hf::save`] writes (a test
//! holds them equal): `model.` before the decoder's tensors, a norm's
//! `gamma` as `weight`, and every linear weight transposed (Burn stores
//! `[in, out]`, PyTorch `[out, in]`). Values keep the payload's dtype
//! (bf16 under a bf16 broadcast); the engine casts them to the one it
//! serves in.

use std::collections::BTreeMap;

use burn::store::burn_pack::{self, DType};
use safetensors::{Dtype, tensor::TensorView};
use serde::Deserialize;

use crate::hf_patch::{self, Patch, PatchError};

/// Where each HF tensor lies in a model payload.
#[derive(Debug, Clone)]
pub struct Layout {
    tensors: Vec<Slot>,
    /// Bytes before the tensor data (header and metadata): two payloads
    /// of one layout have them equal.
    data_start: usize,
    len: usize,
}

/// One tensor: its bytes in the payload and its HF name and shape.
#[derive(Debug, Clone)]
struct Slot {
    hf_name: String,
    dtype: Dtype,
    /// Shape as transformers has it.
    shape: Vec<usize>,
    /// Byte range in the payload.
    start: usize,
    end: usize,
    /// A linear weight: stored `[in, out]`, `[out, in]` in HF.
    transposed: bool,
}

/// The parts of burnpack's CBOR metadata a layout needs.
#[derive(Deserialize)]
struct Metadata {
    tensors: BTreeMap<String, Descriptor>,
}

#[derive(Deserialize)]
struct Descriptor {
    dtype: DType,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

impl Layout {
    /// The layout of `payload`, from burnpack's header and metadata; a
    /// payload that is not a model of float tensors is refused.
    pub fn read(payload: &[u8]) -> Result<Self, PatchError> {
        let bad = |m: String| PatchError::Read(format!("model payload: {m}"));
        let size = burn_pack::HEADER_SIZE;
        let header = payload
            .get(..size)
            .ok_or_else(|| bad("shorter than a header".into()))
            .and_then(|h| burn_pack::Header::from_bytes(h).map_err(|e| bad(e.to_string())))?;
        let meta_end = size + header.metadata_size as usize;
        let meta = payload
            .get(size..meta_end)
            .ok_or_else(|| bad("metadata cut short".into()))?;
        let meta: Metadata = ciborium::from_reader(meta).map_err(|e| bad(e.to_string()))?;
        let data_start = burn_pack::aligned_data_section_start(header.metadata_size as usize);
        let mut tensors = Vec::with_capacity(meta.tensors.len());
        for (name, d) in meta.tensors {
            tensors.push(slot(&name, d, data_start, payload.len()).map_err(bad)?);
        }
        tensors.sort_by_key(|s| s.start);
        Ok(Self {
            tensors,
            data_start,
            len: payload.len(),
        })
    }

    /// The payload as one safetensors file in transformers' names and
    /// layout: what [`crate::hf::save`] writes for the decoded model, in
    /// the payload's dtype.
    pub fn export(&self, payload: &[u8]) -> Result<Vec<u8>, PatchError> {
        self.check(payload)?;
        let data: Vec<std::borrow::Cow<[u8]>> = self
            .tensors
            .iter()
            .map(|s| s.hf_bytes(&payload[s.start..s.end]))
            .collect();
        let views = self
            .tensors
            .iter()
            .zip(&data)
            .map(|(s, d)| {
                TensorView::new(s.dtype, s.shape.clone(), d)
                    .map(|v| (s.hf_name.clone(), v))
                    .map_err(|e| PatchError::Layout(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::serialize(views, None).map_err(|e| PatchError::Layout(e.to_string()))
    }

    /// The patch that turns the export of `held` into the export of
    /// `new` (both of this layout): the elements whose bits differ, by
    /// HF name and flat HF index. Equal runs are skipped whole, so the
    /// cost is a compare of the two payloads plus the changed elements.
    pub fn patch(&self, held: &[u8], new: &[u8]) -> Result<Patch, PatchError> {
        self.check(held)?;
        self.check(new)?;
        if held[..self.data_start] != new[..self.data_start] {
            return Err(PatchError::Layout("the payloads' tensors differ".into()));
        }
        let mut changes = Vec::new();
        let (mut changed, mut total) = (0, 0);
        for s in &self.tensors {
            let word = s.dtype.bitsize() / 8;
            let (old, now) = (&held[s.start..s.end], &new[s.start..s.end]);
            total += now.len() / word;
            let (idx, val) = match s.transposed {
                true => hf_patch::changed_elements(old, now, word, |i| s.hf_index(i)),
                false => hf_patch::changed_elements(old, now, word, |i| i),
            };
            if !idx.is_empty() {
                changed += idx.len() / 8;
                changes.push((s.hf_name.clone(), s.dtype, s.shape.clone(), idx, val));
            }
        }
        Ok(Patch {
            bytes: hf_patch::serialize(&changes)?,
            changed,
            total,
        })
    }

    fn check(&self, payload: &[u8]) -> Result<(), PatchError> {
        if payload.len() != self.len {
            return Err(PatchError::Layout(format!(
                "a payload of {} bytes, the layout is of {}",
                payload.len(),
                self.len
            )));
        }
        Ok(())
    }
}

impl Slot {
    /// `[in, out]` dims as stored (for a transposed tensor).
    fn stored(&self) -> (usize, usize) {
        (self.shape[1], self.shape[0])
    }

    /// The HF flat index of stored element `i` of a transposed tensor.
    fn hf_index(&self, i: usize) -> usize {
        let (rows, cols) = self.stored();
        let (r, c) = (i / cols, i % cols);
        c * rows + r
    }

    /// The tensor's bytes in HF order.
    fn hf_bytes<'a>(&self, stored: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        if !self.transposed {
            return stored.into();
        }
        let word = self.dtype.bitsize() / 8;
        let (rows, cols) = self.stored();
        let mut out = vec![0u8; stored.len()];
        for (r, row) in stored.chunks_exact(cols * word).enumerate() {
            for (c, w) in row.chunks_exact(word).enumerate() {
                let at = (c * rows + r) * word;
                out[at..at + word].copy_from_slice(w);
            }
        }
        debug_assert_eq!(rows * cols * word, stored.len());
        out.into()
    }
}

/// The slot of burnpack tensor `name`, checked against a payload of `len`
/// bytes whose data begin at `data_start`.
fn slot(name: &str, d: Descriptor, data_start: usize, len: usize) -> Result<Slot, String> {
    let dtype = match d.dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        other => return Err(format!("{name} is {other:?}, not a float of 16 or 32 bits")),
    };
    let misfit = || format!("{name}: its bytes do not fit its shape or the payload");
    let stored: Vec<usize> = d.shape.iter().map(|&x| x as usize).collect();
    let bytes = stored
        .iter()
        .try_fold(dtype.bitsize() / 8, |n, &x| n.checked_mul(x))
        .ok_or_else(misfit)?;
    let at = |offset: u64| usize::try_from(offset).ok()?.checked_add(data_start);
    let (start, end) = at(d.data_offsets.0)
        .zip(at(d.data_offsets.1))
        .ok_or_else(misfit)?;
    if end < start || end - start != bytes || end > len {
        return Err(misfit());
    }
    let (prefix, last) = name.rsplit_once('.').unwrap_or(("", name));
    let transposed = stored.len() == 2 && last == "weight" && prefix != "embed_tokens";
    let last = match last {
        "gamma" => "weight",
        "beta" => "bias",
        other => other,
    };
    let under_model = ["embed_tokens", "layers", "norm"]
        .iter()
        .any(|m| prefix == *m || prefix.starts_with(&format!("{m}.")));
    let hf_name = match (under_model, prefix.is_empty()) {
        (true, _) => format!("model.{prefix}.{last}"),
        (false, true) => last.to_string(),
        (false, false) => format!("{prefix}.{last}"),
    };
    let shape = match transposed {
        true => vec![stored[1], stored[0]],
        false => stored,
    };
    Ok(Slot {
        hf_name,
        dtype,
        shape,
        start,
        end,
        transposed,
    })
}

#[cfg(test)]
mod tests {
    use safetensors::SafeTensors;

    use super::*;
    use crate::{
        Policy,
        burn::prelude::*,
        testing::tiny_config,
        weights::{self, Encoding},
    };

    fn payload(p: &Policy, encoding: Encoding) -> Vec<u8> {
        weights::encode_as(&p.model, 1, encoding)
            .unwrap()
            .1
            .to_vec()
    }

    /// A float tensor's values as f32.
    fn values(v: &TensorView) -> Vec<f32> {
        match v.dtype() {
            Dtype::F32 => v
                .data()
                .chunks_exact(4)
                .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => v
                .data()
                .chunks_exact(2)
                .map(|w| f32::from_bits(u32::from(u16::from_le_bytes([w[0], w[1]])) << 16))
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    /// Every tensor of an export as f32 values, by name.
    fn floats(export: &[u8]) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
        let t = SafeTensors::deserialize(export).unwrap();
        t.tensors()
            .into_iter()
            .map(|(name, v)| (name, (v.shape().to_vec(), values(&v))))
            .collect()
    }

    fn configs() -> Vec<crate::ModelConfig> {
        let tied = tiny_config();
        let mut qwen = tiny_config();
        qwen.model_type = "qwen2".into();
        qwen.tie_word_embeddings = false;
        vec![tied, qwen]
    }

    /// The layout's export of a payload is what `hf::save` writes for the
    /// model it decodes to: same names, shapes and values (tied and
    /// untied heads, with and without q/k/v biases; f32 and bf16).
    #[test]
    fn an_export_from_the_payload_is_the_models_export() {
        let device = Device::flex();
        for config in configs() {
            device.seed(3);
            let p = Policy::init(config.clone(), &device);
            for encoding in [Encoding::F32, Encoding::Bf16] {
                let bytes = payload(&p, encoding);
                let (header, _) = weights::encode_as(&p.model, 1, encoding).unwrap();
                let fresh = crate::model::Transformer::init(&config, &device);
                let decoded = weights::decode_as(&header, encoding, bytes.clone(), fresh).unwrap();
                let decoded = Policy::with_model(config.clone(), decoded, &device);
                let want = floats(&crate::hf::to_safetensors(&decoded).unwrap());
                let got = floats(&Layout::read(&bytes).unwrap().export(&bytes).unwrap());
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    want.keys().collect::<Vec<_>>()
                );
                for (name, w) in &want {
                    assert_eq!(&got[name], w, "{name} under {encoding}");
                }
            }
        }
    }

    /// A patch made from two payloads, applied to the export of the first,
    /// gives the export of the second.
    #[test]
    fn a_patch_from_payloads_turns_one_export_into_the_next() {
        let device = Device::flex();
        for config in configs() {
            device.seed(4);
            let p = Policy::init(config, &device);
            let held = payload(&p, Encoding::Bf16);
            let mut new = held.clone();
            let layout = Layout::read(&held).unwrap();
            // Change a few words of every tensor.
            for s in &layout.tensors {
                for at in [s.start, s.start + 6, s.end - 2] {
                    new[at] ^= 0x40;
                }
            }
            let patch = layout.patch(&held, &new).unwrap();
            assert!(patch.changed >= layout.tensors.len() * 2, "{patch:?}");
            let mut export = floats(&layout.export(&held).unwrap());
            let t = SafeTensors::deserialize(&patch.bytes).unwrap();
            for (name, (_, held_values)) in export.iter_mut() {
                let Ok(idx) = t.tensor(&format!("{name}@idx")) else {
                    continue;
                };
                let val = values(&t.tensor(&format!("{name}@val")).unwrap());
                for (i, v) in idx.data().chunks_exact(8).zip(val) {
                    held_values[i64::from_le_bytes(i.try_into().unwrap()) as usize] = v;
                }
            }
            let want = floats(&layout.export(&new).unwrap());
            assert_eq!(export, want);
        }
    }

    #[test]
    fn payloads_of_another_layout_are_refused() {
        let device = Device::flex();
        let p = Policy::init(tiny_config(), &device);
        let (f32s, bf16s) = (payload(&p, Encoding::F32), payload(&p, Encoding::Bf16));
        let layout = Layout::read(&bf16s).unwrap();
        assert!(matches!(
            layout.patch(&bf16s, &f32s),
            Err(PatchError::Layout(_))
        ));
        assert!(matches!(
            Layout::read(b"not a payload"),
            Err(PatchError::Read(_))
        ));
        // Tensors the metadata places past the end: refused, by name.
        let cut = &bf16s[..bf16s.len() / 2];
        assert!(matches!(Layout::read(cut), Err(PatchError::Read(m)) if m.contains("do not fit")));
    }
}
