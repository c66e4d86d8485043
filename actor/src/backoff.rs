//! Exponential backoff with full jitter, so that actors restarted together
//! do not reconnect in lockstep; and the one retry loop the clients of a
//! user's services (rewards, environments) share.

use std::{future::Future, time::Duration};

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

/// The longest wait between two attempts of a call.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(10);

/// How hard to try one call: up to `retries` more attempts after the
/// first, waiting from `backoff` (doubled each time, capped at 10 s, with
/// jitter) between them.
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    pub retries: u32,
    pub backoff: Duration,
}

/// `call` until it succeeds, `failed` (which sees every failure, to count
/// it) says the failure is final, or `retry.retries` further attempts
/// fail; the last failure is returned.
pub async fn retrying<T, E, F>(
    retry: Retry,
    mut call: impl FnMut() -> F,
    mut failed: impl FnMut(&E) -> bool,
) -> Result<T, E>
where
    F: Future<Output = Result<T, E>>,
{
    let mut backoff = Backoff::new(retry.backoff, MAX_RETRY_DELAY);
    let mut attempt = 0;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                if !failed(&e) || attempt >= retry.retries {
                    return Err(e);
                }
                attempt += 1;
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
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
