//! The engine's weight loading against a small in-process fake of vLLM's
//! HTTP routes (the real server is tested by `vllm_engine.rs`, opt-in):
//! the order of a reload's calls, and what the actor does when a reload
//! fails, hangs, or the server's model is not the learner's. What must
//! hold each time: no version is served (the slots wait) and the engine's
//! label is `unknown` until a reload succeeded, and the engine is resumed.
//! Later versions go as patches through the weight-transfer routes; a
//! server without them, or a patch it refuses, gets a file reload.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use bapo_actor::{
    UpdateMode,
    subscription::{Versioned, Wire},
    vllm::{self, VllmConfig},
};
use bapo_policy::{ModelConfig, Policy, burn::prelude::*, model::Transformer, weights::Encoding};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::watch,
};

/// How the fake answers a reload.
#[derive(Clone, Copy, PartialEq)]
enum Reload {
    Works,
    Fails,
    Hangs,
}

/// How the fake answers the weight-transfer routes.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Transfer {
    Works,
    /// `/update_weights` answers 500.
    Fails,
    /// No transfer engine: `/init_weight_transfer_engine` answers 404.
    Absent,
}

struct Fake {
    reload: Reload,
    transfer: Transfer,
    vocab: usize,
    /// Every request's method, route and body, in order.
    calls: Mutex<Vec<String>>,
}

impl Fake {
    fn answer(&self, route: &str, body: &str) -> (u16, String) {
        self.calls.lock().unwrap().push(format!("{route} {body}"));
        match route {
            "/health" => (200, String::new()),
            "/collective_rpc" if body.contains("describe_model") => {
                let d = format!(
                    r#"{{"vocab_size": {}, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}"#,
                    self.vocab
                );
                (200, serde_json::json!({"results": [d]}).to_string())
            }
            "/init_weight_transfer_engine" if self.transfer == Transfer::Absent => {
                (404, r#"{"detail": "Not Found"}"#.into())
            }
            "/update_weights" if self.transfer == Transfer::Fails => {
                (500, r#"{"error": {"message": "bapo_shm: refused"}}"#.into())
            }
            "/collective_rpc" => match self.reload {
                Reload::Works | Reload::Hangs => (200, r#"{"results": ["reloaded"]}"#.into()),
                Reload::Fails => (500, r#"{"error": {"message": "bad tensor"}}"#.into()),
            },
            _ => (200, r#"{"status": "ok"}"#.into()),
        }
    }
}

/// Serves `fake` on a loopback port: one HTTP/1.1 request per connection.
async fn serve(fake: Arc<Fake>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let fake = fake.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let (head, body) = loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let len = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if body.len() >= len {
                            break (head.to_string(), body.to_string());
                        }
                    }
                };
                let route = head.split_whitespace().nth(1).unwrap_or("").to_string();
                let route = route.split('?').next().unwrap_or("").to_string();
                if fake.reload == Reload::Hangs
                    && route == "/collective_rpc"
                    && !body.contains("describe")
                {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                let (status, text) = fake.answer(&route, &body);
                let resp = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    url
}

fn tiny() -> ModelConfig {
    ModelConfig {
        vocab_size: 32,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        ..ModelConfig::preset("tiny").unwrap()
    }
}

/// What a test holds: the fake, the engine side, and what must stay alive.
struct Setup {
    fake: Arc<Fake>,
    started: vllm::Started,
    dir: tempfile::TempDir,
    _weights: watch::Sender<Option<Arc<Versioned>>>,
    _stop: watch::Sender<bool>,
    /// v7's model.
    model: Transformer,
}

/// `model` as a vLLM actor receives it: the bf16 payload of version
/// `version` of incarnation 3.
fn wire(version: u64, model: &Transformer) -> Arc<Versioned> {
    let w = Wire::encode(&tiny(), model, Encoding::Bf16).unwrap();
    Arc::new(Versioned::wire(version, 3, w))
}

/// Starts the engine side against a fake answering reloads with `reload`
/// and describing a vocabulary of `vocab`; publishes v7 of incarnation 3.
async fn start(reload: Reload, vocab: usize) -> Setup {
    start_with(reload, Transfer::Works, vocab).await
}

async fn start_with(reload: Reload, transfer: Transfer, vocab: usize) -> Setup {
    start_configured(reload, transfer, vocab, true).await
}

/// [`start_with`], the actor's `weight_transfer` set as given.
async fn start_configured(
    reload: Reload,
    transfer: Transfer,
    vocab: usize,
    weight_transfer: bool,
) -> Setup {
    let fake = Arc::new(Fake {
        reload,
        transfer,
        vocab,
        calls: Mutex::new(Vec::new()),
    });
    let url = serve(fake.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = VllmConfig {
        url,
        weights_dir: dir.path().to_path_buf(),
        reload_timeout_s: 1.0,
        weight_transfer,
        ..Default::default()
    };
    let model = Policy::init(tiny(), &Device::flex()).model;
    let (weights_tx, weights) = watch::channel(Some(wire(7, &model)));
    let (stop_tx, stop) = watch::channel(false);
    let started = vllm::start(&cfg, UpdateMode::Partial, None, weights, stop).unwrap();
    Setup {
        fake,
        started,
        dir,
        _weights: weights_tx,
        _stop: stop_tx,
        model,
    }
}

fn calls(fake: &Fake) -> Vec<String> {
    fake.calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| !c.starts_with("/health"))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_labels_the_version_only_after_it_succeeded() {
    let Setup {
        fake,
        mut started,
        dir,
        _weights,
        _stop,
        ..
    } = start(Reload::Works, 32).await;
    let serving = &mut started.serving;
    tokio::time::timeout(Duration::from_secs(30), serving.wait_for(|v| v.is_some()))
        .await
        .expect("never served")
        .unwrap();
    let c = calls(&fake);
    let order: Vec<&str> = c.iter().map(|c| c.split(' ').next().unwrap()).collect();
    assert_eq!(
        order,
        [
            "/collective_rpc", // describe_model
            "/pause",
            "/update_weight_version",
            "/collective_rpc", // reload_hf_dir
            "/update_weight_version",
            "/reset_prefix_cache",
            "/resume"
        ],
        "{c:#?}"
    );
    assert!(c[2].contains(r#""new_version":"unknown""#), "{}", c[2]);
    assert!(
        c[3].contains("reload_hf_dir") && c[3].contains("3.7"),
        "{}",
        c[3]
    );
    assert!(c[4].contains(r#""new_version":"3.7""#), "{}", c[4]);
    assert!(dir.path().join("3.7/model.safetensors").exists());
}

/// Moves every norm weight: a step that changes a few elements.
struct NudgeNorms;

impl bapo_policy::burn::module::ModuleMapper for NudgeNorms {
    fn map_float<const D: usize>(
        &mut self,
        p: bapo_policy::burn::module::Param<Tensor<D>>,
    ) -> bapo_policy::burn::module::Param<Tensor<D>> {
        if D == 1 {
            p.map(|t| t.add_scalar(0.5))
        } else {
            p
        }
    }
}

async fn serving(s: &mut vllm::Started, version: u64) {
    tokio::time::timeout(
        Duration::from_secs(30),
        s.serving
            .wait_for(|v| v.as_ref().is_some_and(|v| v.version == version)),
    )
    .await
    .unwrap_or_else(|_| panic!("never served v{version}"))
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_version_goes_as_a_patch_or_else_by_reload() {
    use bapo_policy::burn::module::Module;
    for transfer in [Transfer::Works, Transfer::Fails, Transfer::Absent] {
        let mut setup = start_with(Reload::Works, transfer, 32).await;
        serving(&mut setup.started, 7).await;
        let before = calls(&setup.fake).len();
        let model = setup.model.clone().map(&mut NudgeNorms);
        setup._weights.send(Some(wire(8, &model))).unwrap();
        serving(&mut setup.started, 8).await;
        let after: Vec<String> = calls(&setup.fake).split_off(before);
        let has = |route: &str| after.iter().any(|c| c.starts_with(route));
        let reloaded = after
            .iter()
            .any(|c| c.contains("reload_hf_dir") && c.contains("3.8"));
        match transfer {
            Transfer::Works => {
                assert!(
                    has("/update_weights") && !reloaded,
                    "{transfer:?}: {after:#?}"
                );
                assert!(
                    after
                        .iter()
                        .any(|c| c.starts_with("/finish_weight_update") && c.contains("3.8")),
                    "{after:#?}"
                );
            }
            Transfer::Fails => assert!(has("/update_weights") && reloaded, "{after:#?}"),
            Transfer::Absent => assert!(!has("/update_weights") && reloaded, "{after:#?}"),
        }
        assert!(has("/resume"), "{transfer:?}: never resumed: {after:#?}");
        // The patch file is gone once applied or refused.
        let left: Vec<_> = std::fs::read_dir(setup.dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect();
        assert!(left.is_empty(), "{transfer:?}: {left:?}");
    }
}

/// `actor.vllm.weight_transfer = false`: a server with a working transfer
/// engine is never asked to set it up, and a later version is reloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_weight_transfer_off_every_version_is_reloaded() {
    use bapo_policy::burn::module::Module;
    let mut setup = start_configured(Reload::Works, Transfer::Works, 32, false).await;
    serving(&mut setup.started, 7).await;
    let model = setup.model.clone().map(&mut NudgeNorms);
    setup._weights.send(Some(wire(8, &model))).unwrap();
    serving(&mut setup.started, 8).await;
    let seen = calls(&setup.fake);
    assert!(
        !seen
            .iter()
            .any(|c| c.contains("weight_transfer") || c.starts_with("/update_weights")),
        "{seen:#?}"
    );
    assert!(
        seen.iter()
            .any(|c| c.contains("reload_hf_dir") && c.contains("3.8")),
        "{seen:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_hung_reload_serves_nothing_and_resumes() {
    for reload in [Reload::Fails, Reload::Hangs] {
        let setup = start(reload, 32).await;
        let (fake, s) = (&setup.fake, &setup.started);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(s.serving.borrow().is_none(), "a version was served");
        let c = calls(fake);
        assert!(
            c.iter().any(|c| c.starts_with("/resume")),
            "never resumed: {c:#?}"
        );
        assert!(
            !c.iter().any(|c| c.contains(r#""new_version":"3.7""#)),
            "labelled a version the engine may not hold: {c:#?}"
        );
        assert!(
            !s.background.is_finished(),
            "a failed reload ended the engine"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_of_another_model_is_refused_by_name() {
    let setup = start(Reload::Works, 49152).await;
    let (fake, s) = (setup.fake, setup.started);
    let err = tokio::time::timeout(Duration::from_secs(30), s.background)
        .await
        .expect("not refused")
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("vocab_size Some(49152) where the learner has 32"),
        "{err}"
    );
    assert!(!calls(&fake).iter().any(|c| c.contains("reload_hf_dir")));
}
