//! How in-flight generation follows new weights: a setting of `[actor]`
//! that the engines and the rollout loop read too, so it lives apart from
//! the configuration that holds them (which would otherwise be both above
//! and below them).

use serde::{Deserialize, Serialize};

/// What to do with in-flight responses when new weights arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum UpdateMode {
    /// Keep generating with the new weights: later tokens carry the new
    /// version, the KV cache is rebuilt (partial rollouts).
    Partial,
    /// Throw the in-flight group away and start it again.
    Restart,
}
