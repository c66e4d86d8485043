//! Diagnostics every step reports (spec §3), over masked tokens: ratio
//! statistics, KL estimators between `π_old` and `π_θ`, and effective sample
//! sizes. Sums and counts, not means of means, so they reduce across ranks.

use std::collections::{BTreeMap, HashMap};

use crate::loss::{TokenBatch, log_ratio};

/// `(Σw)² / Σw²`.
pub fn ess(weights: &[f64]) -> f64 {
    let s: f64 = weights.iter().sum();
    let s2: f64 = weights.iter().map(|w| w * w).sum();
    if s2 > 0.0 { s * s / s2 } else { 0.0 }
}

/// Ratio and KL statistics of `r = π_θ/π_old`, plus the behaviour ratio
/// `π_old/π_behav` and its sequence-level ESS when behaviour log-probs are
/// present.
pub fn ratio_metrics(batch: &TokenBatch) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    let idx: Vec<usize> = (0..batch.len()).filter(|&t| batch.mask[t]).collect();
    if idx.is_empty() {
        return m;
    }
    let n = idx.len() as f64;
    let log_r: Vec<f64> = idx
        .iter()
        .map(|&t| log_ratio(batch.logp[t], batch.logp_old[t]))
        .collect();
    let r: Vec<f64> = log_r.iter().map(|l| l.exp()).collect();
    let mean = r.iter().sum::<f64>() / n;
    let var = r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    m.insert("ratio_mean".into(), mean);
    m.insert("ratio_std".into(), var.sqrt());
    m.insert(
        "ratio_min".into(),
        r.iter().copied().fold(f64::INFINITY, f64::min),
    );
    m.insert(
        "ratio_max".into(),
        r.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    m.insert("kl_k1".into(), log_r.iter().map(|l| -l).sum::<f64>() / n);
    m.insert(
        "kl_k2".into(),
        log_r.iter().map(|l| 0.5 * l * l).sum::<f64>() / n,
    );
    m.insert(
        "kl_k3".into(),
        log_r
            .iter()
            .zip(&r)
            .map(|(l, x)| (x - 1.0) - l)
            .sum::<f64>()
            / n,
    );
    m.insert("ess_token".into(), ess(&r) / n);
    if let Some(behav) = &batch.logp_behav {
        let lw: Vec<f64> = idx
            .iter()
            .map(|&t| log_ratio(batch.logp_old[t], behav[t]))
            .collect();
        let w: Vec<f64> = lw.iter().map(|l| l.exp()).collect();
        m.insert("behav_ratio_mean".into(), w.iter().sum::<f64>() / n);
        m.insert(
            "behav_kl_k3".into(),
            lw.iter().zip(&w).map(|(l, x)| (x - 1.0) - l).sum::<f64>() / n,
        );
        let mut seq: HashMap<u32, f64> = HashMap::new();
        for (&t, l) in idx.iter().zip(&lw) {
            *seq.entry(batch.seq_ids[t]).or_default() += l;
        }
        let sw: Vec<f64> = seq.values().map(|l| l.clamp(-20.0, 20.0).exp()).collect();
        m.insert("ess_seq".into(), ess(&sw) / sw.len() as f64);
    }
    m
}

/// The band outside which a token counts as mismatched.
pub const MISMATCH_BAND: (f64, f64) = (0.5, 2.0);

/// Training/inference mismatch: how far the learner's log-probs before the
/// update are from the actor's, over masked tokens, with
/// `w = π_learner/π_behav`:
///
/// * `mismatch_kl_k3 = mean((w − 1) − log w)`, the k3 estimate of
///   `KL(π_behav ‖ π_learner)` on the actor's samples (≥ 0);
/// * `mismatch_ess = (Σw)² / (N Σw²)` ∈ (0, 1];
/// * `mismatch_outside_frac`: tokens with `w` outside `[0.5, 2]`.
///
/// `π_learner` is the proximal policy when `lp_behav` is given
/// (`recompute`: fixed for all updates of a batch), else the current
/// policy `π_θ` (`behavior`: `lp_old` is then the behaviour log-prob, and
/// `w` is the very ratio the loss clips).
pub fn mismatch_metrics(batch: &TokenBatch) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    let lw: Vec<f64> = (0..batch.len())
        .filter(|&t| batch.mask[t])
        .map(|t| match &batch.logp_behav {
            Some(b) => log_ratio(batch.logp_old[t], b[t]),
            None => log_ratio(batch.logp[t], batch.logp_old[t]),
        })
        .collect();
    if lw.is_empty() {
        return m;
    }
    let n = lw.len() as f64;
    let w: Vec<f64> = lw.iter().map(|l| l.exp()).collect();
    let k3 = lw.iter().zip(&w).map(|(l, x)| (x - 1.0) - l).sum::<f64>() / n;
    let (lo, hi) = MISMATCH_BAND;
    let outside = w.iter().filter(|x| !(lo..=hi).contains(*x)).count() as f64;
    m.insert("mismatch_kl_k3".into(), k3);
    m.insert("mismatch_ess".into(), ess(&w) / n);
    m.insert("mismatch_outside_frac".into(), outside / n);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    #[test]
    fn t3_metrics() {
        let m = ratio_metrics(&t3());
        close(m["kl_k1"], -0.282828);
        close(m["kl_k2"], 0.242040);
        close(m["kl_k3"], 0.425505);
        close(m["ratio_mean"], 1.708333);
        close(m["ratio_min"], 0.7);
        close(m["ratio_max"], 5.0);
        close(m["ess_token"], 0.567369);
    }

    /// `w = [4, 0.8, 0.3, 1.5]`: k3 terms `(w − 1) − ln w` =
    /// `[1.613706, 0.023144, 0.503973, 0.094535]`, mean 0.558839;
    /// ESS = 6.6² / (4 · 18.98) = 0.573762; 4 and 0.3 are outside [0.5, 2].
    #[test]
    fn mismatch_metrics_by_hand() {
        let ln = |v: &[f64]| v.iter().map(|p| p.ln()).collect::<Vec<_>>();
        let old = ln(&[0.4, 0.4, 0.15, 0.6]);
        let behav = ln(&[0.1, 0.5, 0.5, 0.4]);
        let b = TokenBatch::new(
            vec![1.0; 4],
            ln(&[0.5; 4]),
            old.clone(),
            Some(behav.clone()),
            None,
            None,
        )
        .unwrap();
        let m = mismatch_metrics(&b);
        close(m["mismatch_kl_k3"], 0.558839);
        close(m["mismatch_ess"], 0.573762);
        close(m["mismatch_outside_frac"], 0.5);
        // Without lp_behav, lp_old is the behaviour log-prob and the
        // current policy is compared with it: the same numbers.
        let bypass = TokenBatch::new(vec![1.0; 4], old, behav, None, None, None).unwrap();
        assert_eq!(mismatch_metrics(&bypass), m);
    }

    #[test]
    fn masked_tokens_do_not_count() {
        let mut b = t3();
        let full = ratio_metrics(&b);
        b.mask.push(false);
        b.advantages.push(9.0);
        b.logp.push(-0.01);
        b.logp_old.push(-9.0);
        b.seq_ids.push(99);
        assert_eq!(ratio_metrics(&b), full);
    }
}
