//! The error of a `[learner]` setting, apart from the configuration
//! itself: the tables the learner's configuration holds (`[learner.spear]`,
//! `[learner.remix]`) validate themselves with it, and the configuration
//! holds them, so it cannot live in `config` without a cycle.

use crate::loss::LossError;

/// A `[learner]` setting that cannot work, named by its key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    /// The key, `learner.` included (`learner.lr`).
    pub field: String,
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: format!("learner.{field}"),
            message: message.into(),
        }
    }

    /// A loss option the registry refused. Its field is named by the loss
    /// (`learner.agg`, or an option such as `clip_eps`), so `learner.` is
    /// added only where it is missing.
    pub(crate) fn from_loss(e: LossError) -> Self {
        let field = match e.field.strip_prefix("learner.") {
            Some(_) => e.field,
            None => format!("learner.{}", e.field),
        };
        Self {
            field,
            message: e.message,
        }
    }
}
