//! The KL penalty's per-token estimator.

use bapo_policy::burn::prelude::*;

/// verl's `low_var_kl` (k3 of Schulman's note) per token, from `d =
/// lp_ref − lp_θ`: `exp(d) − d − 1`, with `d` clamped to ±20 and the
/// estimate to at most 10 (zero gradient beyond), so that one token the
/// reference finds absurd cannot dominate the step. k3 is never negative,
/// so verl's lower clamp at −10 never binds.
pub(super) fn low_var_kl(d: Tensor<2>) -> Tensor<2> {
    let d = d.clamp(-20.0, 20.0);
    d.clone().exp().sub(d).sub_scalar(1.0).clamp_max(10.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k3_is_clamped_at_10_with_no_gradient_beyond() {
        let device = Device::flex().autodiff();
        let raw = [0.0f32, 0.5, -0.5, 3.0, 25.0];
        let d =
            Tensor::<2>::from_data(TensorData::new(raw.to_vec(), [1, 5]), &device).require_grad();
        let k = low_var_kl(d.clone());
        let got: Vec<f32> = k
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        let want = [0.0, 0.5f32.exp() - 1.5, (-0.5f32).exp() - 0.5, 10.0, 10.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
        let grads = k.sum().backward();
        let g: Vec<f32> = d
            .grad(&grads)
            .unwrap()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        // ∂k3/∂d = exp(d) − 1 inside; 0 where clamped (d = 3: e³ − 4 > 10).
        assert!((g[1] - (0.5f32.exp() - 1.0)).abs() < 1e-6, "{g:?}");
        assert_eq!((g[0], g[3], g[4]), (0.0, 0.0, 0.0));
    }
}
