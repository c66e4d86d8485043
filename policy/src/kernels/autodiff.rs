//! The kernels under autodiff: each differentiable operation is one node
//! in Burn's graph whose backward step calls the matching hand-written
//! backward kernel, instead of a node per element-wise op, each holding
//! its own intermediate.
//!
//! The raw `*_forward`/`*_backward` methods are not differentiable
//! themselves: under autodiff they run on the inner backend and return
//! constants (no second derivatives are needed anywhere in bapo).

use burn::backend::{
    Autodiff, Backend,
    autodiff::{
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::{FloatTensor, IntTensor},
};

use super::PolicyKernels;
use crate::packing::Segments;

type Ad<B, C> = Autodiff<B, C>;

/// A constant (untracked) autodiff tensor around an inner-backend result.
fn constant<B: Backend, C: CheckpointStrategy>(t: FloatTensor<B>) -> FloatTensor<Ad<B, C>> {
    <FloatTensor<Ad<B, C>>>::new(t)
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: Backend + PolicyKernels> Backward<B, 2> for RmsNormBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, eps) = ops.state;
        let (dx, dgamma) = B::rms_norm_backward(x, gamma, grad, eps);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<B>(node.id, dgamma);
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: Backend + PolicyKernels> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (dgate, dup) = B::swiglu_backward(gate, up, grad);
        if let Some(node) = node_gate {
            grads.register::<B>(node.id, dgate);
        }
        if let Some(node) = node_up {
            grads.register::<B>(node.id, dup);
        }
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend + PolicyKernels> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output, the rows' log-sum-exp, and the segments.
    type State = ([FloatTensor<B>; 5], Segments);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let ([q, k, v, out, lse], segments) = ops.state;
        let (dq, dk, dv) = B::causal_attention_backward(q, k, v, out, lse, grad, segments);
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

#[derive(Debug)]
struct StatsBackward;

impl<B: Backend + PolicyKernels> Backward<B, 1> for StatsBackward {
    /// logits, tokens, the forward's statistics and log-sum-exps, 1/T.
    type State = (
        FloatTensor<B>,
        IntTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        f64,
    );

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (logits, tokens, stats, lse, inv_t) = ops.state;
        if let Some(node) = node_logits {
            let d = B::next_token_stats_backward(logits, tokens, stats, lse, grad, inv_t);
            grads.register::<B>(node.id, d);
        }
    }
}

impl<B: Backend + PolicyKernels, C: CheckpointStrategy> PolicyKernels for Ad<B, C> {
    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let prep = RmsNormBackward
            .prepare::<C>([x.node(), gamma.node()])
            .compute_bound()
            .stateful();
        let (x, gamma) = (x.into_primitive(), gamma.into_primitive());
        match prep {
            OpsKind::Tracked(prep) => {
                let y = B::rms_norm(x.clone(), gamma.clone(), eps);
                prep.finish((x, gamma, eps), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x, gamma, eps)),
        }
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dgamma) = B::rms_norm_backward(
            x.into_primitive(),
            gamma.into_primitive(),
            grad.into_primitive(),
            eps,
        );
        (constant::<B, C>(dx), constant::<B, C>(dgamma))
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let prep = SwigluBackward
            .prepare::<C>([gate.node(), up.node()])
            .compute_bound()
            .stateful();
        let (gate, up) = (gate.into_primitive(), up.into_primitive());
        match prep {
            OpsKind::Tracked(prep) => {
                let y = B::swiglu(gate.clone(), up.clone());
                prep.finish((gate, up), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate, up)),
        }
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dg, du) = B::swiglu_backward(
            gate.into_primitive(),
            up.into_primitive(),
            grad.into_primitive(),
        );
        (constant::<B, C>(dg), constant::<B, C>(du))
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        segments: Segments,
    ) -> FloatTensor<Self> {
        let prep = AttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful();
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        match prep {
            OpsKind::Tracked(prep) => {
                let (out, lse) =
                    B::causal_attention_forward(q.clone(), k.clone(), v.clone(), segments.clone());
                prep.finish(([q, k, v, out.clone(), lse], segments), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::causal_attention(q, k, v, segments)),
        }
    }

    fn few_rows_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        constant::<B, C>(B::few_rows_matmul(
            x.into_primitive(),
            weight.into_primitive(),
        ))
    }

    fn cached_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        offset: usize,
    ) -> FloatTensor<Self> {
        constant::<B, C>(B::cached_attention(
            q.into_primitive(),
            k_cache.into_primitive(),
            v_cache.into_primitive(),
            offset,
        ))
    }

    fn causal_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        segments: Segments,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = B::causal_attention_forward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            segments,
        );
        (constant::<B, C>(out), constant::<B, C>(lse))
    }

    fn causal_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        segments: Segments,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::causal_attention_backward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            out.into_primitive(),
            lse.into_primitive(),
            grad.into_primitive(),
            segments,
        );
        (
            constant::<B, C>(dq),
            constant::<B, C>(dk),
            constant::<B, C>(dv),
        )
    }

    fn next_token_stats(
        logits: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        inv_temperature: f64,
    ) -> FloatTensor<Self> {
        let prep = StatsBackward
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful();
        let logits = logits.into_primitive();
        match prep {
            OpsKind::Tracked(prep) => {
                let (stats, lse) =
                    B::next_token_stats_forward(logits.clone(), tokens.clone(), inv_temperature);
                prep.finish((logits, tokens, stats.clone(), lse, inv_temperature), stats)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::next_token_stats(logits, tokens, inv_temperature))
            }
        }
    }

    fn next_token_stats_forward(
        logits: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        inv_temperature: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (stats, lse) =
            B::next_token_stats_forward(logits.into_primitive(), tokens, inv_temperature);
        (constant::<B, C>(stats), constant::<B, C>(lse))
    }

    fn next_token_stats_backward(
        logits: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        stats: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        inv_temperature: f64,
    ) -> FloatTensor<Self> {
        constant::<B, C>(B::next_token_stats_backward(
            logits.into_primitive(),
            tokens,
            stats.into_primitive(),
            lse.into_primitive(),
            grad.into_primitive(),
            inv_temperature,
        ))
    }
}
