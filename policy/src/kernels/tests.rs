//! Each kernel against its composition from Burn ops (`reference.rs`):
//! values, and gradients through Burn's own autodiff of the composition.

use burn::tensor::Distribution;

use super::*;
use crate::packing::Segments;

fn plain() -> Device {
    Device::flex()
}

fn ad() -> Device {
    Device::flex().autodiff()
}

fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn close<const D: usize>(got: Tensor<D>, want: Tensor<D>, tol: f32, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let diff = (got - want.clone()).abs().max().into_scalar::<f32>();
    let scale = want.abs().max().into_scalar::<f32>().max(1.0);
    assert!(
        diff <= tol * scale,
        "{what}: max |diff| {diff} (scale {scale})"
    );
}

/// Gradients of `Σ w · f(inputs)` for a fixed random `w`, for every input.
fn grads<const D: usize, const O: usize>(
    inputs: &[Tensor<D>],
    w: &Tensor<O>,
    f: impl Fn(Vec<Tensor<D>>) -> Tensor<O>,
) -> Vec<Tensor<D>> {
    let device = ad();
    let leaves: Vec<Tensor<D>> = inputs
        .iter()
        .map(|x| Tensor::from_data(x.to_data(), &device).require_grad())
        .collect();
    let w = Tensor::from_data(w.to_data(), &device);
    let g = (f(leaves.clone()) * w).sum().backward();
    leaves
        .iter()
        .map(|x| {
            Tensor::from_data(
                x.grad(&g).expect("input has a gradient").to_data(),
                &plain(),
            )
        })
        .collect()
}

#[test]
fn rms_norm_matches_composition() {
    let d = plain();
    let (x, gamma) = (random([37, 48], &d), random([48], &d) + 1.0);
    close(
        rms_norm(x.clone(), gamma.clone(), 1e-6),
        reference::rms_norm(x.clone(), gamma.clone(), 1e-6),
        1e-5,
        "rms_norm",
    );
    // Burn's own module gives the same.
    let module = burn::nn::RmsNormConfig::new(48).with_epsilon(1e-6).init(&d);
    let module = burn::nn::RmsNorm {
        gamma: burn::module::Param::from_tensor(gamma.clone()),
        ..module
    };
    close(
        rms_norm(x.clone(), gamma.clone(), 1e-6),
        module.forward(x.clone()),
        1e-5,
        "module",
    );

    let w = random([37, 48], &d);
    let inputs = [x, gamma.unsqueeze::<2>()];
    let fused = grads(&inputs, &w, |v| {
        rms_norm(v[0].clone(), v[1].clone().squeeze_dim(0), 1e-6)
    });
    let composed = grads(&inputs, &w, |v| {
        reference::rms_norm(v[0].clone(), v[1].clone().squeeze_dim(0), 1e-6)
    });
    close(fused[0].clone(), composed[0].clone(), 1e-4, "d x");
    close(fused[1].clone(), composed[1].clone(), 1e-4, "d gamma");
}

#[test]
fn swiglu_matches_composition() {
    let d = plain();
    let (g, u) = (random([5, 13, 11], &d) * 4.0, random([5, 13, 11], &d));
    close(
        swiglu(g.clone(), u.clone()),
        reference::swiglu(g.clone(), u.clone()),
        1e-6,
        "swiglu",
    );
    let w = random([5, 13, 11], &d);
    let inputs = [g, u];
    let fused = grads(&inputs, &w, |v| swiglu(v[0].clone(), v[1].clone()));
    let composed = grads(&inputs, &w, |v| {
        reference::swiglu(v[0].clone(), v[1].clone())
    });
    close(fused[0].clone(), composed[0].clone(), 1e-5, "d gate");
    close(fused[1].clone(), composed[1].clone(), 1e-5, "d up");
}

fn check_attention(b: usize, t: usize, h: usize, kv: usize, hd: usize) {
    let d = plain();
    let q = random([b, t, h, hd], &d);
    let k = random([b, t, kv, hd], &d);
    let v = random([b, t, kv, hd], &d);
    let what = format!("attention b{b} t{t} h{h} kv{kv} d{hd}");
    close(
        causal_attention(q.clone(), k.clone(), v.clone()),
        reference::causal_attention(q.clone(), k.clone(), v.clone()),
        1e-5,
        &what,
    );
    let w = random([b, t, h, hd], &d);
    let inputs = [q, k, v];
    let fused = grads(&inputs, &w, |x| {
        causal_attention(x[0].clone(), x[1].clone(), x[2].clone())
    });
    let composed = grads(&inputs, &w, |x| {
        reference::causal_attention(x[0].clone(), x[1].clone(), x[2].clone())
    });
    for (i, name) in ["q", "k", "v"].iter().enumerate() {
        close(
            fused[i].clone(),
            composed[i].clone(),
            1e-4,
            &format!("{what}: d {name}"),
        );
    }
}

#[test]
fn attention_matches_composition() {
    // One query block, several with a partial last one, grouped-query
    // heads, and a single position.
    check_attention(2, 7, 4, 4, 8);
    check_attention(3, 75, 4, 2, 16);
    check_attention(1, 1, 2, 1, 4);
    check_attention(2, 64, 8, 2, 32);
}

/// Each segment of each row attended on its own, then put back in place:
/// what packed attention must equal.
fn segments_alone(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, s: &Segments) -> Tensor<4> {
    let rows = (0..s.rows())
        .map(|r| {
            let row =
                |x: &Tensor<4>, a: usize, len: usize| x.clone().narrow(0, r, 1).narrow(1, a, len);
            let parts = s
                .of_row(r)
                .map(|(a, len)| causal_attention(row(&q, a, len), row(&k, a, len), row(&v, a, len)))
                .collect();
            Tensor::cat(parts, 1)
        })
        .collect();
    Tensor::cat(rows, 0)
}

#[test]
fn packed_attention_equals_each_sequence_alone() {
    // Segments inside one query block, across blocks, and a row of one;
    // the fused kernel and the composed mask, values and gradients.
    let s = Segments::of_lengths(&[vec![5, 70, 3], vec![40], vec![1, 1, 1]], 80);
    let (h, kv, hd) = (4, 2, 16);
    let d = plain();
    let q = random([3, 80, h, hd], &d);
    let k = random([3, 80, kv, hd], &d);
    let v = random([3, 80, kv, hd], &d);
    let want = segments_alone(q.clone(), k.clone(), v.clone(), &s);
    let fused = segment_attention(q.clone(), k.clone(), v.clone(), &s);
    close(fused, want.clone(), 1e-5, "packed, fused");
    let composed = reference::segment_attention(q.clone(), k.clone(), v.clone(), &s);
    close(composed, want, 1e-5, "packed, composed");
    let w = random([3, 80, h, hd], &d);
    let inputs = [q, k, v];
    let alone = grads(&inputs, &w, |x| {
        segments_alone(x[0].clone(), x[1].clone(), x[2].clone(), &s)
    });
    let fused = grads(&inputs, &w, |x| {
        segment_attention(x[0].clone(), x[1].clone(), x[2].clone(), &s)
    });
    let composed = grads(&inputs, &w, |x| {
        reference::segment_attention(x[0].clone(), x[1].clone(), x[2].clone(), &s)
    });
    for (i, name) in ["q", "k", "v"].iter().enumerate() {
        close(
            fused[i].clone(),
            alone[i].clone(),
            1e-4,
            &format!("fused d {name}"),
        );
        close(
            composed[i].clone(),
            alone[i].clone(),
            1e-4,
            &format!("composed d {name}"),
        );
    }
}

#[test]
fn next_token_stats_match_composition() {
    let d = plain();
    let (b, t, v) = (3, 9, 37);
    let logits = random([b, t, v], &d) * 3.0;
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 11 % v) as i64).collect();
    let tokens = Tensor::<1, Int>::from_data(ids.as_slice(), &d).reshape([b, t]);
    for temperature in [1.0f32, 0.7] {
        let (lp, ent) =
            next_token_logprobs_and_entropy(logits.clone(), tokens.clone(), temperature);
        let want = reference::next_token_stats(logits.clone(), tokens.clone(), temperature);
        close(
            lp.clone().unsqueeze_dim(2),
            want.clone().narrow(2, 0, 1),
            1e-5,
            "log-prob",
        );
        close(ent.unsqueeze_dim(2), want.narrow(2, 1, 1), 1e-5, "entropy");
        // Log-probs are normalised: exp over the vocabulary sums to one.
        assert!(lp.max().into_scalar::<f32>() < 0.0);

        let w = random([b, t - 1, 2], &d);
        let fused = grads(std::slice::from_ref(&logits), &w, |x| {
            let (lp, ent) =
                next_token_logprobs_and_entropy(x[0].clone(), tokens.clone(), temperature);
            Tensor::cat(vec![lp.unsqueeze_dim(2), ent.unsqueeze_dim(2)], 2)
        });
        let composed = grads(std::slice::from_ref(&logits), &w, |x| {
            reference::next_token_stats(x[0].clone(), tokens.clone(), temperature)
        });
        close(fused[0].clone(), composed[0].clone(), 1e-5, "d logits");
        // The last position predicts nothing: no gradient.
        let last = fused[0].clone().narrow(1, t - 1, 1).abs().max();
        assert_eq!(last.into_scalar::<f32>(), 0.0);
    }
}

#[test]
fn next_token_gradient_matches_finite_differences() {
    // Independent of Burn's autodiff: central differences in f64 of the
    // kernel's own forward.
    let d = plain();
    let (b, t, v) = (1, 3, 6);
    let base: Vec<f32> = (0..b * t * v)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3)
        .collect();
    let tokens = Tensor::<2, Int>::from_data([[1i64, 4, 2]], &d);
    let w = [0.7f32, -1.3, 0.4, 2.0];
    let objective = |x: &[f32]| -> f64 {
        let logits = Tensor::<1>::from_data(x, &d).reshape([b, t, v]);
        let (lp, ent) = next_token_logprobs_and_entropy(logits, tokens.clone(), 0.8);
        let lp = lp.into_data().try_to_vec::<f32>().unwrap();
        let ent = ent.into_data().try_to_vec::<f32>().unwrap();
        f64::from(w[0] * lp[0] + w[1] * lp[1] + w[2] * ent[0] + w[3] * ent[1])
    };
    let wt = Tensor::<3>::from_data([[[w[0], w[2]], [w[1], w[3]]]], &d);
    let logits = Tensor::<1>::from_data(base.as_slice(), &d).reshape([b, t, v]);
    let analytic = grads(&[logits], &wt, |x| {
        let (lp, ent) = next_token_logprobs_and_entropy(x[0].clone(), tokens.clone(), 0.8);
        Tensor::cat(vec![lp.unsqueeze_dim(2), ent.unsqueeze_dim(2)], 2)
    })[0]
        .clone()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let h = 1e-2f32;
    for i in 0..base.len() {
        let (mut up, mut down) = (base.clone(), base.clone());
        up[i] += h;
        down[i] -= h;
        let numeric = (objective(&up) - objective(&down)) / f64::from(2.0 * h);
        assert!(
            (numeric - f64::from(analytic[i])).abs() < 2e-3,
            "logit {i}: numeric {numeric} analytic {}",
            analytic[i]
        );
    }
}

#[test]
#[should_panic(expected = "outside the vocabulary")]
fn next_token_stats_refuse_out_of_vocabulary_ids() {
    let d = plain();
    let logits = random([1, 3, 5], &d);
    let tokens = Tensor::<2, Int>::from_data([[0i64, 9, 1]], &d);
    let _ = next_token_logprobs(logits, tokens, 1.0).into_data();
}

#[test]
fn kernels_leave_untracked_inputs_untracked() {
    // Under autodiff, inputs that need no gradient get none and the
    // forward still runs (the learner's no-grad log-prob pre-pass).
    let device = ad();
    let x = random([4, 8], &device);
    let gamma = random([8], &device).require_grad();
    let y = rms_norm(x.clone(), gamma.clone(), 1e-6).sum().backward();
    assert!(x.grad(&y).is_none());
    assert!(gamma.grad(&y).is_some());
}

#[test]
fn cached_attention_matches_composition() {
    let d = plain();
    let (b, h, kv, hd, cap) = (2, 4, 2, 8, 80);
    let k = random([b, cap, kv, hd], &d);
    let v = random([b, cap, kv, hd], &d);
    // A prefill from zero, a prefill after cached positions (gemm blocks
    // and the direct path), and single decode steps.
    for (offset, t) in [(0, 40), (5, 37), (17, 3), (63, 1), (0, 1)] {
        let q = random([b, t, h, hd], &d);
        close(
            cached_attention(q.clone(), k.clone(), v.clone(), offset),
            reference::cached_attention(q, k.clone(), v.clone(), offset),
            1e-5,
            &format!("cached attention offset {offset} t {t}"),
        );
    }
}

#[test]
fn few_rows_linear_matches_matmul_for_both_weight_layouts() {
    let d = plain();
    for rows in [1, 7, 16, 64, 65] {
        let x = random([rows, 24], &d);
        let w = random([24, 40], &d);
        let bias = random([40], &d);
        let want = x.clone().matmul(w.clone()) + bias.clone().unsqueeze();
        close(
            linear(x.clone(), w, Some(bias)),
            want,
            1e-5,
            "row-major weight",
        );
        // A transposed view, as the tied LM head reads the embedding.
        let e = random([40, 24], &d);
        let want = x.clone().matmul(e.clone().transpose());
        close(
            linear(x, e.transpose(), None),
            want,
            1e-5,
            "transposed weight",
        );
    }
}
