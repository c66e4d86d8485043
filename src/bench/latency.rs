//! Latency recording shared by the benchmarks.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Microsecond histogram from 1 µs to 60 s, 3 significant digits.
pub struct Latencies(Histogram<u64>);

impl Latencies {
    pub fn new() -> Self {
        Self(Histogram::new_with_bounds(1, 60_000_000, 3).expect("static bounds are valid"))
    }

    pub fn record(&mut self, d: Duration) {
        self.0.saturating_record(d.as_micros().max(1) as u64);
    }

    pub fn merge(&mut self, other: &Latencies) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.0.add(&other.0);
    }

    /// Quantile in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.0.value_at_quantile(q) as f64 / 1000.0
    }
}
