//! Policy losses: one file each behind [`PolicyLoss`], all computed in f64
//! from per-token log-probs, returning the loss, its gradient with respect to
//! each token's current log-prob, and the metrics the spec asks for.
//!
//! Sign convention: losses are minimised (`L = −J`). "Gradient" means
//! `∂L/∂lp_θ,t` after aggregation, zero on masked tokens.

pub mod agg;
pub mod bapo;
pub mod cispo;
pub mod clip_cov;
pub mod decoupled;
pub mod gspo;
pub mod options;
pub mod ppo;
pub mod rec;
pub mod registry;
pub mod reinforce;
pub mod remix;
pub mod sapo;
pub mod tis;
pub mod turn_ppo;

use std::collections::{BTreeMap, HashMap};

pub use agg::{Aggregation, Denominators};

use crate::record::Metric;

/// Input that cannot be used, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct LossError {
    pub field: String,
    pub message: String,
}

impl LossError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The tokens of one optimiser step (or micro-batch), flattened: every
/// vector has one entry per token.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenBatch {
    pub advantages: Vec<f64>,
    /// `lp_θ`: log-prob under the policy being trained.
    pub logp: Vec<f64>,
    /// `lp_old`: the proximal/anchor policy (recomputed by the learner).
    pub logp_old: Vec<f64>,
    /// `lp_behav`: the policy that sampled the token, when it differs.
    pub logp_behav: Option<Vec<f64>>,
    /// Response (loss) mask.
    pub mask: Vec<bool>,
    /// Sequence of each token, for sequence-level aggregation and ratios.
    pub seq_ids: Vec<u32>,
    /// Turn of each token within its sequence (multi-turn episodes, for
    /// turn-level ratios); empty: every sequence is one turn.
    pub turn_ids: Vec<u32>,
}

impl TokenBatch {
    /// Checks lengths and values, naming the first bad field.
    pub fn new(
        advantages: Vec<f64>,
        logp: Vec<f64>,
        logp_old: Vec<f64>,
        logp_behav: Option<Vec<f64>>,
        mask: Option<Vec<bool>>,
        seq_ids: Option<Vec<u32>>,
    ) -> Result<Self, LossError> {
        let n = advantages.len();
        let mask = mask.unwrap_or_else(|| vec![true; n]);
        // Without sequence ids every token is its own sequence.
        let seq_ids = seq_ids.unwrap_or_else(|| (0..n as u32).collect());
        let lens = [
            ("logp", logp.len()),
            ("logp_old", logp_old.len()),
            ("mask", mask.len()),
            ("seq_ids", seq_ids.len()),
        ];
        for (name, len) in lens
            .into_iter()
            .chain(logp_behav.as_ref().map(|b| ("logp_behav", b.len())))
        {
            if len != n {
                return Err(LossError::new(
                    name,
                    format!("has {len} entries but advantages has {n}"),
                ));
            }
        }
        if let Some(i) = advantages.iter().position(|a| !a.is_finite()) {
            return Err(LossError::new(
                format!("advantages[{i}]"),
                format!("{} is not finite", advantages[i]),
            ));
        }
        let arrays = [("logp", &logp), ("logp_old", &logp_old)];
        for (name, v) in arrays
            .into_iter()
            .chain(logp_behav.as_ref().map(|b| ("logp_behav", b)))
        {
            for (i, (&x, &m)) in v.iter().zip(&mask).enumerate() {
                // A masked-out token may carry anything (padding), a
                // trained token must be a log-probability.
                if m && !(x.is_finite() && x <= 0.0) {
                    return Err(LossError::new(
                        format!("{name}[{i}]"),
                        format!(
                            "{x} is not a log-probability of a sampled token (must be finite and <= 0)"
                        ),
                    ));
                }
            }
        }
        Ok(Self {
            advantages,
            logp,
            logp_old,
            logp_behav,
            mask,
            seq_ids,
            turn_ids: Vec::new(),
        })
    }

    /// The batch with a turn id per token, refused unless there is one
    /// per token.
    pub fn with_turns(mut self, turn_ids: Vec<u32>) -> Result<Self, LossError> {
        if !turn_ids.is_empty() && turn_ids.len() != self.len() {
            return Err(LossError::new(
                "turn_ids",
                format!(
                    "has {} entries but advantages has {}",
                    turn_ids.len(),
                    self.len()
                ),
            ));
        }
        self.turn_ids = turn_ids;
        Ok(self)
    }

    /// Token `t`'s turn: its sequence and its turn id in it (0 without
    /// turn ids).
    pub fn turn_of(&self, t: usize) -> (u32, u32) {
        (self.seq_ids[t], self.turn_ids.get(t).copied().unwrap_or(0))
    }

    pub fn len(&self) -> usize {
        self.advantages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.advantages.is_empty()
    }

    pub fn masked_count(&self) -> usize {
        self.mask.iter().filter(|&&m| m).count()
    }

    /// Tokens per sequence (masked ones only, or all), by sequence id.
    /// Sequences with no counted token are absent.
    pub fn seq_lengths(&self, masked_only: bool) -> HashMap<u32, f64> {
        let mut out = HashMap::new();
        for (&s, &m) in self.seq_ids.iter().zip(&self.mask) {
            if m || !masked_only {
                *out.entry(s).or_insert(0.0) += 1.0;
            }
        }
        out
    }

    /// `log(π_old/π_behav)` per token (clamped); zeros without behaviour
    /// log-probs, where the sampling policy is the proximal one.
    pub fn behav_log_weights(&self) -> Vec<f64> {
        match &self.logp_behav {
            Some(b) => self
                .logp_old
                .iter()
                .zip(b)
                .map(|(&old, &behav)| log_ratio(old, behav))
                .collect(),
            None => vec![0.0; self.len()],
        }
    }

    /// `f(t)` for every masked token `t`, zero terms elsewhere: masked-out
    /// tokens never reach a loss's formula.
    pub fn masked_terms(&self, mut f: impl FnMut(usize) -> TokenTerm) -> Vec<TokenTerm> {
        (0..self.len())
            .map(|t| {
                if self.mask[t] {
                    f(t)
                } else {
                    TokenTerm::default()
                }
            })
            .collect()
    }

    /// `r_t = exp(clamp(lp_θ − lp_old, ±20))` for every token.
    pub fn ratios(&self) -> Vec<f64> {
        self.logp
            .iter()
            .zip(&self.logp_old)
            .map(|(&a, &b)| log_ratio(a, b).exp())
            .collect()
    }
}

/// `lp_a − lp_b` clamped to ±20 as verl does (so `exp` stays in about
/// `[2e−9, 4.9e8]`); `−inf − (−inf)` is 0, as in AReaL.
pub fn log_ratio(lp_a: f64, lp_b: f64) -> f64 {
    let d = lp_a - lp_b;
    if d.is_nan() {
        0.0
    } else {
        d.clamp(-20.0, 20.0)
    }
}

/// What a loss returns.
#[derive(Debug, Clone, PartialEq)]
pub struct LossOutput {
    pub loss: f64,
    /// `∂loss/∂lp_θ` per token; 0 where masked.
    pub grad: Vec<f64>,
    pub metrics: BTreeMap<String, f64>,
}

/// One policy loss. Implementations hold their hyperparameters.
pub trait PolicyLoss: Send + Sync {
    fn name(&self) -> &'static str;
    /// How per-token losses are aggregated.
    fn aggregation(&self) -> Aggregation;
    /// Loss, gradient and metrics over `batch`, dividing by the step's
    /// global `denominators`.
    fn compute(&self, batch: &TokenBatch, denominators: &Denominators) -> LossOutput;
}

/// Per-token loss value and gradient coefficient `∂ℓ_t/∂lp_θ,t`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TokenTerm {
    pub loss: f64,
    pub grad: f64,
}

impl LossOutput {
    /// Aggregates per-token terms into the loss and its per-token gradient;
    /// metrics start empty.
    pub fn aggregate(
        terms: &[TokenTerm],
        agg: Aggregation,
        batch: &TokenBatch,
        d: &Denominators,
    ) -> Self {
        let w = agg::weights(agg, batch, d);
        Self {
            loss: terms.iter().zip(&w).map(|(t, w)| t.loss * w).sum(),
            grad: terms.iter().zip(&w).map(|(t, w)| t.grad * w).collect(),
            metrics: BTreeMap::new(),
        }
    }

    /// Records `total / masked tokens` as metric `name`.
    pub fn per_token_metric(&mut self, name: &str, total: f64, batch: &TokenBatch) {
        let n = batch.masked_count().max(1) as f64;
        self.metrics.insert(name.to_string(), total / n);
    }
}

/// Counts of clipped tokens, reported as fractions of the masked tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClipCounts {
    pub low: usize,
    pub high: usize,
    pub dual: usize,
}

impl ClipCounts {
    pub fn insert_into(&self, n_masked: usize, m: &mut BTreeMap<String, f64>) {
        let frac = |k: usize| {
            if n_masked > 0 {
                k as f64 / n_masked as f64
            } else {
                0.0
            }
        };
        m.insert(Metric::ClipFracLow.into(), frac(self.low));
        m.insert(Metric::ClipFracHigh.into(), frac(self.high));
        m.insert("pg_clipfrac".into(), frac(self.low + self.high));
        m.insert("dual_clip_frac".into(), frac(self.dual));
    }
}

#[cfg(test)]
pub(crate) mod testing;
