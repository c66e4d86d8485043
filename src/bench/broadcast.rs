//! `bapo bench broadcast`: one weight version from the learner's publish
//! to every subscriber, over the real weight stream (gRPC on loopback,
//! plaintext), whole in f32, whole in bf16, and as bf16 deltas, measured
//! in the same run on the same versions.
//!
//! The versions are real: `--lr` BAPO steps of the learner's own trainer
//! between them (the deltas of real steps, not random noise); `--lr 0`
//! republishes one set of weights (for shapes too large to train here).
//!
//! Two kinds of subscriber:
//! - *serving*: the actor's own subscription (verify, apply a delta in
//!   place, decode, load into a model): publish to serving, for up to
//!   `--serving-max` subscribers (each holds a model and its payload);
//! - *stream*: a bare gRPC subscriber that assembles each version,
//!   applies deltas and checks the CRC32, without decoding: what the
//!   learner and the wire cost at 1, 4, 16 subscribers.
//!
//! Beside them, the actor's side of the two ways into a vLLM engine, from
//! the payload as it came: the HF safetensors directory the file reload
//! needs, and the patch the weight-transfer path sends instead; and the
//! decode and export a vLLM actor did per version before (vLLM's own work
//! comes on top of all of them, docs/vllm.md).

use std::{sync::Arc, time::Instant};

use bapo_actor::subscription::{self, Versioned};
use bapo_learner::broadcast::WeightHub;

use super::hub::Served;
use bapo_policy::{
    ModelConfig, Precision, burn::prelude::*, delta, hf_layout::Layout, model::Transformer,
    weights::Encoding,
};
use bapo_proto::v1::{
    SubscribeRequest, WeightUpdate, weight_message::Kind, weight_source_client::WeightSourceClient,
};
use clap::Args;
use tokio::sync::watch;

#[derive(Debug, Args)]
pub struct BroadcastBenchArgs {
    /// Models to measure: preset names or paths to an HF `config.json`.
    #[arg(long, default_value = "small")]
    pub configs: String,
    /// Subscriber counts.
    #[arg(long, default_value = "1,4,16")]
    pub subscribers: String,
    /// Timed versions per setting (the median is shown).
    #[arg(long, default_value_t = 3)]
    pub updates: u64,
    /// Learning rate of the BAPO steps between versions (0: the same
    /// weights every version).
    #[arg(long, default_value_t = 1e-6)]
    pub lr: f64,
    /// How the versions travel: any of f32, bf16, bf16-delta (f32
    /// versions never travel as deltas: AdamW changes every f32 word).
    #[arg(long, default_value = "f32,bf16,bf16-delta")]
    pub modes: String,
    /// The most subscribers that load each version into a model.
    #[arg(long, default_value_t = 4)]
    pub serving_max: usize,
    /// Also publish the versions to a vLLM actor (needs
    /// scripts/vllm-env.sh): publish to serving through the engine's
    /// weight-transfer path, beside reloading files.
    #[arg(long)]
    pub vllm: bool,
}

/// How versions travel in one measurement.
#[derive(Debug, Clone, Copy)]
struct Mode {
    encoding: Encoding,
    deltas: bool,
}

impl Mode {
    fn parse(s: &str) -> anyhow::Result<Self> {
        let (dtype, deltas) = match s.trim().strip_suffix("-delta") {
            Some(d) => (d, true),
            None => (s.trim(), false),
        };
        let encoding = Encoding::from_name(dtype)
            .ok_or_else(|| anyhow::anyhow!("--modes: {s:?} (f32, bf16, bf16-delta)"))?;
        Ok(Self { encoding, deltas })
    }

    fn name(self) -> String {
        let suffix = if self.deltas { "-delta" } else { "" };
        format!("{}{suffix}", self.encoding.name())
    }
}

/// What one setting measured: medians over the timed versions.
struct Row {
    /// Payload bytes sent per subscriber per version, and of a whole one.
    bytes: f64,
    whole: f64,
    /// The learner's publish: encode, CRC32 and (with deltas) the diff.
    publish_s: f64,
    /// From publish to every subscriber holding the version.
    to_all_s: f64,
}

pub async fn run(a: BroadcastBenchArgs) -> anyhow::Result<()> {
    let counts: Vec<usize> = a
        .subscribers
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let modes: Vec<Mode> = a
        .modes
        .split(',')
        .map(Mode::parse)
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(a.updates > 0, "--updates must be at least 1");
    println!(
        "bapo bench broadcast: {} ({} threads), loopback gRPC; versions {} apart; median of {} versions",
        super::weights::cpu_name(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if a.lr > 0.0 {
            format!("one BAPO step at lr {:e}", a.lr)
        } else {
            "not (the same weights)".into()
        },
        a.updates
    );
    for name in a.configs.split(',') {
        let config = super::model_config(name)?;
        println!(
            "\n== {}: {:.2} M parameters ==",
            name.trim(),
            config.num_params() as f64 / 1e6
        );
        let versions = versions(&config, a.lr, a.updates as usize + 1)?;
        if a.lr > 0.0 {
            reference(&config, &versions).await?;
        }
        if a.vllm {
            super::vllm_publish::run(&config, &versions).await?;
        }
        println!(
            "{:<11} {:>11} {:>9} {:>12} {:>10} {:>11} {:>11}",
            "mode", "subscribers", "kind", "MB/version", "of whole", "publish s", "to all s"
        );
        for &mode in &modes {
            for &n in &counts {
                let mut kinds = vec![("stream", false)];
                if n <= a.serving_max {
                    kinds.push(("serving", true));
                }
                for (kind, serving) in kinds {
                    let r = measure(&config, &versions, n, mode, serving).await?;
                    println!(
                        "{:<11} {:>11} {:>9} {:>12.2} {:>10.4} {:>11.3} {:>11.3}",
                        mode.name(),
                        n,
                        kind,
                        r.bytes / 1e6,
                        r.bytes / r.whole,
                        r.publish_s,
                        r.to_all_s
                    );
                }
            }
        }
    }
    Ok(())
}

/// `n` versions of a model of `config`, one real BAPO step at `lr` apart
/// (the same weights `n` times when `lr` is 0).
fn versions(config: &ModelConfig, lr: f64, n: usize) -> anyhow::Result<Vec<Arc<Transformer>>> {
    let device = Device::flex();
    device.seed(0);
    let model = Transformer::init(config, &device);
    if lr == 0.0 {
        let model = Arc::new(model);
        return Ok((0..n).map(|_| model.clone()).collect());
    }
    let policy = bapo_policy::Policy::with_model(config.clone(), model, &device);
    let cfg = bapo_learner::LearnerConfig {
        lr,
        batch_groups: 4,
        ..Default::default()
    };
    let mut trainer = bapo_learner::Trainer::new(cfg, policy, 0)?;
    let mut out = vec![Arc::new(trainer.model().clone())];
    for step in 1..n {
        let groups = super::weights::batch(&trainer.policy(), step as u32);
        trainer.step(&groups)?;
        out.push(Arc::new(trainer.model().clone()));
    }
    Ok(out)
}

/// The actor's side of the engine paths, for one version as a vLLM
/// actor gets it (the bf16 payload as it came): the file reload's HF
/// safetensors directory (vLLM then reloads all of it); the transfer
/// path's patch against the version before, made from the two payloads
/// (vLLM then writes only the patch in place); and, as the reference,
/// what the actor did per version before it kept payloads: decode into a
/// Burn model and export it (a diff of two exports came on top).
async fn reference(config: &ModelConfig, versions: &[Arc<Transformer>]) -> anyhow::Result<()> {
    let payload = |m: &Arc<Transformer>| -> anyhow::Result<_> {
        let (header, payload) = bapo_policy::weights::encode_as(m, 0, Encoding::Bf16)?;
        Ok((header, payload.to_vec()))
    };
    let dir = tempfile::tempdir()?;
    let (mut write, mut patch, mut decode_export) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for (i, pair) in versions.windows(2).enumerate() {
        let ((_, old), (header, new)) = (payload(&pair[0])?, payload(&pair[1])?);
        let t = Instant::now();
        let layout = Layout::read(&new)?;
        let export = layout.export(&new)?;
        bapo_policy::hf::save_bytes(config, &dir.path().join(i.to_string()), &export)?;
        write.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let p = Layout::read(&new)?.patch(&old, &new)?;
        patch.push(t.elapsed().as_secs_f64());
        last = Some(p);
        let t = Instant::now();
        let device = Device::flex();
        let fresh = Transformer::init(config, &device);
        let model = bapo_policy::weights::decode_as(&header, Encoding::Bf16, new, fresh)?;
        let model = bapo_policy::weights::for_inference(model, Precision::F32);
        let policy = bapo_policy::Policy::with_model(config.clone(), model, &device);
        bapo_policy::hf::to_safetensors(&policy).map_err(anyhow::Error::msg)?;
        decode_export.push(t.elapsed().as_secs_f64());
    }
    println!(
        "engine, file reload: the bf16 payload as an HF safetensors directory, {:.3} s to write",
        super::median(write)
    );
    if let Some(p) = last {
        println!(
            "engine, transfer: patch from the two payloads {:.3} s (reference, the model path: decode + export {:.3} s); {:.4} of the elements changed, patch {:.1} MB",
            super::median(patch),
            super::median(decode_export),
            p.changed as f64 / p.total as f64,
            p.bytes.len() as f64 / 1e6
        );
    }
    Ok(())
}

/// Publishes `versions` to `n` subscribers in `mode` (the first untimed:
/// connections up, every subscriber holding it) and times the rest.
async fn measure(
    config: &ModelConfig,
    versions: &[Arc<Transformer>],
    n: usize,
    mode: Mode,
    serving: bool,
) -> anyhow::Result<Row> {
    let hub = WeightHub::new().with_deltas(mode.deltas);
    let Served { url, stop, server } = super::hub::serve(&hub).await?;
    let stop_rx = stop.subscribe();
    let mut held = Vec::new();
    for i in 0..n {
        held.push(subscribe(&url, i, serving, stop_rx.clone()));
    }
    let (mut bytes, mut publish, mut to_all) = (Vec::new(), Vec::new(), Vec::new());
    let mut whole = 0.0;
    for (v, model) in versions.iter().enumerate() {
        let version = v as u64 + 1;
        let t0 = Instant::now();
        let p = hub.publish_as(model, config, version, mode.encoding)?;
        let publish_s = t0.elapsed().as_secs_f64();
        whole = p.payload.len() as f64;
        for h in &mut held {
            h.wait_for(|&at| at >= version).await?;
        }
        if v > 0 {
            publish.push(publish_s);
            to_all.push(t0.elapsed().as_secs_f64());
            let delta = p.links.last().filter(|l| l.from_version == version - 1);
            bytes.push(delta.map_or(p.payload.len(), |l| l.delta.len()) as f64);
        }
    }
    let _ = stop.send(true);
    hub.close();
    let _ = server.await;
    Ok(Row {
        bytes: super::median(bytes),
        whole,
        publish_s: super::median(publish),
        to_all_s: super::median(to_all),
    })
}

/// One subscriber; its receiver holds the newest version it holds.
fn subscribe(
    url: &str,
    i: usize,
    serving: bool,
    stop: watch::Receiver<bool>,
) -> watch::Receiver<u64> {
    let (at_tx, at_rx) = watch::channel(0);
    let url = url.to_string();
    if serving {
        let (tx, mut rx) = watch::channel::<Option<Arc<Versioned>>>(None);
        tokio::spawn(subscription::follow(
            url,
            None,
            format!("bench-{i}"),
            subscription::Target::model(Device::flex(), Precision::F32),
            tx,
            stop,
        ));
        tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let v = rx.borrow_and_update().as_ref().map_or(0, |v| v.version);
                at_tx.send_replace(v);
            }
        });
    } else {
        tokio::spawn(async move {
            if let Err(e) = stream(url, i, at_tx).await {
                eprintln!("bench stream subscriber {i}: {e:#}");
            }
        });
    }
    at_rx
}

/// A bare subscriber: assembles each version, applies deltas to the
/// payload it keeps, checks the CRC32, and reports the version.
async fn stream(url: String, i: usize, at: watch::Sender<u64>) -> anyhow::Result<()> {
    let mut client = WeightSourceClient::connect(url)
        .await?
        .max_decoding_message_size(64 << 20);
    let request = SubscribeRequest {
        actor_id: format!("bench-stream-{i}"),
        takes_deltas: true,
        ..Default::default()
    };
    let mut s = client.subscribe(request).await?.into_inner();
    let mut kept: Vec<u8> = Vec::new();
    let mut current: Option<(WeightUpdate, Vec<u8>)> = None;
    while let Some(m) = s.message().await? {
        match m.kind {
            Some(Kind::Update(u)) => {
                if !u.delta {
                    // A whole version replaces what is kept: do not hold both.
                    kept = Vec::new();
                }
                let cap = u.payload_len as usize;
                current = Some((u, Vec::with_capacity(cap)));
            }
            Some(Kind::Chunk(c)) => {
                if let Some((_, b)) = current.as_mut() {
                    b.extend_from_slice(&c);
                }
            }
            None => continue,
        }
        let done = current
            .as_ref()
            .is_some_and(|(u, b)| b.len() as u64 == u.payload_len);
        if !done {
            continue;
        }
        let (u, payload) = current.take().expect("an update");
        if u.delta {
            delta::apply_in_place(&mut kept, &payload)?;
        } else {
            let (h, _, _) = bapo_policy::weights::WeightsHeader::read_any(&u.header)?;
            h.verify(&payload)?;
            kept = payload;
        }
        if u.deltas_after == 0 {
            at.send_replace(u.version);
        }
    }
    Ok(())
}
