//! Checkpoints as the hub ships them: bf16 and f16 safetensors (most
//! instruct models are bf16) load into the f32 model, each weight the
//! stored value widened exactly. Made here from the committed f32
//! fixtures, converted tensor by tensor.

use std::path::{Path, PathBuf};

use bapo_policy::{
    Policy,
    burn::prelude::*,
    hf,
    weights::{Encoding, decode_as, encode_as},
};
use half::{bf16, f16};

fn fixture(name: &str) -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("tests/fixtures")
        .join(name)
}

/// Rewrites `src`'s F32 tensors as `dtype` ("BF16" or "F16") into `dst`.
fn convert(src: &Path, dst: &Path, dtype: &str) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out_header = serde_json::Map::new();
    let mut out_data = Vec::new();
    let mut names: Vec<_> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    for name in names {
        let t = &header[name];
        assert_eq!(t["dtype"], "F32", "{name}");
        let [a, b] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap() as usize);
        let start = out_data.len();
        for x in data[a..b].chunks_exact(4) {
            let x = f32::from_le_bytes(x.try_into().unwrap());
            let half = match dtype {
                "BF16" => bf16::from_f32(x).to_bits(),
                _ => f16::from_f32(x).to_bits(),
            };
            out_data.extend_from_slice(&half.to_le_bytes());
        }
        out_header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": t["shape"], "data_offsets": [start, out_data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&out_header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    file.extend(out_data);
    std::fs::write(dst, file).unwrap();
}

/// A copy of fixture `name` with its weights stored as `dtype`.
fn fixture_as(name: &str, dtype: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    convert(
        &fixture(name).join("model.safetensors"),
        &dir.path().join("model.safetensors"),
        dtype,
    );
    dir
}

fn logits(p: &Policy) -> Vec<f32> {
    let t = Policy::tokens(&[vec![1, 5, 9, 14, 3]], &p.device());
    p.model
        .forward(t, &p.rope, None)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

#[test]
fn a_bf16_checkpoint_loads_as_its_f32_weights_rounded() {
    let device = Device::flex();
    for name in ["llama", "qwen2"] {
        let f32_policy = hf::load(&fixture(name), &device).unwrap();
        // The f32 weights rounded to bf16 and widened back, by the weight
        // stream's own (separately tested) cast.
        let (h, payload) = encode_as(&f32_policy.model, 0, Encoding::Bf16).unwrap();
        let rounded = decode_as(
            &h,
            Encoding::Bf16,
            payload.to_vec(),
            f32_policy.model.clone(),
        )
        .unwrap();
        let rounded = Policy::with_model(f32_policy.config.clone(), rounded, &device);
        let dir = fixture_as(name, "BF16");
        let loaded = hf::load(dir.path(), &device).unwrap();
        assert_eq!(
            logits(&loaded),
            logits(&rounded),
            "{name}: bf16 weights widened exactly"
        );
    }
}

#[test]
fn an_f16_checkpoint_loads_close_to_the_f32_one() {
    let device = Device::flex();
    for name in ["llama", "qwen2"] {
        let want = logits(&hf::load(&fixture(name), &device).unwrap());
        let dir = fixture_as(name, "F16");
        let got = logits(&hf::load(dir.path(), &device).unwrap());
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = want
            .iter()
            .zip(&got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // f16 keeps 11 significant bits (u = 2^-11): a few u of the
        // largest logit, as for bf16's 2^-9 in the weight-stream tests.
        assert!(
            worst <= 8.0 * scale / 2048.0,
            "{name}: {worst} vs scale {scale}"
        );
        assert!(worst > 0.0, "{name}: f16 rounding changed nothing?");
    }
}
