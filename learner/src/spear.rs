//! SPEAR's self-imitation memory (spec §2b.1, from the official code):
//! trajectories that beat their group are kept, aged out after a few
//! steps, and once enough of them beat the running median of group means
//! they are replayed in an extra pass with recalibrated advantages, then
//! forgotten.
//!
//! The memory lives in the learner, not the buffer service: what it keeps
//! (the proximal log-probs of the step that trained a trajectory, its
//! advantage) exists only there. It is saved with every checkpoint, so a
//! resumed learner replays what one that never stopped would have.

use std::collections::VecDeque;

use rand::{SeedableRng, rngs::SmallRng, seq::index};
use serde::{Deserialize, Serialize};

use crate::{
    config_error::ConfigError,
    loss::registry::{ClipCovOptions, LossOptions},
};

/// The official code's cap on `tolerate_steps`.
const MAX_TOLERATE: u64 = 10;

/// `[learner.spear]`: defaults are the SPEAR scripts' where they set a
/// value, the yaml's otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpearConfig {
    /// Replay set cap; the memory replays once it counts more than 1.5×
    /// this many trajectories. Absent: one batch of sequences
    /// (`batch_groups × group_size`), the unit of SPEAR's math recipe
    /// (2048 = 128 × 16 there; the ALFWorld scripts' 2048 counts env-step
    /// rows, which bapo's episodes are not).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trajectory_buffer_size: Option<usize>,
    /// Trajectories more than this many batches older than the newest
    /// stored one are dropped before a batch is admitted (scripts 5; capped
    /// at 10, as the code does).
    pub tolerate_steps: u64,
    /// Entropy bonus of both passes (the official yaml's 0.001; the math
    /// recipe's is 0). `learner.entropy_coef` is refused with SPEAR.
    pub entropy_coef: f64,
    /// Group entries of the baseline history (per-group reward mean, std).
    pub baseline_buffer_size: usize,
    /// `None`: recalibrate replay advantages against the history's median
    /// (the scripts); `Some(w)` in (0, 1]: the stored advantage times `w`.
    pub advantage_scale: Option<f64>,
    /// Divide recalibrated advantages by the history's median group std.
    pub norm_adv_by_std: bool,
    /// `c_replay` of the replay loss's cosine warm-up.
    pub replay_loss_coef: f64,
    /// Batches over which the replay coefficient rises to `c_replay`.
    pub max_replay_loss_steps: u64,
    /// Clip-Cov of the on-policy pass (code defaults).
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    /// Clip-Cov of the replay pass (scripts).
    pub replay_clip_cov_ratio: f64,
    pub replay_clip_cov_lb: f64,
    pub replay_clip_cov_ub: f64,
}

impl Default for SpearConfig {
    fn default() -> Self {
        Self {
            trajectory_buffer_size: None,
            tolerate_steps: 5,
            entropy_coef: 0.001,
            baseline_buffer_size: 10240,
            advantage_scale: None,
            norm_adv_by_std: false,
            replay_loss_coef: 1.0,
            max_replay_loss_steps: 200,
            clip_cov_ratio: 2e-4,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            replay_clip_cov_ratio: 0.02,
            replay_clip_cov_lb: 2.0,
            replay_clip_cov_ub: 60.0,
        }
    }
}

impl SpearConfig {
    pub fn on_policy_clip_cov(&self) -> ClipCovOptions {
        ClipCovOptions {
            ratio: self.clip_cov_ratio,
            lb: self.clip_cov_lb,
            ub: self.clip_cov_ub,
        }
    }

    pub fn replay_clip_cov(&self) -> ClipCovOptions {
        ClipCovOptions {
            ratio: self.replay_clip_cov_ratio,
            lb: self.replay_clip_cov_lb,
            ub: self.replay_clip_cov_ub,
        }
    }

    /// The replay pass's loss options over the on-policy ones.
    pub fn replay_options(&self, on_policy: &LossOptions) -> LossOptions {
        LossOptions {
            clip_cov: Some(self.replay_clip_cov()),
            ..on_policy.clone()
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |f: &str, m: String| Err(ConfigError::new(&format!("spear.{f}"), m));
        if self.trajectory_buffer_size == Some(0) {
            return bad("trajectory_buffer_size", "must be at least 1".into());
        }
        if !(self.entropy_coef.is_finite() && self.entropy_coef >= 0.0) {
            return bad(
                "entropy_coef",
                format!("{} must be a number >= 0", self.entropy_coef),
            );
        }
        if self.baseline_buffer_size == 0 {
            return bad("baseline_buffer_size", "must be at least 1".into());
        }
        if let Some(w) = self.advantage_scale
            && !(w > 0.0 && w <= 1.0)
        {
            return bad("advantage_scale", format!("{w} must be in (0, 1]"));
        }
        if !(self.replay_loss_coef.is_finite() && self.replay_loss_coef >= 0.0) {
            return bad(
                "replay_loss_coef",
                format!("{} must be a number >= 0", self.replay_loss_coef),
            );
        }
        for (prefix, cc) in [
            ("spear.", self.on_policy_clip_cov()),
            ("spear.replay_", self.replay_clip_cov()),
        ] {
            cc.check(prefix).map_err(ConfigError::from_loss)?;
        }
        Ok(())
    }

    /// `c(t) = c_replay·(1 − cos(π t/T))/2` for `t ≤ T`, `c_replay` after,
    /// `t` verl's 1-based global step: batch `b` (0-based) is step `b + 1`.
    pub fn replay_coef(&self, batch: u64) -> f64 {
        let (t, t_max) = (batch + 1, self.max_replay_loss_steps);
        if t >= t_max {
            return self.replay_loss_coef;
        }
        let x = std::f64::consts::PI * t as f64 / t_max as f64;
        self.replay_loss_coef * (1.0 - x.cos()) / 2.0
    }

    /// The replay set cap for batches of `batch_seqs` sequences.
    pub fn buffer_size(&self, batch_seqs: usize) -> usize {
        self.trajectory_buffer_size.unwrap_or(batch_seqs).max(1)
    }

    /// Refuses a buffer the memory can never count past 1.5× of: at most
    /// `group_size − 1` winners a group are kept, over the
    /// `min(tolerate_steps, 10) + 2` batches the memory spans.
    pub fn check_reachable(&self, batch_groups: u32, group_size: usize) -> Result<(), String> {
        let Some(tbs) = self.trajectory_buffer_size else {
            return Ok(());
        };
        let span = self.tolerate_steps.min(MAX_TOLERATE) + 2;
        let most = span as usize * batch_groups as usize * group_size.saturating_sub(1);
        if 3 * tbs >= 2 * most {
            return Err(format!(
                "learner.spear.trajectory_buffer_size = {tbs}: the replay needs more than 1.5 × \
                 {tbs} remembered winners, but the memory holds at most {most} ({span} batches × \
                 {batch_groups} groups × {} winners a group of {group_size}), so SPEAR would never \
                 replay; set it below {}, or leave it out (one batch of sequences)",
                group_size.saturating_sub(1),
                (2 * most).div_ceil(3)
            ));
        }
        Ok(())
    }
}

/// One remembered trajectory, as its step trained it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    /// The batch (training iteration) that admitted it.
    pub batch: u64,
    pub reward: f32,
    pub advantage: f64,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// `lp_old` of its step: the replay ratio's anchor.
    pub logp_old: Vec<f32>,
    /// Which response tokens are the policy's (see `Sequence::mask`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mask: Vec<bool>,
}

/// A trajectory to replay, with the advantage it is replayed with.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    pub advantage: f64,
    pub stored: Stored,
}

/// Reward statistics of one group at one batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupStat {
    pub mean: f64,
    /// Population std (`np.std`).
    pub std: f64,
}

impl GroupStat {
    pub fn of(rewards: &[f64]) -> Self {
        let n = rewards.len().max(1) as f64;
        let mean = rewards.iter().sum::<f64>() / n;
        let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
        Self {
            mean,
            std: var.sqrt(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpearMemory {
    entries: Vec<Stored>,
    baseline: VecDeque<GroupStat>,
}

/// `np.percentile(v, 50)`: the middle value, or the mean of the two.
pub fn median(v: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = v.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

impl Stored {
    /// A stored trajectory the replay pass can lay out (see
    /// [`SpearMemory::check`]).
    fn check(&self, vocab: usize, max_len: usize) -> Result<(), String> {
        let n = self.response.len();
        if self.prompt.is_empty() || n == 0 {
            return Err("empty prompt or response".into());
        }
        if self.logp_old.len() != n || !(self.mask.is_empty() || self.mask.len() == n) {
            return Err(format!(
                "{n} response tokens but {} log-probs and a mask of {}",
                self.logp_old.len(),
                self.mask.len()
            ));
        }
        let finite = self.reward.is_finite() && self.advantage.is_finite();
        if !finite || self.logp_old.iter().any(|x| !x.is_finite()) {
            return Err("a reward, advantage or log-prob that is not finite".into());
        }
        crate::rollouts::check_tokens(&self.prompt, &self.response, vocab, max_len)
    }
}

impl SpearMemory {
    /// Refuses, naming the entry, a memory read back from a checkpoint
    /// that the replay pass could not train on (fresh batches are checked
    /// off the wire; a saved memory bypasses that).
    pub fn check(&self, vocab: usize, max_len: usize) -> Result<(), String> {
        for (i, e) in self.entries.iter().enumerate() {
            e.check(vocab, max_len)
                .map_err(|m| format!("SPEAR's memory, entry {i}: {m}"))?;
        }
        if self
            .baseline
            .iter()
            .any(|g| !(g.mean.is_finite() && g.std.is_finite()))
        {
            return Err("SPEAR's baseline holds a statistic that is not finite".into());
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Median of the history's group means and of its group stds.
    pub fn baseline(&self) -> Option<(f64, f64)> {
        let b = median(self.baseline.iter().map(|g| g.mean))?;
        let s = median(self.baseline.iter().map(|g| g.std))?;
        Some((b, s))
    }

    /// Records a batch's group statistics, ages the memory and keeps the
    /// trajectories that beat their group (advantage > 0).
    pub fn admit(
        &mut self,
        cfg: &SpearConfig,
        groups: &[GroupStat],
        trajectories: impl IntoIterator<Item = Stored>,
    ) {
        for g in groups {
            if self.baseline.len() == cfg.baseline_buffer_size {
                self.baseline.pop_front();
            }
            self.baseline.push_back(*g);
        }
        // As the official `remove_old`, before admitting: against the
        // newest stored batch, not this one.
        if let Some(latest) = self.entries.iter().map(|e| e.batch).max() {
            let tolerate = cfg.tolerate_steps.min(MAX_TOLERATE);
            self.entries.retain(|e| latest - e.batch <= tolerate);
        }
        self.entries
            .extend(trajectories.into_iter().filter(|t| t.advantage > 0.0));
    }

    /// What the trigger counts: in recalibration mode the trajectories
    /// whose reward beats the history's median group mean, else all.
    pub fn counted(&self, cfg: &SpearConfig) -> usize {
        match (cfg.advantage_scale, self.baseline()) {
            (None, Some((b, _))) => self.entries.iter().filter(|e| e.reward as f64 > b).count(),
            (None, None) => 0,
            (Some(_), _) => self.entries.len(),
        }
    }

    /// Every stored trajectory with its replay advantage (recalibrated
    /// against the history, or scaled), those below 0 dropped.
    pub fn recalibrated(&self, cfg: &SpearConfig) -> Vec<Replay> {
        let (b, s) = self.baseline().unwrap_or((0.0, 1.0));
        self.entries
            .iter()
            .map(|e| {
                let advantage = match cfg.advantage_scale {
                    Some(w) => e.advantage * w,
                    None if cfg.norm_adv_by_std => (e.reward as f64 - b) / (s + 1e-6),
                    None => e.reward as f64 - b,
                };
                Replay {
                    advantage,
                    stored: e.clone(),
                }
            })
            .filter(|r| r.advantage >= 0.0)
            .collect()
    }

    /// The replay set when the memory is full enough (then empties it): the
    /// recalibrated trajectories, a random subset of the largest power of
    /// two that fits, at most `trajectory_buffer_size`.
    pub fn take(&mut self, cfg: &SpearConfig, batch_seqs: usize, seed: u64) -> Option<Vec<Replay>> {
        let size = cfg.buffer_size(batch_seqs);
        if 2 * self.counted(cfg) <= 3 * size {
            return None;
        }
        let mut keep: Vec<Option<Replay>> = self.recalibrated(cfg).into_iter().map(Some).collect();
        self.entries.clear();
        let n = largest_power_of_two(keep.len()).min(size);
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut idx = index::sample(&mut rng, keep.len(), n).into_vec();
        idx.sort_unstable();
        let out: Vec<Replay> = idx.into_iter().filter_map(|i| keep[i].take()).collect();
        (!out.is_empty()).then_some(out)
    }
}

fn largest_power_of_two(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(batch: u64, reward: f32, advantage: f64) -> Stored {
        Stored {
            batch,
            reward,
            advantage,
            prompt: vec![1],
            response: vec![2],
            logp_old: vec![-0.5],
            mask: Vec::new(),
        }
    }

    fn stats(means: &[f64], stds: &[f64]) -> Vec<GroupStat> {
        means
            .iter()
            .zip(stds)
            .map(|(&mean, &std)| GroupStat { mean, std })
            .collect()
    }

    /// np.percentile(v, 50): the middle value, the mean of the middle two
    /// when even, whatever the order; nothing of nothing.
    #[test]
    fn median_is_numpys() {
        let m = |v: &[f64]| median(v.iter().copied());
        assert_eq!(m(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(m(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(m(&[7.0]), Some(7.0));
        assert_eq!(m(&[]), None);
    }

    /// Spec vector S1 (= survey V5): history means [0.2, 0.5, 0.8, 0.4,
    /// 0.6] → b = 0.5, stds → s = 0.25; rewards [1, 0.7, 0.3, 0.55] give
    /// A = [0.5, 0.2, −0.2, 0.05] (kept: all but the third), with the std
    /// [1.999992, 0.799997, −, 0.199999].
    #[test]
    fn s1_recalibration() {
        let h = stats(&[0.2, 0.5, 0.8, 0.4, 0.6], &[0.1, 0.3, 0.2, 0.4, 0.25]);
        for (norm, want) in [
            (false, [0.5, 0.2, 0.05]),
            (true, [1.999992, 0.799997, 0.199999]),
        ] {
            let cfg = SpearConfig {
                trajectory_buffer_size: Some(2),
                norm_adv_by_std: norm,
                ..Default::default()
            };
            let mut m = SpearMemory::default();
            m.admit(&cfg, &h, [1.0, 0.7, 0.3, 0.55].map(|r| stored(0, r, 1.0)));
            assert_eq!(m.baseline(), Some((0.5, 0.25)));
            let got: Vec<f64> = m.recalibrated(&cfg).iter().map(|r| r.advantage).collect();
            assert_eq!(got.len(), 3);
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "norm {norm}: {got:?}");
            }
            // Three rewards beat b = 0.5: not more than 1.5 × 2.
            assert_eq!(m.counted(&cfg), 3);
            assert!(m.take(&cfg, 0, 1).is_none());
            // With a cap of 1 they are: a subset of 1, and the memory empties.
            let one = SpearConfig {
                trajectory_buffer_size: Some(1),
                ..cfg
            };
            assert_eq!(m.take(&one, 0, 1).unwrap().len(), 1);
            assert!(m.is_empty());
        }
    }

    #[test]
    fn s1_replay_coefficient() {
        let cfg = SpearConfig {
            replay_loss_coef: 1.0,
            max_replay_loss_steps: 100,
            ..Default::default()
        };
        // c(t) at verl's steps t = 1, 25, 50, 100, 150: batches t − 1.
        let got: Vec<f64> = [0, 24, 49, 99, 149]
            .iter()
            .map(|&b| cfg.replay_coef(b))
            .collect();
        for (g, w) in got.iter().zip([0.000247, 0.146447, 0.5, 1.0, 1.0]) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }

    #[test]
    fn admission_keeps_winners_and_ages_out_old_batches() {
        // As `remove_old`: before admitting, against the newest stored
        // batch, so the memory spans tolerate_steps + 2 batches.
        let cfg = SpearConfig {
            tolerate_steps: 2,
            ..Default::default()
        };
        let mut m = SpearMemory::default();
        let g = stats(&[0.5], &[0.5]);
        m.admit(&cfg, &g, [stored(0, 1.0, 0.5), stored(0, 0.0, -0.5)]);
        assert_eq!(m.len(), 1, "a loser is not admitted");
        m.admit(&cfg, &g, [stored(2, 1.0, 0.5)]);
        assert_eq!(m.len(), 2);
        m.admit(&cfg, &g, [stored(3, 1.0, 0.0)]);
        assert_eq!(
            m.len(),
            2,
            "newest stored is 2: batch 0 stays; A = 0 not admitted"
        );
        m.admit(&cfg, &g, [stored(4, 1.0, 0.5)]);
        assert_eq!(m.len(), 3);
        m.admit(&cfg, &g, [stored(5, 1.0, 0.5)]);
        assert_eq!(m.len(), 3, "newest stored is 4: batch 0 is gone");
    }

    #[test]
    fn a_buffer_the_memory_can_never_fill_is_refused() {
        // Defaults: 7 batches × 8 groups × 7 winners = 392 at most.
        let cfg = SpearConfig {
            trajectory_buffer_size: Some(2048),
            ..Default::default()
        };
        let err = cfg.check_reachable(8, 8).unwrap_err();
        assert!(
            err.contains("learner.spear.trajectory_buffer_size") && err.contains("392"),
            "{err}"
        );
        let fits = SpearConfig {
            trajectory_buffer_size: Some(261),
            ..cfg
        };
        fits.check_reachable(8, 8).unwrap();
        SpearConfig::default().check_reachable(8, 8).unwrap();
        assert_eq!(SpearConfig::default().buffer_size(64), 64);
    }

    #[test]
    fn the_subset_is_a_power_of_two_and_the_baseline_history_is_bounded() {
        let cfg = SpearConfig {
            trajectory_buffer_size: Some(8),
            baseline_buffer_size: 4,
            ..Default::default()
        };
        let mut m = SpearMemory::default();
        let g = stats(&[0.0; 6], &[0.1; 6]);
        m.admit(&cfg, &g, (0..13).map(|_| stored(0, 1.0, 1.0)));
        assert_eq!(m.baseline.len(), 4);
        assert_eq!(m.counted(&cfg), 13);
        assert_eq!(m.take(&cfg, 0, 0).unwrap().len(), 8);
        let mut m = SpearMemory::default();
        m.admit(&cfg, &g, (0..13).map(|_| stored(0, 1.0, 1.0)));
        let small = SpearConfig {
            trajectory_buffer_size: Some(100),
            ..cfg.clone()
        };
        assert!(m.clone().take(&small, 0, 0).is_none());
        assert_eq!(largest_power_of_two(13), 8);
        assert_eq!(largest_power_of_two(16), 16);
        assert_eq!(largest_power_of_two(1), 1);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let e = SpearConfig {
            advantage_scale: Some(1.5),
            ..Default::default()
        };
        assert_eq!(
            e.validate().unwrap_err().field,
            "learner.spear.advantage_scale"
        );
        let e = SpearConfig {
            replay_clip_cov_lb: 70.0,
            ..Default::default()
        };
        assert_eq!(
            e.validate().unwrap_err().field,
            "learner.spear.replay_clip_cov_lb"
        );
        SpearConfig::default().validate().unwrap();
    }
}
