//! The Redis Streams reference for `bapo bench buffer`: the same payload,
//! XADD pipelined per group from the same number of producers, one
//! consumer-group reader doing XREADGROUP + XACK (and XDEL, so memory stays
//! bounded like the buffer's consume-once mode).

use std::{
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use redis::{AsyncCommands, aio::MultiplexedConnection, streams::StreamReadReply};
use tokio::process::{Child, Command};

use super::{
    latency::Latencies,
    workload::{Payload, Phase, Workload},
};

const STREAM: &str = "bapo:rollouts";
const GROUP: &str = "learner";

/// A private redis-server on a free loopback port, killed on drop.
pub struct RedisServer {
    _child: Child,
    url: String,
}

impl RedisServer {
    /// `None` when the binary is not installed.
    pub async fn start(bin: &Path) -> anyhow::Result<Option<Self>> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = match Command::new(bin)
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
        {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("starting {}", bin.display())),
        };
        let server = Self {
            _child: child,
            url: format!("redis://127.0.0.1:{port}/"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = server.connect().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok()
            {
                return Ok(Some(server));
            }
            if Instant::now() > deadline {
                bail!("redis-server did not answer PING within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn connect(&self) -> anyhow::Result<MultiplexedConnection> {
        connect(&self.url).await
    }
}

async fn connect(url: &str) -> anyhow::Result<MultiplexedConnection> {
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?)
}

fn le_bytes<T: Copy>(v: &[T], f: impl Fn(T) -> [u8; 4]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

async fn producer(
    url: String,
    id: usize,
    tokens: usize,
    k: u32,
    deadline: Instant,
) -> anyhow::Result<(u64, Latencies)> {
    let mut con = connect(&url).await?;
    let p = Payload::new(tokens, id as u64);
    let tok = le_bytes(&p.tokens, u32::to_le_bytes);
    let lps = le_bytes(&p.logprobs, f32::to_le_bytes);
    let prompt = le_bytes(&p.prompt, u32::to_le_bytes);
    let mut lat = Latencies::new();
    let mut sent = 0;
    let mut g = 0u64;
    while Instant::now() < deadline {
        let versions = vec![0u8; tokens * 4];
        let group = format!("p{id}-g{g}");
        let mut pipe = redis::pipe();
        for i in 0..k {
            pipe.cmd("XADD")
                .arg(STREAM)
                .arg("*")
                .arg("group")
                .arg(&group)
                .arg("id")
                .arg(format!("{group}-{i}"))
                .arg("prompt")
                .arg(&prompt)
                .arg("tokens")
                .arg(&tok)
                .arg("logprobs")
                .arg(&lps)
                .arg("versions")
                .arg(&versions)
                .arg("reward")
                .arg((i % 2) as f32)
                .ignore();
        }
        let t0 = Instant::now();
        pipe.query_async::<()>(&mut con).await?;
        lat.record(t0.elapsed());
        sent += k as u64;
        g += 1;
    }
    Ok((sent, lat))
}

async fn consumer(server: &RedisServer, count: usize, deadline: Instant) -> anyhow::Result<u64> {
    let mut con = server.connect().await?;
    let mut consumed = 0;
    while Instant::now() < deadline {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("c0")
            .arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(50)
            .arg("STREAMS")
            .arg(STREAM)
            .arg(">")
            .query_async(&mut con)
            .await?;
        let ids: Vec<String> = reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .map(|e| e.id)
            .collect();
        if ids.is_empty() {
            continue;
        }
        consumed += ids.len() as u64;
        let _: u64 = con.xack(STREAM, GROUP, &ids).await?;
        let _: u64 = con.xdel(STREAM, &ids).await?;
    }
    Ok(consumed)
}

/// Peak phase against Redis with the bench's producer count and payload.
pub async fn run(server: &RedisServer, args: &Workload) -> anyhow::Result<Phase> {
    let mut con = server.connect().await?;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(STREAM)
        .arg(GROUP)
        .arg("$")
        .arg("MKSTREAM")
        .query_async(&mut con)
        .await
        .context("creating the Redis consumer group")?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.seconds);
    let batch = (args.batch_groups * args.group_size) as usize;
    let producers: Vec<_> = (0..args.pushers)
        .map(|id| {
            tokio::spawn(producer(
                server.url.clone(),
                id,
                args.tokens,
                args.group_size,
                deadline,
            ))
        })
        .collect();
    let consumed = consumer(server, batch, deadline).await;
    let mut acks = Latencies::new();
    let mut rollouts = 0;
    for p in producers {
        let (n, lat) = p.await??;
        rollouts += n;
        acks.merge(&lat);
    }
    Ok(Phase {
        rollouts,
        seconds: start.elapsed().as_secs_f64(),
        acks,
        consumed_rollouts: consumed?,
    })
}
