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
