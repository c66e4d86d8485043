//! bf16 weight broadcast end to end, over real loopback gRPC: the
//! learner's hub publishes bf16, its server streams it, an actor's
//! subscription loads it, and the actor then holds exactly the learner's
//! f32 weights rounded to nearest-even bf16, widened back to f32, at half
//! the bytes on the wire. A learner run with `broadcast_dtype = "bf16"`
//! trains, its actor follows, and its checkpoints keep f32 weights.

mod common;

use std::time::Duration;

use bapo_actor::subscription::{Assembly, TransferError};
use bapo_learner::{LearnerConfig, broadcast::WeightHub, checkpoint};
use bapo_policy::{
    Policy,
    burn::{
        module::{Module, ModuleVisitor, Param},
        prelude::*,
        tensor::{DType, FloatDType},
    },
    weights::{Encoding, WeightsHeader},
};
use bapo_proto::v1::{StatsRequest, WeightUpdate};
use common::{Loop, actor_config, follow, tiny, version, weight_server};
use half::bf16;

/// Every float parameter: path, dtype, values as f32.
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

fn floats(p: &Policy) -> Vec<(String, DType, Vec<f32>)> {
    let mut v = Floats::default();
    p.model.visit(&mut v);
    v.params
}

/// `got` holds exactly `master`'s weights rounded to bf16, in f32.
fn assert_rounded_copy(got: &Policy, master: &Policy) {
    let (want, got) = (floats(master), floats(got));
    assert_eq!(want.len(), got.len());
    let mut changed = 0;
    for ((path, _, w), (got_path, dtype, g)) in want.iter().zip(&got) {
        assert_eq!(path, got_path);
        assert_eq!(*dtype, DType::F32, "{path}: the actor computes in f32");
        assert_eq!(w.len(), g.len(), "{path}");
        for (i, (&x, &y)) in w.iter().zip(g).enumerate() {
            let rounded = bf16::from_f32(x).to_f32();
            assert_eq!(rounded.to_bits(), y.to_bits(), "{path}[{i}]: {x} -> {y}");
            changed += usize::from(x != y);
        }
    }
    assert!(changed > 0, "the weights were rounded");
}

fn logits(p: &Policy) -> Vec<f32> {
    let t = Policy::tokens(&[vec![4, 5, 6, 7]], &p.device());
    p.model
        .forward(t, &p.rope, None)
        .into_data()
        .try_into_vec()
        .unwrap()
}

/// An actor's weight subscription to `url`; the cell it fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_actor_applies_bf16_weights_as_the_learner_rounded_them() {
    let hub = WeightHub::new();
    let first = tiny(11);
    let f32_len = hub
        .publish(&first.model, &first.config, 1)
        .unwrap()
        .payload
        .len();
    let published = hub
        .publish_as(&first.model, &first.config, 1, Encoding::Bf16)
        .unwrap();
    let (header, encoding) = WeightsHeader::read(&published.header).unwrap();
    assert_eq!(encoding, Encoding::Bf16);
    // The checksum covers the bf16 bytes sent.
    header.verify(&published.payload).unwrap();
    let bf16_len = published.payload.len();
    assert!(
        bf16_len * 2 <= f32_len + 4096 && bf16_len * 2 > f32_len * 9 / 10,
        "bf16 {bf16_len} bytes, f32 {f32_len}"
    );

    let (url, _stop_server) = weight_server(hub.clone()).await;
    let (mut cell, _stop) = follow(url, "bf16-actor");
    let got = version(&mut cell, 1).await;
    assert_rounded_copy(got.policy().unwrap(), &first);
    // The learner's master weights stay f32 and unrounded.
    assert!(floats(&first).iter().all(|(_, d, _)| *d == DType::F32));
    assert_ne!(logits(got.policy().unwrap()), logits(&first));

    // The next version replaces it, rounded the same way.
    let second = tiny(12);
    hub.publish_as(&second.model, &second.config, 2, Encoding::Bf16)
        .unwrap();
    let got = version(&mut cell, 2).await;
    assert_rounded_copy(got.policy().unwrap(), &second);
}

/// Every single-bit flip of a bf16 update's header is refused by name,
/// including those that turn its encoding into f32 or an unknown one.
#[test]
fn a_flipped_bit_in_a_bf16_header_is_refused() {
    let hub = WeightHub::new();
    let p = tiny(13);
    let published = hub
        .publish_as(&p.model, &p.config, 4, Encoding::Bf16)
        .unwrap();
    let update = WeightUpdate {
        version: 4,
        header: published.header.clone(),
        payload_len: published.payload.len() as u64,
        chunks: 1,
        model_config_json: published.config_json.clone(),
        incarnation: published.incarnation,
        ..Default::default()
    };
    let load = |header: Vec<u8>| {
        let mut a = Assembly::new(WeightUpdate {
            header: header.into(),
            ..update.clone()
        });
        assert!(a.push(&published.payload).unwrap());
        a.finish(&Device::flex(), Default::default(), None)
            .and_then(bapo_actor::subscription::Loaded::policy)
    };
    let intact = load(published.header.to_vec()).unwrap();
    assert_rounded_copy(intact.policy().unwrap(), &p);
    let mut said = std::collections::BTreeSet::new();
    for byte in 0..published.header.len() {
        for bit in 0..8 {
            let mut h = published.header.to_vec();
            h[byte] ^= 1 << bit;
            let e = load(h).expect_err("a damaged header loaded");
            assert!(matches!(e, TransferError::Invalid { .. }), "{e}");
            if byte == 10 {
                said.insert(e.to_string());
            }
        }
    }
    // The encoding field: 1 -> 0 is f32, which the payload is not; the
    // other flips name unknown encodings.
    assert!(
        said.iter().any(|e| e.contains("the header announces f32")),
        "{said:?}"
    );
    assert!(
        said.iter().any(|e| e.contains("encoding 3 is unknown")),
        "{said:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_learner_broadcasting_bf16_trains_and_its_actor_follows() {
    let lp = Loop::with(4, 2, 2).await;
    let (buffer, hub, out) = (&lp.buffer, &lp.hub, &lp.out);
    let learner_url = lp.learner_url.clone();
    let cfg = LearnerConfig {
        broadcast_dtype: "bf16".into(),
        ..lp.learner_config(2, 2)
    };
    cfg.validate().unwrap();
    let learner = lp.spawn_learner(cfg);
    let (actor, stop_actor) = common::spawn_actor(actor_config(4), lp.actor_options("bf16-actor"));

    let summary = tokio::time::timeout(Duration::from_secs(120), learner)
        .await
        .expect("the learner finishes its steps")
        .unwrap()
        .unwrap();
    assert_eq!((summary.steps, summary.version), (2, 2));
    let stats = buffer
        .source()
        .await
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.rollouts_rejected, 0, "{stats:?}");
    stop_actor.send(()).unwrap();
    let a = tokio::time::timeout(Duration::from_secs(30), actor)
        .await
        .expect("the actor stops after its grace period")
        .unwrap()
        .unwrap();
    assert!(a.groups >= 4, "{a:?}");

    // The broadcast is bf16; the final checkpoint keeps the f32 master
    // weights, and a subscriber holds them rounded.
    let (_, encoding) = WeightsHeader::read(&hub.latest().unwrap().header).unwrap();
    assert_eq!(encoding, Encoding::Bf16);
    let ckpt = checkpoint::latest(&out.path().join("checkpoints"))
        .unwrap()
        .unwrap();
    let (saved, _) = checkpoint::load_policy(&ckpt, &Device::flex()).unwrap();
    let (mut cell, _stop) = follow(learner_url, "bf16-actor");
    let got = version(&mut cell, 2).await;
    assert_rounded_copy(got.policy().unwrap(), &saved);
}
