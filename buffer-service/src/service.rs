//! gRPC services over the core: decode, call [`Buffer`], encode. No policy
//! lives here.

use std::{pin::Pin, time::Duration, time::Instant};

use bapo_proto::{
    deadline,
    v1::{
        self, Batch, LeaseReply, LeaseRequest, PushAck, ReleaseReply, SampleRequest, StatsRequest,
        VersionAck, VersionReport, batch_source_server::BatchSource,
        rollout_sink_server::RolloutSink,
    },
};
use futures::Stream;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use crate::{
    Buffer, BufferError, LearnerReport, PushOutcome,
    eviction::EvictReason,
    group::SampledGroup,
    lease::{Grant, LeaseAnswer},
    metrics as m, wire,
};

impl From<BufferError> for Status {
    fn from(e: BufferError) -> Self {
        match e {
            BufferError::Closing => Status::unavailable(e.to_string()),
            BufferError::NotEnough { .. } => Status::deadline_exceeded(e.to_string()),
            BufferError::InvalidRequest(_) => Status::invalid_argument(e.to_string()),
            BufferError::Superseded(_) | BufferError::AlreadyPushed(_) => {
                Status::failed_precondition(e.to_string())
            }
            BufferError::NotHolder(_) => Status::permission_denied(e.to_string()),
            BufferError::Wal(e) => Status::internal(format!("{e}; the data is not durable, retry")),
        }
    }
}

/// What actors call.
pub struct RolloutSinkService {
    buffer: Buffer,
}

impl RolloutSinkService {
    pub fn new(buffer: Buffer) -> Self {
        Self { buffer }
    }
}

#[tonic::async_trait]
impl RolloutSink for RolloutSinkService {
    async fn push(
        &self,
        req: Request<Streaming<v1::Rollout>>,
    ) -> Result<Response<PushAck>, Status> {
        // Under mutual TLS the sender is who its certificate says, whatever
        // the rollouts declare: each one records the verified identity.
        let verified = bapo_proto::tls::peer(&req).map(|p| p.id.clone());
        let mut stream = req.into_inner();
        let mut ack = PushAck::default();
        let mut start = None;
        // A transport error ends the stream; what was accepted before it
        // stays accepted, and a re-sent stream is deduplicated.
        while let Some(mut msg) = stream.message().await? {
            start.get_or_insert_with(Instant::now);
            if let Some(id) = &verified {
                msg.actor_id.clone_from(id);
            }
            let len = msg.encoded_len();
            let outcome = match wire::rollout_from_wire(msg) {
                Ok(r) => self.buffer.push(r, len).await?,
                Err(rejection) => self.buffer.refuse(rejection),
            };
            match outcome {
                PushOutcome::Accepted => ack.accepted += 1,
                PushOutcome::Duplicate => ack.duplicates += 1,
                PushOutcome::Rejected(r) => ack.rejected.push(v1::Rejection {
                    rollout_id: r.rollout_id,
                    group_id: r.group_id,
                    code: r.code.grpc_code(),
                    reason: r.reason,
                }),
            }
        }
        self.buffer.sync().await?;
        ack.learner_version = self.buffer.learner_version();
        if let Some(start) = start {
            metrics::histogram!(m::PUSH_SECONDS).record(start.elapsed().as_secs_f64());
        }
        Ok(Response::new(ack))
    }

    async fn lease(&self, req: Request<LeaseRequest>) -> Result<Response<LeaseReply>, Status> {
        // Answer within the caller's deadline, so "not granted" arrives
        // instead of DEADLINE_EXCEEDED.
        let caller = deadline::grpc_timeout(req.metadata());
        let wait = deadline::hold_within(self.buffer.config().lease_wait(), caller);
        let holder = bapo_proto::tls::peer(&req).map(|p| p.id.clone());
        let group_id = req.into_inner().group_id;
        let answer = self
            .buffer
            .lease(&group_id, holder.as_deref(), wait)
            .await?;
        Ok(Response::new(lease_reply(answer)))
    }

    async fn release_lease(
        &self,
        req: Request<LeaseRequest>,
    ) -> Result<Response<ReleaseReply>, Status> {
        let holder = bapo_proto::tls::peer(&req).map(|p| p.id.clone());
        let group_id = req.into_inner().group_id;
        let released = self.buffer.give_back_lease(&group_id, holder.as_deref())?;
        Ok(Response::new(ReleaseReply { released }))
    }
}

fn lease_reply(answer: LeaseAnswer) -> LeaseReply {
    match answer {
        LeaseAnswer::Granted(Grant {
            version,
            incarnation,
            expires_in,
            ..
        }) => LeaseReply {
            granted: true,
            learner_version: version,
            learner_incarnation: incarnation,
            expires_in_ms: u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX),
            held_by: String::new(),
        },
        LeaseAnswer::NotGranted {
            version,
            incarnation,
            held_by,
        } => LeaseReply {
            granted: false,
            learner_version: version,
            learner_incarnation: incarnation,
            expires_in_ms: 0,
            held_by: held_by.label().to_string(),
        },
    }
}

/// What the learner calls.
pub struct BatchSourceService {
    buffer: Buffer,
}

impl BatchSourceService {
    pub fn new(buffer: Buffer) -> Self {
        Self { buffer }
    }

    async fn take(&self, req: SampleRequest) -> Result<Vec<SampledGroup>, Status> {
        Ok(self
            .buffer
            .sample(
                req.num_groups as usize,
                Duration::from_millis(req.timeout_ms as u64),
                req.allow_partial,
            )
            .await?)
    }
}

/// Puts a sampled group on the wire; payload arrays are shared, not copied.
pub fn group_to_wire(s: SampledGroup) -> v1::Group {
    v1::Group {
        group_id: s.group.id.clone(),
        rollouts: s.group.members.iter().map(wire::rollout_to_wire).collect(),
        staleness: s.staleness,
        use_count: s.use_count,
        sequence: s.group.sequence,
    }
}

type GroupStream = Pin<Box<dyn Stream<Item = Result<v1::Group, Status>> + Send>>;

#[tonic::async_trait]
impl BatchSource for BatchSourceService {
    async fn sample(&self, req: Request<SampleRequest>) -> Result<Response<Batch>, Status> {
        let groups = self.take(req.into_inner()).await?;
        Ok(Response::new(Batch {
            groups: groups.into_iter().map(group_to_wire).collect(),
            learner_version: self.buffer.learner_version(),
        }))
    }

    type SampleStreamStream = GroupStream;

    async fn sample_stream(
        &self,
        req: Request<SampleRequest>,
    ) -> Result<Response<GroupStream>, Status> {
        let groups = self.take(req.into_inner()).await?;
        // Convert lazily: one group's wire copy alive at a time.
        let stream = futures::stream::iter(groups.into_iter().map(|g| Ok(group_to_wire(g))));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_version(
        &self,
        req: Request<VersionReport>,
    ) -> Result<Response<VersionAck>, Status> {
        let report = req.into_inner();
        let version = report.version;
        let outcome = self.buffer.report(LearnerReport {
            version,
            lineage: report.lineage,
            groups_trained: report.groups_trained,
            batch_groups: report.batch_groups,
        })?;
        Ok(Response::new(VersionAck {
            version,
            evicted_stale: outcome.evicted_stale,
            evicted_rolled_back: outcome.evicted_rolled_back,
        }))
    }

    async fn get_stats(&self, _: Request<StatsRequest>) -> Result<Response<v1::Stats>, Status> {
        let s = self.buffer.stats();
        Ok(Response::new(v1::Stats {
            learner_version: s.learner_version,
            max_staleness: s.max_staleness,
            groups_pending: s.groups_pending,
            groups_ready: s.groups_ready,
            bytes_held: s.bytes_held,
            rollouts_accepted: s.rollouts_accepted,
            rollouts_duplicate: s.rollouts_duplicate,
            rollouts_rejected: s.rollouts_rejected,
            rejections: s
                .rejections
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            groups_consumed: s.groups_consumed,
            group_samples: s.group_samples,
            evictions: EvictReason::ALL
                .iter()
                .map(|r| {
                    (
                        r.label().to_string(),
                        s.evictions.get(r.label()).copied().unwrap_or(0),
                    )
                })
                .collect(),
            admitted_groups: s.admitted_groups,
            admission_limit: s.admission_limit,
            learner_incarnation: s.learner_incarnation,
            groups_lost_to_rollback: s.groups_lost_to_rollback,
            groups_admitted: s.groups_admitted,
            leases_outstanding: s.leases_outstanding,
            leases_granted: s.leases_granted,
            leases_expired: s.leases_expired,
            leases_used: s.leases_used,
            leases_released: s.leases_released,
        }))
    }
}
