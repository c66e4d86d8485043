//! TLS, client authentication and per-role authorization on the real
//! servers, with certificates made here: a caller without a certificate, with one from
//! another CA or with an expired one is refused at the handshake; each
//! role may call its own methods only (PERMISSION_DENIED otherwise, naming
//! the role and the method); the buffer records the certificate's identity
//! on each rollout; a lease is its holder's alone (another actor can
//! neither renew, release nor push into it); a blocklisted identity is refused after a reload; a
//! rotated server certificate is served to new connections while an open
//! weight stream keeps going; and the whole loop (buffer, learner, actor)
//! runs over mutual TLS. Bearer tokens: a wrong or missing one is
//! UNAUTHENTICATED, a valid one has its line's role and no other, a
//! rotated token file applies without a restart, and a server taking both
//! still refuses a foreign certificate.

mod common;

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use bapo_actor::ActorOptions;
use bapo_buffer::{Buffer, BufferConfig};
use bapo_learner::{LearnerConfig, Trainer, broadcast::WeightHub, run::RunOptions, server};
use bapo_policy::{burn::prelude::*, tokenizer::TextTokenizer};
use bapo_proto::{
    tls::{
        self, AuthChannel, ClientTls, ClientToken, Role, ServerFiles, ServerSecurity, ServerTls,
        TlsFiles,
        pki::{Ca, Options},
    },
    v1::{
        LeaseRequest, PushAck, Rollout, SampleRequest, StatsRequest, SubscribeRequest,
        VersionReport, batch_source_client::BatchSourceClient,
        rollout_sink_client::RolloutSinkClient, weight_source_client::WeightSourceClient,
    },
};
use bapo_tasks::TaskSpec;
use tokio::sync::oneshot;
use tonic::Code;

const TD: &str = "bapo.test";

fn loopback() -> Options {
    Options {
        hosts: vec!["localhost".into(), "127.0.0.1".into()],
        valid: None,
    }
}

/// A CA, and certificates of it written into a temporary directory.
struct Pki {
    ca: Ca,
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        tls::install_default_provider();
        Self {
            ca: Ca::new(TD).unwrap(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn files(&self, name: &str, path: &str, opts: &Options) -> TlsFiles {
        let issued = self.ca.issue(path, opts).unwrap();
        self.ca.write(self.dir.path(), name, &issued).unwrap()
    }

    fn client(&self, name: &str, path: &str) -> ClientTls {
        ClientTls::mtls(self.files(name, path, &loopback()))
    }

    fn server(&self, blocklist: Option<&Path>) -> Arc<ServerTls> {
        let files = self.files("server", "buffer", &loopback());
        ServerTls::load(ServerFiles {
            blocklist: blocklist.map(Path::to_path_buf),
            ..ServerFiles::mtls(files)
        })
        .unwrap()
    }
}

/// A buffer serving mutual TLS on an ephemeral port; stops on drop of the
/// sender.
async fn tls_buffer(cfg: BufferConfig, tls: Arc<ServerTls>) -> (String, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let buffer = Buffer::open(cfg).unwrap();
    tokio::spawn(bapo_buffer::server::serve_with(
        buffer,
        listener,
        ServerSecurity::Mtls(tls),
        async {
            let _ = rx.await;
        },
    ));
    (format!("https://{addr}"), tx)
}

async fn tls_learner(hub: WeightHub, tls: Arc<ServerTls>) -> (String, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server::serve_with(
        hub,
        listener,
        ServerSecurity::Mtls(tls),
        async {
            let _ = rx.await;
        },
    ));
    (format!("https://{addr}"), tx)
}

/// A channel to `url` with `tls`; the error if it cannot be made.
async fn connect(url: &str, tls: Option<&ClientTls>) -> Result<AuthChannel, String> {
    let url = url.replace("https://", "http://");
    let c = tls::connector(&url, tls).map_err(|e| e.to_string())?;
    c.connect().await.map_err(|e| format!("{e:?}"))
}

async fn stats(url: &str, tls: Option<&ClientTls>) -> Result<(), tonic::Status> {
    let ch = connect(url, tls)
        .await
        .map_err(tonic::Status::unavailable)?;
    BatchSourceClient::new(ch)
        .get_stats(StatsRequest {})
        .await
        .map(|_| ())
}

#[tokio::test]
async fn untrusted_callers_are_refused_at_the_handshake() {
    let pki = Pki::new();
    let (url, _stop) = tls_buffer(BufferConfig::default(), pki.server(None)).await;
    let admin = pki.client("admin", "admin");
    stats(&url, Some(&admin))
        .await
        .expect("an admin certificate reads the stats");

    // No client certificate: plaintext to a TLS port, and TLS without one.
    let plain = stats(&url.replace("https://", "http://"), None).await;
    assert!(plain.is_err());
    let no_cert = {
        let ca = tonic::transport::Certificate::from_pem(std::fs::read(&admin.ca).unwrap());
        let ep = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(ca))
            .unwrap();
        match ep.connect().await {
            Ok(ch) => BatchSourceClient::new(ch)
                .get_stats(StatsRequest {})
                .await
                .map(|_| ()),
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        }
    };
    let e = no_cert.expect_err("no client certificate");
    assert_ne!(e.code(), Code::PermissionDenied, "{e:?}");

    // A certificate from another CA (trusting ours for the server).
    let other = Pki::new();
    let mut foreign = other.client("admin", "admin");
    foreign.ca = admin.ca.clone();
    let e = stats(&url, Some(&foreign)).await.expect_err("another CA");
    assert_ne!(e.code(), Code::PermissionDenied, "{e:?}");

    // Expired, from our CA.
    let expired = ClientTls::mtls(pki.files(
        "expired",
        "admin",
        &Options {
            valid: Some(((2001, 1, 1), (2002, 1, 1))),
            ..loopback()
        },
    ));
    let e = stats(&url, Some(&expired)).await.expect_err("expired");
    assert_ne!(e.code(), Code::PermissionDenied, "{e:?}");

    // The server still serves the trusted.
    stats(&url, Some(&admin)).await.unwrap();
}

async fn push(sink: &mut RolloutSinkClient<AuthChannel>, group: Vec<Rollout>) -> PushAck {
    sink.push(tokio_stream::iter(group))
        .await
        .expect("push stream")
        .into_inner()
}

fn sample_req() -> SampleRequest {
    SampleRequest {
        num_groups: 1,
        timeout_ms: 10,
        allow_partial: true,
    }
}

#[tokio::test]
async fn each_role_calls_its_own_methods_only() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let blocklist = dir.path().join("blocked.txt");
    std::fs::write(&blocklist, "# none yet\n").unwrap();
    let server_tls = pki.server(Some(&blocklist));
    let cfg = BufferConfig {
        group_size: 2,
        min_group_size: 1,
        batch_groups: 1,
        ..Default::default()
    };
    let (url, _stop) = tls_buffer(cfg, server_tls.clone()).await;
    let actor = pki.client("actor-1", "actor/actor-1");
    let learner = pki.client("learner", "learner");

    let mut as_actor = BatchSourceClient::new(connect(&url, Some(&actor)).await.unwrap());
    let e = as_actor.sample(sample_req()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("role actor"), "{}", e.message());
    assert!(
        e.message().contains("/bapo.v1.BatchSource/Sample"),
        "{}",
        e.message()
    );
    let e = as_actor
        .report_version(VersionReport {
            version: 99,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("ReportVersion"), "{}", e.message());
    as_actor.get_stats(StatsRequest {}).await.unwrap();

    // The learner may not push.
    let mut learner_sink = RolloutSinkClient::new(connect(&url, Some(&learner)).await.unwrap());
    let e = learner_sink
        .push(tokio_stream::iter(common::group("g-l", 2, 0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("role learner"), "{}", e.message());
    // Nor lease room for a group.
    let lease = LeaseRequest {
        group_id: "g-a".into(),
    };
    let e = learner_sink.lease(lease.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("Lease"), "{}", e.message());

    // The actor may (its lease becomes the group it pushes), and what it
    // declares as its id is replaced by the certificate's identity.
    let mut sink = RolloutSinkClient::new(connect(&url, Some(&actor)).await.unwrap());
    assert!(sink.lease(lease).await.unwrap().into_inner().granted);
    let mut group = common::group("g-a", 2, 0);
    for r in &mut group {
        r.actor_id = "somebody-else".into();
    }
    let ack = push(&mut sink, group).await;
    assert_eq!(ack.accepted, 2, "{ack:?}");
    let mut source = BatchSourceClient::new(connect(&url, Some(&learner)).await.unwrap());
    let batch = source
        .sample(SampleRequest {
            num_groups: 1,
            timeout_ms: 5000,
            allow_partial: false,
        })
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<_> = batch.groups[0]
        .rollouts
        .iter()
        .map(|r| r.actor_id.as_str())
        .collect();
    let id = format!("spiffe://{TD}/actor/actor-1");
    assert_eq!(ids, [id.as_str(), id.as_str()]);

    // Blocked without a restart: the next call is refused, others go on.
    std::fs::write(&blocklist, format!("spiffe://{TD}/actor/actor-1\n")).unwrap();
    assert!(server_tls.reload().unwrap());
    let e = sink
        .push(tokio_stream::iter(common::group("g-b", 2, 0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("blocked"), "{}", e.message());
    source.get_stats(StatsRequest {}).await.unwrap();
}

#[tokio::test]
async fn one_actor_cannot_release_or_fill_anothers_lease() {
    let pki = Pki::new();
    let cfg = BufferConfig {
        group_size: 2,
        min_group_size: 1,
        batch_groups: 1,
        ..Default::default()
    };
    let (url, _stop) = tls_buffer(cfg, pki.server(None)).await;
    let (one, two) = (
        pki.client("actor-1", "actor/actor-1"),
        pki.client("actor-2", "actor/actor-2"),
    );
    let mut sink1 = RolloutSinkClient::new(connect(&url, Some(&one)).await.unwrap());
    let mut sink2 = RolloutSinkClient::new(connect(&url, Some(&two)).await.unwrap());
    let lease = LeaseRequest {
        group_id: "g-1".into(),
    };
    assert!(
        sink1
            .lease(lease.clone())
            .await
            .unwrap()
            .into_inner()
            .granted
    );
    for e in [
        sink2.release_lease(lease.clone()).await.unwrap_err(),
        sink2.lease(lease.clone()).await.unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let holder = format!("spiffe://{TD}/actor/actor-1");
        assert!(e.message().contains(&holder), "{}", e.message());
    }
    let ack = push(&mut sink2, common::group("g-1", 2, 0)).await;
    assert_eq!((ack.accepted, ack.rejected.len()), (0, 2), "{ack:?}");
    assert!(ack.rejected[0].reason.contains("leased by"), "{ack:?}");
    // The holder's lease is intact: its first rollout redeems it...
    let mut mine = common::group("g-1", 2, 0).into_iter();
    let ack = push(&mut sink1, mine.by_ref().take(1).collect()).await;
    assert_eq!(ack.accepted, 1, "{ack:?}");
    // ...and the group stays the holder's until complete.
    let theirs = common::group("g-1", 2, 0).split_off(1);
    let ack = push(&mut sink2, theirs).await;
    assert_eq!((ack.accepted, ack.rejected.len()), (0, 1), "{ack:?}");
    assert!(ack.rejected[0].reason.contains("leased by"), "{ack:?}");
    let ack = push(&mut sink1, mine.collect()).await;
    assert_eq!(ack.accepted, 1, "{ack:?}");
}

#[tokio::test]
async fn a_long_lived_client_follows_its_renewed_certificate() {
    let pki = Pki::new();
    let (url, _stop) = tls_buffer(
        BufferConfig {
            group_size: 2,
            min_group_size: 1,
            ..Default::default()
        },
        pki.server(None),
    )
    .await;
    // Issued as an admin first: it may read stats, not push.
    let files = pki.files("renewed", "admin/ops", &loopback());
    let channel = tls::connector(
        &url.replace("https://", "http://"),
        Some(&ClientTls::mtls(files.clone())),
    )
    .unwrap()
    .reload_every(Duration::ZERO)
    .connect_lazy();
    let mut sink = RolloutSinkClient::new(channel);
    let e = sink
        .push(tokio_stream::iter(common::group("g-0", 2, 0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    // The files are rewritten in place (as Kubernetes does with a renewed
    // Secret); the same client's next call uses the new certificate.
    let renewed = pki.ca.issue("actor/renewed", &loopback()).unwrap();
    std::fs::write(&files.cert, &renewed.cert_pem).unwrap();
    std::fs::write(&files.key, &renewed.key_pem).unwrap();
    let ack = push(&mut sink, common::group("g-1", 2, 0)).await;
    assert_eq!(ack.accepted, 2, "{ack:?}");

    // A half-written file keeps the settings that work.
    std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\n").unwrap();
    let ack = push(&mut sink, common::group("g-2", 2, 0)).await;
    assert_eq!(ack.accepted, 2, "{ack:?}");
}

use bapo_policy::testing::tiny_policy as tiny;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_without_breaking_a_weight_stream() {
    let pki = Pki::new();
    let files = pki.files("learner-srv", "learner", &loopback());
    let server_tls = ServerTls::load(ServerFiles::mtls(files.clone())).unwrap();
    let hub = WeightHub::new();
    let p = tiny(3);
    hub.publish(&p.model, &p.config, 1).unwrap();
    let (url, _stop) = tls_learner(hub.clone(), server_tls.clone()).await;
    let actor = pki.client("actor-0", "actor/actor-0");

    // Only actors may subscribe.
    let learner = pki.client("learner", "learner");
    let e = WeightSourceClient::new(connect(&url, Some(&learner)).await.unwrap())
        .subscribe(SubscribeRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    let mut stream = WeightSourceClient::new(connect(&url, Some(&actor)).await.unwrap())
        .max_decoding_message_size(64 << 20)
        .subscribe(SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first_version = |m: bapo_proto::v1::WeightMessage| match m.kind {
        Some(bapo_proto::v1::weight_message::Kind::Update(u)) => Some(u.version),
        _ => None,
    };
    let m = stream.message().await.unwrap().unwrap();
    assert_eq!(first_version(m), Some(1));

    // The rotated certificate names a host the old one did not.
    let renamed = ClientTls {
        server_name: Some("rotated.bapo.test".into()),
        ..actor.clone()
    };
    assert!(connect(&url, Some(&renamed)).await.is_err());
    let rotated = pki.ca.issue(
        "learner",
        &Options {
            hosts: vec!["rotated.bapo.test".into(), "127.0.0.1".into()],
            valid: None,
        },
    );
    let rotated = rotated.unwrap();
    std::fs::write(&files.cert, &rotated.cert_pem).unwrap();
    std::fs::write(&files.key, &rotated.key_pem).unwrap();
    assert!(server_tls.reload().unwrap());
    connect(&url, Some(&renamed))
        .await
        .expect("new connections get the rotated certificate");

    // The stream opened before the rotation still carries new versions.
    hub.publish(&p.model, &p.config, 2).unwrap();
    let mut got = None;
    while let Some(m) = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .unwrap()
        .unwrap()
    {
        if let Some(v) = first_version(m) {
            got = Some(v);
            break;
        }
    }
    assert_eq!(got, Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_loop_runs_over_mutual_tls() {
    let pki = Pki::new();
    let (buffer_url, _stop_buffer) = tls_buffer(
        BufferConfig {
            group_size: 4,
            batch_groups: 2,
            max_staleness: 2,
            ..Default::default()
        },
        pki.server(None),
    )
    .await;
    let hub = WeightHub::new();
    let learner_files = pki.files("learner", "learner", &loopback());
    let learner_tls = ClientTls::mtls(learner_files.clone());
    let learner_server =
        ServerTls::load(ServerFiles::mtls(learner_files)).expect("one certificate both ways");
    let (learner_url, _stop_learner) = tls_learner(hub.clone(), learner_server).await;
    let out = tempfile::tempdir().unwrap();
    let trainer = Trainer::new(
        LearnerConfig {
            batch_groups: 2,
            steps: 2,
            lr: 1e-3,
            eval_every: 0,
            checkpoint_every: 0,
            ..Default::default()
        },
        tiny(1),
        0,
    )
    .unwrap();
    let learner = tokio::spawn(bapo_learner::run::run(
        trainer,
        hub.clone(),
        RunOptions {
            buffer: buffer_url.clone(),
            tls: Some(learner_tls.clone()),
            out: out.path().to_path_buf(),
            provenance: Default::default(),
            eval: None,
            decode: None,
            params: serde_json::Value::Null,
            export_final: false,
        },
        std::future::pending(),
    ));
    let (stop_actor, rx) = oneshot::channel::<()>();
    let actor = tokio::spawn(bapo_actor::run(
        common::actor_config(4),
        Arc::from(bapo_tasks::build(&TaskSpec::default()).unwrap()),
        Arc::new(TextTokenizer::char_level()),
        ActorOptions {
            buffer: buffer_url.clone(),
            learner: learner_url,
            actor_id: "declared".into(),
            device: Device::flex(),
            precision: Default::default(),
            tls: Some(pki.client("actor-0", "actor/actor-0")),
            reward: Default::default(),
            model_dir: None,
            chat: None,
        },
        async {
            let _ = rx.await;
        },
    ));
    let summary = tokio::time::timeout(Duration::from_secs(120), learner)
        .await
        .expect("the learner finishes its steps over mTLS")
        .unwrap()
        .unwrap();
    assert_eq!((summary.steps, summary.version), (2, 2));
    let admin = pki.client("admin", "admin");
    let mut source = BatchSourceClient::new(connect(&buffer_url, Some(&admin)).await.unwrap());
    let s = source
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.learner_version, 2);
    assert_eq!(s.rollouts_rejected, 0, "{s:?}");
    stop_actor.send(()).unwrap();
    let a = tokio::time::timeout(Duration::from_secs(30), actor)
        .await
        .expect("the actor stops")
        .unwrap()
        .unwrap();
    assert!(a.groups >= 4, "{a:?}");
}

// ---------------------------------------------------------------------------
// Bearer tokens

const ACTOR_TOKEN: &str = "actor-token-0123456789abcdef";
const LEARNER_TOKEN: &str = "learner-token-0123456789abcdef";
const ADMIN_TOKEN: &str = "admin-token-0123456789abcdef";

/// A token file holding `text`, in `dir`.
fn token_file(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A client that authenticates with the `role` token of `file` only.
fn token_client(pki: &Pki, file: &Path, role: Role) -> ClientTls {
    let ca = pki.files("ca-holder", "admin", &loopback()).ca;
    ClientTls {
        ca,
        identity: None,
        token: Some(ClientToken {
            file: file.to_path_buf(),
            role,
        }),
        server_name: None,
    }
}

/// A buffer's server files: its certificate, `tokens`, and a client CA
/// only when `certs_too`.
fn token_server(pki: &Pki, tokens: &Path, certs_too: bool) -> Arc<ServerTls> {
    let files = pki.files("server", "buffer", &loopback());
    ServerTls::load(ServerFiles {
        client_ca: certs_too.then_some(files.ca.clone()),
        tokens: Some(tokens.to_path_buf()),
        ..ServerFiles::mtls(files)
    })
    .unwrap()
}

#[tokio::test]
async fn bearer_tokens_authenticate_a_role_and_only_that_role() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_file(
        dir.path(),
        "server-tokens",
        &format!("actor {ACTOR_TOKEN}\nlearner {LEARNER_TOKEN}\nadmin {ADMIN_TOKEN}\n"),
    );
    let server_tls = token_server(&pki, &tokens, false);
    let cfg = BufferConfig {
        group_size: 2,
        min_group_size: 1,
        batch_groups: 1,
        ..Default::default()
    };
    let (url, _stop) = tls_buffer(cfg, server_tls.clone()).await;

    stats(&url, Some(&token_client(&pki, &tokens, Role::Admin)))
        .await
        .expect("the admin token reads the stats");

    // A wrong token, and none at all (TLS only, no certificate either).
    let wrong = token_file(dir.path(), "wrong", "admin not-the-admin-token-at-all\n");
    let e = stats(&url, Some(&token_client(&pki, &wrong, Role::Admin)))
        .await
        .expect_err("a wrong token");
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let none = {
        let ca = std::fs::read(token_client(&pki, &tokens, Role::Admin).ca).unwrap();
        let ep = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
            )
            .unwrap();
        BatchSourceClient::new(ep.connect().await.unwrap())
            .get_stats(StatsRequest {})
            .await
            .unwrap_err()
    };
    assert_eq!(none.code(), Code::Unauthenticated, "{none:?}");
    assert!(
        none.message().contains("bearer token"),
        "{}",
        none.message()
    );

    // The actor token pushes (its identity recorded) and may not sample.
    let actor = token_client(&pki, &tokens, Role::Actor);
    let mut as_actor = BatchSourceClient::new(connect(&url, Some(&actor)).await.unwrap());
    let e = as_actor.sample(sample_req()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("role actor"), "{}", e.message());
    let mut sink = RolloutSinkClient::new(connect(&url, Some(&actor)).await.unwrap());
    let ack = push(&mut sink, common::group("g-t", 2, 0)).await;
    assert_eq!(ack.accepted, 2, "{ack:?}");
    let learner = token_client(&pki, &tokens, Role::Learner);
    let mut source = BatchSourceClient::new(connect(&url, Some(&learner)).await.unwrap());
    let batch = source.sample(sample_req()).await.unwrap().into_inner();
    assert_eq!(batch.groups[0].rollouts[0].actor_id, "token:actor");

    // A rotated token file: the old actor token is refused on the next
    // call of the same connection, the new one accepted.
    let new_actor = "actor-token-rotated-0123456789";
    std::fs::write(
        &tokens,
        format!("actor {new_actor}\nlearner {LEARNER_TOKEN}\nadmin {ADMIN_TOKEN}\n"),
    )
    .unwrap();
    assert!(server_tls.reload().unwrap());
    let e = sink
        .push(tokio_stream::iter(common::group("g-old", 2, 0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let rotated = token_file(dir.path(), "actor-tokens", &format!("actor {new_actor}\n"));
    let mut sink = RolloutSinkClient::new(
        connect(&url, Some(&token_client(&pki, &rotated, Role::Actor)))
            .await
            .unwrap(),
    );
    let ack = push(&mut sink, common::group("g-new", 2, 0)).await;
    assert_eq!(ack.accepted, 2, "{ack:?}");
}

#[tokio::test]
async fn a_server_taking_tokens_and_certificates_still_checks_certificates() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_file(dir.path(), "tokens", &format!("admin {ADMIN_TOKEN}\n"));
    let (url, _stop) = tls_buffer(BufferConfig::default(), token_server(&pki, &tokens, true)).await;
    stats(&url, Some(&pki.client("admin", "admin")))
        .await
        .expect("a certificate");
    stats(&url, Some(&token_client(&pki, &tokens, Role::Admin)))
        .await
        .expect("a token");
    let other = Pki::new();
    let mut foreign = other.client("admin", "admin");
    foreign.ca = pki.client("admin2", "admin").ca;
    let e = stats(&url, Some(&foreign)).await.expect_err("another CA");
    assert_ne!(e.code(), Code::PermissionDenied, "{e:?}");
}
