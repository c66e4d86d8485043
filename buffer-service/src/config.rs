//! Buffer configuration: one struct, read from the `[buffer]` table of the
//! shared TOML file and overridden by command-line flags.
//!
//! Every field has a default, so an empty file (or none) gives a working
//! on-policy-ish buffer for groups of 8.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

/// How the learner's batches are drawn from the ready groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SamplingMode {
    /// Oldest ready group first, each handed out once.
    #[default]
    Fifo,
    /// Uniform over ready groups; each reused up to `max_reuse` times.
    Uniform,
    /// Newer groups more likely (weight `recency_decay^age_rank`); each reused
    /// up to `max_reuse` times.
    Recency,
}

impl SamplingMode {
    /// Whether groups stay in the buffer after being sampled.
    pub fn replays(self) -> bool {
        !matches!(self, SamplingMode::Fifo)
    }
}

/// What happens when the buffer is at capacity and a new group arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum FullPolicy {
    /// Hold the pusher until room frees up. Nothing accepted is lost.
    #[default]
    Block,
    /// Evict the oldest ready group to make room (counted as `capacity`).
    DropOldest,
}

/// When the write-ahead log is forced to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum FsyncPolicy {
    /// fsync before any ack that depends on the record (group commit: one
    /// fsync covers every record written since the last one). Survives power
    /// loss.
    #[default]
    Always,
    /// fsync at most every `fsync_interval_ms`; acks wait only for the write
    /// to reach the OS. Survives a killed process, not a lost machine.
    Interval,
    /// Never fsync; the OS decides. Survives a killed process.
    Never,
}

/// All buffer settings. Field names are the TOML keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BufferConfig {
    /// gRPC listen address.
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address; `None` disables the exporter.
    pub metrics_listen: Option<SocketAddr>,
    /// K: responses per prompt. A group is complete with K members.
    pub group_size: u32,
    /// A group that has waited `group_timeout_ms` is sampleable with at least
    /// this many members (and evicted with fewer).
    pub min_group_size: u32,
    pub group_timeout_ms: u64,
    /// Groups per learner batch; the unit of the staleness admission bound.
    pub batch_groups: u32,
    /// Maximum policy-version lag of a trained group. 0 is synchronous.
    pub max_staleness: u64,
    /// Capacity in held (pending + ready) groups.
    pub capacity_groups: u64,
    /// Capacity in held bytes (payload in memory).
    pub capacity_bytes: u64,
    pub when_full: FullPolicy,
    pub sampling: SamplingMode,
    /// Times a group may be handed out in replay modes (1 in FIFO).
    pub max_reuse: u32,
    /// Reverb-style rate limiter for replay modes: target group samples per
    /// inserted group, and the slack either way before one side waits.
    pub samples_per_insert: f64,
    pub rate_limit_error_buffer: f64,
    /// Per-step weight decay of the recency sampler (newest group weight 1).
    pub recency_decay: f64,
    /// Largest prompt + response length accepted, in tokens.
    pub max_tokens: usize,
    /// Largest encoded rollout accepted, in bytes.
    pub max_rollout_bytes: usize,
    /// Sealed group ids remembered for duplicate and late-member detection.
    pub dedup_window_groups: usize,
    /// Write-ahead log directory; `None` keeps everything in memory only.
    pub data_dir: Option<PathBuf>,
    pub fsync: FsyncPolicy,
    pub fsync_interval_ms: u64,
    /// The log is compacted when it exceeds this many bytes and holds more
    /// than twice the live data.
    pub compact_bytes: u64,
    /// Seed of the replay samplers' RNG.
    pub seed: u64,
    /// How long a lease (room for a group an actor is generating) lasts
    /// without its group arriving or a renewal: what a dead actor's lease
    /// costs the others. Actors renew at half of it, so generation may take
    /// longer.
    pub lease_ttl_ms: u64,
    /// How long a lease request is held while there is no room before it is
    /// answered "not granted, ask again" (never beyond the caller's
    /// deadline).
    pub lease_wait_ms: u64,
}

impl Default for BufferConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_listen: None,
            group_size: 8,
            min_group_size: 2,
            group_timeout_ms: 120_000,
            batch_groups: 8,
            max_staleness: 4,
            capacity_groups: 4096,
            capacity_bytes: 4 << 30,
            when_full: FullPolicy::Block,
            sampling: SamplingMode::Fifo,
            max_reuse: 1,
            samples_per_insert: 1.0,
            rate_limit_error_buffer: 64.0,
            recency_decay: 0.99,
            max_tokens: 32_768,
            max_rollout_bytes: 8 << 20,
            dedup_window_groups: 65_536,
            data_dir: None,
            fsync: FsyncPolicy::Always,
            fsync_interval_ms: 100,
            compact_bytes: 256 << 20,
            seed: 0,
            lease_ttl_ms: 120_000,
            lease_wait_ms: 10_000,
        }
    }
}

/// A setting that cannot work, named.
#[derive(Debug, thiserror::Error)]
#[error("invalid buffer config: {0}")]
pub struct ConfigError(pub String);

impl BufferConfig {
    /// Checks the relations between fields that serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        if self.group_size == 0 {
            return bad("group_size must be at least 1".into());
        }
        if self.min_group_size == 0 || self.min_group_size > self.group_size {
            return bad(format!(
                "min_group_size = {} must be in 1..=group_size ({})",
                self.min_group_size, self.group_size
            ));
        }
        if self.batch_groups == 0 {
            return bad("batch_groups must be at least 1".into());
        }
        if self.capacity_groups == 0 || self.capacity_bytes == 0 {
            return bad("capacity_groups and capacity_bytes must be positive".into());
        }
        if self.sampling.replays() {
            if self.max_reuse == 0 {
                return bad("max_reuse must be at least 1".into());
            }
            if !(self.samples_per_insert.is_finite() && self.samples_per_insert > 0.0) {
                return bad(format!(
                    "samples_per_insert = {} must be a positive number",
                    self.samples_per_insert
                ));
            }
            if !(self.rate_limit_error_buffer.is_finite() && self.rate_limit_error_buffer >= 1.0) {
                return bad(format!(
                    "rate_limit_error_buffer = {} must be at least 1",
                    self.rate_limit_error_buffer
                ));
            }
        }
        if !(self.recency_decay > 0.0 && self.recency_decay <= 1.0) {
            return bad(format!(
                "recency_decay = {} must be in (0, 1]",
                self.recency_decay
            ));
        }
        if self.max_tokens == 0 || self.max_rollout_bytes == 0 {
            return bad("max_tokens and max_rollout_bytes must be positive".into());
        }
        if self.lease_ttl_ms == 0 {
            return bad("lease_ttl_ms must be positive".into());
        }
        Ok(())
    }

    /// Uses per group before it retires: `max_reuse` when replaying, else 1.
    pub fn uses_per_group(&self) -> u32 {
        if self.sampling.replays() {
            self.max_reuse
        } else {
            1
        }
    }

    pub fn group_timeout(&self) -> Duration {
        Duration::from_millis(self.group_timeout_ms)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }

    pub fn lease_wait(&self) -> Duration {
        Duration::from_millis(self.lease_wait_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_toml_round_trips() {
        let cfg = BufferConfig::default();
        cfg.validate().unwrap();
        let text = toml::to_string(&cfg).unwrap();
        let back: BufferConfig = toml::from_str(&text).unwrap();
        assert_eq!(back.group_size, cfg.group_size);
        assert_eq!(back.sampling, cfg.sampling);
    }

    #[test]
    fn unknown_keys_and_bad_relations_are_named() {
        let err = toml::from_str::<BufferConfig>("group_sise = 4").unwrap_err();
        assert!(err.to_string().contains("group_sise"), "{err}");
        let cfg = BufferConfig {
            min_group_size: 9,
            ..Default::default()
        };
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("min_group_size"), "{err}");
    }
}
