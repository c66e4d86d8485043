//! The key/value cache of one generation: owned by it, never shared, so the
//! weights stay immutable and any number of generations can run against
//! them. After a weight update the cache is dropped and rebuilt from the
//! tokens so far (a cache computed by old weights would mix policies).

use burn::prelude::*;

#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer `(keys, values)`, each `[batch, kv_heads, len, head_dim]`.
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    len: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
        }
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends a layer's new keys and values; returns the full ones.
    pub fn extend(&mut self, layer: usize, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let full = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
            None => (k, v),
        };
        self.layers[layer] = Some(full.clone());
        full
    }

    /// Called once a forward pass over `new` positions has gone through every
    /// layer.
    pub fn advance(&mut self, new: usize) {
        self.len += new;
    }
}
