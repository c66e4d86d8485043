//! How the learner's batch is picked from the ready groups. Each mode is a
//! small type behind [`Sampler`], chosen by config, so a new mode is a new
//! type rather than a branch in the hot path.

use rand::{rngs::SmallRng, seq::index};

use crate::config::{BufferConfig, SamplingMode};

/// Picks `n` distinct positions among `len` ready groups, ordered oldest
/// (position 0) to newest.
pub trait Sampler: Send {
    fn pick(&mut self, len: usize, n: usize, rng: &mut SmallRng) -> Vec<usize>;
}

/// Oldest first.
pub struct Fifo;

impl Sampler for Fifo {
    fn pick(&mut self, len: usize, n: usize, _: &mut SmallRng) -> Vec<usize> {
        (0..n.min(len)).collect()
    }
}

/// Uniform without replacement.
pub struct Uniform;

impl Sampler for Uniform {
    fn pick(&mut self, len: usize, n: usize, rng: &mut SmallRng) -> Vec<usize> {
        index::sample(rng, len, n.min(len)).into_vec()
    }
}

/// Without replacement, weight `decay^(age rank)`: the newest group weighs 1.
pub struct Recency {
    pub decay: f64,
}

impl Sampler for Recency {
    fn pick(&mut self, len: usize, n: usize, rng: &mut SmallRng) -> Vec<usize> {
        let n = n.min(len);
        let ln_decay = self.decay.ln();
        // Weights far below f64's range still order correctly in log space,
        // but sample_weighted needs positive finite weights: floor them.
        let weight = |i: usize| ((len - 1 - i) as f64 * ln_decay).exp().max(1e-300);
        match index::sample_weighted(rng, len, weight, n) {
            Ok(idx) => idx.into_vec(),
            // Unreachable with the floored, finite-or-infinite positive
            // weights above (rand accepts those); kept as uniform without
            // replacement so that no path gives a batch one group twice.
            Err(_) => Uniform.pick(len, n, rng),
        }
    }
}

pub fn from_config(cfg: &BufferConfig) -> Box<dyn Sampler> {
    match cfg.sampling {
        SamplingMode::Fifo => Box::new(Fifo),
        SamplingMode::Uniform => Box::new(Uniform),
        SamplingMode::Recency => Box::new(Recency {
            decay: cfg.recency_decay,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn distinct(mut v: Vec<usize>) -> bool {
        let n = v.len();
        v.sort();
        v.dedup();
        v.len() == n
    }

    #[test]
    fn every_sampler_picks_distinct_positions_in_range() {
        let mut rng = SmallRng::seed_from_u64(1);
        let samplers: Vec<Box<dyn Sampler>> = vec![
            Box::new(Fifo),
            Box::new(Uniform),
            Box::new(Recency { decay: 0.9 }),
        ];
        for mut s in samplers {
            for (len, n) in [(10, 3), (5, 5), (3, 7), (1000, 64)] {
                let p = s.pick(len, n, &mut rng);
                assert_eq!(p.len(), n.min(len));
                assert!(p.iter().all(|&i| i < len));
                assert!(distinct(p));
            }
        }
    }

    #[test]
    fn recency_prefers_new_groups() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut s = Recency { decay: 0.8 };
        let mut hits = [0u32; 20];
        for _ in 0..2000 {
            for i in s.pick(20, 1, &mut rng) {
                hits[i] += 1;
            }
        }
        assert!(hits[19] > hits[10] * 3, "{hits:?}");
        assert!(hits[10] > hits[0], "{hits:?}");
    }
}
