//! The step's loss on the host, in the three ways its log-probs can arrive:
//! from a no-grad pass before the first backward (several micro-batches,
//! one loss over the step), read off the first autodiff pass (one
//! micro-batch), or per micro-batch when the loss's data-dependent choices
//! are scoped to micro-batches (the denominators stay the step's).

use std::collections::BTreeMap;

use bapo_policy::burn::prelude::*;

use super::{Pass, TrainError, compute_loss, slice, to_host, token_batch};
use crate::{
    loss::{Denominators, LossOutput, PolicyLoss, TokenBatch},
    record::Metric,
};

/// The loss metrics also kept per micro-batch: a bound search's choices.
const PER_MICRO: [Metric; 5] = [
    Metric::CLow,
    Metric::CHigh,
    Metric::SearchSteps,
    Metric::TargetMet,
    Metric::PosFraction,
];

pub(super) struct HostLoss<'a> {
    loss: &'a dyn PolicyLoss,
    skel: &'a TokenBatch,
    denoms: Denominators,
    per_micro: bool,
    /// The whole step's loss, once computed (not per micro-batch).
    out: Option<(LossOutput, TokenBatch)>,
    /// Per micro-batch: current log-probs, gradients, loss and
    /// token-weighted metrics gathered so far.
    lp: Vec<f64>,
    grad: Vec<f64>,
    loss_sum: f64,
    metric_sums: BTreeMap<String, f64>,
    /// Micro-batches done (per micro-batch only).
    micro: usize,
}

impl<'a> HostLoss<'a> {
    pub(super) fn new(
        loss: &'a dyn PolicyLoss,
        skel: &'a TokenBatch,
        denoms: Denominators,
        per_micro: bool,
    ) -> Self {
        let n = skel.advantages.len();
        Self {
            loss,
            skel,
            denoms,
            per_micro,
            out: None,
            lp: vec![0.0; n],
            grad: vec![0.0; n],
            loss_sum: 0.0,
            metric_sums: BTreeMap::new(),
            micro: 0,
        }
    }

    /// The step's loss from log-probs of a no-grad pass over every row.
    pub(super) fn set_from_prepass(&mut self, lp: Vec<f64>) -> Result<(), TrainError> {
        self.out = Some(compute_loss(self.loss, self.skel, lp, &self.denoms)?);
        Ok(())
    }

    /// `∂L/∂lp` for every token of the step, after computing whatever
    /// `rows`' log-probs `lp` (this micro-batch's autodiff pass) complete.
    pub(super) fn gradient(
        &mut self,
        pass: &Pass<'_>,
        lp: &Tensor<2>,
    ) -> Result<&[f64], TrainError> {
        let n = self.skel.advantages.len();
        let rows = &pass.rows;
        if self.per_micro {
            pass.scatter_response(&to_host(lp.clone()), &mut self.lp);
            let last = rows.last().expect("micro-batches are not empty");
            let range = rows[0].offset..last.offset + last.len;
            let sub = slice(self.skel, range.clone());
            let lp = self.lp[range.clone()].to_vec();
            let (o, _) = compute_loss(self.loss, &sub, lp, &self.denoms)?;
            self.grad[range.clone()].copy_from_slice(&o.grad);
            self.loss_sum += o.loss;
            self.record_own(&o, &sub);
            for (k, v) in o.metrics {
                *self.metric_sums.entry(k).or_default() += v * range.len() as f64 / n as f64;
            }
        } else if self.out.is_none() {
            let mut flat = vec![0.0; n];
            pass.scatter_response(&to_host(lp.clone()), &mut flat);
            self.out = Some(compute_loss(self.loss, self.skel, flat, &self.denoms)?);
        }
        Ok(match &self.out {
            Some((o, _)) => &o.grad,
            None => &self.grad,
        })
    }

    /// The search's own choices of this micro-batch, beside the step's
    /// token-weighted means: `<key>_mb<i>`, and `empty_mb<i>` (1: every
    /// trained token's advantage is 0, so no bound can matter). A mean of
    /// one micro-batch at its limit and one at its start is neither.
    fn record_own(&mut self, o: &LossOutput, sub: &TokenBatch) {
        let i = self.micro;
        self.micro += 1;
        for key in PER_MICRO {
            if let Some(&v) = o.metrics.get(key.key()) {
                self.metric_sums.insert(format!("{}_mb{i}", key.key()), v);
            }
        }
        let empty = sub
            .advantages
            .iter()
            .zip(&sub.mask)
            .all(|(&a, &m)| !m || a == 0.0);
        self.metric_sums
            .insert(format!("empty_mb{i}"), f64::from(u8::from(empty)));
    }

    /// The step's loss and the token batch it was computed on.
    pub(super) fn finish(self) -> Result<(LossOutput, TokenBatch), TrainError> {
        if self.per_micro {
            let batch = token_batch(self.skel, self.lp)?;
            let loss = LossOutput {
                loss: self.loss_sum,
                grad: self.grad,
                metrics: self.metric_sums,
            };
            return Ok((loss, batch));
        }
        self.out.ok_or(TrainError::Empty)
    }
}
