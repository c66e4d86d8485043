//! Global gradient-norm clipping: one norm over every parameter of the
//! model, as torch's `clip_grad_norm_` computes it. (Burn's optimiser
//! clipping works per tensor, which changes the update's direction.)

use bapo_policy::burn::{
    module::{Module, ModuleVisitor, Param},
    optim::GradientsParams,
    prelude::*,
};

struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    parts: Vec<Tensor<1>>,
}

impl ModuleVisitor for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.parts.push(g.powi_scalar(2).sum());
        }
    }
}

struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f32,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            self.grads.register(param.id, g.mul_scalar(self.factor));
        }
    }
}

/// The L2 norm of all of `module`'s gradients together.
pub fn global_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    let mut v = SquaredNorm {
        grads,
        parts: Vec::new(),
    };
    module.visit(&mut v);
    if v.parts.is_empty() {
        return 0.0;
    }
    let total: f32 = Tensor::cat(v.parts, 0).sum().into_scalar::<f32>();
    (total as f64).sqrt()
}

/// Scales every gradient by `factor`.
pub fn scale<M: Module>(module: &M, grads: &mut GradientsParams, factor: f64) {
    module.visit(&mut Scale {
        grads,
        factor: factor as f32,
    });
}

/// Clips to `max_norm` (0 disables); returns the norm before and after.
pub fn clip_global_norm<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> (f64, f64) {
    let norm = global_norm(module, grads);
    if max_norm > 0.0 && norm > max_norm && norm.is_finite() {
        let factor = max_norm / (norm + 1e-6);
        scale(module, grads, factor);
        (norm, norm * factor)
    } else {
        (norm, norm)
    }
}
