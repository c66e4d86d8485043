//! The kernels on Burn's CPU backend (`flex`): plain loops over `f32`
//! slices, compiled a second time for AVX2+FMA (`multiversion` picks at
//! run time), threaded over rows or (batch, kv-head) pairs with rayon, and
//! the attention products through `gemm`, the matmul crate flex itself
//! uses. Outputs are built from `Vec<f32>` directly: flex's own
//! `FlexTensor::empty` allocates zeroed bytes and then copies them once
//! more to re-align them, which was a tenth of a training step.

use burn::{
    backend::{
        Bytes, Flex,
        flex::{FlexTensor, Layout},
    },
    tensor::{DType, Shape},
};
use multiversion::multiversion;
use rayon::prelude::*;

use super::{PolicyKernels, fastmath};
use crate::packing::Segments;

/// Rows per rayon task in the row-wise kernels: enough work per task to
/// amortise scheduling, enough tasks to keep every core busy.
fn rows_per_task(rows: usize, row_len: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_work = (16 * 1024 / row_len.max(1)).max(1);
    by_work.min(rows.div_ceil(threads * 4)).max(1)
}

/// The `f32` elements of `t` in row-major order, copying only if `t` is a
/// strided view.
fn dense(t: FlexTensor) -> FlexTensor {
    assert_eq!(
        t.dtype(),
        DType::F32,
        "the fused kernels compute in f32; got a {:?} tensor",
        t.dtype()
    );
    if t.as_slice::<f32>().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("dense() made the tensor contiguous")
}

fn tensor<const N: usize>(data: Vec<f32>, shape: [usize; N]) -> FlexTensor {
    debug_assert_eq!(data.len(), shape.iter().product::<usize>());
    FlexTensor::new(
        Bytes::from_elems(data),
        Layout::contiguous(Shape::from(shape)),
        DType::F32,
    )
}

fn dims<const N: usize>(t: &FlexTensor, what: &str) -> [usize; N] {
    let shape = t.layout().shape();
    assert_eq!(
        shape.num_dims(),
        N,
        "{what}: expected a rank-{N} tensor, got shape {shape:?}"
    );
    std::array::from_fn(|i| shape[i])
}

/// Token ids of an integer tensor of any integer dtype, row-major.
fn token_ids(t: FlexTensor) -> Vec<usize> {
    let t = if t.is_contiguous() {
        t
    } else {
        t.to_contiguous()
    };
    let n = t.layout().num_elements();
    let (start, _) = t
        .layout()
        .contiguous_offsets()
        .expect("contiguous after to_contiguous");
    fn take<E: burn::tensor::Element + bytemuck::Pod>(
        t: &FlexTensor,
        start: usize,
        n: usize,
        to: impl Fn(E) -> Option<usize>,
    ) -> Vec<usize> {
        t.storage::<E>()[start..start + n]
            .iter()
            .map(|&v| to(v).expect("negative token id"))
            .collect()
    }
    match t.dtype() {
        DType::I64 => take::<i64>(&t, start, n, |v| usize::try_from(v).ok()),
        DType::I32 => take::<i32>(&t, start, n, |v| usize::try_from(v).ok()),
        DType::I16 => take::<i16>(&t, start, n, |v| usize::try_from(v).ok()),
        DType::U64 => take::<u64>(&t, start, n, |v| usize::try_from(v).ok()),
        DType::U32 => take::<u32>(&t, start, n, |v| usize::try_from(v).ok()),
        other => panic!("token ids must be an integer tensor, got {other:?}"),
    }
}

/// Sum of `a[i] · b[i]` with eight independent accumulators, so that the
/// loop vectorises (a single accumulator would fix the addition order).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b[..a.len()].as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let (ac, ar) = a.as_chunks::<8>();
    for x in ac {
        for i in 0..8 {
            acc[i] = acc[i].max(x[i]);
        }
    }
    ar.iter()
        .chain(acc.iter())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

// ---------------------------------------------------------------- RMSNorm

#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn rms_norm_rows(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32]) {
    let h = gamma.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let r = 1.0 / (dot(xr, xr) / h as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(gamma) {
            *o = v * r * g;
        }
    }
}

/// One block of rows of the RMSNorm backward; adds this block's share of
/// `dgamma` into `dgamma`.
#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn rms_norm_backward_rows(
    x: &[f32],
    gamma: &[f32],
    grad: &[f32],
    eps: f32,
    dx: &mut [f32],
    dgamma: &mut [f32],
) {
    let h = gamma.len();
    for ((xr, gr), dr) in x
        .chunks_exact(h)
        .zip(grad.chunks_exact(h))
        .zip(dx.chunks_exact_mut(h))
    {
        let r = 1.0 / (dot(xr, xr) / h as f32 + eps).sqrt();
        // c = mean(dxhat · xhat) with dxhat = g·gamma, xhat = x·r.
        let mut acc = 0.0f32;
        for ((&v, &g), &w) in xr.iter().zip(gr).zip(gamma) {
            acc += g * w * v;
        }
        let c = acc * r * r / h as f32;
        for (((d, &v), &g), (&w, dg)) in dr
            .iter_mut()
            .zip(xr)
            .zip(gr)
            .zip(gamma.iter().zip(dgamma.iter_mut()))
        {
            *d = r * (g * w - v * c);
            *dg += g * v * r;
        }
    }
}

// ----------------------------------------------------------------- SwiGLU

#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn swiglu_chunk(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g * fastmath::sigmoid(g) * u;
    }
}

#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn swiglu_backward_chunk(
    gate: &[f32],
    up: &[f32],
    grad: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) {
    for ((((dg, du), &g), &u), &d) in dgate
        .iter_mut()
        .zip(dup.iter_mut())
        .zip(gate)
        .zip(up)
        .zip(grad)
    {
        let s = fastmath::sigmoid(g);
        *du = d * g * s;
        *dg = d * u * s * (1.0 + g * (1.0 - s));
    }
}

// --------------------------------------------------------------- attention

/// Query rows per block: a block of queries needs keys up to its last row
/// only, which skips most of the masked half of the score matrix.
const QUERY_BLOCK: usize = 32;

/// A raw pointer that may cross into rayon tasks. Every task writes only
/// the (batch, head) slots it owns, so the writes never overlap.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: used only for disjoint writes, see the type's comment.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: callers stay inside the allocation this pointer came from.
        unsafe { self.0.add(offset) }
    }
}

/// Strided matrix operand for `gemm`: element `(i, j)` at
/// `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl Mat {
    /// Row-major rows of `data`, `rs` apart.
    fn rows(data: &[f32], rs: isize) -> Mat {
        Mat {
            ptr: data.as_ptr(),
            rs,
            cs: 1,
        }
    }

    fn t(self) -> Mat {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// `dst (m×n) = [dst +] scale · lhs (m×k) · rhs (k×n)`.
///
/// # Safety
/// Every operand must be valid for the index ranges its strides reach.
#[allow(clippy::too_many_arguments)]
unsafe fn mm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
    scale: f32,
) {
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs,
            accumulate,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Turns the scores of query rows `r0..r0+m` (row `i` of `s` holds keys
/// `0..n`) into causal softmax probabilities in place; returns nothing,
/// writes each row's log-sum-exp to `lse`.
#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn causal_softmax_rows(s: &mut [f32], n: usize, r0: usize, lse: &mut [f32]) {
    for (i, (row, l)) in s.chunks_exact_mut(n).zip(lse.iter_mut()).enumerate() {
        let visible = r0 + i + 1;
        let (keep, masked) = row.split_at_mut(visible);
        let m = max(keep);
        let mut sum = 0.0f32;
        for v in keep.iter_mut() {
            *v = fastmath::exp(*v - m);
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in keep.iter_mut() {
            *v *= inv;
        }
        masked.fill(0.0);
        *l = m + sum.ln();
    }
}

/// Recomputes probabilities from scores and saved log-sum-exps, then turns
/// `dp` into `ds = p · (dp − δ)` in place (both `m × n`, row `i` at query
/// `r0 + i`); `delta[i] = Σ_d dO·O` of the row.
#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn attention_grad_rows(
    s: &mut [f32],
    dp: &mut [f32],
    n: usize,
    r0: usize,
    lse: &[f32],
    delta: &[f32],
) {
    for (i, ((srow, dprow), (&l, &dl))) in s
        .chunks_exact_mut(n)
        .zip(dp.chunks_exact_mut(n))
        .zip(lse.iter().zip(delta))
        .enumerate()
    {
        let visible = r0 + i + 1;
        for (p, d) in srow[..visible].iter_mut().zip(&mut dprow[..visible]) {
            *p = fastmath::exp(*p - l);
            *d = *p * (*d - dl);
        }
        srow[visible..].fill(0.0);
        dprow[visible..].fill(0.0);
    }
}

struct AttentionShape {
    b: usize,
    /// Query positions.
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
    /// Key positions held by k and v (a cache may hold more than are
    /// visible yet).
    cap: usize,
}

impl AttentionShape {
    /// `offset`: absolute position of the first query; keys
    /// `0..offset + t` must be present.
    fn of(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor, offset: usize) -> Self {
        let [b, t, h, d] = dims(q, "causal_attention q");
        let [kb, cap, kv, kd] = dims(k, "causal_attention k");
        assert_eq!(
            k.layout().shape(),
            v.layout().shape(),
            "causal_attention: k and v differ in shape"
        );
        assert!(
            kb == b && cap >= offset + t && kd == d && kv > 0 && h % kv == 0,
            "causal_attention: q [{b}, {t}, {h}, {d}] at offset {offset} and k [{kb}, {cap}, {kv}, {kd}] do not fit"
        );
        Self {
            b,
            t,
            h,
            kv,
            d,
            cap,
        }
    }
    /// Row strides of q (and the output) and of k/v.
    fn q_rs(&self) -> usize {
        self.h * self.d
    }
    fn kv_rs(&self) -> usize {
        self.kv * self.d
    }
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}

/// Segments must describe the `[b, t]` queries; packed rows (more than
/// one segment) only in training, where keys and queries coincide.
fn check_segments(segments: &Segments, sh: &AttentionShape, offset: usize) {
    assert!(
        segments.rows() == sh.b && segments.width() == sh.t,
        "causal_attention: segments of {} rows × {} for queries [{}, {}]",
        segments.rows(),
        segments.width(),
        sh.b,
        sh.t
    );
    assert!(
        offset == 0 || segments.is_whole(),
        "causal_attention: packed rows attend over whole sequences only (offset {offset})"
    );
}

/// Query rows below this count attend by direct dot products: a `gemm`
/// call per row costs more than the row's arithmetic (decode steps).
const DIRECT_ROWS: usize = 4;

/// Attention of query rows one by one: `q` rows at stride `q_rs`, keys and
/// values at stride `kv_rs`, row `i` seeing keys `0..=first + i`; writes
/// output rows at stride `q_rs` and each row's log-sum-exp.
#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
fn attend_direct(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (m, d, q_rs, kv_rs): (usize, usize, usize, usize),
    first: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    for i in 0..m {
        let qr = &q[i * q_rs..i * q_rs + d];
        let n = first + i + 1;
        let s = &mut scores[..n];
        for (j, sj) in s.iter_mut().enumerate() {
            *sj = scale * dot(qr, &k[j * kv_rs..j * kv_rs + d]);
        }
        let mx = max(s);
        let mut sum = 0.0;
        for sj in s.iter_mut() {
            *sj = fastmath::exp(*sj - mx);
            sum += *sj;
        }
        let inv = 1.0 / sum;
        let or = &mut out[i * q_rs..i * q_rs + d];
        or.fill(0.0);
        for (j, &p) in s.iter().enumerate() {
            let w = p * inv;
            for (o, &x) in or.iter_mut().zip(&v[j * kv_rs..j * kv_rs + d]) {
                *o += w * x;
            }
        }
        lse[i] = mx + sum.ln();
    }
}

/// Causal attention of `t` queries at absolute positions `offset..` over
/// the first `offset + t` positions of k and v; see `AttentionShape`.
fn attention_forward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    offset: usize,
    segments: &Segments,
) -> (FlexTensor, FlexTensor) {
    let sh = AttentionShape::of(&q, &k, &v, offset);
    check_segments(segments, &sh, offset);
    let (q, k, v) = (dense(q), dense(k), dense(v));
    let (qs, ks, vs) = (values(&q), values(&k), values(&v));
    let AttentionShape {
        b,
        t,
        h,
        kv,
        d,
        cap,
    } = sh;
    let rep = h / kv;
    let mut out = vec![0.0f32; b * t * h * d];
    let mut lse = vec![0.0f32; b * h * t];
    let (out_p, lse_p) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    let keys = offset + t;
    (0..b * kv).into_par_iter().for_each(|task| {
        let (bi, g) = (task / kv, task % kv);
        let mut s = vec![0.0f32; QUERY_BLOCK.min(t) * keys];
        // Each segment attends to itself alone, as a sequence of its own
        // starting at column `s0` (one segment from 0: plain causal).
        for (s0, len) in segments.of_row(bi) {
            let kv_off = (bi * cap * kv + g) * d + s0 * kv * d;
            for head in g * rep..(g + 1) * rep {
                let q_off = (bi * t * h + head) * d + s0 * h * d;
                let lse_off = (bi * h + head) * t + s0;
                for r0 in (0..len).step_by(QUERY_BLOCK) {
                    let m = QUERY_BLOCK.min(len - r0);
                    let at = (q_off + r0 * h * d, kv_off, lse_off + r0);
                    // SAFETY: the offsets index inside q/k/v/out by
                    // construction; `out` and `lse` rows of this head
                    // belong to this task alone.
                    unsafe {
                        forward_block(
                            (qs, ks, vs),
                            (out_p, lse_p),
                            &sh,
                            at,
                            (m, offset + r0),
                            &mut s,
                        )
                    };
                }
            }
        }
    });
    (tensor(out, [b, t, h, d]), tensor(lse, [b, h, t]))
}

/// `s (m×n) = scale · A Bᵀ` for one block: `A` its `m` rows (queries, or
/// the output's gradient), `B` the `n` key-side rows (keys, or values).
///
/// # Safety
/// `a` and `b` must be valid for `m` and `n` rows of `d` elements.
unsafe fn scores(s: &mut [f32], (m, n, d): (usize, usize, usize), a: Mat, b: Mat, scale: f32) {
    // SAFETY: the caller's contract; `s` holds m·n elements.
    unsafe { mm(m, n, d, s.as_mut_ptr(), n as isize, false, a, b.t(), scale) }
}

/// One block of `m` query rows of one head, the first at absolute
/// position `first`: its scores against the keys it sees, the causal
/// softmax (and each row's log-sum-exp), and P·V into its output rows.
/// `at`: the block's first row in q and out, its kv head's first key
/// row, and its first slot in lse.
///
/// # Safety
/// The offsets must index inside q/k/v/out/lse, and the block's `out`
/// rows and `lse` slots must be the caller's alone.
unsafe fn forward_block(
    (qs, ks, vs): (&[f32], &[f32], &[f32]),
    (out_p, lse_p): (Shared, Shared),
    sh: &AttentionShape,
    (row0, kv_off, lse_at): (usize, usize, usize),
    (m, first): (usize, usize),
    scratch: &mut [f32],
) {
    let (h, kv, d) = (sh.h, sh.kv, sh.d);
    let (q_rs, kv_rs, scale) = (sh.q_rs() as isize, sh.kv_rs() as isize, sh.scale());
    let n = first + m;
    // SAFETY: the caller's contract.
    unsafe {
        let lse_rows = std::slice::from_raw_parts_mut(lse_p.at(lse_at), m);
        if m < DIRECT_ROWS {
            let span = (m - 1) * h * d + d;
            let out_rows = std::slice::from_raw_parts_mut(out_p.at(row0), span);
            let shape = (m, d, h * d, kv * d);
            let (k, v) = (&ks[kv_off..], &vs[kv_off..]);
            let q = &qs[row0..row0 + span];
            attend_direct(q, k, v, shape, first, scale, scratch, out_rows, lse_rows);
            return;
        }
        let k_mat = Mat::rows(&ks[kv_off..], kv_rs);
        let v_mat = Mat::rows(&vs[kv_off..], kv_rs);
        let q_mat = Mat::rows(&qs[row0..], q_rs);
        let s = &mut scratch[..m * n];
        scores(s, (m, n, d), q_mat, k_mat, scale);
        causal_softmax_rows(s, n, first, lse_rows);
        let p = Mat::rows(s, n as isize);
        mm(m, d, n, out_p.at(row0), q_rs, false, p, v_mat, 1.0);
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_backward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    out: FlexTensor,
    lse: FlexTensor,
    grad: FlexTensor,
    segments: &Segments,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let sh = AttentionShape::of(&q, &k, &v, 0);
    check_segments(segments, &sh, 0);
    let AttentionShape {
        b,
        t,
        h,
        kv,
        d,
        cap,
    } = sh;
    assert_eq!(
        cap, t,
        "causal_attention backward: keys and queries differ in length"
    );
    let [lb, lh, lt] = dims(&lse, "causal_attention lse");
    assert!(lb == b && lh == h && lt == t, "causal_attention: lse shape");
    let (q, k, v, out, lse, grad) = (
        dense(q),
        dense(k),
        dense(v),
        dense(out),
        dense(lse),
        dense(grad),
    );
    let saved = Saved {
        q: values(&q),
        k: values(&k),
        v: values(&v),
        out: values(&out),
        lse: values(&lse),
        grad: values(&grad),
    };
    let rep = h / kv;
    let mut dq = vec![0.0f32; b * t * h * d];
    let mut dk = vec![0.0f32; b * t * kv * d];
    let mut dv = vec![0.0f32; b * t * kv * d];
    let grads = Grads {
        dq: Shared(dq.as_mut_ptr()),
        dk: Shared(dk.as_mut_ptr()),
        dv: Shared(dv.as_mut_ptr()),
    };
    (0..b * kv).into_par_iter().for_each(|task| {
        let (bi, g) = (task / kv, task % kv);
        let mut scratch = Scratch::for_block(QUERY_BLOCK.min(t), t);
        for (s0, len) in segments.of_row(bi) {
            let kv_off = (bi * t * kv + g) * d + s0 * kv * d;
            for head in g * rep..(g + 1) * rep {
                let q_off = (bi * t * h + head) * d + s0 * h * d;
                let lse_off = (bi * h + head) * t + s0;
                for r0 in (0..len).step_by(QUERY_BLOCK) {
                    let m = QUERY_BLOCK.min(len - r0);
                    let at = (q_off + r0 * h * d, kv_off, lse_off + r0);
                    // SAFETY: as in the forward; dq rows of this head and
                    // the dk/dv rows of kv head `g` of batch `bi` belong
                    // to this task.
                    unsafe { backward_block(&saved, grads, &sh, at, (m, r0), &mut scratch) };
                }
            }
        }
    });
    (
        tensor(dq, [b, t, h, d]),
        tensor(dk, [b, t, kv, d]),
        tensor(dv, [b, t, kv, d]),
    )
}

/// What the attention backward reads, as flat rows: the forward's
/// inputs, its output and log-sum-exp, and the output's gradient.
struct Saved<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    out: &'a [f32],
    lse: &'a [f32],
    grad: &'a [f32],
}

/// Where the attention backward writes.
#[derive(Clone, Copy)]
struct Grads {
    dq: Shared,
    dk: Shared,
    dv: Shared,
}

/// One task's working rows: the block's probabilities, their gradient,
/// and each query row's dO·O.
struct Scratch {
    s: Vec<f32>,
    dp: Vec<f32>,
    delta: Vec<f32>,
}

impl Scratch {
    fn for_block(rows: usize, keys: usize) -> Self {
        Self {
            s: vec![0.0; rows * keys],
            dp: vec![0.0; rows * keys],
            delta: vec![0.0; rows],
        }
    }
}

/// The backward of one block of `m` query rows of one head, the first at
/// position `r0` of its segment: P and dP recomputed from the saved
/// log-sum-exp, dS, then dV and dK of its kv head accumulated and dQ of
/// its rows written. `at` as in [`forward_block`].
///
/// # Safety
/// The offsets must index inside the saved rows and the gradients; the
/// block's dq rows and its kv head's dk/dv rows must be the caller's
/// alone.
unsafe fn backward_block(
    x: &Saved,
    g: Grads,
    sh: &AttentionShape,
    (row0, kv_off, lse_at): (usize, usize, usize),
    (m, r0): (usize, usize),
    w: &mut Scratch,
) {
    let (h, d) = (sh.h, sh.d);
    let (q_rs, kv_rs, scale) = (sh.q_rs() as isize, sh.kv_rs() as isize, sh.scale());
    let n = r0 + m;
    let k_mat = Mat::rows(&x.k[kv_off..], kv_rs);
    let v_mat = Mat::rows(&x.v[kv_off..], kv_rs);
    let q_mat = Mat::rows(&x.q[row0..], q_rs);
    let do_mat = Mat::rows(&x.grad[row0..], q_rs);
    for (i, dl) in w.delta[..m].iter_mut().enumerate() {
        let at = row0 + i * h * d;
        *dl = dot(&x.grad[at..at + d], &x.out[at..at + d]);
    }
    let (s, dp) = (&mut w.s[..m * n], &mut w.dp[..m * n]);
    // SAFETY: the caller's contract.
    unsafe {
        scores(s, (m, n, d), q_mat, k_mat, scale);
        scores(dp, (m, n, d), do_mat, v_mat, 1.0);
        attention_grad_rows(s, dp, n, r0, &x.lse[lse_at..lse_at + m], &w.delta[..m]);
        let p = Mat::rows(s, n as isize);
        let ds = Mat::rows(dp, n as isize);
        // dV[0..n] += Pᵀ dO ; dK[0..n] += scale · dSᵀ Q ; dQ = scale · dS K.
        mm(n, d, m, g.dv.at(kv_off), kv_rs, true, p.t(), do_mat, 1.0);
        mm(n, d, m, g.dk.at(kv_off), kv_rs, true, ds.t(), q_mat, scale);
        mm(m, d, n, g.dq.at(row0), q_rs, false, ds, k_mat, scale);
    }
}

// ------------------------------------------------------ few-rows matmul

fn few_rows_matmul(x: FlexTensor, w: FlexTensor) -> FlexTensor {
    let [m, k] = dims(&x, "few_rows_matmul x");
    let [wk, n] = dims(&w, "few_rows_matmul weight");
    assert_eq!(
        wk, k,
        "few_rows_matmul: x has {k} columns, the weight {wk} rows"
    );
    assert_eq!(w.dtype(), DType::F32, "few_rows_matmul: f32 weights only");
    let x = dense(x);
    let xs = values(&x);
    let w = if w.layout().strides().iter().all(|&s| s > 0) {
        w
    } else {
        w.to_contiguous()
    };
    let (w_rs, w_cs) = {
        let st = w.layout().strides();
        (st[0], st[1])
    };
    let ws = &w.storage::<f32>()[w.layout().start_offset()..];
    let mut y = vec![0.0f32; m * n];
    // yᵀ (n×m) = Wᵀ (n×k) · xᵀ (k×m): the weight is the left operand,
    // which gemm reads in place when its rows are contiguous.
    // SAFETY: strides and extents come from the tensors' own layouts.
    unsafe {
        gemm::gemm(
            n,
            m,
            k,
            y.as_mut_ptr(),
            n as isize,
            1,
            false,
            ws.as_ptr(),
            w_rs,
            w_cs,
            xs.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    tensor(y, [m, n])
}

// ------------------------------------------------ next-token log-prob head

/// Forward of one row: `(log-prob of target, entropy, log-sum-exp)` of
/// `softmax(row · inv_t)`.
#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
fn stats_row(row: &[f32], target: usize, inv_t: f32) -> (f32, f32, f32) {
    let m = max(row) * inv_t;
    let mut sum = [0.0f32; 8];
    let mut weighted = [0.0f32; 8];
    let (chunks, rest) = row.as_chunks::<8>();
    for c in chunks {
        for i in 0..8 {
            let z = c[i] * inv_t;
            let e = fastmath::exp(z - m);
            sum[i] += e;
            weighted[i] += e * z;
        }
    }
    let (mut s, mut w) = (sum.iter().sum::<f32>(), weighted.iter().sum::<f32>());
    for &x in rest {
        let z = x * inv_t;
        let e = fastmath::exp(z - m);
        s += e;
        w += e * z;
    }
    let lse = m + s.ln();
    (row[target] * inv_t - lse, lse - w / s, lse)
}

/// Backward of one row: `d(logits)` from the gradients of the row's
/// log-prob and entropy.
#[multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
fn stats_backward_row(
    row: &[f32],
    target: usize,
    inv_t: f32,
    lse: f32,
    entropy: f32,
    g_lp: f32,
    g_h: f32,
    out: &mut [f32],
) {
    // d lp / dz_j = δ_jt − p_j;  d H / dz_j = −p_j (z_j − lse + H).
    for (o, &x) in out.iter_mut().zip(row) {
        let z = x * inv_t;
        let p = fastmath::exp(z - lse);
        *o = -p * (g_lp + g_h * (z - lse + entropy)) * inv_t;
    }
    out[target] += g_lp * inv_t;
}

struct StatsShape {
    b: usize,
    t: usize,
    v: usize,
}

impl StatsShape {
    fn of(logits: &FlexTensor, tokens: &FlexTensor) -> Self {
        let [b, t, v] = dims(logits, "next_token_stats logits");
        let [tb, tt] = dims(tokens, "next_token_stats tokens");
        assert!(
            tb == b && tt == t && t >= 2,
            "next_token_stats: logits [{b}, {t}, {v}] and tokens [{tb}, {tt}] do not fit"
        );
        Self { b, t, v }
    }
}

fn check_targets(ids: &[usize], v: usize) {
    if let Some(bad) = ids.iter().find(|&&id| id >= v) {
        panic!("next_token_stats: token id {bad} is outside the vocabulary of {v}");
    }
}

fn stats_forward(logits: FlexTensor, tokens: FlexTensor, inv_t: f64) -> (FlexTensor, FlexTensor) {
    let StatsShape { b, t, v } = StatsShape::of(&logits, &tokens);
    let ids = token_ids(tokens);
    check_targets(&ids, v);
    let logits = dense(logits);
    let xs = values(&logits);
    let inv_t = inv_t as f32;
    let rows = b * (t - 1);
    let mut stats = vec![0.0f32; rows * 2];
    let mut lse = vec![0.0f32; rows];
    let per = rows_per_task(rows, v);
    stats
        .par_chunks_mut(2 * per)
        .zip(lse.par_chunks_mut(per))
        .enumerate()
        .for_each(|(chunk, (st, ls))| {
            for (i, (pair, l)) in st.chunks_exact_mut(2).zip(ls.iter_mut()).enumerate() {
                let r = chunk * per + i;
                let (bi, ti) = (r / (t - 1), r % (t - 1));
                let at = (bi * t + ti) * v;
                let (lp, ent, lse) = stats_row(&xs[at..at + v], ids[bi * t + ti + 1], inv_t);
                pair[0] = lp;
                pair[1] = ent;
                *l = lse;
            }
        });
    (tensor(stats, [b, t - 1, 2]), tensor(lse, [b, t - 1]))
}

fn stats_backward(
    logits: FlexTensor,
    tokens: FlexTensor,
    stats: FlexTensor,
    lse: FlexTensor,
    grad: FlexTensor,
    inv_t: f64,
) -> FlexTensor {
    let StatsShape { b, t, v } = StatsShape::of(&logits, &tokens);
    let ids = token_ids(tokens);
    check_targets(&ids, v);
    let (logits, stats, lse, grad) = (dense(logits), dense(stats), dense(lse), dense(grad));
    let (xs, st, ls, gs) = (values(&logits), values(&stats), values(&lse), values(&grad));
    assert_eq!(
        gs.len(),
        b * (t - 1) * 2,
        "next_token_stats: gradient shape"
    );
    let inv_t = inv_t as f32;
    let mut out = vec![0.0f32; b * t * v];
    // One sequence per task: its last row (no next token) stays zero.
    out.par_chunks_mut(t * v).enumerate().for_each(|(bi, seq)| {
        for (ti, row_out) in seq.chunks_exact_mut(v).take(t - 1).enumerate() {
            let r = bi * (t - 1) + ti;
            let at = (bi * t + ti) * v;
            stats_backward_row(
                &xs[at..at + v],
                ids[bi * t + ti + 1],
                inv_t,
                ls[r],
                st[2 * r + 1],
                gs[2 * r],
                gs[2 * r + 1],
                row_out,
            );
        }
    });
    tensor(out, [b, t, v])
}

impl PolicyKernels for Flex {
    fn rms_norm(x: FlexTensor, gamma: FlexTensor, eps: f64) -> FlexTensor {
        let [rows, hidden] = dims(&x, "rms_norm x");
        let [hg] = dims(&gamma, "rms_norm gamma");
        assert_eq!(
            hg, hidden,
            "rms_norm: gamma has {hg} entries for rows of {hidden}"
        );
        let (x, gamma) = (dense(x), dense(gamma));
        let (xs, gs) = (values(&x), values(&gamma));
        let mut out = vec![0.0f32; rows * hidden];
        let per = rows_per_task(rows, hidden) * hidden;
        out.par_chunks_mut(per)
            .zip(xs.par_chunks(per))
            .for_each(|(o, x)| rms_norm_rows(x, gs, eps as f32, o));
        tensor(out, [rows, hidden])
    }

    fn rms_norm_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        grad: FlexTensor,
        eps: f64,
    ) -> (FlexTensor, FlexTensor) {
        let [rows, hidden] = dims(&x, "rms_norm x");
        let (x, gamma, grad) = (dense(x), dense(gamma), dense(grad));
        let (xs, gs, ds) = (values(&x), values(&gamma), values(&grad));
        let mut dx = vec![0.0f32; rows * hidden];
        let per = rows_per_task(rows, hidden) * hidden;
        let dgamma = dx
            .par_chunks_mut(per)
            .zip(xs.par_chunks(per).zip(ds.par_chunks(per)))
            .map(|(dx, (x, g))| {
                let mut dgamma = vec![0.0f32; hidden];
                rms_norm_backward_rows(x, gs, g, eps as f32, dx, &mut dgamma);
                dgamma
            })
            .reduce(
                || vec![0.0f32; hidden],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        (tensor(dx, [rows, hidden]), tensor(dgamma, [hidden]))
    }

    fn swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        let shape = gate.layout().shape().clone();
        assert_eq!(
            &shape,
            up.layout().shape(),
            "swiglu: gate and up differ in shape"
        );
        let (gate, up) = (dense(gate), dense(up));
        let (gs, us) = (values(&gate), values(&up));
        let mut out = vec![0.0f32; gs.len()];
        let per = rows_per_task(gs.len(), 1);
        out.par_chunks_mut(per)
            .zip(gs.par_chunks(per).zip(us.par_chunks(per)))
            .for_each(|(o, (g, u))| swiglu_chunk(g, u, o));
        FlexTensor::new(
            Bytes::from_elems(out),
            Layout::contiguous(shape),
            DType::F32,
        )
    }

    fn swiglu_backward(
        gate: FlexTensor,
        up: FlexTensor,
        grad: FlexTensor,
    ) -> (FlexTensor, FlexTensor) {
        let shape = gate.layout().shape().clone();
        let (gate, up, grad) = (dense(gate), dense(up), dense(grad));
        let (gs, us, ds) = (values(&gate), values(&up), values(&grad));
        let mut dgate = vec![0.0f32; gs.len()];
        let mut dup = vec![0.0f32; gs.len()];
        let per = rows_per_task(gs.len(), 1);
        dgate
            .par_chunks_mut(per)
            .zip(dup.par_chunks_mut(per))
            .zip(
                gs.par_chunks(per)
                    .zip(us.par_chunks(per))
                    .zip(ds.par_chunks(per)),
            )
            .for_each(|((dg, du), ((g, u), d))| swiglu_backward_chunk(g, u, d, dg, du));
        let make = |v: Vec<f32>| {
            FlexTensor::new(
                Bytes::from_elems(v),
                Layout::contiguous(shape.clone()),
                DType::F32,
            )
        };
        (make(dgate), make(dup))
    }

    fn causal_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        segments: Segments,
    ) -> FlexTensor {
        attention_forward(q, k, v, 0, &segments).0
    }

    fn few_rows_matmul(x: FlexTensor, weight: FlexTensor) -> FlexTensor {
        few_rows_matmul(x, weight)
    }

    fn cached_attention(
        q: FlexTensor,
        k_cache: FlexTensor,
        v_cache: FlexTensor,
        offset: usize,
    ) -> FlexTensor {
        let [b, t, _, _] = dims::<4>(&q, "cached_attention q");
        attention_forward(q, k_cache, v_cache, offset, &Segments::whole(b, t)).0
    }

    fn causal_attention_forward(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        segments: Segments,
    ) -> (FlexTensor, FlexTensor) {
        attention_forward(q, k, v, 0, &segments)
    }

    fn causal_attention_backward(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        out: FlexTensor,
        lse: FlexTensor,
        grad: FlexTensor,
        segments: Segments,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        attention_backward(q, k, v, out, lse, grad, &segments)
    }

    fn next_token_stats(
        logits: FlexTensor,
        tokens: FlexTensor,
        inv_temperature: f64,
    ) -> FlexTensor {
        stats_forward(logits, tokens, inv_temperature).0
    }

    fn next_token_stats_forward(
        logits: FlexTensor,
        tokens: FlexTensor,
        inv_temperature: f64,
    ) -> (FlexTensor, FlexTensor) {
        stats_forward(logits, tokens, inv_temperature)
    }

    fn next_token_stats_backward(
        logits: FlexTensor,
        tokens: FlexTensor,
        stats: FlexTensor,
        lse: FlexTensor,
        grad: FlexTensor,
        inv_temperature: f64,
    ) -> FlexTensor {
        stats_backward(logits, tokens, stats, lse, grad, inv_temperature)
    }
}
