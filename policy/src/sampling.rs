//! Choosing the next token on the host: temperature, top-k, top-p, a
//! seedable RNG, and the behaviour log-prob of the choice (see `logprob.rs`
//! for which distribution it is under).

use rand::{Rng, SeedableRng, rngs::SmallRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set with this much mass; 1 keeps all.
    pub top_p: f32,
    pub max_new_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 64,
            stop_tokens: Vec::new(),
            seed: 0,
        }
    }
}

/// A row of logits → `(token, log-prob under softmax(logits / T))`.
/// Greedy (T = 0) reports the log-prob under T = 1.
pub struct Sampler {
    params: SamplingParams,
    rng: SmallRng,
    /// Scratch for one row's unnormalised probabilities.
    weights: Vec<f64>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = SmallRng::seed_from_u64(params.seed);
        Self {
            params,
            rng,
            weights: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn sample(&mut self, logits: &[f32]) -> (u32, f32) {
        let p = &self.params;
        let t = if p.temperature > 0.0 {
            f64::from(p.temperature)
        } else {
            1.0
        };
        // One pass of exponentials, in f64 for the reported log-prob; they
        // serve as the sampling weights too.
        let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let weights = &mut self.weights;
        weights.clear();
        weights.extend(logits.iter().map(|&l| ((f64::from(l) - max) / t).exp()));
        let z: f64 = weights.iter().sum();
        let log_z = z.ln();
        let logp = |i: usize| ((f64::from(logits[i]) - max) / t - log_z) as f32;
        if p.temperature <= 0.0 {
            let best = argmax(logits);
            return (best as u32, logp(best));
        }
        if p.top_k == 0 && p.top_p >= 1.0 {
            let mut u = self.rng.random::<f64>() * z;
            for (i, w) in weights.iter().enumerate() {
                u -= w;
                if u <= 0.0 {
                    return (i as u32, logp(i));
                }
            }
            let last = logits.len() - 1;
            return (last as u32, logp(last));
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let mut mass = 0.0;
            let keep = idx
                .iter()
                .position(|&i| {
                    mass += weights[i] / z;
                    mass >= f64::from(p.top_p)
                })
                .map_or(idx.len(), |k| k + 1);
            idx.truncate(keep);
        }
        let total: f64 = idx.iter().map(|&i| weights[i]).sum();
        let mut u = self.rng.random::<f64>() * total;
        for &i in &idx {
            u -= weights[i];
            if u <= 0.0 {
                return (i as u32, logp(i));
            }
        }
        let last = *idx.last().expect("the vocabulary is not empty");
        (last as u32, logp(last))
    }
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_maximum_and_reports_its_log_prob() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            ..Default::default()
        });
        let (tok, lp) = s.sample(&[0.0, 2.0, 1.0]);
        assert_eq!(tok, 1);
        let z = (0f64.exp() + 2f64.exp() + 1f64.exp()).ln();
        assert!((lp as f64 - (2.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn sampling_follows_the_tempered_distribution_and_is_seeded() {
        let logits = [0.0f32, 1.0, 2.0];
        let params = SamplingParams {
            temperature: 2.0,
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(params.clone());
        let mut counts = [0usize; 3];
        let draws: Vec<u32> = (0..20_000)
            .map(|_| {
                let (t, _) = s.sample(&logits);
                counts[t as usize] += 1;
                t
            })
            .collect();
        let p: Vec<f64> = {
            let e: Vec<f64> = logits.iter().map(|&l| (l as f64 / 2.0).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|x| x / z).collect()
        };
        for k in 0..3 {
            let freq = counts[k] as f64 / 20_000.0;
            assert!((freq - p[k]).abs() < 0.015, "{k}: {freq} vs {}", p[k]);
        }
        let mut again = Sampler::new(params);
        assert!(
            draws
                .iter()
                .take(100)
                .all(|&d| again.sample(&logits).0 == d)
        );
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0f32, 4.0, 0.0, -1.0];
        let mut k1 = Sampler::new(SamplingParams {
            top_k: 1,
            ..Default::default()
        });
        assert!((0..50).all(|_| k1.sample(&logits).0 == 0));
        let mut p = Sampler::new(SamplingParams {
            top_p: 0.9,
            ..Default::default()
        });
        assert!((0..200).all(|_| p.sample(&logits).0 < 2));
    }
}
