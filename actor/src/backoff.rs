//! Exponential backoff with full jitter, so that actors restarted together
//! do not reconnect in lockstep.

use std::time::Duration;

use rand::{Rng, SeedableRng, rngs::SmallRng};

pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
    rng: SmallRng,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            attempt: 0,
            rng: SmallRng::from_os_rng(),
        }
    }

    /// A delay drawn uniformly from `[0, min(max, base · 2^attempt)]`.
    pub fn next_delay(&mut self) -> Duration {
        let cap = self
            .base
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.max);
        self.attempt += 1;
        cap.mul_f64(self.rng.random::<f64>())
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for i in 0..20 {
            let d = b.next_delay();
            let cap = Duration::from_millis(100 * (1u64 << i.min(16))).min(Duration::from_secs(1));
            assert!(d <= cap, "attempt {i}: {d:?} > {cap:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
