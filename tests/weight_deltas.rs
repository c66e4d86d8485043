//! Weight deltas end to end, over real loopback gRPC: after its first
//! snapshot an actor is sent each version as the words that changed, and
//! after every version it holds exactly the weights the learner's
//! payload for that version decodes to; an actor that skipped versions is
//! sent the chain of deltas; one whose delta was dropped on the way
//! (`BAPO_FAULT_DROP_DELTAS`) refuses the next one and is sent the newest
//! whole. Each check compares every float weight, bit for bit.
//!
//! The counters are one global recorder for this test binary.

mod common;

use std::{
    collections::BTreeMap,
    sync::{Mutex, OnceLock},
};

use bapo_actor::subscription::Assembly;
use bapo_learner::{
    broadcast::{Published, WeightHub},
    server::{self, Faults},
};
use bapo_policy::{
    Policy,
    burn::{
        module::{Module, ModuleMapper, ModuleVisitor, Param},
        prelude::*,
        tensor::FloatDType,
    },
    model::Transformer,
    weights::Encoding,
};
use bapo_proto::v1::WeightUpdate;
use common::{follow, tiny, version, weight_server};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Counters of the whole binary so far, by name and labels. (A snapshot
/// drains the recorder's counters, so they are summed here.)
fn counters() -> BTreeMap<String, u64> {
    static SNAP: OnceLock<(Snapshotter, Mutex<BTreeMap<String, u64>>)> = OnceLock::new();
    let (snap, sums) = SNAP.get_or_init(|| {
        let rec = DebuggingRecorder::new();
        let s = rec.snapshotter();
        rec.install().expect("one recorder per test binary");
        (s, Mutex::default())
    });
    let mut sums = sums.lock().unwrap();
    for (k, _, _, v) in snap.snapshot().into_vec() {
        if let DebugValue::Counter(c) = v {
            let labels: Vec<_> = k.key().labels().map(|l| l.value().to_string()).collect();
            *sums
                .entry(format!("{}{labels:?}", k.key().name()))
                .or_default() += c;
        }
    }
    sums.clone()
}

/// Adds `by` to every weight of the RMS norms: a small step that changes
/// a few percent of the model's words, as a real RL step at a small
/// learning rate does.
struct Nudge {
    by: f32,
    path: Vec<String>,
}

impl ModuleMapper for Nudge {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.path.join(".").contains("norm") {
            param.map(|t| t.add_scalar(self.by))
        } else {
            param
        }
    }
}

fn nudged(model: Transformer, step: u64) -> Transformer {
    model.map(&mut Nudge {
        by: 0.01 * step as f32,
        path: vec![],
    })
}

/// Every float weight, as f32 bits.
#[derive(Default)]
struct Bits(Vec<Vec<u32>>);

impl ModuleVisitor for Bits {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let v: Vec<f32> = param
            .val()
            .cast(FloatDType::F32)
            .into_data()
            .try_into_vec()
            .unwrap();
        self.0.push(v.into_iter().map(f32::to_bits).collect());
    }
}

fn bits(p: &Policy) -> Vec<Vec<u32>> {
    let mut b = Bits::default();
    p.model.visit(&mut b);
    b.0
}

/// What the learner's payload for `p` decodes to, as an actor loading it
/// whole would hold it.
fn decoded(p: &Published) -> Policy {
    let mut a = Assembly::new(WeightUpdate {
        version: p.version,
        header: p.header.clone(),
        payload_len: p.payload.len() as u64,
        chunks: 1,
        model_config_json: p.config_json.clone(),
        incarnation: p.incarnation,
        ..Default::default()
    });
    assert!(a.push(&p.payload).unwrap());
    let loaded = a.finish(&Device::flex(), Default::default(), None).unwrap();
    loaded.policy().unwrap().into_policy().unwrap()
}

fn count(name: &str, label: &str) -> u64 {
    counters()
        .get(&format!("{name}[\"{label}\"]"))
        .copied()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deltas_bring_an_actor_to_exactly_the_learners_weights() {
    let hub = WeightHub::new();
    let mut model = tiny(11);
    let first = hub
        .publish_as(&model.model, &model.config, 1, Encoding::Bf16)
        .unwrap();
    let (url, _server) = weight_server(hub.clone()).await;
    let (mut cell, _stop) = follow(url, "delta-actor");
    let got = version(&mut cell, 1).await;
    assert_eq!(bits(got.policy().unwrap()), bits(&decoded(&first)));

    let deltas_before = count("bapo_actor_weight_updates_total", "delta");
    for v in 2..=4 {
        model.model = nudged(model.model, v);
        let p = hub
            .publish_as(&model.model, &model.config, v, Encoding::Bf16)
            .unwrap();
        let link = p.links.last().expect("a delta from the version before");
        assert_eq!(link.from_version, v - 1);
        assert!(
            link.delta.len() * 10 < p.payload.len(),
            "delta {} bytes, whole {}",
            link.delta.len(),
            p.payload.len()
        );
        let got = version(&mut cell, v).await;
        assert_eq!(bits(got.policy().unwrap()), bits(&decoded(&p)), "v{v}");
    }
    // Counters are per binary: at least this test's three.
    assert!(count("bapo_actor_weight_updates_total", "delta") >= deltas_before + 3);

    // A subscriber that joins late holds nothing: it gets v4 whole, then
    // v5 as a delta, on the same weights as the first.
    let (url2, _server2) = weight_server(hub.clone()).await;
    let (mut late, _stop2) = follow(url2, "delta-actor-late");
    version(&mut late, 4).await;
    model.model = nudged(model.model, 5);
    let p = hub
        .publish_as(&model.model, &model.config, 5, Encoding::Bf16)
        .unwrap();
    let want = bits(&decoded(&p));
    assert_eq!(bits(version(&mut late, 5).await.policy().unwrap()), want);
    assert_eq!(bits(version(&mut cell, 5).await.policy().unwrap()), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_delta_is_refused_and_the_newest_comes_whole() {
    let hub = WeightHub::new();
    let mut model = tiny(21);
    hub.publish_as(&model.model, &model.config, 11, Encoding::Bf16)
        .unwrap();
    // The server never sends the delta that builds v13.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (_server, stop) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server::serve_faulty(
        hub.clone(),
        listener,
        bapo_proto::tls::ServerSecurity::Plaintext,
        Faults::drop_deltas(vec![13]),
        async {
            let _ = stop.await;
        },
    ));
    let (mut cell, _stop) = follow(url, "delta-actor");
    version(&mut cell, 11).await;
    let refused_before = count("bapo_actor_weight_deltas_refused_total", "base");
    let mut last = None;
    for v in 12..=14 {
        model.model = nudged(model.model, v);
        let p = hub
            .publish_as(&model.model, &model.config, v, Encoding::Bf16)
            .unwrap();
        if v == 12 {
            version(&mut cell, 12).await;
        }
        last = Some(p);
    }
    // v13's delta never came; v14's names v13's bytes, which the actor
    // does not hold: refused, and v14 is sent whole.
    let p = last.unwrap();
    assert_eq!(
        bits(version(&mut cell, 14).await.policy().unwrap()),
        bits(&decoded(&p))
    );
    assert!(count("bapo_actor_weight_deltas_refused_total", "base") > refused_before);
}
