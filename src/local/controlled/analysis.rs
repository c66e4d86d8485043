//! From runs to verdicts: each arm's endpoints over seeds, the two gates
//! and the four pre-registered hypotheses (docs/study/lag/README.md),
//! judged at a two-sided Welch p < 0.05.

use serde::Serialize;

use super::{
    arms::Arm,
    episode::{ArmRun, MicroSearch, StepRow},
    stats::{Welch, mean_sd, slope, welch},
};

/// The significance level the hypotheses were registered with.
pub const ALPHA: f64 = 0.05;
/// Gate 1: BAPO's start window misses its target in at least this share
/// of steps, or the bound search has nothing to do.
pub const GATE1_MISS: f64 = 0.30;

/// One arm's endpoints, per seed and summarised.
#[derive(Debug, Clone, Serialize)]
pub struct ArmSummary {
    pub arm: String,
    pub label: String,
    pub seeds: usize,
    /// Primary: fresh-sample entropy at the end minus at the start (nats).
    pub entropy_change: Vec<f64>,
    pub final_entropy: Vec<f64>,
    /// Least-squares slope of the probed entropy, per 100 steps.
    pub entropy_slope: Vec<f64>,
    pub test_accuracy: Vec<f64>,
    pub test_pass_at_k: Vec<f64>,
    pub final_val_accuracy: Vec<f64>,
    pub clip_frac_low: Vec<f64>,
    pub clip_frac_high: Vec<f64>,
    /// Steps whose gradient norm exceeds 3 × the run's median.
    pub grad_spikes: Vec<f64>,
    /// BAPO arms: share of searches at the start window, moved and
    /// meeting the target, exhausted (target missed at the search's end),
    /// and empty.
    pub regimes: Option<Regimes>,
    /// Mean ± sd over seeds of each endpoint above.
    pub mean_sd: Vec<(String, f64, f64)>,
}

/// Shares of a BAPO arm's searches: per update, or per micro-batch where
/// the search ran per micro-batch (so that no share is a mean of a
/// micro-batch at its limit and one at its start).
#[derive(Debug, Clone, Serialize)]
pub struct Regimes {
    /// The start window met the target, with something to train on.
    pub start: f64,
    pub moved: f64,
    pub exhausted: f64,
    /// Nothing to train on (every advantage 0; per update: no gradient):
    /// the search reports these as met at its start window, and they are
    /// counted apart.
    pub empty: f64,
    /// The same runs by quarter of their length: where in a run the search
    /// engages (training can erase the long failures it answers to).
    pub by_quarter: Vec<Quarter>,
}

/// One quarter of a BAPO arm's runs.
#[derive(Debug, Clone, Serialize)]
pub struct Quarter {
    /// Updates whose start window missed the target.
    pub searched: f64,
    /// Median positive share at ratio 1 (each batch's first update) over
    /// mini-batches with any advantage (GRPO gives those both signs; the
    /// learner reports 1 for one without).
    pub ratio1_share: f64,
}

/// Named tests of one hypothesis; `None`: too few seeds or no variance.
type Tests = Vec<(String, Option<Welch>)>;

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub name: String,
    pub statement: String,
    /// `None`: an arm it needs was not run.
    pub holds: Option<bool>,
    pub tests: Tests,
}

#[derive(Debug, Clone, Serialize)]
pub struct Analysis {
    pub arms: Vec<ArmSummary>,
    pub gate1_start_window_miss: Option<f64>,
    pub gate1_passed: Option<bool>,
    pub gate2_passed: Option<bool>,
    pub verdicts: Vec<Verdict>,
}

pub(super) fn median(xs: &[f64]) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    mean_sd(&v).0
}

pub(super) fn summarise(arm: &Arm, runs: &[&ArmRun]) -> ArmSummary {
    let per = |f: &dyn Fn(&ArmRun) -> f64| runs.iter().map(|r| f(r)).collect::<Vec<f64>>();
    let first = |r: &ArmRun| r.probes.first().map_or(f64::NAN, |p| p.entropy);
    let last = |r: &ArmRun| r.probes.last().map_or(f64::NAN, |p| p.entropy);
    let spikes = |r: &ArmRun| {
        let norms: Vec<f64> = r.steps.iter().map(|s| s.grad_norm).collect();
        let m = median(&norms);
        norms.iter().filter(|&&g| g > 3.0 * m).count() as f64
    };
    let regimes = (arm.algo == "bapo").then(|| regimes(runs));
    let mut s = ArmSummary {
        arm: arm.id.to_string(),
        label: arm.label.to_string(),
        seeds: runs.len(),
        entropy_change: per(&|r| last(r) - first(r)),
        final_entropy: per(&last),
        entropy_slope: per(&|r| {
            let pts: Vec<(f64, f64)> = r
                .probes
                .iter()
                .map(|p| (p.step as f64 / 100.0, p.entropy))
                .collect();
            slope(&pts)
        }),
        test_accuracy: per(&|r| r.test_accuracy),
        test_pass_at_k: per(&|r| r.test_pass_at_k.unwrap_or(f64::NAN)),
        final_val_accuracy: per(&|r| r.probes.last().map_or(f64::NAN, |p| p.val_accuracy)),
        clip_frac_low: per(&|r| mean(r.steps.iter().map(|s| s.clip_frac_low))),
        clip_frac_high: per(&|r| mean(r.steps.iter().map(|s| s.clip_frac_high))),
        grad_spikes: per(&spikes),
        regimes,
        mean_sd: Vec::new(),
    };
    s.mean_sd = s
        .endpoints()
        .into_iter()
        .map(|(name, xs)| {
            let (m, sd) = mean_sd(xs);
            (name.to_string(), m, sd)
        })
        .collect();
    s
}

/// [`Quarter`]s of `runs`, each run cut by its own number of batches.
fn regimes(runs: &[&ArmRun]) -> Regimes {
    let searches: Vec<MicroSearch> = runs
        .iter()
        .flat_map(|r| r.steps.iter().flat_map(searches_of))
        .collect();
    let n = searches.len().max(1) as f64;
    let share =
        |f: &dyn Fn(&MicroSearch) -> bool| searches.iter().filter(|s| f(s)).count() as f64 / n;
    Regimes {
        start: share(&|s| !s.empty && s.search_steps == 0.0),
        moved: share(&|s| !s.empty && s.search_steps > 0.0 && s.target_met > 0.0),
        exhausted: share(&|s| !s.empty && s.target_met == 0.0),
        empty: share(&|s| s.empty),
        by_quarter: quarters(runs),
    }
}

/// An update's searches: its micro-batches' where it kept them, else the
/// update's own (empty when it had no gradient).
fn searches_of(s: &StepRow) -> Vec<MicroSearch> {
    if !s.micro.is_empty() {
        return s.micro.clone();
    }
    vec![MicroSearch {
        search_steps: s.search_steps.unwrap_or(0.0),
        target_met: s.target_met.unwrap_or(1.0),
        c_low: s.c_low.unwrap_or(f64::NAN),
        c_high: s.c_high.unwrap_or(f64::NAN),
        empty: s.grad_norm == 0.0,
    }]
}

impl Regimes {
    /// The start window missed the target (Gate 1's reading, as
    /// registered: an empty search counts as met at the start).
    pub fn start_window_missed(&self) -> f64 {
        1.0 - self.start - self.empty
    }
}

fn quarters(runs: &[&ArmRun]) -> Vec<Quarter> {
    let rows = || {
        runs.iter().flat_map(|r| {
            let batches = r.steps.iter().map(|s| s.step + 1).max().unwrap_or(1);
            r.steps
                .iter()
                .map(move |s| ((s.step * 4 / batches) as usize, s))
        })
    };
    (0..4)
        .map(|q| {
            let mine: Vec<&StepRow> = rows().filter(|(k, _)| *k == q).map(|(_, s)| s).collect();
            let searched = mine
                .iter()
                .filter(|s| s.search_steps.unwrap_or(0.0) > 0.0)
                .count();
            let shares: Vec<f64> = mine
                .iter()
                .filter(|s| s.update == 0)
                .filter_map(|s| s.pos_fraction)
                .filter(|&p| p < 1.0)
                .collect();
            Quarter {
                searched: searched as f64 / mine.len().max(1) as f64,
                ratio1_share: median(&shares),
            }
        })
        .collect()
}

impl ArmSummary {
    pub fn endpoints(&self) -> Vec<(&'static str, &[f64])> {
        vec![
            ("entropy_change", &self.entropy_change),
            ("final_entropy", &self.final_entropy),
            ("entropy_slope", &self.entropy_slope),
            ("test_accuracy", &self.test_accuracy),
            ("test_pass_at_k", &self.test_pass_at_k),
            ("final_val_accuracy", &self.final_val_accuracy),
            ("clip_frac_low", &self.clip_frac_low),
            ("clip_frac_high", &self.clip_frac_high),
            ("grad_spikes", &self.grad_spikes),
        ]
    }
}

pub fn analyse(arms: &[Arm], runs: &[ArmRun]) -> Analysis {
    let summaries: Vec<ArmSummary> = arms
        .iter()
        .map(|a| {
            let mine: Vec<&ArmRun> = runs.iter().filter(|r| r.arm == a.id).collect();
            summarise(a, &mine)
        })
        .collect();
    let get = |id: &str| summaries.iter().find(|s| s.arm == id);
    let gate1 = get("f")
        .and_then(|f| f.regimes.as_ref())
        .map(Regimes::start_window_missed);
    let verdicts = hypotheses(&get);
    Analysis {
        gate1_start_window_miss: gate1,
        gate1_passed: gate1.map(|m| m >= GATE1_MISS),
        gate2_passed: verdicts.first().and_then(|v| v.holds),
        verdicts,
        arms: summaries,
    }
}

/// Significantly above (`> 0`) or below (`< 0`) at [`ALPHA`].
fn significant(w: &Option<Welch>, sign: f64) -> bool {
    w.as_ref()
        .is_some_and(|w| w.p < ALPHA && w.diff * sign > 0.0)
}

/// Not significantly below.
fn not_worse(w: &Option<Welch>) -> bool {
    !significant(w, -1.0)
}

fn hypotheses<'a>(get: &dyn Fn(&str) -> Option<&'a ArmSummary>) -> Vec<Verdict> {
    let test = |x: &str, y: &str, f: fn(&ArmSummary) -> &[f64]| {
        let (a, b) = (get(x)?, get(y)?);
        Some(welch(f(a), f(b)))
    };
    fn change(s: &ArmSummary) -> &[f64] {
        &s.entropy_change
    }
    fn fin(s: &ArmSummary) -> &[f64] {
        &s.final_entropy
    }
    fn acc(s: &ArmSummary) -> &[f64] {
        &s.test_accuracy
    }
    let mut out = Vec::new();
    // H1 (gate 2): entropy falls faster under lag with the fixed window.
    let h1 = test("b", "a", change);
    out.push(Verdict {
        name: "H1".into(),
        statement: "entropy(b) falls faster than entropy(a): the lag-16 PPO arm's entropy change is significantly below the lag-0 arm's".into(),
        holds: h1.as_ref().map(|w| significant(w, -1.0)),
        tests: vec![("entropy_change b - a".into(), h1.flatten())],
    });
    let (e_fb, a_fb) = (test("f", "b", fin), test("f", "b", acc));
    out.push(Verdict {
        name: "H2".into(),
        statement: "entropy(f) > entropy(b) (significant) and accuracy(f) >= accuracy(b) (not significantly below)".into(),
        holds: e_fb.as_ref().zip(a_fb.as_ref()).map(|(e, a)| significant(e, 1.0) && not_worse(a)),
        tests: vec![
            ("final_entropy f - b".into(), e_fb.flatten()),
            ("test_accuracy f - b".into(), a_fb.flatten()),
        ],
    });
    let differs = |other: &str| -> Option<(bool, Tests)> {
        let (e, a) = (test("f", other, fin)?, test("f", other, acc)?);
        let d = significant(&e, 1.0)
            || significant(&e, -1.0)
            || significant(&a, 1.0)
            || significant(&a, -1.0);
        Some((
            d,
            vec![
                (format!("final_entropy f - {other}"), e),
                (format!("test_accuracy f - {other}"), a),
            ],
        ))
    };
    let (c, d) = (differs("c"), differs("d"));
    let mut tests = Vec::new();
    for (_, t) in c.iter().chain(d.iter()) {
        tests.extend(t.iter().cloned());
    }
    out.push(Verdict {
        name: "H3".into(),
        statement: "(f) differs significantly from both fixed windows (c) and (d) in final entropy or test accuracy: the adaptation matters, not just its window".into(),
        holds: c.zip(d).map(|(c, d)| c.0 && d.0),
        tests,
    });
    let (e_eb, a_eb) = (test("e", "b", fin), test("e", "b", acc));
    out.push(Verdict {
        name: "H4".into(),
        statement: "(e) >= (b): the asymmetric window's final entropy and test accuracy are not significantly below the symmetric one's".into(),
        holds: e_eb.as_ref().zip(a_eb.as_ref()).map(|(e, a)| not_worse(e) && not_worse(a)),
        tests: vec![
            ("final_entropy e - b".into(), e_eb.flatten()),
            ("test_accuracy e - b".into(), a_eb.flatten()),
        ],
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::controlled::{arms::standard, episode::synthetic_run};

    /// A run whose entropy goes from 1.0 to `end`, with test (and
    /// validation) accuracy `acc`.
    fn run(arm: &str, seed: u64, end: f64, acc: f64) -> ArmRun {
        synthetic_run(arm, (0, seed), end, (acc, acc), acc)
    }

    #[test]
    fn verdicts_follow_the_registered_rules() {
        let jitter = |s: u64| s as f64 * 0.01;
        let mut runs = Vec::new();
        for s in 0..5 {
            runs.push(run("a", s, 0.95 + jitter(s), 0.5));
            runs.push(run("b", s, 0.5 + jitter(s), 0.5 + jitter(s)));
            runs.push(run("c", s, 0.5 + jitter(s), 0.5 + jitter(s)));
            runs.push(run("d", s, 0.9 + jitter(s), 0.5 + jitter(s)));
            runs.push(run("e", s, 0.5 + jitter(s), 0.5 + jitter(s)));
            runs.push(run("f", s, 0.9 + jitter(s), 0.5 + jitter(s)));
        }
        let a = analyse(&standard(16), &runs);
        let holds: Vec<Option<bool>> = a.verdicts.iter().map(|v| v.holds).collect();
        // H1: b loses more entropy than a; H2: f keeps more than b at the
        // same accuracy; H3: f is like d, so not different from both; H4:
        // e is the same as b.
        assert_eq!(holds, [Some(true), Some(true), Some(false), Some(true)]);
        assert_eq!(a.gate2_passed, Some(true));
        assert_eq!(a.gate1_start_window_miss, Some(0.5));
        assert_eq!(a.gate1_passed, Some(true));
        let g = a.arms.iter().find(|s| s.arm == "g").unwrap();
        assert_eq!(g.seeds, 0, "arm g was not run");
    }

    /// Regimes count micro-batches where the search ran per micro-batch:
    /// an update whose two micro-batches are one at its limit and one at
    /// its start is one of each, not "moved"; empty searches (no gradient,
    /// or a micro-batch with every advantage 0) are counted apart.
    #[test]
    fn regimes_count_micro_batches_and_empty_searches_apart() {
        let micro = |steps: f64, met: f64, empty: bool| MicroSearch {
            search_steps: steps,
            target_met: met,
            empty,
            ..MicroSearch::default()
        };
        let mixed = StepRow {
            search_steps: Some(25.0),
            target_met: Some(0.5),
            grad_norm: 1.0,
            micro: vec![micro(51.0, 0.0, false), micro(0.0, 1.0, false)],
            ..StepRow::default()
        };
        let with_empty = StepRow {
            micro: vec![micro(3.0, 1.0, false), micro(0.0, 1.0, true)],
            ..mixed.clone()
        };
        let no_gradient = StepRow {
            search_steps: Some(0.0),
            target_met: Some(1.0),
            grad_norm: 0.0,
            ..StepRow::default()
        };
        let r = ArmRun {
            steps: vec![mixed, with_empty, no_gradient],
            ..run("f", 0, 0.9, 0.5)
        };
        let g = regimes(&[&r]);
        let got = [g.start, g.moved, g.exhausted, g.empty];
        assert_eq!(got, [1.0 / 5.0, 1.0 / 5.0, 1.0 / 5.0, 2.0 / 5.0]);
        assert!((g.start_window_missed() - 2.0 / 5.0).abs() < 1e-12);
    }

    /// Eight batches of two updates: the search engages on every update
    /// of the first two batches and none after; the first updates' shares
    /// are 0.3, 0.5, then 1 (nothing to balance), 0.45, ... Quarter by
    /// quarter: searched 1, 0, 0, 0; the ratio-1 share (the upper median
    /// of the quarter's first updates) 0.5, 0.45 (the 1 left out), 0.7,
    /// 0.4.
    #[test]
    fn quarters_say_where_in_a_run_the_search_engaged() {
        let shares = [0.3, 0.5, 1.0, 0.45, 0.6, 0.7, 0.4, 0.2];
        let steps = (0..16u64)
            .map(|i| StepRow {
                step: i / 2,
                update: i % 2,
                pos_fraction: Some(if i % 2 == 0 {
                    shares[(i / 2) as usize]
                } else {
                    0.9
                }),
                search_steps: Some(if i < 4 { 3.0 } else { 0.0 }),
                ..StepRow::default()
            })
            .collect();
        let r = ArmRun {
            steps,
            ..run("f", 0, 0.9, 0.5)
        };
        let q = quarters(&[&r]);
        let got: Vec<(f64, f64)> = q.iter().map(|q| (q.searched, q.ratio1_share)).collect();
        assert_eq!(got, [(1.0, 0.5), (0.0, 0.45), (0.0, 0.7), (0.0, 0.4)]);
    }
}
