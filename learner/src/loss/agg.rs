//! How per-token losses become one number (verl's `loss_agg_mode`), with the
//! denominators of the whole optimiser step: under gradient accumulation a
//! micro-batch must divide by the step's token or sequence count, or
//! `token-mean` silently becomes a mean of micro-batch means.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::TokenBatch;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// `Σ ℓ / Σ_i T_i` (DAPO, BAPO, CISPO).
    TokenMean,
    /// `(1/|B|) Σ_i (Σ_t ℓ / T_i)` (GRPO, GSPO, SAPO).
    SeqMeanTokenMean,
    /// `(1/|B|) Σ_i Σ_t ℓ`.
    SeqMeanTokenSum,
    /// `Σ_i Σ_t ℓ / L_const` (Dr. GRPO; verl does not divide by |B|).
    SeqMeanTokenSumNorm,
}

impl Aggregation {
    pub const ALL: [Aggregation; 4] = [
        Aggregation::TokenMean,
        Aggregation::SeqMeanTokenMean,
        Aggregation::SeqMeanTokenSum,
        Aggregation::SeqMeanTokenSumNorm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Aggregation::TokenMean => "token-mean",
            Aggregation::SeqMeanTokenMean => "seq-mean-token-mean",
            Aggregation::SeqMeanTokenSum => "seq-mean-token-sum",
            Aggregation::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// The global counts of one optimiser step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Denominators {
    /// Masked tokens in the whole step.
    pub tokens: f64,
    /// Sequences in the whole step.
    pub seqs: f64,
    /// `L_const` of `seq-mean-token-sum-norm`: the padded response length.
    pub l_const: f64,
}

impl Denominators {
    /// The counts of one batch taken as the whole step; `L_const` is its
    /// longest sequence (the padded length of a flat batch).
    pub fn of(batch: &TokenBatch) -> Self {
        Self {
            tokens: batch.masked_count() as f64,
            seqs: batch.seq_lengths(true).len() as f64,
            l_const: batch
                .seq_lengths(false)
                .values()
                .copied()
                .fold(0.0, f64::max),
        }
    }
}

/// Per-token weight `∂L/∂ℓ_t` for each token (0 where masked).
pub fn weights(agg: Aggregation, batch: &TokenBatch, d: &Denominators) -> Vec<f64> {
    let masked_len: HashMap<u32, f64> = batch.seq_lengths(true);
    let safe = |x: f64| if x > 0.0 { 1.0 / x } else { 0.0 };
    batch
        .mask
        .iter()
        .zip(&batch.seq_ids)
        .map(|(&m, s)| {
            if !m {
                return 0.0;
            }
            match agg {
                Aggregation::TokenMean => safe(d.tokens),
                Aggregation::SeqMeanTokenMean => safe(d.seqs) * safe(masked_len[s]),
                Aggregation::SeqMeanTokenSum => safe(d.seqs),
                Aggregation::SeqMeanTokenSumNorm => safe(d.l_const),
            }
        })
        .collect()
}
