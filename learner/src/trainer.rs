//! One optimiser step on a batch of groups, with nothing of gRPC in it:
//! advantages, current log-probs, the configured loss over the whole step
//! (so BAPO's bound search and every denominator are global), the
//! surrogate backward pass per micro-batch, global-norm clipping and AdamW.
//!
//! The loss is computed on the host in f64 from the per-token log-probs
//! (`loss/`), giving `∂L/∂lp_t` exactly; the model is trained with the
//! surrogate `Σ_t sg(∂L/∂lp_t) · lp_t`, whose gradient is the same.

use std::{borrow::Cow, collections::BTreeMap, ops::Range, time::Instant};

use bapo_policy::{
    ModelConfig, Policy, Precision,
    burn::{
        module::Module,
        optim::{AdamWConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer},
        prelude::*,
        tensor::{Bytes, Gradients},
    },
    logprob::{next_token_logprobs, next_token_logprobs_and_entropy},
    lora,
    model::Transformer,
    rope::Rope,
};

use crate::{
    advantage::batch_advantages,
    config::{ConfigError, LearnerConfig, Proximal, SearchScope},
    grads::clip_global_norm,
    loss::{Denominators, LossError, LossOutput, PolicyLoss, TokenBatch, registry},
    memory,
    record::Metric,
    rollouts::{Sequence, TrainGroup},
    stats::{mismatch_metrics, ratio_metrics},
    vcpo::{LrRule, RHO_BASE, lr_scale},
};

mod algo;
mod host_loss;
mod kl;
mod micro;
mod pass;
mod remix_run;
mod replay;

pub use algo::AlgoState;
use algo::{Batch, BatchAlgo, BatchEnd};
use host_loss::HostLoss;
use pass::Pass;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    #[error("loss: {0}")]
    Loss(#[from] LossError),
    /// Saved AdamW moments that do not decode or do not fit the model.
    #[error("optimiser state: {0}")]
    OptimizerState(String),
    #[error(
        "sequence {index} of group {group} has {len} tokens, more than the model's {max} positions"
    )]
    TooLong {
        group: String,
        index: usize,
        len: usize,
        max: usize,
    },
    /// Dr. GRPO's normaliser is a constant; a longer response would
    /// bring back the length-dependent scaling it removes.
    #[error(
        "sequence {index} of group {group} has a {len}-token response, more than learner.max_response_tokens = {max}"
    )]
    ResponseTooLong {
        group: String,
        index: usize,
        len: usize,
        max: usize,
    },
    #[error("token id {id} in group {group} is outside the vocabulary ({vocab})")]
    BadToken {
        group: String,
        id: u32,
        vocab: usize,
    },
    #[error("the batch holds no sequence to train on")]
    Empty,
    /// Updates whose loss or gradient was not finite, several in a row:
    /// training cannot go on from these weights on this data.
    #[error(
        "{in_a_row} updates in a row had a non-finite loss ({loss}) or gradient norm \
         ({grad_norm}); none was applied, and the learner stops on its last finite weights \
         (look for rewards of extreme size, or lower learner.lr)"
    )]
    NonFinite {
        loss: f64,
        grad_norm: f64,
        in_a_row: u32,
    },
    /// A SPEAR or ReMix memory read back that a step could not train on.
    #[error("saved replay memory: {0}")]
    ReplayState(String),
    /// A step the device cannot hold, by the estimate (`memory.rs`).
    #[error("memory: {0}")]
    Memory(String),
    #[error(
        "sequence {index} of group {group} has {len} tokens, more than learner.micro_batch_tokens = {budget}"
    )]
    OverBudget {
        group: String,
        index: usize,
        len: usize,
        budget: usize,
    },
}

/// What one step did, for logs and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// The optimiser step just taken (1-based).
    pub step: u64,
    /// The policy version after it.
    pub version: u64,
    pub loss: f64,
    pub lr: f64,
    pub sequences: usize,
    pub tokens: usize,
    pub seconds: f64,
    /// Everything else, by name: the loss's metrics, entropy, ratio stats,
    /// grad norms, rewards, lengths, staleness.
    pub metrics: BTreeMap<String, f64>,
}

/// A step's gradients before the optimiser sees them.
pub struct Backward {
    pub grads: GradientsParams,
    /// The host loss: value, `∂L/∂lp` per token, metrics.
    pub loss: LossOutput,
    /// The token batch it was computed on (current log-probs included).
    pub batch: TokenBatch,
    /// `Σ_t (lp_θ − lp_behav)` per sequence.
    pub seq_log_weights: Vec<f64>,
    pub metrics: BTreeMap<String, f64>,
}

/// A sampled batch (or mini-batch) laid out for the model, with what every
/// update on it shares: advantages, `lp_old` (the behaviour log-probs, or
/// the proximal ones recomputed before the batch's first update) and, under
/// `recompute`, `lp_behav`.
pub struct Prepared {
    rows: Vec<Row>,
    /// The token batch without current log-probs (`logp` empty).
    skel: TokenBatch,
    /// Reward, length and staleness of the batch.
    metrics: BTreeMap<String, f64>,
}

impl Prepared {
    /// `lp_old` per response token.
    pub fn logp_old(&self) -> &[f64] {
        &self.skel.logp_old
    }
}

/// Rows, the token batch without current log-probs, and data metrics.
/// Rows, the token batch, the data metrics, and the policy tokens of
/// turns whose tokens carry more than one version.
type Layout = (Vec<Row>, TokenBatch, BTreeMap<String, f64>, Vec<usize>);

/// What a pass that checkpoints layers keeps of its forward: each layer's
/// input (no graph), and the last layer's output as the tracked leaf the
/// head's graph starts from.
struct Checkpoints {
    inputs: Vec<Tensor<2>>,
    top: Tensor<2>,
}

/// Entropy and KL penalties summed over a step's micro-batches.
struct Sums {
    entropy: f64,
    kl: Vec<f64>,
}

/// The terms a pass adds to the surrogate beside the loss: the entropy
/// bonus's coefficient and the KL penalties (reference, coefficient,
/// metric name).
struct Terms<'a> {
    entropy_coef: f64,
    kl: Vec<(&'a Transformer, f64, &'static str)>,
}

/// One trained sequence laid out for the model.
#[derive(Clone)]
struct Row {
    tokens: Vec<u32>,
    reward: f32,
    /// Shifted position of the first response token.
    start: usize,
    len: usize,
    /// Index of the first response token in the flattened token batch.
    offset: usize,
}

pub struct Trainer {
    cfg: LearnerConfig,
    model_config: ModelConfig,
    device: Device,
    model: Transformer,
    optim: ModuleOptimizer,
    rope: Rope,
    /// The same tables without autodiff, for passes without a graph.
    rope_plain: Rope,
    loss: Box<dyn PolicyLoss>,
    /// Frozen initial policy, for the KL penalty.
    reference: Option<Transformer>,
    step: u64,
    version: u64,
    /// Batches (training iterations) done: the clock of SPEAR's and
    /// ReMix's schedules.
    batches: u64,
    /// What the algorithm adds to a batch besides its loss (SPEAR's
    /// replay pass, ReMix's mixed batches and frozen policies).
    algo: Box<dyn BatchAlgo>,
    /// [`lora::fingerprint`] of the frozen base under LoRA; 0 without.
    base_fingerprint: u64,
    /// Updates skipped in a row for a non-finite loss or gradient.
    nonfinite_in_a_row: u32,
}

/// Non-finite updates in a row after which the learner stops
/// ([`TrainError::NonFinite`]): one is skipped and counted (a freak
/// batch), three mean the weights or the data are broken.
pub const NONFINITE_LIMIT: u32 = 3;

/// `model` (autodiff form) ready for `cfg`: under `[learner.lora]` its base
/// frozen and adapters, fresh or restored, the only trainable weights;
/// without, unchanged (and refused if it carries adapters).
fn with_adapters(
    cfg: &LearnerConfig,
    config: &ModelConfig,
    mut model: Transformer,
) -> Result<Transformer, TrainError> {
    let lora_err = |m: String| TrainError::Config(ConfigError::new("lora", m));
    let Some(l) = &cfg.lora else {
        return match model.lora {
            Some(_) => Err(lora_err(
                "is not set, but the weights carry LoRA adapters (a LoRA checkpoint): set \
                 [learner.lora] as it was trained"
                    .into(),
            )),
            None => Ok(model),
        };
    };
    l.validate_for(config)
        .map_err(|e| lora_err(e.to_string()))?;
    let Some(mut adapters) = model.lora.take() else {
        model
            .embed_tokens
            .weight
            .val()
            .device()
            .seed(cfg.seed ^ 0x4c6f_5241);
        return Ok(lora::attach(model, config, l));
    };
    let mut want = l.targets.clone();
    want.sort();
    let same_scale = (adapters.scale - l.scale()).abs() <= 1e-12 * l.scale();
    if adapters.rank() != l.rank || adapters.targets() != want || !same_scale {
        return Err(lora_err(format!(
            "the adapters were trained with rank {}, scale {}, targets {:?}; the config asks \
             for rank {}, scale {}, targets {want:?}",
            adapters.rank(),
            adapters.scale,
            adapters.targets(),
            l.rank,
            l.scale()
        )));
    }
    adapters.dropout = l.dropout;
    let mut model = model.no_grad();
    model.lora = Some(adapters.set_require_grad(true));
    Ok(model)
}

/// Refuses, at start, a step that `policy`'s device cannot hold by the
/// estimate, and logs the estimate either way.
fn check_memory(cfg: &LearnerConfig, policy: &Policy) -> Result<(), TrainError> {
    let precision = policy.model.compute;
    let device = policy.device();
    let attention = memory::Attention::on(&device, precision);
    let est = memory::estimate(&policy.config, cfg, precision, attention);
    let capacity = match cfg.device_memory_gib {
        0.0 => bapo_policy::kernels::on_cpu(device.clone())
            .then(memory::host_memory)
            .flatten(),
        gib => Some(memory::bytes(gib)),
    };
    tracing::info!(
        capacity_gib = capacity.map(memory::gib),
        "memory of a training step, estimated: {}",
        est.describe()
    );
    if let Some(max) = bapo_policy::device::max_buffer_bytes(&device) {
        memory::check_buffers(&policy.config, cfg, max).map_err(TrainError::Memory)?;
    }
    match capacity {
        Some(c) => memory::check(&est, cfg, c, &policy.config, precision, attention)
            .map_err(TrainError::Memory),
        None => Ok(()),
    }
}

impl Trainer {
    /// Trains `policy`'s weights (moved onto the autodiff form of their
    /// device), starting at policy version `version`.
    pub fn new(cfg: LearnerConfig, policy: Policy, version: u64) -> Result<Self, TrainError> {
        cfg.validate()?;
        check_memory(&cfg, &policy)?;
        let loss = cfg.build_loss()?;
        let device = policy.device().autodiff();
        let c = &policy.config;
        let rope_on =
            |d: &Device| Rope::new(c.head_dim(), c.rope_theta(), c.max_position_embeddings, d);
        let (rope, rope_plain) = (rope_on(&device), rope_on(&policy.device()));
        // Under LoRA the reference is the base with the adapters off: the
        // same tensors, no second copy of the model.
        let reference = (cfg.kl_coef > 0.0).then(|| lora::base_of(&policy.model.valid()));
        let algo = batch_algo(&cfg, || policy.model.valid());
        // Restored adapters carry the fingerprint their checkpoint verified;
        // fresh ones need the base hashed (a pass over every weight).
        let base_fingerprint = match (&cfg.lora, policy.model.lora.as_ref()) {
            (None, _) => 0,
            (Some(_), Some(a)) if a.base != 0 => a.base,
            (Some(_), _) => lora::fingerprint(&policy.model),
        };
        let model = with_adapters(
            &cfg,
            &policy.config,
            policy.model.to_device(&device).train(),
        )?;
        let optim = AdamWConfig::new()
            .with_beta_1(cfg.beta1 as f32)
            .with_beta_2(cfg.beta2 as f32)
            .with_weight_decay(cfg.weight_decay as f32)
            .init();
        Ok(Self {
            cfg,
            model_config: policy.config,
            device,
            model,
            optim,
            rope,
            rope_plain,
            loss,
            reference,
            step: 0,
            version,
            batches: 0,
            algo,
            base_fingerprint,
            nonfinite_in_a_row: 0,
        })
    }

    /// The fingerprint of the frozen base under LoRA (0 without).
    pub fn base_fingerprint(&self) -> u64 {
        self.base_fingerprint
    }

    /// A trainer that continues a saved run: `policy` holds the weights
    /// after `step` optimiser steps at `version`, `optimizer` the AdamW
    /// moments as [`Trainer::optimizer_state`] encoded them. The schedule
    /// goes on from `step`, so resuming equals never stopping.
    pub fn restore(
        cfg: LearnerConfig,
        policy: Policy,
        version: u64,
        step: u64,
        optimizer: Vec<u8>,
    ) -> Result<Self, TrainError> {
        let mut t = Self::new(cfg, policy, version)?;
        t.optim = t
            .optim
            .from_bytes(Bytes::from_bytes_vec(optimizer))
            .map_err(|e| TrainError::OptimizerState(format!("{e:?}")))?;
        t.step = step;
        // Checkpoints written before batches were counted: every batch
        // took the same number of updates then.
        t.batches = step / t.cfg.updates_per_batch();
        Ok(t)
    }

    /// The AdamW moments, encoded for a checkpoint.
    pub fn optimizer_state(&self) -> Result<Bytes, TrainError> {
        self.optim
            .into_bytes()
            .map_err(|e| TrainError::OptimizerState(format!("{e:?}")))
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn steps_done(&self) -> u64 {
        self.step
    }

    pub fn config(&self) -> &LearnerConfig {
        &self.cfg
    }

    /// The architecture being trained.
    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The current weights, without autodiff, for evaluation and
    /// publishing. Shares the tensors.
    pub fn policy(&self) -> Policy {
        let model = self.model.valid();
        let device = self.device.clone().inner();
        Policy::with_model(self.model_config.clone(), model, &device)
    }

    /// Computes the forward and backward in `precision` from now on; the
    /// weights and the optimiser's moments stay f32 (a checkpoint does not
    /// record the compute dtype, the learner's config does).
    pub fn set_precision(&mut self, precision: Precision) {
        self.model.compute = precision;
    }

    /// The current weights as trained (autodiff form).
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// Every optimiser update of one sampled batch: `epochs` passes over
    /// `mini_batches` shares of its groups, each update advancing the
    /// version by one. Advantages and the proximal log-probs are computed
    /// once, before the first update, so from the second update on the
    /// ratio `π_θ/π_old` moves and clipping has something to clip.
    ///
    /// ReMix mixes replayed groups into `fresh`; SPEAR follows each
    /// epoch's updates with its replay pass when its memory is full.
    pub fn train_batch(&mut self, fresh: &[TrainGroup]) -> Result<Vec<StepReport>, TrainError> {
        let mut batch_metrics = BTreeMap::new();
        let batch = Batch {
            cfg: &self.cfg,
            t: self.batches,
        };
        let groups = self.algo.mix_in(&batch, fresh, &mut batch_metrics);
        let start = self.algo.keeps_start().then(|| self.model.valid());
        let parts = split_groups(&groups, self.cfg.mini_batches as usize);
        let prepared = parts
            .iter()
            .map(|g| self.prepare(g))
            .collect::<Result<Vec<_>, _>>()?;
        let batch = Batch {
            cfg: &self.cfg,
            t: self.batches,
        };
        let replay = self.algo.replay(&batch, &prepared, &mut batch_metrics)?;
        let mut reports = Vec::new();
        for epoch in 0..self.cfg.epochs {
            for (k, p) in prepared.iter().enumerate() {
                let t0 = Instant::now();
                let mut r = self.apply(self.backward(p)?, t0)?;
                r.metrics.insert("epoch".into(), epoch as f64);
                r.metrics.insert("mini_batch".into(), k as f64);
                reports.push(r);
            }
            if let Some((parts, loss, coef)) = &replay {
                for (k, p) in parts.iter().enumerate() {
                    let t0 = Instant::now();
                    let back = self.backward_with(p, loss.as_ref(), Some(*coef))?;
                    let mut r = self.apply(back, t0)?;
                    r.metrics.insert("epoch".into(), epoch as f64);
                    r.metrics.insert("spear_replay".into(), 1.0);
                    r.metrics.insert("spear_replay_mini_batch".into(), k as f64);
                    reports.push(r);
                }
            }
        }
        let model = &self.model;
        let end = BatchEnd {
            fresh,
            prepared: &prepared,
            start,
            current: &|| model.valid(),
        };
        let batch = Batch {
            cfg: &self.cfg,
            t: self.batches,
        };
        self.algo.end_batch(&batch, end, &mut batch_metrics);
        for r in &mut reports {
            r.metrics.extend(batch_metrics.clone());
        }
        self.batches += 1;
        Ok(reports)
    }

    /// [`Trainer::train_batch`], reporting its last update.
    pub fn step(&mut self, groups: &[TrainGroup]) -> Result<StepReport, TrainError> {
        self.train_batch(groups)?.pop().ok_or(TrainError::Empty)
    }

    /// One optimiser update with `back`'s gradients; advances the version.
    ///
    /// A non-finite loss or gradient norm skips the update (weights,
    /// optimiser state, step and version unchanged; `nonfinite_skipped`
    /// in the report): applied, it would turn every weight NaN, and the
    /// NaN weights would be broadcast and checkpointed. The
    /// [`NONFINITE_LIMIT`]th in a row is an error that stops the learner,
    /// whose weights and checkpoints are then still the last finite ones.
    pub fn apply(&mut self, back: Backward, t0: Instant) -> Result<StepReport, TrainError> {
        let Backward {
            mut grads,
            loss,
            batch,
            seq_log_weights,
            mut metrics,
        } = back;
        let (norm_before, norm_after) =
            clip_global_norm(&self.model, &mut grads, self.cfg.max_grad_norm);
        metrics.insert(Metric::GradNorm.into(), norm_before);
        let lr = if norm_before.is_finite() && loss.loss.is_finite() {
            self.nonfinite_in_a_row = 0;
            metrics.insert("grad_norm_clipped".into(), norm_after);
            self.update(grads, &seq_log_weights, &mut metrics)
        } else {
            self.nonfinite_in_a_row += 1;
            if self.nonfinite_in_a_row >= NONFINITE_LIMIT {
                return Err(TrainError::NonFinite {
                    loss: loss.loss,
                    grad_norm: norm_before,
                    in_a_row: self.nonfinite_in_a_row,
                });
            }
            metrics.insert("nonfinite_skipped".into(), 1.0);
            0.0
        };
        Ok(StepReport {
            step: self.step,
            version: self.version,
            loss: loss.loss,
            lr,
            sequences: seq_log_weights.len(),
            tokens: batch.len(),
            seconds: t0.elapsed().as_secs_f64(),
            metrics,
        })
    }

    /// AdamW with `grads` at the schedule's rate (VCPO-scaled where
    /// asked); advances the step and the version; returns the rate.
    fn update(
        &mut self,
        grads: GradientsParams,
        seq_log_weights: &[f64],
        metrics: &mut BTreeMap<String, f64>,
    ) -> f64 {
        let mut lr = self.cfg.schedule().at(self.step);
        if self.cfg.vcpo {
            let scale = lr_scale(seq_log_weights, RHO_BASE, LrRule::Sqrt);
            metrics.insert("vcpo_lr_scale".into(), scale);
            lr *= scale;
        }
        self.model = self.optim.step(lr, self.model.clone(), grads);
        self.step += 1;
        self.version += 1;
        lr
    }

    /// The loss of `groups` under the current weights and its gradient with
    /// respect to every parameter (accumulated over micro-batches), without
    /// changing anything: [`Trainer::prepare`] then [`Trainer::backward`].
    pub fn gradients(&self, groups: &[TrainGroup]) -> Result<Backward, TrainError> {
        self.backward(&self.prepare(groups)?)
    }

    /// Lays `groups` out and fixes `lp_old`: the behaviour log-probs, or
    /// (`recompute`) the current policy's, in a no-grad pass.
    pub fn prepare(&self, groups: &[TrainGroup]) -> Result<Prepared, TrainError> {
        let (rows, mut skel, mut metrics, mixed) = self.layout(groups)?;
        // The layout's lp_old is the behaviour's; recompute moves it aside.
        if self.cfg.proximal == Proximal::Recompute {
            let lp = self.logprobs_no_grad(&rows, skel.len());
            skel.logp_behav = Some(std::mem::replace(&mut skel.logp_old, lp));
        } else if self.turn_ratio() && !mixed.is_empty() {
            // A turn's ratio needs one policy under it: turns sampled
            // across a weight update take the current policy's.
            let lp = self.logprobs_no_grad(&rows, skel.len());
            let mut old = skel.logp_old.clone();
            for &t in &mixed {
                old[t] = lp[t];
            }
            skel.logp_behav = Some(std::mem::replace(&mut skel.logp_old, old));
        }
        if self.turn_ratio() {
            metrics.insert("mixed_version_turn_tokens".into(), mixed.len() as f64);
        }
        Ok(Prepared {
            rows,
            skel,
            metrics,
        })
    }

    /// Whether the loss's ratio is one per turn (its registry entry's
    /// `turn_ratio`).
    fn turn_ratio(&self) -> bool {
        registry::entry_of(&self.cfg.algo).is_ok_and(|e| e.turn_ratio)
    }

    /// Response-token log-probs of `rows` under the current weights,
    /// without a graph, micro-batch by micro-batch.
    fn logprobs_no_grad(&self, rows: &[Row], n_tokens: usize) -> Vec<f64> {
        let valid = self.model.valid();
        let rope = &self.rope_plain;
        let mut lp = vec![0.0; n_tokens];
        for pass in self.passes(rows, false) {
            let tokens = pass.tokens(&self.device.clone().inner());
            let logits = pass.logits(&valid, tokens.clone(), rope);
            let host = to_host(next_token_logprobs(logits, tokens, self.cfg.temperature));
            pass.scatter_response(&host, &mut lp);
        }
        lp.into_iter().map(|x| x.min(0.0)).collect()
    }

    /// `L_const` of `seq-mean-token-sum-norm`: a constant of the run.
    fn l_const(&self) -> usize {
        match self.cfg.max_response_tokens {
            0 => self.model_config.max_position_embeddings,
            n => n,
        }
    }

    /// The loss of a prepared batch under the current weights and its
    /// parameter gradients (accumulated over micro-batches).
    pub fn backward(&self, prepared: &Prepared) -> Result<Backward, TrainError> {
        self.backward_with(prepared, self.loss.as_ref(), None)
    }

    /// The entropy bonus's coefficient: SPEAR's and ReMix's own (their
    /// sources' configs), `learner.entropy_coef` otherwise.
    fn entropy_coef(&self) -> f64 {
        self.algo.entropy_coef(&self.cfg)
    }

    /// [`Trainer::backward`] with `loss`. `replay`: SPEAR's replay pass
    /// with its coefficient `c(t)`, which scales the entropy bonus as it
    /// scales the loss (the official code multiplies the whole loss), and
    /// no KL penalties.
    fn backward_with(
        &self,
        prepared: &Prepared,
        loss: &dyn PolicyLoss,
        replay: Option<f64>,
    ) -> Result<Backward, TrainError> {
        let Prepared {
            rows,
            skel,
            metrics,
        } = prepared;
        let (rows, mut metrics) = (&rows[..], metrics.clone());
        // With the search scoped to micro-batches, each computes its own
        // loss (bounds, statistics) from its own forward pass; otherwise
        // one loss over the step, from a no-grad pass first when there are
        // several micro-batches.
        let scoped = self.cfg.search_scope == SearchScope::MicroBatch;
        let micro = self.passes(rows, scoped);
        let per_micro = scoped && micro.len() > 1;
        let denoms = Denominators {
            l_const: self.l_const() as f64,
            ..Denominators::of(skel)
        };
        let mut host = HostLoss::new(loss, skel, denoms, per_micro);
        if !per_micro && micro.len() > 1 {
            host.set_from_prepass(self.logprobs_no_grad(rows, skel.advantages.len()))?;
        }
        let terms = Terms {
            entropy_coef: self.entropy_coef() * replay.unwrap_or(1.0),
            kl: match replay {
                None => self.kl_terms(),
                Some(_) => Vec::new(),
            },
        };
        let token_weight = token_weights(skel);
        let mut sums = Sums {
            entropy: 0.0,
            kl: vec![0.0; terms.kl.len()],
        };
        metrics.extend(pass::metrics(&micro));
        let mut peak_mem = None;
        let mut accum = GradientsAccumulator::<Transformer>::new();
        for pass in &micro {
            let tokens = pass.tokens(&self.device);
            let (logits, kept) = self.logits_for_backward(pass, tokens.clone());
            let (lp, entropy) =
                next_token_logprobs_and_entropy(logits, tokens.clone(), self.cfg.temperature);
            let grad = host.gradient(pass, &lp)?;
            let objective =
                self.objective(pass, (lp, entropy), grad, &token_weight, &terms, &mut sums);
            // The pass's peak is near here: its activations are all alive.
            peak_mem = peak_mem.max(self.device_memory());
            let grads = objective.backward();
            match kept {
                None => {
                    accum.accumulate(&self.model, GradientsParams::from_grads(grads, &self.model))
                }
                Some(kept) => self.backward_layers(pass, kept, grads, tokens, &mut accum),
            }
        }
        let (loss_out, batch) = host.finish()?;
        let seq_log_weights = seq_log_weights(rows, &batch);
        metrics.extend(loss_out.metrics.clone());
        step_metrics(&mut metrics, &batch, &terms, sums, peak_mem);
        Ok(Backward {
            grads: accum.grads(),
            loss: loss_out,
            batch,
            seq_log_weights,
            metrics,
        })
    }

    /// Logits `[batch, seq, vocab]` of `tokens` with their graph. With
    /// `checkpoint_layers`, the layers run without a graph, keeping only
    /// each layer's input, and the graph starts at the last layer's output
    /// (the head's input); [`Trainer::backward_layers`] then recomputes
    /// the layers one at a time.
    fn logits_for_backward(
        &self,
        pass: &Pass<'_>,
        tokens: Tensor<2, Int>,
    ) -> (Tensor<3>, Option<Checkpoints>) {
        if !self.cfg.checkpoint_layers {
            return (pass.logits(&self.model, tokens, &self.rope), None);
        }
        let [b, t] = tokens.dims();
        let valid = self.model.valid();
        let mut inputs = vec![valid.embed(tokens.inner())];
        for i in 0..valid.layers.len() {
            let x = valid.layer(
                i,
                inputs[i].clone(),
                (b, t),
                &self.rope_plain,
                pass.segments(),
            );
            inputs.push(x);
        }
        let top = inputs
            .pop()
            .expect("the embedding is kept")
            .autodiff()
            .require_grad();
        let logits = self.model.head(top.clone());
        let v = logits.dims()[1];
        (logits.reshape([b, t, v]), Some(Checkpoints { inputs, top }))
    }

    /// The gradients of a checkpointed pass: the head's (`grads`, from the
    /// objective), then each layer's, last to first, recomputed from its
    /// kept input with the gradient of its output, then the embedding's.
    fn backward_layers(
        &self,
        pass: &Pass<'_>,
        kept: Checkpoints,
        grads: Gradients,
        tokens: Tensor<2, Int>,
        accum: &mut GradientsAccumulator<Transformer>,
    ) {
        let mut g = kept
            .top
            .grad(&grads)
            .expect("the head's input is a tracked leaf");
        accum.accumulate(&self.model, GradientsParams::from_grads(grads, &self.model));
        let [b, t] = tokens.dims();
        for (i, x) in kept.inputs.into_iter().enumerate().rev() {
            let x = x.autodiff().require_grad();
            let out = self
                .model
                .layer(i, x.clone(), (b, t), &self.rope, pass.segments());
            let grads = out.mul(g).sum().backward();
            g = x.grad(&grads).expect("a layer's input is a tracked leaf");
            accum.accumulate(&self.model, GradientsParams::from_grads(grads, &self.model));
        }
        // A frozen embedding (LoRA) has no graph to go back through.
        let embedded = self.model.embed(tokens);
        if embedded.is_tracked() {
            let grads = embedded.mul(g).sum().backward();
            accum.accumulate(&self.model, GradientsParams::from_grads(grads, &self.model));
        }
    }

    /// One micro-batch's objective: the surrogate `Σ sg(∂L/∂lp)·lp`, minus
    /// the entropy bonus, plus the KL penalties (each `Σ k3 / tokens`,
    /// `token_weight` 1/tokens on the policy's tokens, 0 elsewhere); the
    /// entropy and KL sums are added to `sums`.
    fn objective(
        &self,
        pass: &Pass<'_>,
        (lp, entropy): (Tensor<2>, Tensor<2>),
        grad: &[f64],
        token_weight: &[f32],
        terms: &Terms<'_>,
        sums: &mut Sums,
    ) -> Tensor<1> {
        let [b, t] = lp.dims();
        let grid = |f: &dyn Fn(&Row, usize) -> f32| {
            let g = pass.response_grid(t, f);
            Tensor::<2>::from_data(TensorData::new(g, [b, t]), &self.device)
        };
        let coef = grid(&|row, j| grad[row.offset + j] as f32);
        let mask = grid(&|row, j| token_weight[row.offset + j]);
        let weighted_entropy = entropy.mul(mask.clone()).sum();
        sums.entropy += weighted_entropy.clone().into_scalar::<f32>() as f64;
        let mut objective = lp.clone().mul(coef).sum();
        if terms.entropy_coef > 0.0 {
            objective = objective - weighted_entropy.mul_scalar(terms.entropy_coef as f32);
        }
        for (i, (reference, coef, _)) in terms.kl.iter().enumerate() {
            let k3 = self.k3_to(reference, pass, lp.clone(), mask.clone());
            sums.kl[i] += k3.clone().into_scalar::<f32>() as f64;
            objective = objective + k3.mul_scalar(*coef as f32);
        }
        objective
    }

    /// Rows, the token batch with the behaviour log-probs in `logp_old`,
    /// and the batch's data metrics (reward, length, staleness).
    fn layout(&self, groups: &[TrainGroup]) -> Result<Layout, TrainError> {
        let rewards: Vec<Vec<f64>> = groups
            .iter()
            .map(|g| g.sequences.iter().map(|s| s.reward as f64).collect())
            .collect();
        let adv = batch_advantages(
            &rewards,
            self.cfg.estimator(),
            self.cfg.filter_zero_variance,
        );
        // Only a loss with a ratio per turn needs the mixed-version turns.
        let turn_ratio = self.turn_ratio();
        let mut rows = Vec::new();
        let mut skel = TokenBatch::default();
        let mut behav = Vec::new();
        let (mut stale, mut lens, mut all_rewards) = (Vec::new(), Vec::new(), Vec::new());
        let (mut turns, mut model_lens, mut mixed) = (Vec::new(), Vec::new(), Vec::new());
        for (g, a) in groups.iter().zip(&adv.groups) {
            all_rewards.extend(g.sequences.iter().map(|s| s.reward as f64));
            stale.extend(g.staleness(self.version));
            let Some(a) = a else { continue };
            for (i, (s, &adv)) in g.sequences.iter().zip(a).enumerate() {
                self.check_sequence(&g.group_id, i, s)?;
                let seq = rows.len() as u32;
                rows.push(Row {
                    tokens: s.prompt.iter().chain(&s.response).copied().collect(),
                    reward: s.reward,
                    start: s.prompt.len() - 1,
                    len: s.response.len(),
                    offset: skel.advantages.len(),
                });
                lens.push(s.response.len() as f64);
                turns.push(s.turns.last().map_or(1.0, |&t| f64::from(t) + 1.0));
                let mut own = 0usize;
                if turn_ratio {
                    mixed.extend(mixed_turn_tokens(s).map(|j| skel.advantages.len() + j));
                }
                for (j, &lp) in s.behavior_logprobs.iter().enumerate() {
                    let policy = s.is_policy_token(j);
                    own += usize::from(policy);
                    skel.advantages.push(adv);
                    skel.mask.push(policy);
                    skel.seq_ids.push(seq);
                    skel.turn_ids.push(s.turns.get(j).copied().unwrap_or(0));
                    behav.push((lp as f64).min(0.0));
                }
                model_lens.push(own as f64);
            }
        }
        if rows.is_empty() {
            return Err(TrainError::Empty);
        }
        skel.logp_old = behav;
        let mut m = BTreeMap::new();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        m.insert(Metric::RewardMean.into(), mean(&all_rewards));
        m.insert("response_len_mean".into(), mean(&lens));
        // The model's own tokens: an episode's response also holds the
        // environment's observations, which the length above counts.
        m.insert("model_tokens_mean".into(), mean(&model_lens));
        // Model turns per trained sequence (1 for single answers).
        m.insert("turns_mean".into(), mean(&turns));
        let stale: Vec<f64> = stale.into_iter().map(|s| s as f64).collect();
        m.insert(Metric::StalenessMean.into(), mean(&stale));
        m.insert(
            Metric::StalenessMax.into(),
            stale.iter().copied().fold(0.0, f64::max),
        );
        m.insert(
            "staleness_min".into(),
            stale.iter().copied().fold(f64::INFINITY, f64::min),
        );
        m.insert("groups".into(), groups.len() as f64);
        m.insert(
            "zero_variance_groups".into(),
            adv.zero_variance_groups as f64,
        );
        Ok((rows, skel, m, mixed))
    }

    /// Refuses, by name, a sequence the model cannot take: longer than
    /// its positions, over the token budget or `max_response_tokens`, or
    /// with a token outside the vocabulary.
    fn check_sequence(&self, group: &str, i: usize, s: &Sequence) -> Result<(), TrainError> {
        let max_response = self.cfg.max_response_tokens;
        let max = self.model_config.max_position_embeddings;
        let vocab = self.model_config.vocab_size;
        let len = s.prompt.len() + s.response.len();
        if len > max {
            return Err(TrainError::TooLong {
                group: group.to_string(),
                index: i,
                len,
                max,
            });
        }
        let budget = self.cfg.micro_batch_tokens;
        if budget > 0 && len > budget {
            return Err(TrainError::OverBudget {
                group: group.to_string(),
                index: i,
                len,
                budget,
            });
        }
        if max_response > 0 && s.response.len() > max_response {
            return Err(TrainError::ResponseTooLong {
                group: group.to_string(),
                index: i,
                len: s.response.len(),
                max: max_response,
            });
        }
        if let Some(&id) = s
            .prompt
            .iter()
            .chain(&s.response)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(TrainError::BadToken {
                group: group.to_string(),
                id,
                vocab,
            });
        }
        Ok(())
    }

    /// The KL penalties of this batch: (frozen policy, coefficient,
    /// metric name). `kl_coef` to the initial policy; ReMix's KL-Convex
    /// pair to `π_base` and `π_{k−1}` weighted by `λ(t)`.
    fn kl_terms(&self) -> Vec<(&Transformer, f64, &'static str)> {
        let mut v = Vec::new();
        if let Some(reference) = &self.reference {
            v.push((reference, self.cfg.kl_coef, "kl_ref_k3"));
        }
        let batch = Batch {
            cfg: &self.cfg,
            t: self.batches,
        };
        v.extend(self.algo.kl_terms(&batch));
        v
    }

    /// `Σ k3 · mask` of the current log-probs `lp` against `reference`'s,
    /// with `k3 = exp(lp_ref − lp) − (lp_ref − lp) − 1 ≥ 0`.
    fn k3_to(
        &self,
        reference: &Transformer,
        pass: &Pass<'_>,
        lp: Tensor<2>,
        mask: Tensor<2>,
    ) -> Tensor<1> {
        let [b, t] = lp.dims();
        let plain = self.device.clone().inner();
        let tokens_ref = pass.tokens(&plain);
        let logits = pass.logits(reference, tokens_ref.clone(), &self.rope_plain);
        let ref_lp = to_host(next_token_logprobs(
            logits,
            tokens_ref,
            self.cfg.temperature,
        ));
        let ref_lp = Tensor::<2>::from_data(TensorData::new(ref_lp, [b, t]), &self.device);
        kl::low_var_kl(ref_lp.sub(lp)).mul(mask).sum()
    }

    /// Bytes in use and reserved by the device's memory pools, where the
    /// backend keeps pools (GPUs; not the CPU backend).
    fn device_memory(&self) -> Option<(u64, u64)> {
        let u = self.device.memory_pool_usage()?;
        Some((u.bytes_in_use, u.bytes_reserved))
    }

    /// `rows` cut into forward/backward passes by `micro_batch_seqs` and
    /// `micro_batch_tokens` (`micro.rs`), packed several a line with
    /// `pack_sequences`; `in_order` keeps the rows' order (a
    /// micro-batch-scoped loss). A pass of consecutive rows borrows them;
    /// only regrouped rows are copied.
    fn passes<'r>(&self, rows: &'r [Row], in_order: bool) -> Vec<Pass<'r>> {
        let lens: Vec<usize> = rows.iter().map(|r| r.tokens.len()).collect();
        let limits = micro::Limits {
            seqs: self.cfg.micro_batch_seqs,
            tokens: self.cfg.micro_batch_tokens,
            in_order,
        };
        if self.cfg.pack_sequences {
            return micro::pack(&lens, limits)
                .iter()
                .map(|line| Pass::packed(rows, line))
                .collect();
        }
        micro::plan(&lens, limits)
            .into_iter()
            .map(|p| match (p.first(), p.last()) {
                (Some(&a), Some(&b)) if b - a + 1 == p.len() => Cow::Borrowed(&rows[a..=b]),
                _ => Cow::Owned(p.into_iter().map(|i| rows[i].clone()).collect()),
            })
            .map(Pass::plain)
            .collect()
    }
}

/// The loss of `skel`'s tokens from their current log-probs `lp`,
/// divided by the step's `denoms`.
fn compute_loss(
    loss: &dyn PolicyLoss,
    skel: &TokenBatch,
    lp: Vec<f64>,
    denoms: &Denominators,
) -> Result<(LossOutput, TokenBatch), TrainError> {
    let batch = token_batch(skel, lp)?;
    let out = loss.compute(&batch, denoms);
    Ok((out, batch))
}

/// `1/N` on each of the policy's `N` tokens, 0 elsewhere: entropy and KL
/// are means over the policy's tokens, an environment's observations
/// weigh nothing.
fn token_weights(skel: &TokenBatch) -> Vec<f32> {
    let inv_tokens = 1.0 / skel.masked_count().max(1) as f32;
    skel.mask
        .iter()
        .map(|&m| if m { inv_tokens } else { 0.0 })
        .collect()
}

/// What a backward pass adds to the step's metrics besides the loss's:
/// ratio and mismatch statistics, entropy, KL terms, device memory.
fn step_metrics(
    metrics: &mut BTreeMap<String, f64>,
    batch: &TokenBatch,
    terms: &Terms<'_>,
    sums: Sums,
    peak_mem: Option<(u64, u64)>,
) {
    metrics.extend(ratio_metrics(batch));
    metrics.extend(mismatch_metrics(batch));
    metrics.insert(Metric::Entropy.into(), sums.entropy);
    if let Some((in_use, reserved)) = peak_mem {
        metrics.insert("device_mem_in_use_gib".into(), memory::gib(in_use));
        metrics.insert("device_mem_reserved_gib".into(), memory::gib(reserved));
    }
    for ((_, _, name), v) in terms.kl.iter().zip(sums.kl) {
        metrics.insert((*name).into(), v);
    }
}

/// The batch algorithm of `cfg.algo`; `initial`: the starting policy
/// (ReMix's first `π_base`).
fn batch_algo(cfg: &LearnerConfig, initial: impl FnOnce() -> Transformer) -> Box<dyn BatchAlgo> {
    match cfg.algo.as_str() {
        "spear" => Box::new(replay::Spear::default()),
        "remix" => Box::new(remix_run::RemixRun::new(initial())),
        _ => Box::new(algo::Plain),
    }
}

/// The token batch with current log-probs `lp` filled in.
fn token_batch(skel: &TokenBatch, lp: Vec<f64>) -> Result<TokenBatch, TrainError> {
    let lp: Vec<f64> = lp.into_iter().map(|x| x.min(0.0)).collect();
    Ok(TokenBatch::new(
        skel.advantages.clone(),
        lp,
        skel.logp_old.clone(),
        skel.logp_behav.clone(),
        Some(skel.mask.clone()),
        Some(skel.seq_ids.clone()),
    )?
    .with_turns(skel.turn_ids.clone())?)
}

/// Response positions of `s`'s policy tokens in turns sampled under more
/// than one policy version (a weight update mid-turn, `mode = "partial"`).
fn mixed_turn_tokens(s: &Sequence) -> impl Iterator<Item = usize> + '_ {
    let mut versions: BTreeMap<u32, (u32, bool)> = BTreeMap::new();
    let policy = (0..s.response.len()).filter(|&j| s.is_policy_token(j));
    for j in policy.clone() {
        let turn = s.turns.get(j).copied().unwrap_or(0);
        let e = versions.entry(turn).or_insert((s.versions[j], false));
        e.1 |= e.0 != s.versions[j];
    }
    policy.filter(move |&j| versions[&s.turns.get(j).copied().unwrap_or(0)].1)
}

/// `groups` in `k` contiguous shares of whole groups, as even as can be
/// (group-relative advantages need each group in one piece).
fn split_groups(groups: &[TrainGroup], k: usize) -> Vec<&[TrainGroup]> {
    let k = k.clamp(1, groups.len().max(1));
    (0..k)
        .map(|i| &groups[i * groups.len() / k..(i + 1) * groups.len() / k])
        .collect()
}

/// The tokens `range` of a batch.
fn slice(b: &TokenBatch, range: Range<usize>) -> TokenBatch {
    TokenBatch {
        advantages: b.advantages[range.clone()].to_vec(),
        logp: Vec::new(),
        logp_old: b.logp_old[range.clone()].to_vec(),
        logp_behav: b.logp_behav.as_ref().map(|v| v[range.clone()].to_vec()),
        mask: b.mask[range.clone()].to_vec(),
        seq_ids: b.seq_ids[range.clone()].to_vec(),
        turn_ids: b
            .turn_ids
            .get(range)
            .map(<[u32]>::to_vec)
            .unwrap_or_default(),
    }
}

fn to_host(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("log-probs are f32")
}

/// `Σ_t (lp_θ − lp_behav)` over each sequence's policy tokens: how far
/// each has drifted.
fn seq_log_weights(rows: &[Row], batch: &TokenBatch) -> Vec<f64> {
    let behav = batch.logp_behav.as_ref().unwrap_or(&batch.logp_old);
    rows.iter()
        .map(|r| {
            (r.offset..r.offset + r.len)
                .filter(|&k| batch.mask[k])
                .map(|k| batch.logp[k] - behav[k])
                .sum()
        })
        .collect()
}
