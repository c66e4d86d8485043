//! An OpenEnv server, spoken to over its stateful WebSocket protocol
//! (openenv-core 0.3; `openenv` 0.10 adds keys, which are ignored).
//!
//! One connection is one episode: `{"type":"reset","data":{"seed":S}}`,
//! then `{"type":"step","data":ACTION}` per turn, `{"type":"close"}` at the
//! end; each request gets one reply, `observation` (`{"observation":{..},
//! "reward":R,"done":D}`) or `error` (`{"message","code"}`). The server's
//! HTTP reset/step are stateless and cannot carry an episode. A task per
//! connection keeps reading the socket while the model generates, so the
//! server's keepalive pings are answered. The server allows
//! `max_concurrent_envs` sessions (default 1) and answers one more with
//! `CAPACITY_REACHED` after the handshake: retried with backoff. OpenEnv
//! steps are not idempotent, so a step whose request went out is never
//! retried; its episode is dropped instead.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_tungstenite::tungstenite::{
    Error as WsError, Message as Frame, protocol::WebSocketConfig,
};

use super::{
    EnvError, EnvInfo, Environment, Message, Observation, ResetInput, Started, StepOutcome, Turn,
    config::OpenEnvConfig,
};
use crate::{http::Http, reward::BoxFuture};

/// Largest HTTP answer read (`/health`, `/schema`, `/metadata`).
const MAX_HTTP_BYTES: usize = 1 << 20;

type Reply = oneshot::Sender<Result<Value, EnvError>>;

/// One open episode: the connection task's request queue and the pool
/// permit it holds.
struct Session {
    requests: mpsc::Sender<(String, Option<Reply>)>,
    _permit: OwnedSemaphorePermit,
}

impl Session {
    /// Asks the server to end the episode; no reply comes (the server
    /// closes the socket), and the permit goes with `self`.
    async fn close(self) {
        let _ = self
            .requests
            .send((json!({"type": "close"}).to_string(), None))
            .await;
    }
}

pub struct OpenEnv {
    base: String,
    http: Http,
    cfg: OpenEnvConfig,
    sessions: Mutex<HashMap<String, Session>>,
    pool: Arc<Semaphore>,
    next: AtomicU64,
}

fn error(reason: &'static str, message: impl Into<String>, retryable: bool) -> EnvError {
    EnvError::new(reason, message, retryable)
}

impl OpenEnv {
    /// A client of the server at `base` (`http://host:port`), once `/health`
    /// answers and `/schema` accepts the configured action.
    pub async fn connect(
        base: &str,
        cfg: &OpenEnvConfig,
        timeout: Duration,
    ) -> Result<Self, EnvError> {
        let env = Self {
            base: base.trim_end_matches('/').to_string(),
            http: Http::new(MAX_HTTP_BYTES),
            cfg: cfg.clone(),
            sessions: Mutex::new(HashMap::new()),
            pool: Arc::new(Semaphore::new(cfg.max_sessions)),
            next: AtomicU64::new(0),
        };
        let (status, body) = env.get("/health", timeout).await?;
        if status != 200 {
            return Err(error(
                "unavailable",
                format!("/health: HTTP {status}: {body}"),
                true,
            ));
        }
        let (status, schema) = env.get("/schema", timeout).await?;
        if status != 200 {
            return Err(error("refused", format!("/schema: HTTP {status}"), false));
        }
        let schema: Value = serde_json::from_str(&schema)
            .map_err(|e| error("garbage", format!("/schema is not JSON: {e}"), false))?;
        check_action(&action(&cfg.action, "x")?, &schema["action"])?;
        Ok(env)
    }

    async fn get(&self, route: &str, timeout: Duration) -> Result<(u16, String), EnvError> {
        let url = format!("{}{route}", self.base);
        self.http
            .exchange("GET", &url, None, timeout)
            .await
            .map_err(|why| error("unavailable", format!("{url}: {why}"), true))
    }

    /// Sends `frame` on episode `id`'s connection and waits for the reply.
    async fn request(&self, id: &str, frame: Value) -> Result<Value, EnvError> {
        let tx = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .map(|s| s.requests.clone())
            .ok_or_else(|| error("not_found", format!("no open episode {id:?}"), false))?;
        ask(&tx, frame).await
    }
}

/// Sends `frame` down a connection task's queue and waits for its reply.
async fn ask(tx: &mpsc::Sender<(String, Option<Reply>)>, frame: Value) -> Result<Value, EnvError> {
    let (reply, answer) = oneshot::channel();
    tx.send((frame.to_string(), Some(reply)))
        .await
        .map_err(|_| error("unavailable", "the connection is closed", false))?;
    answer
        .await
        .map_err(|_| error("unavailable", "the connection closed", false))?
}

/// The action of a turn: `template` with every `{text}` in its strings
/// replaced by `text` (escaped as JSON, since it is substituted into
/// parsed strings).
pub fn action(template: &str, text: &str) -> Result<Value, EnvError> {
    fn fill(v: &mut Value, text: &str) {
        match v {
            Value::String(s) => *s = s.replace("{text}", text),
            Value::Array(a) => a.iter_mut().for_each(|x| fill(x, text)),
            Value::Object(o) => o.values_mut().for_each(|x| fill(x, text)),
            _ => {}
        }
    }
    let mut v: Value = serde_json::from_str(template)
        .map_err(|e| error("refused", format!("actor.env.openenv.action: {e}"), false))?;
    fill(&mut v, text);
    Ok(v)
}

/// Refuses an action the server's schema would: a key it does not know
/// (its schemas forbid extra keys) or a required key missing.
pub fn check_action(action: &Value, schema: &Value) -> Result<(), EnvError> {
    let bad = |why: String| error("refused", format!("actor.env.openenv.action: {why}"), false);
    let keys = action
        .as_object()
        .ok_or_else(|| bad("not an object".into()))?;
    let props = schema["properties"].as_object();
    if let Some(props) = props
        && let Some(k) = keys.keys().find(|k| !props.contains_key(*k))
    {
        let known: Vec<&String> = props.keys().collect();
        return Err(bad(format!(
            "key {k:?} is not in the server's action schema {known:?}"
        )));
    }
    for r in schema["required"].as_array().into_iter().flatten() {
        if let Some(r) = r.as_str()
            && !keys.contains_key(r)
        {
            return Err(bad(format!("the server's action schema requires {r:?}")));
        }
    }
    Ok(())
}

/// A reply frame's observation, reward and done flag; an `error` frame as
/// an error (`CAPACITY_REACHED` retryable).
pub fn outcome(frame: &Value, field: &str) -> Result<StepOutcome, EnvError> {
    match frame["type"].as_str() {
        Some("observation") => {}
        Some("error") => {
            let code = frame["data"]["code"].as_str().unwrap_or("?");
            let message = frame["data"]["message"].as_str().unwrap_or("");
            let (reason, retryable) = match code {
                "CAPACITY_REACHED" => ("capacity", true),
                "VALIDATION_ERROR" | "UNKNOWN_TYPE" | "INVALID_JSON" => ("refused", false),
                _ => ("error", false),
            };
            return Err(error(reason, format!("{code}: {message}"), retryable));
        }
        other => {
            return Err(error(
                "garbage",
                format!("a reply of type {other:?}"),
                false,
            ));
        }
    }
    let data = &frame["data"];
    // OpenEnv passes the environment's reward through as it is.
    let reward = match &data["reward"] {
        Value::Null => 0.0,
        Value::Bool(b) => f32::from(u8::from(*b)),
        Value::Number(n) => n.as_f64().unwrap_or(f64::NAN) as f32,
        other => return Err(error("garbage", format!("reward {other}"), false)),
    };
    let done = data["done"].as_bool().unwrap_or(false);
    let mut text = &data["observation"];
    for part in field.split('.') {
        text = &text[part];
    }
    let observation = match text {
        Value::String(s) => Some(Observation::Messages(vec![Message::new("user", s.clone())])),
        Value::Null if done => None,
        other => {
            return Err(error(
                "garbage",
                format!("observation field {field:?} is {other}, not text"),
                false,
            ));
        }
    };
    Ok(StepOutcome {
        observation,
        reward,
        done,
        ..Default::default()
    })
}

/// Owns one connection: writes requests, reads every frame (answering the
/// server's pings meanwhile) and hands each reply to its request.
async fn drive<S>(
    ws: tokio_tungstenite::WebSocketStream<S>,
    mut requests: mpsc::Receiver<(String, Option<Reply>)>,
    max_frame: usize,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut sink, mut stream) = ws.split();
    let mut pending: Option<Reply> = None;
    // A frame that came unasked (a capacity error right after the
    // handshake) answers the next request.
    let mut early: Option<Value> = None;
    loop {
        tokio::select! {
            req = requests.recv() => {
                let Some((frame, reply)) = req else { break };
                if let Some(v) = early.take() {
                    if let Some(r) = reply { let _ = r.send(Ok(v)); }
                    continue;
                }
                if let Err(e) = sink.send(Frame::text(frame)).await {
                    if let Some(r) = reply {
                        let _ = r.send(Err(error("unavailable", format!("send: {e}"), false)));
                    }
                    break;
                }
                pending = reply;
            }
            frame = stream.next() => match frame {
                Some(Ok(Frame::Text(t))) => {
                    let v = serde_json::from_str(t.as_str()).map_err(|e| {
                        error("garbage", format!("a frame that is not JSON: {e}"), false)
                    });
                    match pending.take() {
                        Some(r) => { let _ = r.send(v); }
                        None => early = v.ok(),
                    }
                }
                Some(Ok(_)) => {} // pings are answered by the read itself
                Some(Err(e)) => {
                    let e = match e {
                        WsError::Capacity(e) => error(
                            "garbage",
                            format!("{e}: over actor.env.openenv.max_frame_bytes = {max_frame}"),
                            false,
                        ),
                        e => error("unavailable", format!("read: {e}"), false),
                    };
                    if let Some(r) = pending.take() {
                        let _ = r.send(Err(e));
                    }
                    break;
                }
                None => {
                    let closed = || error("unavailable", "the server closed the connection", false);
                    if let Some(r) = pending.take() {
                        let _ = r.send(Err(closed()));
                    } else if let Some(v) = early.take()
                        && let Some((_, Some(r))) = requests.recv().await
                    {
                        // The server's last word (a refusal) answers the
                        // request that was on its way.
                        let _ = r.send(Ok(v));
                    }
                    break;
                }
            },
        }
    }
    let _ = sink.close().await;
}

impl Environment for OpenEnv {
    fn describe(&self) -> BoxFuture<'_, Result<EnvInfo, EnvError>> {
        Box::pin(async move {
            let name = match self.get("/metadata", Duration::from_secs(10)).await {
                Ok((200, body)) => serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v["name"].as_str().map(str::to_string)),
                _ => None,
            };
            Ok(EnvInfo {
                name: format!("openenv:{}", name.unwrap_or_else(|| "?".into())),
                max_turns: 0,
                min_reward: self.cfg.min_reward,
                max_reward: self.cfg.max_reward,
            })
        })
    }

    fn reset<'a>(&'a self, input: ResetInput<'a>) -> BoxFuture<'a, Result<Started, EnvError>> {
        Box::pin(async move {
            let permit = self.pool.clone().try_acquire_owned().map_err(|_| {
                error(
                    "capacity",
                    "actor.env.openenv.max_sessions episodes open",
                    true,
                )
            })?;
            let url = format!("ws{}/ws", self.base.trim_start_matches("http"));
            let config = WebSocketConfig::default()
                .max_frame_size(Some(self.cfg.max_frame_bytes))
                .max_message_size(Some(self.cfg.max_frame_bytes));
            let (ws, _) =
                tokio_tungstenite::connect_async_with_config(url.as_str(), Some(config), true)
                    .await
                    .map_err(|e| error("unavailable", format!("{url}: {e}"), true))?;
            let (tx, rx) = mpsc::channel(1);
            tokio::spawn(drive(ws, rx, self.cfg.max_frame_bytes));
            // The session joins the table only once its reset answered: a
            // reset abandoned by a timeout drops `tx` and the permit here,
            // which ends the connection task, closes the socket and frees
            // the server's session and this actor's slot.
            let session = Session {
                requests: tx,
                _permit: permit,
            };
            let frame = json!({"type": "reset", "data": {"seed": input.seed % (1 << 31)}});
            let first = ask(&session.requests, frame)
                .await
                .and_then(|reply| outcome(&reply, &self.cfg.observation_field))
                .and_then(|o| {
                    o.observation
                        .ok_or_else(|| error("garbage", "reset answered no observation", false))
                });
            match first {
                Ok(observation) => {
                    let id = format!("openenv-{}", self.next.fetch_add(1, Ordering::Relaxed));
                    self.sessions
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id.clone(), session);
                    Ok(Started {
                        episode_id: id,
                        observation,
                    })
                }
                Err(mut e) => {
                    session.close().await;
                    // A refused session (capacity) is worth another try.
                    e.retryable |= e.reason == "capacity" || e.reason == "unavailable";
                    Err(e)
                }
            }
        })
    }

    fn step<'a>(
        &'a self,
        episode_id: &'a str,
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        Box::pin(async move {
            let data = action(&self.cfg.action, turn.text)?;
            let reply = self
                .request(episode_id, json!({"type": "step", "data": data}))
                .await?;
            outcome(&reply, &self.cfg.observation_field)
        })
    }

    fn steps_retryable(&self) -> bool {
        false
    }

    fn close<'a>(&'a self, episode_id: &'a str) -> BoxFuture<'a, ()> {
        let session = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(episode_id);
        Box::pin(async move {
            if let Some(s) = session {
                s.close().await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WebSocket server on a real socket that answers the first frame
    /// with a text frame of `bytes` bytes.
    async fn oversized_answer(bytes: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
            let _ = ws.next().await;
            let _ = ws.send(Frame::text("x".repeat(bytes))).await;
            let _ = ws.next().await;
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn a_frame_over_the_bound_is_refused_by_name() {
        let cfg = OpenEnvConfig {
            max_frame_bytes: 4096,
            ..Default::default()
        };
        let env = OpenEnv {
            base: oversized_answer(64 << 10).await,
            http: Http::new(MAX_HTTP_BYTES),
            cfg,
            sessions: Mutex::new(HashMap::new()),
            pool: Arc::new(Semaphore::new(1)),
            next: AtomicU64::new(0),
        };
        let p = bapo_tasks::Problem {
            id: "p".into(),
            prompt: String::new(),
            answer: String::new(),
            solution: String::new(),
        };
        let input = ResetInput {
            task: "t",
            problem: &p,
            seed: 1,
        };
        let e = env.reset(input).await.unwrap_err();
        assert_eq!(e.reason, "garbage", "{e}");
        assert!(e.message.contains("max_frame_bytes = 4096"), "{e}");
    }

    #[test]
    fn the_action_carries_the_turn_text_escaped() {
        let a = action(r#"{"message": "{text}", "n": 1}"#, "say \"hi\"\n").unwrap();
        assert_eq!(a, json!({"message": "say \"hi\"\n", "n": 1}));
        let schema =
            json!({"properties": {"message": {}, "metadata": {}}, "required": ["message"]});
        assert!(
            check_action(&a, &schema)
                .unwrap_err()
                .message
                .contains("\"n\"")
        );
        let a = action(r#"{"msg": "{text}"}"#, "x").unwrap();
        assert!(check_action(&a, &json!({"required": ["message"]})).is_err());
        assert!(check_action(&json!({"message": "x"}), &schema).is_ok());
    }

    #[test]
    fn replies_are_read_as_the_protocol_writes_them() {
        let obs = json!({"type": "observation", "data": {
            "observation": {"text": "What is 2+2?", "attempt": 0}, "reward": null, "done": false}});
        let o = outcome(&obs, "text").unwrap();
        assert_eq!(o.reward, 0.0);
        assert_eq!(
            o.observation,
            Some(Observation::Messages(vec![Message::new(
                "user",
                "What is 2+2?"
            )]))
        );
        let done = json!({"type": "observation", "data": {
            "observation": {"text": "Correct!"}, "reward": true, "done": true}});
        assert_eq!(outcome(&done, "text").unwrap().reward, 1.0);
        let full = json!({"type": "error", "data": {"code": "CAPACITY_REACHED", "message": "1/1"}});
        let e = outcome(&full, "text").unwrap_err();
        assert_eq!((e.reason, e.retryable), ("capacity", true));
        let nested = json!({"type": "observation", "data": {
            "observation": {"chat": {"last": "hi"}}, "done": false}});
        assert!(outcome(&nested, "chat.last").unwrap().observation.is_some());
        assert_eq!(outcome(&nested, "text").unwrap_err().reason, "garbage");
    }
}
