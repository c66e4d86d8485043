//! `bapo bench broadcast --vllm`: from the learner's publish to a vLLM
//! actor serving the version. The learner's hub publishes each version
//! (bf16, deltas on), the actor's own subscription follows it in the form
//! a vLLM actor takes (payloads, never decoded into a model), and the
//! actor's engine side (`bapo_actor::vllm`) gets it into a vLLM server it
//! started from the first version's directory. Measured twice in one run
//! on the same versions: through the weight-transfer path (patches in
//! place), and, as the reference, reloading every version from a file
//! (`actor.vllm.weight_transfer = false`). Needs the vLLM venv
//! (scripts/vllm-env.sh).

use std::{sync::Arc, time::Instant};

use bapo_actor::{
    UpdateMode,
    subscription::{self, Form, Target},
    vllm::{self, VllmConfig},
};
use bapo_learner::broadcast::WeightHub;

use super::hub::Served;
use bapo_policy::{
    ModelConfig, Policy, Precision, burn::prelude::*, hf, model::Transformer,
    tokenizer::TextTokenizer, weights::Encoding,
};
use tokio::sync::watch;

/// Seconds from the publish call of one version to its return (the
/// learner's encode and diff), to the subscription holding the version,
/// and to the engine serving it.
struct Timing {
    published: f64,
    held: f64,
    serving: f64,
}

/// Both paths over `versions`, printed.
pub async fn run(config: &ModelConfig, versions: &[Arc<Transformer>]) -> anyhow::Result<()> {
    for transfer in [false, true] {
        let t = measure(config, versions, transfer).await?;
        let (first, later) = t.split_first().expect("at least one version");
        let serving: Vec<f64> = later.iter().map(|t| t.serving).collect();
        let max = serving.iter().copied().fold(0.0, f64::max);
        let median = |f: fn(&Timing) -> f64| super::median(later.iter().map(f).collect());
        let each = serving.clone();
        println!(
            "vLLM actor, {}: publish to serving {:.2} s median (max {max:.2}) over {} versions; of it, the learner's publish {:.2} s, held by the subscription after {:.2} s; first version {:.2} s; each: {}",
            if transfer {
                "weight transfer (patches in place)"
            } else {
                "file reload (reference)"
            },
            super::median(each),
            later.len(),
            median(|t| t.published),
            median(|t| t.held),
            first.serving,
            serving
                .iter()
                .map(|s| format!("{s:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    Ok(())
}

/// Publishes `versions` to one vLLM actor and times each.
async fn measure(
    config: &ModelConfig,
    versions: &[Arc<Transformer>],
    transfer: bool,
) -> anyhow::Result<Vec<Timing>> {
    let dir = tempfile::tempdir()?;
    let device = Device::flex();
    let first = Policy::with_model(config.clone(), (*versions[0]).clone(), &device);
    hf::save(&first, dir.path())?;
    TextTokenizer::char_level().save(&dir.path().join("tokenizer.json"))?;

    let hub = WeightHub::new().with_deltas(true);
    let Served { url, stop, server } = super::hub::serve(&hub).await?;
    let stop_rx = stop.subscribe();
    let (cell_tx, cell_rx) = watch::channel(None);
    let mut held = cell_tx.subscribe();
    let target = Target {
        device,
        precision: Precision::F32,
        form: Form::Wire,
    };
    tokio::spawn(subscription::follow(
        url,
        None,
        "bench-vllm".into(),
        target,
        cell_tx,
        stop_rx.clone(),
    ));
    let cfg = engine_config(config, transfer);
    let started = vllm::start(
        &cfg,
        UpdateMode::Partial,
        Some(dir.path().to_path_buf()),
        cell_rx,
        stop_rx,
    )?;
    let mut serving = started.serving;
    let mut out = Vec::new();
    for (i, model) in versions.iter().enumerate() {
        let version = i as u64 + 1;
        let t0 = Instant::now();
        hub.publish_as(model, config, version, Encoding::Bf16)?;
        let published = t0.elapsed().as_secs_f64();
        let at = |v: &Option<Arc<subscription::Versioned>>| {
            v.as_ref().is_some_and(|v| v.version >= version)
        };
        held.wait_for(at).await?;
        let held_s = t0.elapsed().as_secs_f64();
        serving.wait_for(at).await?;
        out.push(Timing {
            published,
            held: held_s,
            serving: t0.elapsed().as_secs_f64(),
        });
    }
    let _ = stop.send(true);
    hub.close();
    let _ = server.await;
    // The server the actor started ends with its background task.
    let _ = started.background.await;
    Ok(out)
}

/// A started server in eager mode (no torch.compile: a faster start),
/// contexts no longer than the model's positions.
fn engine_config(config: &ModelConfig, transfer: bool) -> VllmConfig {
    let len = config.max_position_embeddings.min(1024).to_string();
    VllmConfig {
        extra_args: ["--enforce-eager", "--max-model-len", &len]
            .map(String::from)
            .to_vec(),
        weight_transfer: transfer,
        ..Default::default()
    }
}
