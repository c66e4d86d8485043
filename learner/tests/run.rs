//! The learner service loop against a scripted buffer on a loopback
//! socket: every report carries the lineage (this incarnation last) and the
//! group draws trained, groups sampled at another temperature are refused,
//! the final checkpoint keeps the provenance, and a buffer that says a
//! newer incarnation superseded this one stops the learner by name.

mod common;

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use bapo_learner::{
    TrainGroup, Trainer,
    broadcast::WeightHub,
    checkpoint::{self, Provenance},
    lineage::{Incarnation, Lineage},
    run::{RunOptions, RunSummary, Superseded},
};
use bapo_proto::{
    packed,
    v1::{
        self, Batch, SampleRequest, SamplingParams, Stats, StatsRequest, VersionAck, VersionReport,
        batch_source_server::{BatchSource, BatchSourceServer},
    },
};
use common::{config, group, tiny_policy};
use tonic::{Request, Response, Status};

const EARLIER: u64 = 0xe1;
const THIS: u64 = 0x7a;

/// A buffer that hands out scripted batches and records version reports,
/// refusing them all when `superseded`.
#[derive(Clone, Default)]
struct ScriptedBuffer {
    batches: Arc<Mutex<VecDeque<Vec<v1::Group>>>>,
    reports: Arc<Mutex<Vec<VersionReport>>>,
    superseded: bool,
}

#[tonic::async_trait]
impl BatchSource for ScriptedBuffer {
    async fn sample(&self, _: Request<SampleRequest>) -> Result<Response<Batch>, Status> {
        let next = self.batches.lock().unwrap().pop_front();
        match next {
            Some(groups) => Ok(Response::new(Batch {
                groups,
                learner_version: 0,
            })),
            None => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(Status::deadline_exceeded("no batch"))
            }
        }
    }

    type SampleStreamStream = tokio_stream::Empty<Result<v1::Group, Status>>;

    async fn sample_stream(
        &self,
        _: Request<SampleRequest>,
    ) -> Result<Response<Self::SampleStreamStream>, Status> {
        Err(Status::unimplemented("scripted buffer"))
    }

    async fn report_version(
        &self,
        request: Request<VersionReport>,
    ) -> Result<Response<VersionAck>, Status> {
        let report = request.into_inner();
        let version = report.version;
        self.reports.lock().unwrap().push(report);
        if self.superseded {
            return Err(Status::failed_precondition(
                "incarnation superseded by a newer learner",
            ));
        }
        Ok(Response::new(VersionAck {
            version,
            ..Default::default()
        }))
    }

    async fn get_stats(&self, _: Request<StatsRequest>) -> Result<Response<Stats>, Status> {
        Err(Status::unimplemented("scripted buffer"))
    }
}

impl ScriptedBuffer {
    /// Serves on an ephemeral loopback port; returns the address.
    async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let svc = BatchSourceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(incoming),
        );
        format!("http://{addr}")
    }

    fn reports(&self) -> Vec<VersionReport> {
        self.reports.lock().unwrap().clone()
    }
}

/// `g` as the buffer sends it, each rollout sampled at `temperature`
/// (`None`: not recorded).
fn wire(g: &TrainGroup, temperature: Option<f32>) -> v1::Group {
    let rollouts = g
        .sequences
        .iter()
        .enumerate()
        .map(|(i, s)| v1::Rollout {
            rollout_id: format!("{}-{i}", g.group_id),
            group_id: g.group_id.clone(),
            prompt_tokens: packed::pack_u32(&s.prompt),
            response_tokens: packed::pack_u32(&s.response),
            behavior_logprobs: packed::pack_f32(&s.behavior_logprobs),
            token_versions: packed::pack_u32(&s.versions),
            reward: s.reward,
            sampling: temperature.map(|temperature| SamplingParams {
                temperature,
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    v1::Group {
        group_id: g.group_id.clone(),
        rollouts,
        sequence: g.sequence_number,
        ..Default::default()
    }
}

/// Weights resumed at version 2 of an earlier incarnation that trained on
/// 5 group draws.
fn resumed() -> Provenance {
    Provenance {
        data_cursor: 4,
        lineage: Lineage::new(
            vec![Incarnation {
                id: EARLIER,
                first_version: 0,
            }],
            2,
        )
        .unwrap(),
        groups_trained: 5,
    }
}

async fn run(
    buffer: &ScriptedBuffer,
    hub: &WeightHub,
    out: &std::path::Path,
) -> anyhow::Result<RunSummary> {
    let mut cfg = config("bapo");
    cfg.batch_groups = 2;
    cfg.steps = 2;
    cfg.checkpoint_every = 0;
    cfg.eval_every = 0;
    let trainer = Trainer::new(cfg, tiny_policy(41), 2).unwrap();
    let opts = RunOptions {
        buffer: buffer.serve().await,
        tls: None,
        out: out.to_path_buf(),
        provenance: resumed(),
        eval: None,
        decode: None,
        params: serde_json::Value::Null,
        export_final: false,
    };
    let run = bapo_learner::run::run(trainer, hub.clone(), opts, std::future::pending());
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run ends")
}

/// The resumed lineage continued by this incarnation at version 2.
fn lineage() -> Vec<v1::Incarnation> {
    vec![
        v1::Incarnation {
            id: EARLIER,
            first_version: 0,
        },
        v1::Incarnation {
            id: THIS,
            first_version: 2,
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_carry_the_lineage_and_draws_and_other_temperatures_are_refused() {
    let stale = tiny_policy(42);
    let g = |i: u32| group(&stale, i, 2);
    let buffer = ScriptedBuffer::default();
    // The learner samples at 1.0: groups at 1.0 or not saying are trained
    // on, groups sampled at 0.5 refused (a whole batch, then one of two).
    buffer.batches.lock().unwrap().extend([
        vec![wire(&g(5), Some(1.0)), wire(&g(6), None)],
        vec![wire(&g(7), Some(0.5)), wire(&g(8), Some(0.5))],
        vec![wire(&g(9), Some(1.0)), wire(&g(10), Some(0.5))],
    ]);
    let hub = WeightHub::with_incarnation(THIS);
    let out = tempfile::tempdir().unwrap();
    let summary = run(&buffer, &hub, out.path()).await.unwrap();
    assert_eq!((summary.steps, summary.version), (2, 4));
    assert_eq!(summary.incarnation, THIS);

    // The start, then one report per step; refused draws count as
    // consumed (5 restored + 2 + 2 + 2).
    let reports = buffer.reports();
    let seen: Vec<_> = reports
        .iter()
        .map(|r| (r.version, r.groups_trained))
        .collect();
    assert_eq!(seen, [(2, 5), (3, 7), (4, 11)]);
    assert!(
        reports.iter().all(|r| r.lineage == lineage()),
        "{reports:?}"
    );
    assert_eq!(summary.groups_trained, 11);

    let published = hub.latest().expect("weights were published");
    assert_eq!((published.version, published.incarnation), (4, THIS));

    // The final checkpoint keeps what the next incarnation continues.
    let ckpt = checkpoint::latest(&out.path().join("checkpoints"))
        .unwrap()
        .expect("a final checkpoint");
    let state = checkpoint::read_state(&ckpt).unwrap();
    assert_eq!(state.policy_version, 4);
    assert_eq!(state.provenance.lineage.to_wire(), lineage());
    assert_eq!(state.provenance.groups_trained, 11);
    assert_eq!(state.provenance.data_cursor, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_learner_stops_by_name_before_publishing() {
    let buffer = ScriptedBuffer {
        superseded: true,
        ..Default::default()
    };
    let hub = WeightHub::with_incarnation(THIS);
    let out = tempfile::tempdir().unwrap();
    let e = run(&buffer, &hub, out.path())
        .await
        .expect_err("a zombie learner must stop");
    let z = e
        .downcast_ref::<Superseded>()
        .unwrap_or_else(|| panic!("not named as superseded: {e:#}"));
    assert_eq!((z.incarnation, z.version), (THIS, 2));
    assert!(e.to_string().contains("superseded"), "{e}");
    assert_eq!(buffer.reports().len(), 1, "no retry after the refusal");
    assert!(
        hub.latest().is_none(),
        "a zombie must not serve its weights"
    );
}

/// A learner told to stop while the buffer is gone (its first report
/// still pending) stops cleanly: `Ok`, with its final checkpoint written,
/// not an error; a restart with the same flags reports the version again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_buffer_is_gone_is_not_a_failure() {
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let out = tempfile::tempdir().unwrap();
    let trainer = Trainer::new(config("bapo"), tiny_policy(43), 0).unwrap();
    let opts = RunOptions {
        buffer: gone,
        tls: None,
        out: out.path().to_path_buf(),
        provenance: Provenance::default(),
        eval: None,
        decode: None,
        params: serde_json::Value::Null,
        export_final: false,
    };
    let stop = tokio::time::sleep(Duration::from_millis(800));
    let hub = WeightHub::with_incarnation(THIS);
    let run = bapo_learner::run::run(trainer, hub, opts, stop);
    let summary = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the stop ends the run")
        .expect("a stop is not a failure");
    assert_eq!(summary.steps, 0);
    let latest = checkpoint::latest(&out.path().join("checkpoints")).unwrap();
    assert!(latest.is_some(), "no final checkpoint");
}
