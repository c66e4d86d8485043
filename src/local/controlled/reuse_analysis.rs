//! From the reuse study's runs to its registered verdicts
//! (docs/study/reuse/README.md): the gates, one primary contrast, the
//! secondary contrasts under Holm's correction, a non-inferiority test and
//! the effect the design could detect. Every contrast is paired: two arms'
//! runs of the same warm start and seed saw the same prompts, drawn the
//! same way.

use serde::Serialize;

use super::{
    analysis::{ALPHA, ArmSummary, GATE1_MISS, Regimes, summarise},
    arms::Arm,
    episode::{ArmRun, Probe, WarmRow},
    gate::Gate0,
    stats::{Paired, detectable_effect, holm, mean_sd, non_inferiority_p, paired},
};

/// Power the detectable effect is stated at.
pub const POWER: f64 = 0.8;

/// One paired contrast of two arms on one endpoint.
#[derive(Debug, Clone, Serialize)]
pub struct Contrast {
    pub name: String,
    pub test: Option<Paired>,
    /// Holm-adjusted p within the secondary family (the primary: its own).
    pub p_adjusted: Option<f64>,
}

impl Contrast {
    /// Significant at [`ALPHA`] after adjustment, in either direction.
    pub fn significant(&self) -> Option<bool> {
        self.p_adjusted.map(|p| p < ALPHA)
    }
}

/// Gate 2's dose-response: entropy change per doubling of E under PPO
/// [0.8, 1.2], one slope per (warm start, seed), tested against 0.
#[derive(Debug, Clone, Serialize)]
pub struct DoseResponse {
    /// Mean entropy change at each E (seed means).
    pub by_updates: Vec<(u64, f64)>,
    pub slope: Option<Paired>,
    /// Arm a's greedy validation accuracy, end minus start, paired over
    /// runs.
    pub on_policy_gain: Option<Paired>,
    /// The same at the training temperature (the entropy probe's samples,
    /// scored): what the gate reads when every run of arm a measured it.
    /// RL raises sampled accuracy; greedy decoding of the tiny model sat at
    /// its ceiling while batch reward rose (gate probe L1).
    pub on_policy_sampled_gain: Option<Paired>,
    pub passed: Option<bool>,
    /// Entropy change of the reuse arm minus its equal-update control
    /// (`pE` − `uE`) at every E where both ran: what reuse costs beyond
    /// making the same updates on fresh data. Not part of the gate.
    pub reuse_vs_fresh: Vec<(u64, Option<Paired>)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NonInferiority {
    pub name: String,
    pub margin: f64,
    pub mean_diff: f64,
    /// One-sided p that the difference exceeds `-margin`.
    pub p: Option<f64>,
    pub holds: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReuseAnalysis {
    pub updates: u64,
    /// The warm starts themselves, measured as the runs are at their end.
    pub warm_starts: Vec<WarmRow>,
    pub arms: Vec<ArmSummary>,
    pub gate0: Vec<Gate0>,
    pub gate0_passed: Option<bool>,
    pub gate1_start_window_miss: Option<f64>,
    pub gate1_passed: Option<bool>,
    /// Gate 1 on each warm start's runs of arm f: the search fades as
    /// training removes the long failures, so one warm start could carry
    /// the pooled figure while another leaves the search idle.
    pub gate1_by_warm_start: Vec<(u64, f64)>,
    pub gate2: DoseResponse,
    pub primary: Contrast,
    /// Holds when the primary contrast is significant with f above b.
    pub primary_holds: Option<bool>,
    /// The primary without the one warm start on which Gate 1 failed,
    /// when exactly one of several did: the registered sensitivity
    /// analysis, reported beside the primary, not a second test.
    pub primary_sensitivity: Option<(u64, Contrast)>,
    pub secondary: Vec<Contrast>,
    pub non_inferiority: NonInferiority,
    /// The smallest primary effect (nats) this many pairs detect at
    /// [`POWER`], from the observed sd of the paired differences.
    pub detectable_effect: Option<f64>,
}

/// Runs of `arm` keyed by (warm start, seed).
fn keyed<'a>(runs: &'a [ArmRun], arm: &str) -> Vec<((u64, u64), &'a ArmRun)> {
    let mut v: Vec<_> = runs
        .iter()
        .filter(|r| r.arm == arm)
        .map(|r| ((r.warm, r.seed), r))
        .collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

/// `f` of arms `x` and `y` on the (warm start, seed) pairs both ran.
fn pairs(runs: &[ArmRun], x: &str, y: &str, f: fn(&ArmRun) -> f64) -> (Vec<f64>, Vec<f64>) {
    let ys = keyed(runs, y);
    keyed(runs, x)
        .into_iter()
        .filter_map(|(k, a)| {
            let b = ys.iter().find(|(kb, _)| *kb == k)?.1;
            Some((f(a), f(b)))
        })
        .unzip()
}

fn final_entropy(r: &ArmRun) -> f64 {
    r.probes.last().map_or(f64::NAN, |p| p.entropy)
}

fn entropy_change(r: &ArmRun) -> f64 {
    final_entropy(r) - r.probes.first().map_or(f64::NAN, |p| p.entropy)
}

fn test_accuracy(r: &ArmRun) -> f64 {
    r.test_accuracy
}

fn contrast(runs: &[ArmRun], x: &str, y: &str, endpoint: (&str, fn(&ArmRun) -> f64)) -> Contrast {
    let (a, b) = pairs(runs, x, y, endpoint.1);
    Contrast {
        name: format!("{} {x} - {y}", endpoint.0),
        test: paired(&a, &b),
        p_adjusted: None,
    }
}

pub fn analyse(
    updates: u64,
    arms: &[Arm],
    runs: &[ArmRun],
    gate0: &[Gate0],
    warm: &[WarmRow],
    margin: f64,
) -> ReuseAnalysis {
    let summaries: Vec<ArmSummary> = arms
        .iter()
        .map(|a| {
            let mine: Vec<&ArmRun> = runs.iter().filter(|r| r.arm == a.id).collect();
            summarise(a, &mine)
        })
        .collect();
    let gate1 = summaries
        .iter()
        .find(|s| s.arm == "f" && s.seeds > 0)
        .and_then(|f| f.regimes.as_ref())
        .map(Regimes::start_window_missed);
    let mut primary = contrast(runs, "f", "b", ("final_entropy", final_entropy));
    primary.p_adjusted = primary.test.as_ref().map(|t| t.p);
    let primary_holds = primary.test.as_ref().map(|t| t.p < ALPHA && t.diff > 0.0);
    let detectable = primary
        .test
        .as_ref()
        .map(|t| detectable_effect(t.n, t.sd, ALPHA, POWER));
    let gate1_by_warm_start = gate1_by_warm_start(arms, runs);
    ReuseAnalysis {
        updates,
        warm_starts: warm.to_vec(),
        gate0: gate0.to_vec(),
        gate0_passed: (!gate0.is_empty()).then(|| gate0.iter().all(Gate0::passed)),
        gate1_start_window_miss: gate1,
        gate1_passed: gate1.map(|m| m >= GATE1_MISS),
        gate2: dose_response(arms, runs, updates),
        primary_sensitivity: without_idle_warm_start(&gate1_by_warm_start, runs),
        gate1_by_warm_start,
        primary,
        primary_holds,
        secondary: secondary(runs),
        non_inferiority: non_inferiority(runs, margin),
        detectable_effect: detectable,
        arms: summaries,
    }
}

/// Arm f's start-window miss (Gate 1's reading) per warm start it ran on.
fn gate1_by_warm_start(arms: &[Arm], runs: &[ArmRun]) -> Vec<(u64, f64)> {
    let Some(f) = arms.iter().find(|a| a.id == "f") else {
        return Vec::new();
    };
    let mine = keyed(runs, "f");
    let warms: std::collections::BTreeSet<u64> = mine.iter().map(|((w, _), _)| *w).collect();
    warms
        .into_iter()
        .filter_map(|w| {
            let of_w: Vec<&ArmRun> = mine.iter().filter(|(k, _)| k.0 == w).map(|x| x.1).collect();
            Some((w, summarise(f, &of_w).regimes?.start_window_missed()))
        })
        .collect()
}

/// The primary over every warm start but the one whose Gate 1 reading
/// fell short, if exactly one of two or more did (registration: "if it
/// fails on one warm start only, the primary is also reported without
/// that warm start").
fn without_idle_warm_start(by_warm: &[(u64, f64)], runs: &[ArmRun]) -> Option<(u64, Contrast)> {
    let failed: Vec<u64> = by_warm
        .iter()
        .filter(|(_, miss)| *miss < GATE1_MISS)
        .map(|(w, _)| *w)
        .collect();
    let ([w], true) = (failed.as_slice(), by_warm.len() >= 2) else {
        return None;
    };
    let kept: Vec<ArmRun> = runs.iter().filter(|r| r.warm != *w).cloned().collect();
    let mut c = contrast(&kept, "f", "b", ("final_entropy", final_entropy));
    c.name = format!("{} without warm start {w}", c.name);
    c.p_adjusted = c.test.as_ref().map(|t| t.p);
    Some((*w, c))
}

/// The registered secondary family, Holm-adjusted together.
fn secondary(runs: &[ArmRun]) -> Vec<Contrast> {
    let fin = ("final_entropy", final_entropy as fn(&ArmRun) -> f64);
    let acc = ("test_accuracy", test_accuracy as fn(&ArmRun) -> f64);
    let mut family = vec![
        contrast(runs, "b", "a", fin),
        contrast(runs, "f", "b", acc),
        contrast(runs, "f", "c", fin),
        contrast(runs, "f", "d", fin),
        contrast(runs, "e", "b", fin),
        contrast(runs, "g", "b", fin),
        contrast(runs, "h", "b", fin),
    ];
    let tested: Vec<usize> = (0..family.len())
        .filter(|&i| family[i].test.is_some())
        .collect();
    let ps: Vec<f64> = tested
        .iter()
        .filter_map(|&i| family[i].test.as_ref().map(|t| t.p))
        .collect();
    for (&i, p) in tested.iter().zip(holm(&ps)) {
        family[i].p_adjusted = Some(p);
    }
    family
}

/// f's test accuracy against b's, within `margin` (registered with the
/// setting: 3 points suits accuracies of 0.1-0.3, not 0.02-0.06).
fn non_inferiority(runs: &[ArmRun], margin: f64) -> NonInferiority {
    let (f, b) = pairs(runs, "f", "b", test_accuracy);
    let diffs: Vec<f64> = f.iter().zip(&b).map(|(x, y)| x - y).collect();
    let p = non_inferiority_p(&f, &b, margin);
    NonInferiority {
        name: "test_accuracy f - b".into(),
        margin,
        mean_diff: mean_sd(&diffs).0,
        p,
        holds: p.map(|p| p < ALPHA),
    }
}

/// PPO [0.8, 1.2] at every E that ran: `a` (1), `p2`, `p4`, `p8` and `b`
/// (the study's E).
fn dose_response(arms: &[Arm], runs: &[ArmRun], updates: u64) -> DoseResponse {
    let ppo_ids: Vec<(&str, u64)> = arms
        .iter()
        .filter(|a| a.algo == "ppo" && a.eps == Some((0.2, 0.2)) && !a.fresh)
        .map(|a| (a.id, a.updates))
        .collect();
    let mut by_updates: Vec<(u64, f64)> = Vec::new();
    let mut per_key: std::collections::BTreeMap<(u64, u64), Vec<(f64, f64)>> = Default::default();
    for &(id, e) in &ppo_ids {
        let mine = keyed(runs, id);
        if mine.is_empty() || by_updates.iter().any(|(x, _)| *x == e) {
            continue;
        }
        let changes: Vec<f64> = mine.iter().map(|(_, r)| entropy_change(r)).collect();
        by_updates.push((e, mean_sd(&changes).0));
        for (k, r) in mine {
            per_key
                .entry(k)
                .or_default()
                .push(((e as f64).log2(), entropy_change(r)));
        }
    }
    by_updates.sort_by_key(|x| x.0);
    let slopes: Vec<f64> = per_key
        .values()
        .filter(|pts| pts.len() >= 2)
        .map(|pts| super::stats::slope(pts))
        .collect();
    let slope = paired(&slopes, &vec![0.0; slopes.len()]);
    let gain = on_policy_gain(runs, |p| Some(p.val_accuracy));
    let sampled_gain = on_policy_gain(runs, |p| p.sampled_accuracy);
    let reaches = by_updates.iter().any(|(e, _)| *e == updates) && by_updates.len() >= 3;
    let passed = match (&slope, sampled_gain.as_ref().or(gain.as_ref())) {
        (Some(s), Some(g)) if reaches => {
            Some(s.diff < 0.0 && s.p < ALPHA && g.diff > 0.0 && g.p < ALPHA)
        }
        _ => None,
    };
    DoseResponse {
        by_updates,
        slope,
        on_policy_gain: gain,
        on_policy_sampled_gain: sampled_gain,
        passed,
        reuse_vs_fresh: reuse_vs_fresh(arms, runs),
    }
}

/// Arm a's accuracy by `pick`, last probe minus first, paired over runs;
/// `None` unless every run measured it.
fn on_policy_gain(runs: &[ArmRun], pick: fn(&Probe) -> Option<f64>) -> Option<Paired> {
    let (end, start): (Vec<f64>, Vec<f64>) = keyed(runs, "a")
        .into_iter()
        .map(|(_, r)| Some((pick(r.probes.last()?)?, pick(r.probes.first()?)?)))
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .unzip();
    paired(&end, &start)
}

/// `pE` − `uE` final entropy change, paired by (warm start, seed), for
/// every fresh arm whose reuse twin (PPO [0.8, 1.2] at the same E) ran.
fn reuse_vs_fresh(arms: &[Arm], runs: &[ArmRun]) -> Vec<(u64, Option<Paired>)> {
    // `b` and `p8` are the same arm at E 8: whichever ran.
    let twin = |e: u64| {
        arms.iter().find(|a| {
            !a.fresh
                && a.algo == "ppo"
                && a.eps == Some((0.2, 0.2))
                && a.updates == e
                && runs.iter().any(|r| r.arm == a.id)
        })
    };
    arms.iter()
        .filter(|a| a.fresh)
        .filter_map(|u| {
            let p = twin(u.updates)?;
            let fresh: std::collections::BTreeMap<_, _> = keyed(runs, u.id).into_iter().collect();
            let (reused, controls): (Vec<f64>, Vec<f64>) = keyed(runs, p.id)
                .into_iter()
                .filter_map(|(k, r)| Some((entropy_change(r), entropy_change(fresh.get(&k)?))))
                .unzip();
            (!reused.is_empty()).then(|| (u.updates, paired(&reused, &controls)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::controlled::{arms::reuse, episode::synthetic_run};

    /// A run whose entropy goes from 1.0 to `end`, validation accuracy
    /// from 0.3 to `val`, test accuracy `acc`.
    fn run(arm: &str, warm: u64, seed: u64, end: f64, val: f64, acc: f64) -> ArmRun {
        synthetic_run(arm, (warm, seed), end, (0.3, val), acc)
    }

    #[test]
    fn verdicts_follow_the_registered_rules() {
        let mut runs = Vec::new();
        for w in 0..3 {
            for s in 0..3 {
                let j = (w * 3 + s) as f64 * 0.003;
                // Entropy falls with E under PPO; f keeps it; accuracy
                // equal within noise.
                runs.push(run("a", w, s, 0.95 + j * 0.5, 0.4 + j, 0.5 + j));
                runs.push(run("p2", w, s, 0.85 + j * 2.0, 0.4, 0.5));
                runs.push(run("p4", w, s, 0.75 - j, 0.4, 0.5));
                runs.push(run("b", w, s, 0.6 + j, 0.4, 0.5 + j));
                runs.push(run("f", w, s, 0.9 - j, 0.4, 0.5 + j * 0.5));
                runs.push(run("u8", w, s, 0.8 + j * 3.0, 0.4, 0.5));
            }
        }
        let a = analyse(8, &reuse(8), &runs, &[], &[], 0.03);
        // b − u8 = (0.6 + j) − (0.8 + 3j) = −0.2 − 2j, over j = 0..0.024.
        let [(e, Some(vs))] = a.gate2.reuse_vs_fresh.as_slice() else {
            panic!("{:?}", a.gate2.reuse_vs_fresh)
        };
        assert_eq!((*e, vs.n), (8, 9));
        assert!((vs.diff - (-0.2 - 2.0 * 0.012)).abs() < 1e-9, "{vs:?}");
        assert_eq!(a.primary_holds, Some(true), "{:?}", a.primary);
        assert_eq!(a.gate2.passed, Some(true), "{:?}", a.gate2);
        assert_eq!(
            a.gate2.by_updates.iter().map(|x| x.0).collect::<Vec<_>>(),
            [1, 2, 4, 8]
        );
        assert_eq!(a.gate1_start_window_miss, Some(0.5));
        assert_eq!(a.gate1_by_warm_start, [(0, 0.5), (1, 0.5), (2, 0.5)]);
        assert_eq!(a.non_inferiority.holds, Some(true));
        // f − b on test accuracy is −j/2, mean −0.006: inside 3 points, not
        // inside a tenth of one.
        let tight = analyse(8, &reuse(8), &runs, &[], &[], 0.001).non_inferiority;
        assert!((tight.mean_diff + 0.006).abs() < 1e-9, "{tight:?}");
        assert_eq!((tight.margin, tight.holds), (0.001, Some(false)));
        let tested: Vec<&str> = a
            .secondary
            .iter()
            .filter(|c| c.test.is_some())
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(tested, ["final_entropy b - a", "test_accuracy f - b"]);
        // Holm never lowers a p-value.
        for c in &a.secondary {
            if let (Some(t), Some(p)) = (&c.test, c.p_adjusted) {
                assert!(p >= t.p, "{c:?}");
            }
        }
        assert!(a.detectable_effect.unwrap() > 0.0);
        assert_eq!(a.gate0_passed, None, "gate 0 not measured");
        let g = a.arms.iter().find(|s| s.arm == "h").unwrap();
        assert_eq!(g.seeds, 0, "arm h was not run");
    }

    #[test]
    fn gate1_is_read_per_warm_start_beside_the_pooled_figure() {
        let mut runs = Vec::new();
        for s in 0..2 {
            // Warm start 0: the search on every other update (as
            // synthesised); warm start 1: on one update in ten.
            runs.push(run("f", 0, s, 0.9, 0.4, 0.5));
            let mut idle = run("f", 1, s, 0.9, 0.4, 0.5);
            for (t, st) in idle.steps.iter_mut().enumerate() {
                st.search_steps = Some(if t == 3 { 2.0 } else { 0.0 });
            }
            runs.push(idle);
            // Arm b on both: f keeps 0.1 more entropy on warm start 0,
            // 0.3 less on warm start 1.
            runs.push(run("b", 0, s, 0.8 - 0.01 * s as f64, 0.4, 0.5));
            runs.push(run("b", 1, s, 1.2, 0.4, 0.5));
        }
        let a = analyse(8, &reuse(8), &runs, &[], &[], 0.03);
        // Pooled: (5 + 1) searched of 10 updates, per seed: 0.3, passing.
        assert!((a.gate1_start_window_miss.unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(a.gate1_passed, Some(true));
        let [(0, w0), (1, w1)] = a.gate1_by_warm_start[..] else {
            panic!("{:?}", a.gate1_by_warm_start)
        };
        assert!(
            (w0 - 0.5).abs() < 1e-12 && (w1 - 0.1).abs() < 1e-12,
            "{w0} {w1}"
        );
        // Warm start 1 fails Gate 1 alone: the primary is read again
        // without it, on warm start 0's two pairs.
        let (w, c) = a.primary_sensitivity.expect("one warm start failed gate 1");
        let t = c.test.unwrap();
        assert_eq!((w, t.n), (1, 2));
        assert!((t.diff - 0.105).abs() < 1e-9, "{t:?}");
        assert!(a.primary.test.unwrap().diff < 0.0, "pooled, f below b");
        // Both passing (or both failing): nothing to read again.
        let both: Vec<ArmRun> = runs.iter().filter(|r| r.warm == 0).cloned().collect();
        assert!(
            analyse(8, &reuse(8), &both, &[], &[], 0.03)
                .primary_sensitivity
                .is_none()
        );
    }

    /// Gate 2's dose arms with a clear entropy dose-response, arm a's
    /// greedy and sampled validation accuracy moving as given.
    fn gate2(greedy_gain: f64, sampled_gain: Option<f64>) -> DoseResponse {
        let mut runs = Vec::new();
        for s in 0..3 {
            let j = s as f64 * 0.01;
            let mut a = run("a", 0, s, 0.95 - j, 0.3 + greedy_gain + j, 0.5);
            for p in &mut a.probes {
                p.sampled_accuracy =
                    sampled_gain.map(|g| 0.1 + if p.step > 0 { g + j } else { 0.0 });
            }
            runs.push(a);
            runs.push(run("p2", 0, s, 0.9 - 2.0 * j, 0.3, 0.5));
            runs.push(run("p4", 0, s, 0.8 - 4.0 * j, 0.3, 0.5));
        }
        analyse(4, &reuse(4), &runs, &[], &[], 0.03).gate2
    }

    #[test]
    fn gate2_reads_sampled_accuracy_where_every_run_measured_it() {
        let rose = gate2(0.05, Some(0.05));
        assert_eq!(rose.passed, Some(true), "{rose:?}");
        let sampled = rose.on_policy_sampled_gain.unwrap();
        assert!((sampled.diff - 0.06).abs() < 1e-9, "{sampled:?}");
        // Greedy up, sampled down: the gate follows the samples.
        assert_eq!(gate2(0.05, Some(-0.05)).passed, Some(false));
        // Greedy down, sampled up: learning as RL measures it.
        assert_eq!(gate2(-0.05, Some(0.05)).passed, Some(true));
        // Runs from before the samples were scored: greedy decides.
        let old = gate2(0.05, None);
        assert!(old.on_policy_sampled_gain.is_none());
        assert_eq!(old.passed, Some(true));
        assert_eq!(gate2(-0.05, None).passed, Some(false));
    }
}
