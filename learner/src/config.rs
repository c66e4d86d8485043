//! The `[learner]` table of the config file: the loss and its options, the
//! optimiser, batching, and how often to broadcast, checkpoint and evaluate.

use bapo_policy::{lora::LoraConfig, weights::Encoding};
use serde::{Deserialize, Serialize};

use crate::{
    advantage::Estimator,
    loss::{
        Aggregation, LossError, PolicyLoss,
        bapo::BapoMode,
        rec::RecWeight,
        registry::{self, ClipCovOptions, LossOptions, TisOptions},
        tis::{IsCorrection, TisLevel},
    },
    remix::RemixConfig,
    schedule::{Decay, LrSchedule},
    spear::SpearConfig,
};

/// Which log-probs play `lp_old`, the anchor of the ratio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Proximal {
    /// `lp_old := lp_behav`, the log-probs the actor recorded: the ratio is
    /// `π_θ / π_rollout`, as in the BAPO paper (its eq. 4 equates the old
    /// policy with the rollout policy). With one optimiser step per batch
    /// this is the only choice under which clipping sees the staleness, and
    /// it costs no extra forward pass.
    Behavior,
    /// `lp_old` recomputed by the learner before the update, `lp_behav`
    /// passed on separately (AReaL's decoupled objective, TIS).
    Recompute,
}

/// Over which tokens a loss's data-dependent choices are made (BAPO's
/// bound search, GSPO's sequence ratios, clip statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SearchScope {
    /// Once per optimiser step on the whole batch: the same bounds for
    /// every micro-batch, and data-parallel ranks agree.
    Step,
    /// Per micro-batch, as the official BAPO code does; the aggregation
    /// denominators stay those of the whole step.
    MicroBatch,
}

pub use crate::config_error::ConfigError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LearnerConfig {
    /// Loss by name (`bapo loss --help` lists them).
    pub algo: String,
    pub bapo_mode: BapoMode,
    /// BAPO's target positive share `ρ0` (unset: the mode's own).
    pub bapo_rho0: Option<f64>,
    /// BAPO's `c_low` search `[start, max, step]` (unset: the mode's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bapo_low: Option<[f64; 3]>,
    /// BAPO's `c_high` search `[start, max, step]` (unset: the mode's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bapo_high: Option<[f64; 3]>,
    /// REC's weight of in-range tokens: `none` (NoIS), `is`, `tis`
    /// (unset: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rec_weight: Option<RecWeight>,
    /// REC's ring bounds `[ε'_l, ε'_h]`, TIS's truncation too (unset:
    /// 0.6, 2.0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rec_ring: Option<[f64; 2]>,
    pub clip_eps: Option<f64>,
    pub clip_eps_high: Option<f64>,
    /// Dual clip `c > 1` for negative advantages; 0 turns off a loss's
    /// default (BAPO code mode: 3).
    pub dual_clip: Option<f64>,
    /// Overrides the loss's own aggregation.
    pub agg: Option<String>,
    pub proximal: Proximal,
    pub search_scope: SearchScope,
    /// Overrides the loss's own advantage estimator (`grpo`,
    /// `grpo-population`, `dr-grpo`); unset, the algorithm's paper decides.
    pub advantage: Option<Estimator>,
    /// Passes over each sampled batch (verl's `ppo_epochs`).
    pub epochs: u32,
    /// Optimiser steps per pass, each on its share of the batch's groups
    /// (verl: batch / mini-batch size). A batch makes `epochs ×
    /// mini_batches` optimiser steps and as many versions; the proximal
    /// log-probs (`proximal = "recompute"`) are taken once, before the first.
    pub mini_batches: u32,
    /// `L_const` of `seq-mean-token-sum-norm` (Dr. GRPO): the longest
    /// response the actors may send. A batch with a longer one is refused.
    /// 0: the model's `max_position_embeddings`.
    pub max_response_tokens: usize,
    /// TIS's correction of the behaviour weight `w = π_old/π_behav`:
    /// `truncate` (`min(w, C)`), `mask` (keep tokens or sequences with `w`
    /// in `[tis_low, tis_high]`, weight 1) or `icepop` (`w` inside the
    /// band, 0 outside; token level).
    pub tis_mode: IsCorrection,
    pub tis_level: TisLevel,
    /// Band floor (`mask`, `icepop`); unset: the mode's default.
    pub tis_low: Option<f64>,
    /// Cap `C` (`truncate`) or band ceiling; unset: the mode's default.
    pub tis_high: Option<f64>,
    /// Drop groups whose rewards are all equal (DAPO's dynamic sampling).
    pub filter_zero_variance: bool,
    /// Groups per optimiser step; must equal the buffer's `batch_groups`,
    /// which its staleness bound counts in.
    pub batch_groups: u32,
    /// Sequences per forward/backward pass; gradients accumulate over the
    /// micro-batches of a step, with the step's global denominators.
    pub micro_batch_seqs: usize,
    /// Padded tokens (`sequences × longest`) per forward/backward pass at
    /// most, sequences of like length sharing a pass; 0: no budget, only
    /// `micro_batch_seqs`. Bounds activation memory whatever the lengths
    /// (see the trainer's `micro.rs`). Same loss and gradients either way.
    #[serde(skip_serializing_if = "is_zero")]
    pub micro_batch_tokens: usize,
    /// Pack a pass's sequences side by side into one row of at most
    /// `micro_batch_tokens` (attention block-diagonal, positions
    /// restarting per sequence): no compute on padding. Needs
    /// `micro_batch_tokens`. Same loss and gradients.
    #[serde(skip_serializing_if = "is_false")]
    pub pack_sequences: bool,
    /// Keep only each layer's input through the forward pass and
    /// recompute the layers one at a time in the backward pass: activation
    /// memory of one layer instead of all, for about one more forward.
    /// Same loss and gradients. (Burn's own `gradient_checkpointing()`
    /// recomputes only element-wise ops, not layers.)
    #[serde(skip_serializing_if = "is_false")]
    pub checkpoint_layers: bool,
    /// The memory the learner's device has for it, in GiB; 0: the host's
    /// on the CPU, unknown on a GPU (then nothing is checked). A step that
    /// the estimate (`memory.rs`) says cannot fit is refused at start.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub device_memory_gib: f64,
    /// Peak learning rate (see [`LrSchedule`]).
    pub lr: f64,
    pub warmup_steps: u64,
    pub decay: Decay,
    pub decay_steps: u64,
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    /// Global gradient-norm clipping; 0 disables.
    pub max_grad_norm: f64,
    /// The sampling temperature of the actors (log-probs are of the same
    /// temperature-scaled distribution).
    pub temperature: f32,
    /// Entropy bonus coefficient (off by default, as in BAPO).
    pub entropy_coef: f64,
    /// KL (k3) penalty to the initial policy (off by default).
    pub kl_coef: f64,
    /// Scale the learning rate by VCPO's ESS rule.
    pub vcpo: bool,
    /// Stop after this many optimiser steps; 0 runs until stopped.
    pub steps: u64,
    /// Publish weights every N steps.
    pub broadcast_every: u64,
    /// How the broadcast carries the float weights: `f32`, or `bf16`
    /// (each weight rounded to nearest even: half the bytes on the wire;
    /// actors widen them back to their compute dtype). The learner keeps
    /// and trains f32 master weights either way; checkpoints stay f32.
    /// Under `bf16` the actors' behaviour log-probs are those of the
    /// rounded weights, and the rollouts record exactly those, so the
    /// importance ratio `π_θ / π_behav` (or TIS's `π_old / π_behav`)
    /// already accounts for the rounding as a little more off-policyness
    /// (see `bapo_policy::weights::Encoding::Bf16`).
    pub broadcast_dtype: String,
    /// Under bf16 broadcasts, send a version to an actor that holds a
    /// recent one as the words that changed (a delta checked by CRC32)
    /// instead of whole (f32 words all change each step); actors
    /// joining, behind by more than a model's worth of deltas, or whose
    /// delta failed get it whole. Costs the learner one diff pass per
    /// publish, and each actor a copy of the payload it serves.
    pub broadcast_deltas: bool,
    /// Checkpoint every N steps (and on shutdown); 0 only on shutdown.
    pub checkpoint_every: u64,
    /// Checkpoints kept on disk.
    pub keep_checkpoints: usize,
    /// Held-out greedy accuracy every N steps; 0 disables.
    pub eval_every: u64,
    pub eval_problems: usize,
    /// Longest response the evaluation generates.
    pub eval_max_new_tokens: usize,
    /// Directory for TensorBoard event files (`bapo run`: the run's
    /// `tensorboard/`); unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<std::path::PathBuf>,
    /// Training rollouts kept at each evaluation step for a person to read
    /// (`rollouts.jsonl`, TensorBoard's text tab, the report): this many
    /// rewarded and as many unrewarded; 0 keeps none.
    #[serde(skip_serializing_if = "is_two")]
    pub sample_rollouts: usize,
    /// `[learner.mlflow]`: parameters and metrics to an MLflow tracking
    /// server (absent: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow: Option<crate::tracking::mlflow::MlflowConfig>,
    pub seed: u64,
    /// `[learner.spear]`: SPEAR's memory and replay pass (algo "spear").
    pub spear: SpearConfig,
    /// `[learner.remix]`: ReMix's replay share, KL-Convex schedule and
    /// reincarnation (algo "remix").
    pub remix: RemixConfig,
    /// `[learner.lora]`: train LoRA adapters on a frozen base instead of
    /// every weight (absent: full fine-tuning).
    pub lora: Option<LoraConfig>,
}

/// Fields added since a study's runs are left out of the serialised
/// config at their defaults: a study's fingerprint hashes this config, so
/// its finished runs stay reusable (and its `study.json.gz` unchanged).
fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn is_two(n: &usize) -> bool {
    *n == 2
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            algo: "bapo".into(),
            bapo_mode: BapoMode::Paper,
            bapo_rho0: None,
            bapo_low: None,
            bapo_high: None,
            rec_weight: None,
            rec_ring: None,
            clip_eps: None,
            clip_eps_high: None,
            dual_clip: None,
            agg: None,
            proximal: Proximal::Behavior,
            search_scope: SearchScope::Step,
            advantage: None,
            epochs: 1,
            mini_batches: 1,
            max_response_tokens: 0,
            tis_mode: IsCorrection::Truncate,
            tis_level: TisLevel::Token,
            tis_low: None,
            tis_high: None,
            filter_zero_variance: false,
            batch_groups: 8,
            micro_batch_seqs: 64,
            micro_batch_tokens: 0,
            pack_sequences: false,
            checkpoint_layers: false,
            device_memory_gib: 0.0,
            lr: 1e-6,
            warmup_steps: 0,
            decay: Decay::Constant,
            decay_steps: 0,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            max_grad_norm: 1.0,
            temperature: 1.0,
            entropy_coef: 0.0,
            kl_coef: 0.0,
            vcpo: false,
            steps: 0,
            broadcast_every: 1,
            broadcast_dtype: Encoding::F32.name().into(),
            broadcast_deltas: true,
            checkpoint_every: 50,
            keep_checkpoints: 3,
            eval_every: 10,
            eval_problems: 200,
            eval_max_new_tokens: 16,
            tensorboard: None,
            sample_rollouts: 2,
            mlflow: None,
            seed: 0,
            spear: SpearConfig::default(),
            remix: RemixConfig::default(),
            lora: None,
        }
    }
}

impl LearnerConfig {
    /// The learning-rate schedule. `decay_steps = 0` decays over the steps
    /// left after warm-up, so a run shortened with `--steps` (a study, a
    /// test) still ends at the floor.
    pub fn schedule(&self) -> LrSchedule {
        let decay_steps = match self.decay_steps {
            0 => self.steps.saturating_sub(self.warmup_steps),
            n => n,
        };
        LrSchedule {
            lr: self.lr,
            warmup_steps: self.warmup_steps,
            decay: self.decay,
            decay_steps,
            min_lr_ratio: self.min_lr_ratio,
        }
    }

    /// The loss options of the config, or an error naming the bad one.
    pub fn loss_options(&self) -> Result<LossOptions, LossError> {
        let agg = match &self.agg {
            None => None,
            Some(s) => Some(Aggregation::parse(s).ok_or_else(|| {
                LossError::new("learner.agg", format!("unknown aggregation {s:?}"))
            })?),
        };
        let clip_cov: Option<ClipCovOptions> =
            (self.algo == "spear").then(|| self.spear.on_policy_clip_cov());
        Ok(LossOptions {
            bapo_mode: Some(self.bapo_mode),
            bapo_rho0: self.bapo_rho0,
            bapo_low: self.bapo_low,
            bapo_high: self.bapo_high,
            rec_weight: self.rec_weight,
            rec_ring: self.rec_ring,
            clip_eps: self.clip_eps,
            clip_eps_high: self.clip_eps_high,
            dual_clip: self.dual_clip,
            agg,
            clip_cov,
        })
    }

    /// The configured loss, or an error naming the bad option.
    pub fn build_loss(&self) -> Result<Box<dyn PolicyLoss>, LossError> {
        registry::build_with(
            &self.algo,
            &self.loss_options()?,
            &TisOptions {
                mode: self.tis_mode,
                level: self.tis_level,
                low: self.tis_low,
                high: self.tis_high,
            },
        )
    }

    /// The advantage estimator: the configured one, else the algorithm's.
    pub fn estimator(&self) -> Estimator {
        self.advantage.unwrap_or_else(|| {
            registry::entry_of(&self.algo).map_or(Estimator::Grpo, |e| e.estimator)
        })
    }

    /// The encoding of the weight broadcast (`broadcast_dtype`).
    pub fn broadcast_encoding(&self) -> Result<Encoding, ConfigError> {
        Encoding::from_name(&self.broadcast_dtype).ok_or_else(|| {
            let known: Vec<_> = Encoding::ALL.iter().map(|e| e.name()).collect();
            ConfigError::new(
                "broadcast_dtype",
                format!(
                    "unknown dtype {:?} (known: {})",
                    self.broadcast_dtype,
                    known.join(", ")
                ),
            )
        })
    }

    /// Optimiser steps (and versions) per sampled batch.
    pub fn updates_per_batch(&self) -> u64 {
        self.epochs as u64 * self.mini_batches as u64
    }

    /// Refuses settings under which the named algorithm silently becomes
    /// another one.
    fn validate_combination(&self) -> Result<(), ConfigError> {
        let e = registry::entry_of(&self.algo).map_err(ConfigError::from_loss)?;
        if e.needs_behaviour && self.proximal == Proximal::Behavior {
            return Err(ConfigError::new(
                "proximal",
                format!(
                    "{} weighs tokens by π_old/π_behav, which is 1 when lp_old is the \
                     behaviour log-prob (\"behavior\"): set proximal = \"recompute\" \
                     (and several updates per batch)",
                    e.name
                ),
            ));
        }
        if e.uses_ratio && self.proximal == Proximal::Recompute && self.updates_per_batch() == 1 {
            return Err(ConfigError::new(
                "proximal",
                format!(
                    "\"recompute\" with one update per batch makes π_θ/π_old ≡ 1, so {} \
                     trains as unclipped policy gradient: set epochs or mini_batches \
                     above 1, or proximal = \"behavior\"",
                    e.name
                ),
            ));
        }
        Ok(())
    }

    /// The tracking sinks this config asks for.
    pub fn sinks(&self) -> crate::tracking::Sinks<'_> {
        crate::tracking::Sinks {
            tensorboard: self.tensorboard.as_deref(),
            sample_rollouts: self.sample_rollouts,
            mlflow: self.mlflow.as_ref(),
        }
    }

    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.build_loss().map_err(ConfigError::from_loss)?;
        let bad = |field: &str, msg: &str| Err(ConfigError::new(field, msg));
        if self.batch_groups == 0 {
            return bad("batch_groups", "must be at least 1");
        }
        if self.epochs == 0 {
            return bad("epochs", "must be at least 1");
        }
        if self.mini_batches == 0 || self.mini_batches > self.batch_groups {
            return bad(
                "mini_batches",
                "must be between 1 and batch_groups (each holds whole groups)",
            );
        }
        self.validate_combination()?;
        self.validate_passes()?;
        if let Some(m) = &self.mlflow {
            m.check().map_err(|e| ConfigError::new("mlflow", e))?;
        }
        if !(self.device_memory_gib.is_finite() && self.device_memory_gib >= 0.0) {
            return bad(
                "device_memory_gib",
                "must be a number of GiB, or 0 for the device's own",
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", "must be a positive number");
        }
        if self.temperature <= 0.0 {
            return bad(
                "temperature",
                "must be positive (greedy actors have no behaviour distribution)",
            );
        }
        if self.broadcast_every == 0 {
            return bad("broadcast_every", "must be at least 1");
        }
        self.broadcast_encoding()?;
        self.validate_lora()?;
        self.validate_algo_tables()
    }

    /// How a step is cut into forward/backward passes.
    fn validate_passes(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, msg: &str| Err(ConfigError::new(field, msg));
        if self.micro_batch_seqs == 0 {
            return bad("micro_batch_seqs", "must be at least 1");
        }
        if self.checkpoint_layers && self.lora.as_ref().is_some_and(|l| l.dropout > 0.0) {
            return bad(
                "checkpoint_layers",
                "cannot recompute layers with LoRA dropout (the recomputed pass would draw \
                 other masks than the one kept): set lora.dropout = 0 or checkpoint_layers = false",
            );
        }
        if self.pack_sequences && self.micro_batch_tokens == 0 {
            return bad(
                "pack_sequences",
                "needs learner.micro_batch_tokens (the tokens a packed pass holds)",
            );
        }
        if self.pack_sequences && self.search_scope == SearchScope::MicroBatch {
            return bad(
                "pack_sequences",
                "cannot pack with search_scope = \"micro_batch\" (its micro-batches are runs of \
                 consecutive sequences, the unit of the method): use search_scope = \"step\"",
            );
        }
        Ok(())
    }

    /// `[learner.lora]` on its own; the rank against the model is checked
    /// when the trainer meets the model.
    fn validate_lora(&self) -> Result<(), ConfigError> {
        let Some(lora) = &self.lora else {
            return Ok(());
        };
        lora.validate().map_err(|e| ConfigError {
            field: format!("learner.lora.{}", e.field),
            message: e.message,
        })?;
        if self.algo == "remix" {
            return Err(ConfigError::new(
                "lora",
                "is not supported with algo \"remix\" (its frozen policies would be whole-model \
                 copies); use full fine-tuning or another algorithm",
            ));
        }
        Ok(())
    }

    /// `[learner.spear]` and `[learner.remix]` are checked, and refused
    /// when set for another algorithm (they would silently do nothing).
    fn validate_algo_tables(&self) -> Result<(), ConfigError> {
        self.spear.validate()?;
        self.remix.validate()?;
        let unused = |table: &str, set: bool| {
            if set && self.algo != table {
                Err(ConfigError::new(
                    table,
                    format!(
                        "is set but learner.algo is {:?}; it only applies to {table:?}",
                        self.algo
                    ),
                ))
            } else {
                Ok(())
            }
        };
        unused("spear", self.spear != SpearConfig::default())?;
        unused("remix", self.remix != RemixConfig::default())?;
        if matches!(self.algo.as_str(), "spear" | "remix") && self.entropy_coef > 0.0 {
            return Err(ConfigError::new(
                "entropy_coef",
                format!(
                    "{} has its own entropy bonus: set learner.{}.entropy_coef instead",
                    self.algo, self.algo
                ),
            ));
        }
        if self.algo == "remix" && self.kl_coef > 0.0 {
            return Err(ConfigError::new(
                "kl_coef",
                "remix has its own KL-Convex penalty: set learner.remix.kl_coef instead",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_bad_key() {
        let cases = [
            (
                LearnerConfig {
                    lr: 0.0,
                    ..Default::default()
                },
                "learner.lr",
            ),
            (
                LearnerConfig {
                    algo: "nope".into(),
                    ..Default::default()
                },
                "learner.algo",
            ),
            (
                LearnerConfig {
                    agg: Some("nope".into()),
                    ..Default::default()
                },
                "learner.agg",
            ),
        ];
        for (cfg, key) in cases {
            let e = cfg.validate().unwrap_err();
            assert_eq!(e.field, key, "{e}");
            assert!(e.to_string().starts_with(key), "{e}");
        }
        LearnerConfig::default().validate().unwrap();
    }

    #[test]
    fn the_broadcast_dtype_is_f32_or_bf16_and_nothing_else() {
        let of = |dtype: &str| LearnerConfig {
            broadcast_dtype: dtype.into(),
            ..Default::default()
        };
        assert_eq!(
            LearnerConfig::default().broadcast_encoding(),
            Ok(Encoding::F32)
        );
        assert_eq!(of("bf16").broadcast_encoding(), Ok(Encoding::Bf16));
        of("bf16").validate().unwrap();
        for bad in ["fp16", "BF16", "bfloat16", "f16", ""] {
            refused(of(bad), "learner.broadcast_dtype", &[bad, "f32, bf16"]);
        }
        #[derive(Deserialize)]
        struct File {
            learner: LearnerConfig,
        }
        let f: File = toml_like(r#"{"learner": {"broadcast_dtype": "bf16"}}"#);
        assert_eq!(f.learner.broadcast_encoding(), Ok(Encoding::Bf16));
    }

    fn with(algo: &str, proximal: Proximal, epochs: u32) -> LearnerConfig {
        LearnerConfig {
            algo: algo.into(),
            proximal,
            epochs,
            ..Default::default()
        }
    }

    fn refused(cfg: LearnerConfig, field: &str, words: &[&str]) {
        let e = cfg.validate().unwrap_err();
        assert_eq!(e.field, field, "{e}");
        for w in words {
            assert!(e.message.contains(w), "{w:?} not in {e}");
        }
    }

    /// Decoupled PPO and TIS weigh by `π_old/π_behav`; with `lp_old` the
    /// behaviour log-prob that weight is 1 and they are plain PPO.
    #[test]
    fn behaviour_weighted_losses_without_behaviour_log_probs_are_refused() {
        for algo in ["decoupled", "tis"] {
            refused(
                with(algo, Proximal::Behavior, 2),
                "learner.proximal",
                &[algo, "recompute"],
            );
            with(algo, Proximal::Recompute, 2).validate().unwrap();
        }
    }

    /// `recompute` with one update per batch makes every ratio 1.
    #[test]
    fn recompute_with_one_update_is_refused_for_ratio_losses() {
        for algo in [
            "bapo",
            "ppo",
            "grpo",
            "gspo",
            "sapo",
            "cispo",
            "opmd",
            "decoupled",
            "tis",
        ] {
            refused(
                with(algo, Proximal::Recompute, 1),
                "learner.proximal",
                &[algo, "one update"],
            );
            with(algo, Proximal::Recompute, 2).validate().unwrap();
            let minis = LearnerConfig {
                mini_batches: 2,
                ..with(algo, Proximal::Recompute, 1)
            };
            minis.validate().unwrap();
        }
        // AsymRE never reads lp_old: nothing degenerates.
        with("asymre", Proximal::Recompute, 1).validate().unwrap();
    }

    #[test]
    fn update_counts_are_checked_by_name() {
        refused(with("bapo", Proximal::Behavior, 0), "learner.epochs", &[]);
        let too_many = LearnerConfig {
            mini_batches: 9,
            batch_groups: 8,
            ..Default::default()
        };
        refused(too_many, "learner.mini_batches", &["batch_groups"]);
        let c = LearnerConfig {
            epochs: 2,
            mini_batches: 4,
            ..Default::default()
        };
        assert_eq!(c.updates_per_batch(), 8);
    }

    #[test]
    fn loss_options_are_refused_by_key() {
        let dual = LearnerConfig {
            dual_clip: Some(0.5),
            ..Default::default()
        };
        refused(dual, "learner.dual_clip", &[]);
        let band = LearnerConfig {
            algo: "tis".into(),
            proximal: Proximal::Recompute,
            epochs: 2,
            tis_mode: IsCorrection::Mask,
            tis_low: Some(3.0),
            ..Default::default()
        };
        refused(band, "learner.tis_low", &[]);
    }

    /// The estimator follows the algorithm unless the config names one;
    /// the TOML spelling is the estimator's name.
    #[test]
    fn the_estimator_is_the_algorithms_unless_overridden() {
        assert_eq!(
            with("grpo", Proximal::Behavior, 1).estimator(),
            Estimator::Grpo
        );
        assert_eq!(
            with("dr-grpo", Proximal::Behavior, 1).estimator(),
            Estimator::DrGrpo
        );
        assert_eq!(
            with("opmd", Proximal::Behavior, 1).estimator(),
            Estimator::DrGrpo
        );
        let over = LearnerConfig {
            algo: "dr-grpo".into(),
            advantage: Some(Estimator::GrpoPopulation),
            ..Default::default()
        };
        assert_eq!(over.estimator(), Estimator::GrpoPopulation);
        #[derive(Deserialize)]
        struct File {
            learner: LearnerConfig,
        }
        let f: File = toml_like(r#"{"learner": {"algo": "grpo", "advantage": "dr-grpo"}}"#);
        assert_eq!(f.learner.estimator(), Estimator::DrGrpo);
    }

    /// serde_json stands in for TOML: the same serde attributes decide
    /// both spellings.
    fn toml_like<T: serde::de::DeserializeOwned>(s: &str) -> T {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn zero_decay_steps_decay_over_the_rest_of_the_run() {
        let cfg = LearnerConfig {
            lr: 1e-4,
            warmup_steps: 50,
            decay: Decay::Cosine,
            decay_steps: 0,
            min_lr_ratio: 0.1,
            steps: 500,
            ..Default::default()
        };
        let s = cfg.schedule();
        assert_eq!(s.decay_steps, 450);
        assert!((s.at(49) - 1e-4).abs() < 1e-15);
        assert!(s.at(274) < 0.6e-4 && s.at(274) > 0.5e-4);
        assert!((s.at(499) - 1e-5).abs() < 1e-8);
        let fixed = LearnerConfig {
            decay_steps: 100,
            ..cfg
        };
        assert_eq!(fixed.schedule().decay_steps, 100);
    }

    /// An algorithm's own table set for another algorithm would do
    /// nothing; ReMix with the plain KL penalty would stack two.
    #[test]
    fn algorithm_tables_apply_to_their_algorithm_only() {
        let spear_table = LearnerConfig {
            spear: SpearConfig {
                tolerate_steps: 2,
                ..Default::default()
            },
            ..with("ppo", Proximal::Behavior, 1)
        };
        refused(spear_table.clone(), "learner.spear", &["\"ppo\""]);
        LearnerConfig {
            algo: "spear".into(),
            ..spear_table
        }
        .validate()
        .unwrap();
        let remix = with("remix", Proximal::Recompute, 2);
        remix.validate().unwrap();
        refused(
            LearnerConfig {
                remix: RemixConfig {
                    policies: 3,
                    ..Default::default()
                },
                ..with("bapo", Proximal::Behavior, 1)
            },
            "learner.remix",
            &["bapo"],
        );
        refused(
            LearnerConfig {
                kl_coef: 0.1,
                ..remix.clone()
            },
            "learner.kl_coef",
            &["remix.kl_coef"],
        );
        refused(
            with("remix", Proximal::Behavior, 2),
            "learner.proximal",
            &["recompute"],
        );
        refused(
            LearnerConfig {
                clip_eps_high: Some(0.3),
                ..remix
            },
            "learner.clip_eps_high",
            &["symmetric"],
        );
    }
}
