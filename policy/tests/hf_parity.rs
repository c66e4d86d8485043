//! Parity with Hugging Face transformers on tiny random Llama and Qwen2
//! checkpoints made by `scripts/make-policy-fixtures.sh` (committed; no
//! Python needed here): logits within 1e-4, identical greedy continuation,
//! on the CPU backend and on wgpu (where this machine has a Vulkan driver;
//! CI runs it on lavapipe), in f32 and in the half precisions.
//!
//! Tolerances, for logits of magnitude up to 5.7. f32: 1e-4, about 20
//! ulps at that size, room for another summation order (a GPU reduces in
//! trees, the CPU in sequence; measured 7e-6 on lavapipe, 5e-6 on the
//! CPU) and nothing more. Half precision rounds every weight and
//! activation to 8 (bf16) or 11 (f16) significant bits, 2⁻⁹ or 2⁻¹²
//! relative per operation, and the two layers' matmuls compound it:
//! measured 0.15-0.17 for bf16 and 0.014-0.020 for f16 (the ratio of ~8
//! is the 3 bits between them). The bounds, 0.3 and 0.04, leave a margin
//! of about 2 and stay far below the logits' own size, which is what a
//! weight in the wrong layout or an op in the wrong dtype gets wrong.

use std::path::PathBuf;

use bapo_policy::{
    Generation, Policy, Precision, SamplingParams,
    burn::prelude::*,
    device::{wgpu_for_test, wgpu_for_test_in},
    hf,
    tokenizer::TextTokenizer,
    weights,
};

struct Reference {
    input_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn fixture(name: &str) -> PathBuf {
    // Read at run time: the compile-time value goes stale when a shared
    // target dir built the same sources in another checkout.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("tests/fixtures")
        .join(name)
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Reference {
        input_ids: ids("input_ids"),
        greedy: ids("greedy"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

/// Loads checkpoint `dir` and compares it with reference `name`.
fn check_against(dir: &str, name: &str) {
    check_on(dir, name, &Device::flex(), Precision::F32, 1e-4);
}

/// The largest |logit − transformers' logit| of checkpoint `dir` against
/// reference `name` on `device` computing in `precision`.
fn logit_error(dir: &str, name: &str, device: &Device, precision: Precision) -> f32 {
    let policy = load(dir, device, precision);
    let r = reference(name);
    let logits = policy.model.forward(
        Policy::tokens(std::slice::from_ref(&r.input_ids), device),
        &policy.rope,
        None,
    );
    let got: Vec<f32> = logits.into_data().try_into_vec().unwrap();
    let v = r.logits[0].len();
    let mut worst = 0f32;
    for (t, row) in r.logits.iter().enumerate() {
        for (j, want) in row.iter().enumerate() {
            worst = worst.max((got[t * v + j] - want).abs());
        }
    }
    worst
}

fn load(dir: &str, device: &Device, precision: Precision) -> Policy {
    let mut policy = hf::load(&fixture(dir), device).unwrap();
    policy.model = weights::for_inference(policy.model, precision);
    policy
}

/// Logits within `tolerance`, and in f32 the same greedy continuation.
fn check_on(dir: &str, name: &str, device: &Device, precision: Precision, tolerance: f32) {
    let worst = logit_error(dir, name, device, precision);
    eprintln!("{name} on {device:?} in {precision}: max |logit diff| {worst:.2e}");
    assert!(
        worst < tolerance,
        "{name} in {precision}: max |logit diff| {worst} (tolerance {tolerance})"
    );
    if precision != Precision::F32 {
        return;
    }
    let policy = load(dir, device, precision);
    let r = reference(name);
    let mut g = Generation::new(
        r.input_ids.clone(),
        1,
        SamplingParams {
            temperature: 0.0,
            max_new_tokens: r.greedy.len(),
            ..Default::default()
        },
    );
    g.run(&policy, 0);
    assert_eq!(
        g.responses()[0].tokens,
        r.greedy,
        "{name}: greedy continuation"
    );
}

#[test]
fn the_tokenizer_encodes_as_transformers_did() {
    for name in ["llama", "qwen2"] {
        let tok = TextTokenizer::from_file(&fixture(name).join("tokenizer.json")).unwrap();
        let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ids = tok.encode(v["prompt"].as_str().unwrap()).unwrap();
        assert_eq!(ids, reference(name).input_ids);
        assert_eq!(tok.decode(&ids).unwrap(), v["prompt"].as_str().unwrap());
        // Out-of-vocabulary ids are dropped, not fatal.
        assert_eq!(tok.decode(&[u32::MAX]).unwrap(), "");
    }
}

fn check(name: &str) {
    check_against(name, name);
}

#[test]
fn llama_matches_transformers() {
    check("llama");
}

#[test]
fn qwen2_matches_transformers() {
    check("qwen2");
}

#[test]
fn llama_and_qwen2_match_transformers_on_wgpu() {
    let Some(device) = wgpu_for_test("hf parity") else {
        return;
    };
    for name in ["llama", "qwen2"] {
        check_on(name, name, &device, Precision::F32, 1e-4);
    }
}

/// Half precision where each backend has it: bf16 and f16 on the CPU,
/// f16 on wgpu (WGSL has no bf16; lavapipe offers `shaderFloat16`).
#[test]
fn half_precision_logits_stay_near_transformers() {
    let cpu = Device::flex();
    for name in ["llama", "qwen2"] {
        check_on(name, name, &cpu, Precision::Bf16, BF16_TOLERANCE);
        check_on(name, name, &cpu, Precision::F16, F16_TOLERANCE);
    }
    if let Some(gpu) = wgpu_for_test_in("f16 parity", Precision::F16) {
        for name in ["llama", "qwen2"] {
            check_on(name, name, &gpu, Precision::F16, F16_TOLERANCE);
        }
    }
}

/// See the module's note on tolerances.
const BF16_TOLERANCE: f32 = 0.3;
const F16_TOLERANCE: f32 = 0.04;

#[test]
fn a_sharded_checkpoint_loads_as_the_single_file_one() {
    assert_eq!(
        hf::weight_files(&fixture("qwen2-sharded")).unwrap().len(),
        3
    );
    check_against("qwen2-sharded", "qwen2");
}

#[test]
fn a_missing_checkpoint_is_named() {
    let err = hf::load(&fixture("nope"), &Device::flex()).err().unwrap();
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn a_truncated_checkpoint_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture("qwen2").join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(fixture("qwen2").join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let err = hf::load(dir, &Device::flex()).err().unwrap();
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn a_saved_policy_reloads_identically_under_transformers_names() {
    let device = Device::flex();
    for name in ["llama", "qwen2"] {
        let policy = hf::load(&fixture(name), &device).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        hf::save(&policy, tmp.path()).unwrap();
        let again = hf::load(tmp.path(), &device).unwrap();
        let ids = reference(name).input_ids;
        let run = |p: &Policy| -> Vec<f32> {
            p.model
                .forward(
                    Policy::tokens(std::slice::from_ref(&ids), &device),
                    &p.rope,
                    None,
                )
                .into_data()
                .try_into_vec()
                .unwrap()
        };
        assert_eq!(run(&policy), run(&again), "{name}");
        // Same tensor names and shapes as the transformers checkpoint.
        let names = |dir: &std::path::Path| {
            let b = std::fs::read(dir.join("model.safetensors")).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
            let mut v: Vec<(String, String)> = h
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.as_str() != "__metadata__")
                .map(|(k, t)| (k.clone(), t["shape"].to_string()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(tmp.path()), names(&fixture(name)), "{name}");
    }
}
