//! Per-token log-probabilities and entropies of the realised next tokens,
//! from one log-softmax over the vocabulary.
//!
//! Temperature is part of the distribution: the actor samples from
//! `softmax(logits / T)` and records the log-prob of the sampled token under
//! it; the learner computes `log_softmax(logits / T)` with the same `T`, so
//! the importance ratio compares the same distribution at two weight
//! versions. (Top-k / top-p truncate the sampling support on top of that;
//! the recorded log-prob is still under the untruncated temperature-scaled
//! distribution, so that actor and learner agree, and the defaults leave
//! both off.)

use burn::{prelude::*, tensor::activation::log_softmax};

/// The training path: shift, log-softmax, gather and entropy in one fused
/// kernel (see [`crate::kernels`]); the functions below take logits and
/// targets already aligned.
pub use crate::kernels::{next_token_logprobs, next_token_logprobs_and_entropy};

/// `logits` `[B, T, V]`, `targets` `[B, T]`: log-prob of each target and
/// the entropy of each position's distribution, both `[B, T]`.
pub fn token_logprobs_and_entropy(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    temperature: f32,
) -> (Tensor<2>, Tensor<2>) {
    let logp = log_softmax(logits.div_scalar(temperature), 2);
    let lp = logp
        .clone()
        .gather(2, targets.unsqueeze_dim::<3>(2))
        .squeeze_dim::<2>(2);
    let entropy = logp
        .clone()
        .exp()
        .mul(logp)
        .sum_dim(2)
        .squeeze_dim::<2>(2)
        .neg();
    (lp, entropy)
}

/// Only the log-probs of the targets, `[B, T]` (no entropy pass).
pub fn token_logprobs(logits: Tensor<3>, targets: Tensor<2, Int>, temperature: f32) -> Tensor<2> {
    log_softmax(logits.div_scalar(temperature), 2)
        .gather(2, targets.unsqueeze_dim::<3>(2))
        .squeeze_dim::<2>(2)
}

/// The next-token view of a sequence: logits at positions `0..T-1` predict
/// tokens `1..T`. Returns `(logits[:, :-1], tokens[:, 1:])`.
pub fn shift_for_next_token(
    logits: Tensor<3>,
    tokens: Tensor<2, Int>,
) -> (Tensor<3>, Tensor<2, Int>) {
    let t = tokens.dims()[1];
    (logits.narrow(1, 0, t - 1), tokens.narrow(1, 1, t - 1))
}
