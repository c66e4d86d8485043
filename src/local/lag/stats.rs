//! Summaries over seeds and the significance test the hypotheses are
//! judged by: Welch's two-sample t-test (unequal variances), two-sided.

use serde::Serialize;
use statrs::distribution::{ContinuousCDF, StudentsT};

/// Mean and sample standard deviation (n − 1) of `xs`.
pub fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (m, f64::NAN);
    }
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, v.sqrt())
}

/// A comparison of two arms on one quantity.
#[derive(Debug, Clone, Serialize)]
pub struct Welch {
    /// Mean of the first minus mean of the second.
    pub diff: f64,
    pub t: f64,
    pub df: f64,
    /// Two-sided p-value.
    pub p: f64,
}

/// Welch's t-test of `a` against `b`; `None` with fewer than two values
/// in either, or no variance in both.
pub fn welch(a: &[f64], b: &[f64]) -> Option<Welch> {
    if a.len() < 2 || b.len() < 2 {
        return None;
    }
    let ((ma, sa), (mb, sb)) = (mean_sd(a), mean_sd(b));
    let (va, vb) = (sa * sa / a.len() as f64, sb * sb / b.len() as f64);
    let se2 = va + vb;
    if se2 <= 0.0 || !se2.is_finite() {
        return None;
    }
    let t = (ma - mb) / se2.sqrt();
    let df = se2 * se2 / (va * va / (a.len() as f64 - 1.0) + vb * vb / (b.len() as f64 - 1.0));
    let dist = StudentsT::new(0.0, 1.0, df).ok()?;
    let p = 2.0 * (1.0 - dist.cdf(t.abs()));
    Some(Welch {
        diff: ma - mb,
        t,
        df,
        p,
    })
}

/// Least-squares slope of `y` on `x`.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return f64::NAN;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    sxy / sxx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_sample_sd_by_hand() {
        let (m, s) = mean_sd(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        // Σ(x − 5)² = 32, / 7.
        assert!((s - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert!(mean_sd(&[1.0]).1.is_nan());
    }

    #[test]
    fn welch_matches_a_hand_computed_case() {
        // a: mean 2, var 1 (n 3); b: mean 5, var 1 (n 3). se² = 2/3,
        // t = -3 / sqrt(2/3) = -3.674; df = (2/3)² / (2 (1/3)² / 2) = 4.
        let w = welch(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]).unwrap();
        assert!((w.t + 3.674_234_614).abs() < 1e-6, "{w:?}");
        assert!((w.df - 4.0).abs() < 1e-9, "{w:?}");
        // Two-sided p of |t| = 3.674 at 4 df: 0.0213 (t tables).
        assert!((w.p - 0.0213).abs() < 5e-4, "{w:?}");
        let same = welch(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]).unwrap();
        assert!((same.p - 1.0).abs() < 1e-12);
        assert!(welch(&[1.0], &[2.0, 3.0]).is_none());
        assert!(welch(&[1.0, 1.0], &[2.0, 2.0]).is_none(), "no variance");
    }

    #[test]
    fn slope_of_a_line() {
        let pts: Vec<(f64, f64)> = (0..5).map(|i| (i as f64, 3.0 - 0.5 * i as f64)).collect();
        assert!((slope(&pts) + 0.5).abs() < 1e-12);
    }
}
