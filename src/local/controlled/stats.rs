//! Summaries over seeds and the significance tests the hypotheses are
//! judged by: Welch's two-sample t-test (unequal variances), two-sided;
//! for the reuse study's paired design (every arm of one warm start and
//! seed sees the same prompts), the paired t-test, its one-sided form for
//! non-inferiority, Holm's step-down correction and the smallest effect a
//! design of this size detects.

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

/// A paired comparison: the mean of `a_i - b_i` and its t-test.
#[derive(Debug, Clone, Serialize)]
pub struct Paired {
    pub n: usize,
    /// Mean difference `a - b`.
    pub diff: f64,
    /// Sample sd of the differences.
    pub sd: f64,
    pub t: f64,
    /// Two-sided p-value.
    pub p: f64,
}

/// Paired t-test of `a` against `b` (same length, pair `i` with `i`);
/// `None` with fewer than two pairs or no variance in the differences.
pub fn paired(a: &[f64], b: &[f64]) -> Option<Paired> {
    if a.len() != b.len() || a.len() < 2 {
        return None;
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let (m, sd) = mean_sd(&d);
    let n = d.len() as f64;
    if sd <= 0.0 || !sd.is_finite() {
        return None;
    }
    let t = m / (sd / n.sqrt());
    let dist = StudentsT::new(0.0, 1.0, n - 1.0).ok()?;
    Some(Paired {
        n: d.len(),
        diff: m,
        sd,
        t,
        p: 2.0 * (1.0 - dist.cdf(t.abs())),
    })
}

/// One-sided p-value that the mean of `a - b` exceeds `-margin` (the
/// non-inferiority of `a` to `b` within `margin`), paired; `None` as for
/// [`paired`].
pub fn non_inferiority_p(a: &[f64], b: &[f64], margin: f64) -> Option<f64> {
    let shifted: Vec<f64> = a.iter().map(|x| x + margin).collect();
    let p = paired(&shifted, b)?;
    let dist = StudentsT::new(0.0, 1.0, p.n as f64 - 1.0).ok()?;
    Some(1.0 - dist.cdf(p.t))
}

/// Holm's step-down adjustment of `ps` (family-wise error), in the order
/// given: the k-th smallest p is multiplied by `m - k`, then made
/// monotone and capped at 1.
pub fn holm(ps: &[f64]) -> Vec<f64> {
    let m = ps.len();
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&i, &j| ps[i].total_cmp(&ps[j]));
    let mut adjusted = vec![0.0; m];
    let mut running: f64 = 0.0;
    for (k, &i) in order.iter().enumerate() {
        running = running.max((ps[i] * (m - k) as f64).min(1.0));
        adjusted[i] = running;
    }
    adjusted
}

/// The smallest mean paired difference a two-sided test at `alpha`
/// detects with probability `power`, for `n` pairs whose differences
/// have sd `sd` (the t approximation `(t_{1-α/2} + t_{power}) sd / √n`).
pub fn detectable_effect(n: usize, sd: f64, alpha: f64, power: f64) -> f64 {
    if n < 2 {
        return f64::NAN;
    }
    let Ok(dist) = StudentsT::new(0.0, 1.0, n as f64 - 1.0) else {
        return f64::NAN;
    };
    (dist.inverse_cdf(1.0 - alpha / 2.0) + dist.inverse_cdf(power)) * sd / (n as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_t_matches_a_hand_computed_case() {
        // d = [1, 2, 3]: mean 2, sd 1, t = 2 / (1/√3) = 3.464 at 2 df;
        // two-sided p = 0.0742 (t tables).
        let p = paired(&[2.0, 4.0, 6.0], &[1.0, 2.0, 3.0]).unwrap();
        assert!((p.t - 3.464_101_615).abs() < 1e-6, "{p:?}");
        assert!((p.p - 0.0742).abs() < 5e-4, "{p:?}");
        assert!(paired(&[1.0, 2.0], &[0.0, 1.0]).is_none(), "no variance");
        assert!(paired(&[1.0], &[0.0]).is_none());
        // Non-inferiority within 0.5 of d = [-0.1, 0.1, 0.0] (mean 0, sd
        // 0.1): t = 0.5 / (0.1/√3) = 8.66 at 2 df, one-sided p = 0.0065.
        let ni = non_inferiority_p(&[0.9, 1.1, 1.0], &[1.0, 1.0, 1.0], 0.5).unwrap();
        assert!((ni - 0.0065).abs() < 5e-4, "{ni}");
    }

    #[test]
    fn holm_by_hand() {
        // Sorted 0.01, 0.02, 0.04 -> x3, x2, x1 = 0.03, 0.04, 0.04.
        let a = holm(&[0.04, 0.01, 0.02]);
        let want = [0.04, 0.03, 0.04];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-12, "{a:?}");
        }
        assert_eq!(holm(&[0.6, 0.5]), vec![1.0, 1.0]);
    }

    #[test]
    fn detectable_effect_shrinks_with_pairs() {
        // n = 9, sd 1, alpha 0.05, power 0.8: (2.306 + 0.889) / 3 = 1.065.
        let e = detectable_effect(9, 1.0, 0.05, 0.8);
        assert!((e - 1.065).abs() < 2e-3, "{e}");
        assert!(detectable_effect(36, 1.0, 0.05, 0.8) < e);
    }

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
