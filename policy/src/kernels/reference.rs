//! The fused operations composed from Burn's tensor ops: what runs on
//! devices without the CPU kernels (CUDA), and the oracle the kernels are
//! tested against. Same shapes and conventions as the functions of
//! [`super`].

use burn::{
    prelude::*,
    tensor::{
        activation::{log_softmax, silu},
        module::attention,
        ops::AttentionModuleOptions,
    },
};

pub fn rms_norm(x: Tensor<2>, gamma: Tensor<1>, eps: f64) -> Tensor<2> {
    let rms = (x.clone().square().mean_dim(1) + eps).sqrt();
    x / rms * gamma.unsqueeze()
}

pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    silu(gate) * up
}

/// `[b, kv_heads, s, d]` → `[b, kv_heads·n_rep, s, d]`, each kv head shared
/// by `n_rep` consecutive query heads (HF's `repeat_kv`).
pub fn repeat_kv(x: Tensor<4>, n_rep: usize) -> Tensor<4> {
    if n_rep == 1 {
        return x;
    }
    let [b, h, s, d] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([b, h, n_rep, s, d])
        .reshape([b, h * n_rep, s, d])
}

/// `q` `[b, t, heads, d]`, `k`/`v` `[b, t, kv_heads, d]` → `[b, t, heads, d]`.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let rep = q.dims()[2] / k.dims()[2];
    let heads_first = |x: Tensor<4>| x.swap_dims(1, 2);
    let out = attention(
        heads_first(q),
        repeat_kv(heads_first(k), rep),
        repeat_kv(heads_first(v), rep),
        None,
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: true,
        },
    );
    out.swap_dims(1, 2)
}

/// `[b, t-1, 2]`: next-token log-prob and entropy per position.
pub fn next_token_stats(logits: Tensor<3>, tokens: Tensor<2, Int>, temperature: f32) -> Tensor<3> {
    let t = tokens.dims()[1];
    let logits = logits.narrow(1, 0, t - 1);
    let targets = tokens.narrow(1, 1, t - 1);
    let logp = log_softmax(logits.div_scalar(temperature), 2);
    let lp = logp.clone().gather(2, targets.unsqueeze_dim::<3>(2));
    let entropy = logp.clone().exp().mul(logp).sum_dim(2).neg();
    Tensor::cat(vec![lp, entropy], 2)
}
