//! `bapo bench parity`: bapo's logits, next-token log-probs and weight
//! gradients beside PyTorch's on the same weights and tokens, on any
//! device. The reference (`scripts/device/torch_parity.py`) saves a random
//! model of a real shape as a HF directory and, in `ref.safetensors`, the
//! tokens, the last logits, the log-probs and the gradients of their sum
//! with respect to four weights; this loads the same directory and
//! computes the same. Why: the tests hold bapo to transformers on tiny
//! fixtures on the CPU; a GPU backend at a real size (vocabulary 150k,
//! 24 layers) is where reductions and dtypes differ.

use std::path::PathBuf;

use anyhow::Context;
use bapo_policy::{
    ComputeDevice, Precision,
    burn::{module::Param, prelude::*},
    hf,
    logprob::next_token_logprobs,
    model::Transformer,
    rope::Rope,
};
use clap::Args;
use safetensors::SafeTensors;

#[derive(Debug, Args)]
pub struct ParityArgs {
    /// The HF directory torch_parity.py wrote (config.json,
    /// model.safetensors, ref.safetensors).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// `cpu`, `wgpu` or `cuda`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype (the reference is f32).
    #[arg(long, default_value = "f32")]
    pub precision: String,
}

/// One compared quantity: the largest absolute difference, and the same
/// over the reference's largest magnitude.
#[derive(serde::Serialize)]
struct Diff {
    name: String,
    max_abs: f64,
    rel: f64,
}

pub fn run(a: ParityArgs) -> anyhow::Result<()> {
    let precision: Precision = a.precision.parse()?;
    let kind: ComputeDevice = a.device.parse()?;
    let device = kind.device_for(precision)?;
    let policy = hf::load(&a.checkpoint, &device)?;
    let path = a.checkpoint.join("ref.safetensors");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let reference = SafeTensors::deserialize(&bytes)?;
    let (tokens, [b, t]) = ints(&reference, "tokens")?;
    let train = device.autodiff();
    let model = policy
        .model
        .with_precision(precision)
        .to_device(&train)
        .train();
    let c = &policy.config;
    let rope = Rope::new(
        c.head_dim(),
        c.rope_theta(),
        c.max_position_embeddings,
        &train,
    );
    let ids = Tensor::<2, Int>::from_data(TensorData::new(tokens, [b, t]), &train);
    let logits = model.forward(ids.clone(), &rope, None);
    let v = logits.dims()[2];
    let tail = logits.clone().narrow(1, t - 8, 8);
    let lp = next_token_logprobs(logits, ids, 1.0);
    let grads = lp.clone().sum().backward();
    let mut diffs = vec![
        diff(
            "logits_tail",
            &host(tail),
            &floats(&reference, "logits_tail")?,
        ),
        diff(
            "next_logprobs",
            &host(lp),
            &floats(&reference, "next_logprobs")?,
        ),
    ];
    for (name, grad) in weight_grads(&model, &grads) {
        let want = floats(&reference, &format!("grad.{name}"))?;
        diffs.push(diff(&format!("grad.{name}"), &grad, &want));
    }
    for d in &diffs {
        println!(
            "{:<48} max |diff| {:.3e}, relative {:.3e}",
            d.name, d.max_abs, d.rel
        );
    }
    let line = serde_json::json!({
        "impl": "bapo", "check": "parity", "device": a.device, "precision": a.precision,
        "adapter": kind.adapter(), "batch": b, "seq": t, "vocab": v, "diffs": diffs,
    });
    println!("{line}");
    Ok(())
}

/// The gradients of the four weights the reference saves, in HF's layout
/// (`[out, in]`; Burn's linear weights are `[in, out]`).
fn weight_grads(
    model: &Transformer,
    grads: &bapo_policy::burn::tensor::Gradients,
) -> Vec<(String, Vec<f32>)> {
    let layer = &model.layers[0];
    let g2 = |p: &Param<Tensor<2>>, transpose: bool| {
        let g = p.val().grad(grads).expect("a gradient");
        host(if transpose { g.transpose() } else { g })
    };
    vec![
        (
            "model.embed_tokens.weight".into(),
            g2(&model.embed_tokens.weight, false),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight".into(),
            g2(&layer.self_attn.q_proj.weight, true),
        ),
        (
            "model.layers.0.mlp.down_proj.weight".into(),
            g2(&layer.mlp.down_proj.weight, true),
        ),
        (
            "model.norm.weight".into(),
            host(model.norm.gamma.val().grad(grads).expect("a gradient")),
        ),
    ]
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data")
}

fn diff(name: &str, got: &[f32], want: &[f32]) -> Diff {
    if got.len() != want.len() {
        return Diff {
            name: format!("{name} (sizes differ: {} vs {})", got.len(), want.len()),
            max_abs: f64::INFINITY,
            rel: f64::INFINITY,
        };
    }
    let max_abs = got
        .iter()
        .zip(want)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max);
    let scale = want.iter().map(|y| f64::from(*y).abs()).fold(0.0, f64::max);
    Diff {
        name: name.into(),
        max_abs,
        rel: max_abs / scale.max(f64::MIN_POSITIVE),
    }
}

fn floats(st: &SafeTensors, name: &str) -> anyhow::Result<Vec<f32>> {
    let view = st
        .tensor(name)
        .with_context(|| format!("ref.safetensors: no {name}"))?;
    anyhow::ensure!(
        view.dtype() == safetensors::Dtype::F32,
        "ref.safetensors: {name} is {:?}, expected F32",
        view.dtype()
    );
    Ok(view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn ints(st: &SafeTensors, name: &str) -> anyhow::Result<(Vec<i32>, [usize; 2])> {
    let view = st
        .tensor(name)
        .with_context(|| format!("ref.safetensors: no {name}"))?;
    let shape: [usize; 2] = view
        .shape()
        .try_into()
        .map_err(|_| anyhow::anyhow!("ref.safetensors: {name} is not [batch, seq]"))?;
    anyhow::ensure!(
        view.dtype() == safetensors::Dtype::I32 && shape[1] > 8,
        "ref.safetensors: {name} must be I32 [batch, seq > 8]"
    );
    let ids = view
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((ids, shape))
}
