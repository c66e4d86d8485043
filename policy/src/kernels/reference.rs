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

use crate::packing::Segments;

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
    let [b, t, ..] = q.dims();
    segment_attention(q, k, v, &Segments::whole(b, t))
}

/// [`causal_attention`] where each row's `segments` see only themselves:
/// a block-diagonal causal mask (plain causal, unmasked, for whole rows).
pub fn segment_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    segments: &Segments,
) -> Tensor<4> {
    let h = q.dims()[2];
    let rep = h / k.dims()[2];
    let heads_first = |x: Tensor<4>| x.swap_dims(1, 2);
    let mask = (!segments.is_whole()).then(|| segments.mask(h, &q.device()));
    let out = attention(
        heads_first(q),
        repeat_kv(heads_first(k), rep),
        repeat_kv(heads_first(v), rep),
        mask.clone(),
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: mask.is_none(),
        },
    );
    out.swap_dims(1, 2)
}

/// `q` `[b, t, heads, d]` at positions `offset..offset+t` over the first
/// `offset + t` positions of caches `[b, capacity, kv_heads, d]`.
pub fn cached_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, offset: usize) -> Tensor<4> {
    let [b, t, h, _] = q.dims();
    let s = offset + t;
    let rep = h / k.dims()[2];
    let heads_first = |x: Tensor<4>| x.narrow(1, 0, s).swap_dims(1, 2);
    // Burn's causal flag aligns the top-left corner: right only when
    // queries and keys start together; a single query sees every key.
    let (mask, is_causal) = match (t, offset) {
        (1, _) => (None, false),
        (_, 0) => (None, true),
        _ => (
            Some(offset_causal_mask(b, h, t, s, offset, &q.device())),
            false,
        ),
    };
    let out = attention(
        q.swap_dims(1, 2),
        repeat_kv(heads_first(k), rep),
        repeat_kv(heads_first(v), rep),
        mask,
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal,
        },
    );
    out.swap_dims(1, 2)
}

/// True where query `i` (absolute position `offset + i`) must not see key
/// `j`, i.e. `j > offset + i`.
fn offset_causal_mask(
    b: usize,
    h: usize,
    t: usize,
    s: usize,
    offset: usize,
    device: &Device,
) -> Tensor<4, Bool> {
    let rows = Tensor::<1, Int>::arange(offset as i64..(offset + t) as i64, device).reshape([t, 1]);
    let cols = Tensor::<1, Int>::arange(0..s as i64, device).reshape([1, s]);
    cols.greater(rows).unsqueeze::<4>().expand([b, h, t, s])
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
