//! LoRA adapters: a fresh adapter changes nothing, the side update equals
//! the merged weight, only adapters train, and PEFT's file layout round-trips.

use bapo_policy::{
    ModelConfig, Policy,
    burn::{
        module::{Module, ModuleVisitor, Param},
        optim::GradientsParams,
        prelude::*,
        tensor::FloatDType,
    },
    lora::{self, Adapters, LoraConfig, Target},
    model::Transformer,
    peft::{self, AdapterMeta},
};

fn tiny() -> ModelConfig {
    ModelConfig::from_toml_str(
        r#"
        model_type = "qwen2"
        vocab_size = 97
        hidden_size = 48
        intermediate_size = 96
        num_hidden_layers = 2
        num_attention_heads = 4
        num_key_value_heads = 2
        tie_word_embeddings = true
        max_position_embeddings = 64
        "#,
    )
    .unwrap()
}

fn policy(seed: u64) -> Policy {
    let device = Device::flex();
    device.seed(seed);
    Policy::init(tiny(), &device)
}

fn logits(model: &Transformer, p: &Policy) -> Tensor<3> {
    let t = Policy::tokens(&[vec![1, 2, 3, 40, 41, 7, 90, 5]], &p.device());
    model.forward(t, &p.rope, None)
}

fn max_diff(a: Tensor<3>, b: Tensor<3>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

/// Every `B` drawn at random, so the adapters change the outputs.
fn perturbed(mut a: Adapters) -> Adapters {
    for layer in &mut a.layers {
        for (_, pair) in layer.pairs_mut() {
            let b = pair.b.val();
            let noise = Tensor::random(b.shape(), burn_normal(), &b.device());
            pair.b = Param::from_tensor(noise);
        }
    }
    a
}

fn burn_normal() -> bapo_policy::burn::tensor::Distribution {
    bapo_policy::burn::tensor::Distribution::Normal(0.0, 0.05)
}

fn with_adapters(p: &Policy, cfg: &LoraConfig) -> Transformer {
    let mut m = p.model.clone();
    m.lora = Some(perturbed(Adapters::init(&p.config, cfg, &p.device())));
    m
}

#[test]
fn a_fresh_adapter_leaves_the_outputs_unchanged() {
    let p = policy(1);
    let fresh = lora::attach(p.model.clone(), &p.config, &LoraConfig::default());
    assert_eq!(max_diff(logits(&p.model, &p), logits(&fresh, &p)), 0.0);
}

#[test]
fn the_side_update_equals_the_merged_weight() {
    let p = policy(2);
    for targets in [Target::ALL.to_vec(), vec![Target::Q, Target::V]] {
        let cfg = LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets,
            ..LoraConfig::default()
        };
        let adapted = with_adapters(&p, &cfg);
        let unmerged = logits(&adapted, &p);
        let changed = max_diff(unmerged.clone(), logits(&p.model, &p));
        assert!(
            changed > 1e-3,
            "the adapters must change the logits ({changed})"
        );
        let merged = lora::merge(adapted);
        assert!(merged.lora.is_none());
        // f32 sums in another order: 1e-5 of logits of order 1.
        let d = max_diff(unmerged, logits(&merged, &p));
        assert!(d < 1e-5, "unmerged vs merged logits differ by {d}");
    }
}

/// Parameters that received a gradient, by path.
struct WithGrad<'a> {
    grads: &'a GradientsParams,
    path: Vec<String>,
    found: Vec<String>,
    total: usize,
}

impl ModuleVisitor for WithGrad<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.total += 1;
        if self.grads.get::<D>(param.id).is_some() {
            self.found.push(self.path.join("."));
        }
    }
}

#[test]
fn only_the_adapters_get_gradients() {
    let p = policy(3);
    let device = p.device().autodiff();
    let cfg = LoraConfig {
        rank: 2,
        ..LoraConfig::default()
    };
    let model = lora::attach(p.model.clone().to_device(&device).train(), &p.config, &cfg);
    let tokens = Policy::tokens(&[vec![3, 4, 5, 6, 7]], &device);
    let rope = bapo_policy::rope::Rope::new(p.config.head_dim(), 10000.0, 64, &device);
    let loss = model.forward(tokens, &rope, None).powi_scalar(2).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut v = WithGrad {
        grads: &grads,
        path: Vec::new(),
        found: Vec::new(),
        total: 0,
    };
    model.visit(&mut v);
    let adapters = 2 * 7 * 2; // layers × targets × factors
    assert_eq!(v.found.len(), adapters, "with a gradient: {:?}", v.found);
    assert!(
        v.found.iter().all(|p| p.starts_with("lora.")),
        "{:?}",
        v.found
    );
    assert!(v.total > adapters, "the base has parameters too");
}

#[test]
fn peft_files_round_trip_with_peft_names() {
    let p = policy(4);
    let cfg = LoraConfig {
        rank: 4,
        alpha: 16.0,
        targets: vec![Target::Q, Target::K, Target::Down],
        ..LoraConfig::default()
    };
    let adapted = with_adapters(&p, &cfg);
    let ad = adapted.lora.as_ref().unwrap();
    let meta = AdapterMeta {
        alpha: 16.0,
        base: lora::fingerprint(&p.model),
    };
    let dir = tempfile::tempdir().unwrap();
    peft::write_dir(dir.path(), ad, meta, "tiny").unwrap();
    let bytes = std::fs::read(dir.path().join(peft::WEIGHTS_FILE)).unwrap();
    let st = safetensors_names(&bytes);
    assert!(st.contains(&(
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight".to_string(),
        vec![4, 48]
    )));
    assert!(st.contains(&(
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight".to_string(),
        vec![48, 4]
    )));
    assert_eq!(st.len(), 2 * 3 * 2);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(peft::CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(json["r"], 4);
    assert_eq!(json["lora_alpha"], 16.0);
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["q_proj", "k_proj", "down_proj"])
    );
    let (back, meta_back) = peft::read_dir(dir.path(), &p.config, &p.device()).unwrap();
    assert_eq!(meta_back, meta);
    // The factors come back bit for bit (the matmuls then read them in
    // another memory layout, so logits may differ in the last bit).
    for (l, r) in ad.layers.iter().zip(&back.layers) {
        for t in Target::ALL {
            match (l.get(t), r.get(t)) {
                (Some(x), Some(y)) => {
                    assert_eq!(x.a.val().into_data(), y.a.val().into_data());
                    assert_eq!(x.b.val().into_data(), y.b.val().into_data());
                }
                (None, None) => {}
                _ => panic!("{t} adapted on one side only"),
            }
        }
    }
    let mut reloaded = p.model.clone();
    reloaded.lora = Some(back);
    assert!(max_diff(logits(&adapted, &p), logits(&reloaded, &p)) < 1e-6);
}

#[test]
fn bf16_adapters_decode_within_rounding() {
    let p = policy(5);
    let adapted = with_adapters(&p, &LoraConfig::default());
    let meta = AdapterMeta {
        alpha: 32.0,
        base: 7,
    };
    let bytes = peft::encode(adapted.lora.as_ref().unwrap(), meta, FloatDType::BF16).unwrap();
    let (back, m) = peft::decode(&bytes, &p.config, None, &p.device()).unwrap();
    assert_eq!(m, meta);
    let mut reloaded = p.model.clone();
    reloaded.lora = Some(back);
    // bf16 keeps 8 bits of mantissa: the updates move by ~0.4% of their size.
    let d = max_diff(logits(&adapted, &p), logits(&reloaded, &p));
    assert!(d < 1e-2, "{d}");
}

#[test]
fn bad_adapter_files_are_refused_by_name() {
    let p = policy(6);
    let other = ModelConfig {
        hidden_size: 64,
        ..tiny()
    };
    let adapted = with_adapters(&p, &LoraConfig::default());
    let meta = AdapterMeta {
        alpha: 32.0,
        base: 0,
    };
    let bytes = peft::encode(adapted.lora.as_ref().unwrap(), meta, FloatDType::F32).unwrap();
    let err = peft::decode(&bytes, &other, None, &p.device()).unwrap_err();
    assert!(err.to_string().contains("proj.lora_"), "{err}");
    assert!(err.to_string().contains("shape"), "{err}");
    let err = peft::decode(&bytes[..bytes.len() / 2], &p.config, None, &p.device()).unwrap_err();
    assert!(err.to_string().starts_with("adapter file"), "{err}");
    let fewer_layers = ModelConfig {
        num_hidden_layers: 1,
        ..tiny()
    };
    let err = peft::decode(&bytes, &fewer_layers, None, &p.device()).unwrap_err();
    assert!(err.to_string().contains("layer 1"), "{err}");
    // rsLoRA scales by alpha/sqrt(r): refused rather than misread.
    let dir = tempfile::tempdir().unwrap();
    peft::write_dir(dir.path(), adapted.lora.as_ref().unwrap(), meta, "tiny").unwrap();
    let cfg_path = dir.path().join(peft::CONFIG_FILE);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    json["use_rslora"] = true.into();
    std::fs::write(&cfg_path, json.to_string()).unwrap();
    let err = peft::read_dir(dir.path(), &p.config, &p.device()).unwrap_err();
    assert!(err.to_string().contains("use_rslora"), "{err}");
}

#[test]
fn the_fingerprint_names_the_base_only() {
    let a = policy(7);
    let b = policy(8);
    let fa = lora::fingerprint(&a.model);
    assert_eq!(fa, lora::fingerprint(&a.model.clone()));
    assert_ne!(fa, lora::fingerprint(&b.model));
    let adapted = with_adapters(&a, &LoraConfig::default());
    assert_eq!(lora::fingerprint(&adapted), fa, "adapters are not the base");
}

#[test]
fn configs_that_cannot_work_are_refused() {
    let c = tiny();
    let bad = |f: fn(&mut LoraConfig)| {
        let mut cfg = LoraConfig::default();
        f(&mut cfg);
        cfg.validate_for(&c).unwrap_err().to_string()
    };
    assert!(bad(|c| c.rank = 0).starts_with("lora.rank"));
    assert!(bad(|c| c.rank = 100).contains("smaller dimension"));
    assert!(bad(|c| c.alpha = -1.0).starts_with("lora.alpha"));
    assert!(bad(|c| c.dropout = 1.0).starts_with("lora.dropout"));
    assert!(bad(|c| c.targets.clear()).starts_with("lora.targets"));
    assert!(bad(|c| c.targets.push(Target::Q)).contains("twice"));
}

/// `(name, shape)` of every tensor of a safetensors file.
fn safetensors_names(bytes: &[u8]) -> Vec<(String, Vec<usize>)> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (k.clone(), shape)
        })
        .collect()
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(
            || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")),
            std::path::PathBuf::from,
        )
        .join("tests/fixtures")
        .join(name)
}

/// An adapter PEFT made and saved itself (`scripts/lora_fixture.py`, on
/// the tiny Llama of the HF parity tests) gives PEFT's logits here, within
/// the f32 bound of those tests (1e-4, see hf_parity.rs); and bapo writes
/// the same tensors under the same names and shapes as PEFT's file.
#[test]
fn a_peft_adapter_gives_peft_logits_and_bapo_writes_peft_names() {
    let device = Device::flex();
    let mut p = bapo_policy::hf::load(&fixture("llama"), &device).unwrap();
    let dir = fixture("llama-lora");
    let (adapters, meta) = peft::read_dir(&dir, &p.config, &device).unwrap();
    assert_eq!((adapters.rank(), meta.alpha), (4, 8.0));
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<u32> = reference["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
        })
        .collect();
    let written = peft::encode(&adapters, meta, FloatDType::F32).unwrap();
    p.model.lora = Some(adapters);
    let got: Vec<f32> = p
        .model
        .forward(Policy::tokens(&[ids], &device), &p.rope, None)
        .into_data()
        .try_into_vec()
        .unwrap();
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "bapo vs PEFT logits differ by {diff}");
    let moved = reference["max_change_from_base"].as_f64().unwrap();
    assert!(moved > 0.1, "the fixture's adapter must matter ({moved})");
    let peft_file = std::fs::read(dir.join(peft::WEIGHTS_FILE)).unwrap();
    let mut ours = safetensors_names(&written);
    let mut theirs = safetensors_names(&peft_file);
    ours.sort();
    theirs.sort();
    assert_eq!(ours, theirs);
}

/// Logits of `model` (moved to `device`) on the fixed tokens, as f32.
fn logits_on(model: Transformer, config: &ModelConfig, device: &Device) -> Vec<f32> {
    let p = Policy::with_model(config.clone(), model.to_device(device), device);
    let t = Policy::tokens(&[vec![1, 2, 3, 40, 41, 7, 90, 5]], device);
    p.model
        .forward(t, &p.rope, None)
        .into_data()
        .convert::<f32>()
        .try_into_vec()
        .unwrap()
}

fn max_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The adapters run wherever the model does: bf16 and f16 compute on the
/// CPU, and wgpu (f32; where the machine has it). Bounds are those of the
/// HF parity tests (hf_parity.rs: 0.3 bf16, 0.04 f16, 1e-4 f32), and the
/// adapters move the logits by more than each bound, so a precision path
/// that dropped them would fail.
#[test]
fn adapters_run_in_half_precision_and_on_wgpu() {
    let p = policy(9);
    let cpu = Device::flex();
    let mut adapted = with_adapters(&p, &LoraConfig::default());
    // Larger updates than `perturbed`'s, so they exceed the bf16 bound.
    for layer in &mut adapted.lora.as_mut().unwrap().layers {
        for (t, pair) in layer.pairs_mut() {
            if matches!(t, Target::Q | Target::Up | Target::Down) {
                let b = pair.b.val();
                pair.b = Param::from_tensor(b.mul_scalar(10.0));
            }
        }
    }
    let want = logits_on(adapted.clone(), &p.config, &cpu);
    let base = logits_on(p.model.clone(), &p.config, &cpu);
    let moved = max_gap(&want, &base);
    assert!(
        moved > 0.3,
        "the adapters must move the logits past the bounds ({moved})"
    );
    for (precision, bound) in [
        (bapo_policy::Precision::Bf16, 0.3),
        (bapo_policy::Precision::F16, 0.04),
    ] {
        let m = adapted.clone().with_precision(precision);
        let gap = max_gap(&logits_on(m, &p.config, &cpu), &want);
        assert!(gap < bound, "{precision:?} on the CPU: {gap}");
    }
    if let Some(gpu) = bapo_policy::device::wgpu_for_test("LoRA on wgpu") {
        let gap = max_gap(&logits_on(adapted, &p.config, &gpu), &want);
        assert!(gap < 1e-4, "f32 on wgpu: {gap}");
    }
}
