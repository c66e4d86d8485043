//! Handing finished groups to the buffer. A group is re-sent until the
//! buffer acknowledges it: rollout ids make re-sending idempotent, so a
//! buffer that crashed mid-push (or restarted from its log) costs nothing
//! that was finished. While the buffer holds a push back (backpressure), the
//! generation slot that made the group waits instead of making more stale
//! data.

use std::time::{Duration, Instant};

use bapo_proto::tls::AuthChannel;
use bapo_proto::v1::{PushAck, Rollout, rollout_sink_client::RolloutSinkClient};
use metrics::{counter, histogram};
use tokio::sync::watch;

use crate::{backoff::Backoff, metrics as names};

#[derive(Debug, thiserror::Error)]
#[error("group {group_id} not pushed: {reason}")]
pub struct PushError {
    pub group_id: String,
    pub reason: String,
}

/// Pushes one group, retrying until acknowledged or `abort` is set.
pub async fn push_group(
    client: &mut RolloutSinkClient<AuthChannel>,
    rollouts: &[Rollout],
    abort: &mut watch::Receiver<bool>,
) -> Result<PushAck, PushError> {
    let group_id = rollouts
        .first()
        .map(|r| r.group_id.clone())
        .unwrap_or_default();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let started = Instant::now();
    loop {
        let attempt = client.push(tokio_stream::iter(rollouts.to_vec()));
        let result = tokio::select! {
            r = attempt => r,
            _ = abort.wait_for(|a| *a) => return Err(PushError { group_id, reason: "aborted at shutdown".into() }),
        };
        match result {
            Ok(ack) => {
                let ack = ack.into_inner();
                histogram!(names::BACKPRESSURE_SECONDS).record(started.elapsed().as_secs_f64());
                for r in &ack.rejected {
                    tracing::warn!(rollout = %r.rollout_id, code = r.code, "buffer refused a rollout: {}", r.reason);
                }
                return Ok(ack);
            }
            Err(status) => {
                counter!(names::RECONNECTS, "peer" => "buffer").increment(1);
                let delay = backoff.next_delay();
                tracing::warn!(group = %group_id, "push failed ({}: {}); retrying in {delay:?}", status.code(), status.message());
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = abort.wait_for(|a| *a) => return Err(PushError { group_id, reason: format!("aborted at shutdown after {}", status.message()) }),
                }
            }
        }
    }
}
