//! Fused kernels for the four places where the training step spends its
//! time outside the matrix multiplies: RMSNorm, the SwiGLU gate, causal
//! self-attention and the next-token log-prob/entropy head.
//!
//! Why: composed from Burn's element-wise ops, each of these allocates a
//! fresh tensor per step of the formula, runs single-threaded scalar `exp`,
//! and autodiff keeps every intermediate alive for the backward pass. On
//! the CPU backend that was about half of a training step (see
//! docs/policy.md#benchmark). Here each one is a single pass forward and a
//! single pass backward over rows, threaded with rayon, with a vectorisable
//! `exp`; attention reads q/k/v in the `[batch, seq, heads, head_dim]`
//! layout the projections produce, so no transpose is ever materialised.
//!
//! They are a Burn backend extension: [`PolicyKernels`] is implemented for
//! the CPU backend (`cpu.rs`) and for autodiff over it (`autodiff.rs`,
//! which holds the hand-written gradients). On any other device (CUDA) the
//! functions below fall back to the same maths composed from Burn's tensor
//! ops (`reference.rs`), which is also what the tests check the kernels
//! against, values and gradients.

mod autodiff;
mod cpu;
mod fastmath;
pub mod reference;

use burn::{
    backend::{
        Backend, Dispatch, DispatchDevice, backend_extension,
        tensor::{FloatTensor, IntTensor},
    },
    prelude::*,
};

use crate::packing::Segments;

/// The fused operations, on backend primitives. The `*_forward` and
/// `*_backward` methods are the raw kernels that the autodiff
/// implementation calls; models use the functions of this module.
#[backend_extension(Flex, Autodiff)]
pub trait PolicyKernels: Backend {
    /// `x` `[rows, hidden]`, `gamma` `[hidden]`: `x / sqrt(mean(x²) + eps) · gamma`.
    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
    /// Gradients of [`PolicyKernels::rms_norm`] for `x` and `gamma`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `silu(gate) · up`, element-wise, any equal shapes.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Gradients of [`PolicyKernels::swiglu`] for `gate` and `up`.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Causal self-attention with scale `1/sqrt(head_dim)`: `q`
    /// `[batch, seq, heads, head_dim]`, `k` and `v` `[batch, seq,
    /// kv_heads, head_dim]` (grouped-query: `heads` a multiple of
    /// `kv_heads`); returns `[batch, seq, heads, head_dim]`. Each row's
    /// `segments` attend each to itself alone (`packing.rs`).
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        segments: Segments,
    ) -> FloatTensor<Self>;
    /// Causal attention of `q` `[batch, t, heads, head_dim]` at absolute
    /// positions `offset..offset+t` over the first `offset + t` positions
    /// of a key/value cache `[batch, capacity, kv_heads, head_dim]`.
    /// Inference only: no gradient.
    fn cached_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        offset: usize,
    ) -> FloatTensor<Self>;
    /// `x` `[rows, d_in]` times `weight` `[d_in, d_out]` (any strides),
    /// for few rows (decoding). Inference only: no gradient.
    fn few_rows_matmul(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self>;
    /// [`PolicyKernels::causal_attention`] and the log-sum-exp of every
    /// score row, `[batch, heads, seq]`, which the backward pass needs.
    fn causal_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        segments: Segments,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// Gradients for `q`, `k` and `v` from the forward's output and
    /// log-sum-exp.
    fn causal_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        segments: Segments,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// `logits` `[batch, seq, vocab]` and `tokens` `[batch, seq]`: for
    /// positions `0..seq-1`, the log-prob of the next token and the entropy
    /// under `softmax(logits · inv_temperature)`, as `[batch, seq-1, 2]`.
    fn next_token_stats(
        logits: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        inv_temperature: f64,
    ) -> FloatTensor<Self>;
    /// [`PolicyKernels::next_token_stats`] and each row's log-sum-exp,
    /// `[batch, seq-1]`.
    fn next_token_stats_forward(
        logits: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        inv_temperature: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// Gradient for `logits` (`[batch, seq, vocab]`, the last position
    /// zero) from the gradient of the `[batch, seq-1, 2]` statistics.
    fn next_token_stats_backward(
        logits: FloatTensor<Self>,
        tokens: IntTensor<Self>,
        stats: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        inv_temperature: f64,
    ) -> FloatTensor<Self>;
}

/// Whether the fused CPU kernels serve `x`: f32 tensors on the CPU
/// backend (they are written for f32; a lower precision, and every other
/// backend, runs the composed ops). `BAPO_FUSED_KERNELS=0` turns them off,
/// to compare the two on a real workload.
fn fused<const D: usize>(x: &Tensor<D>) -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("BAPO_FUSED_KERNELS").map_or(true, |v| v != "0"))
        && x.dtype() == burn::tensor::DType::F32
        && on_cpu(x.device())
}

/// Whether `device` (with or without autodiff) is the CPU backend.
pub fn on_cpu(device: Device) -> bool {
    matches!(
        device.without_autodiff().as_dispatch(),
        DispatchDevice::Flex(_)
    )
}

/// Whether the fused kernels serve a model computing in `precision` on
/// `device`; elsewhere the composed ops run, and attention keeps its
/// `T × T` scores for the backward pass (the learner's memory estimate
/// counts them).
pub fn serve(device: &Device, precision: crate::Precision) -> bool {
    precision == crate::Precision::F32 && on_cpu(device.clone())
}

/// RMSNorm of each row of `x` `[rows, hidden]` with scale `gamma`.
pub fn rms_norm(x: Tensor<2>, gamma: Tensor<1>, eps: f64) -> Tensor<2> {
    if !fused(&x) {
        return reference::rms_norm(x, gamma, eps);
    }
    Tensor::from_dispatch(<Dispatch as PolicyKernels>::rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        eps,
    ))
}

/// The SwiGLU gate: `silu(gate) · up`.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "swiglu: gate and up differ in shape"
    );
    if !fused(&gate) {
        return reference::swiglu(gate, up);
    }
    Tensor::from_dispatch(<Dispatch as PolicyKernels>::swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// Causal self-attention over whole sequences (no cache), in the
/// `[batch, seq, heads, head_dim]` layout; see
/// [`PolicyKernels::causal_attention`].
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [b, t, ..] = q.dims();
    segment_attention(q, k, v, &Segments::whole(b, t))
}

/// [`causal_attention`] of rows that pack several sequences: each of a
/// row's `segments` sees only itself.
pub fn segment_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    segments: &Segments,
) -> Tensor<4> {
    let [b, t, h, d] = q.dims();
    let [kb, kt, kvh, kd] = k.dims();
    assert_eq!(
        k.dims(),
        v.dims(),
        "causal_attention: k and v differ in shape"
    );
    assert!(
        kb == b && kt == t && kd == d && kvh > 0 && h % kvh == 0,
        "causal_attention: q {:?} and k {:?} do not fit",
        q.dims(),
        k.dims()
    );
    assert!(
        segments.rows() == b && segments.width() == t,
        "causal_attention: segments of {} rows × {} for q {:?}",
        segments.rows(),
        segments.width(),
        q.dims()
    );
    if !fused(&q) {
        return reference::segment_attention(q, k, v, segments);
    }
    Tensor::from_dispatch(<Dispatch as PolicyKernels>::causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        segments.clone(),
    ))
}

/// Rows at or below which [`linear`] takes the few-rows path.
const FEW_ROWS: usize = 64;

/// `x · weight + bias` for `x` `[rows, d_in]` and `weight` `[d_in, d_out]`
/// (a Burn `Linear`'s, or a transposed view such as a tied embedding).
///
/// Why not `Linear::forward` when decoding: `gemm` packs the weight
/// into panels on every call, and with a handful of rows that packing
/// costs more than the product; below its size threshold flex also runs
/// the product on one thread. Computed as `yᵀ = weightᵀ · xᵀ` the weight
/// becomes the operand `gemm` streams without packing, on every core
/// (measured: 16 rows × 512 × 512 in 141 µs instead of 277 µs, the
/// tied 8192-word head in 1.8 ms instead of 4.4 ms). Training (autodiff)
/// and larger batches keep Burn's path.
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    if x.dims()[0] > FEW_ROWS || x.device().is_autodiff() || !fused(&x) || !fused(&weight) {
        return burn::tensor::module::linear(x, weight, bias);
    }
    let y = Tensor::from_dispatch(<Dispatch as PolicyKernels>::few_rows_matmul(
        x.into_dispatch(),
        weight.into_dispatch(),
    ));
    match bias {
        Some(b) => y + b.unsqueeze(),
        None => y,
    }
}

/// Attention of new positions against a key/value cache; see
/// [`PolicyKernels::cached_attention`]. The cache's positions beyond
/// `offset + t` are ignored.
pub fn cached_attention(
    q: Tensor<4>,
    k_cache: Tensor<4>,
    v_cache: Tensor<4>,
    offset: usize,
) -> Tensor<4> {
    let [b, t, h, d] = q.dims();
    let [kb, cap, kvh, kd] = k_cache.dims();
    assert_eq!(
        k_cache.dims(),
        v_cache.dims(),
        "cached_attention: k and v caches differ in shape"
    );
    assert!(
        kb == b && kd == d && cap >= offset + t && kvh > 0 && h % kvh == 0,
        "cached_attention: q {:?} at offset {offset} and cache {:?} do not fit",
        q.dims(),
        k_cache.dims()
    );
    if !fused(&q) {
        return reference::cached_attention(q, k_cache, v_cache, offset);
    }
    Tensor::from_dispatch(<Dispatch as PolicyKernels>::cached_attention(
        q.into_dispatch(),
        k_cache.into_dispatch(),
        v_cache.into_dispatch(),
        offset,
    ))
}

/// Log-prob of each next token and the entropy of each position's
/// distribution under `softmax(logits / temperature)`: `logits`
/// `[batch, seq, vocab]` and `tokens` `[batch, seq]` give two
/// `[batch, seq-1]` tensors, position `i` predicting token `i+1`.
pub fn next_token_logprobs_and_entropy(
    logits: Tensor<3>,
    tokens: Tensor<2, Int>,
    temperature: f32,
) -> (Tensor<2>, Tensor<2>) {
    let [b, t, _] = logits.dims();
    assert_eq!(
        tokens.dims(),
        [b, t],
        "next_token_logprobs: tokens do not match the logits' [batch, seq]"
    );
    assert!(t >= 2, "next_token_logprobs: need at least two positions");
    assert!(
        temperature > 0.0 && temperature.is_finite(),
        "temperature must be positive, got {temperature}"
    );
    let stats = if fused(&logits) {
        Tensor::from_dispatch(<Dispatch as PolicyKernels>::next_token_stats(
            logits.into_dispatch(),
            tokens.into_dispatch(),
            1.0 / f64::from(temperature),
        ))
    } else {
        reference::next_token_stats(logits, tokens, temperature)
    };
    let lp = stats.clone().narrow(2, 0, 1).squeeze_dim::<2>(2);
    let entropy = stats.narrow(2, 1, 1).squeeze_dim::<2>(2);
    (lp, entropy)
}

/// Only the next-token log-probs of [`next_token_logprobs_and_entropy`].
pub fn next_token_logprobs(
    logits: Tensor<3>,
    tokens: Tensor<2, Int>,
    temperature: f32,
) -> Tensor<2> {
    next_token_logprobs_and_entropy(logits, tokens, temperature).0
}

#[cfg(test)]
mod tests;
