//! The key/value cache of one generation: owned by it, never shared, so the
//! weights stay immutable and any number of generations can run against
//! them. After a weight update the cache is dropped and rebuilt from the
//! tokens so far (a cache computed by old weights would mix policies).
//!
//! Keys and values are kept per layer in preallocated buffers
//! `[batch, capacity, kv_heads, head_dim]`, the layout the projections
//! produce, so appending a step writes its rows in place and attention
//! reads the buffer as it is. Capacity doubles when it runs out, so a
//! generation of `n` tokens copies its cache `O(log n)` times, not once
//! per token as concatenation would.

use burn::prelude::*;

#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer `(keys, values)`.
    layers: Vec<Option<(Tensor<4>, Tensor<4>)>>,
    len: usize,
}

/// Capacity of a fresh buffer, in positions.
const MIN_CAPACITY: usize = 64;

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

    /// Writes a layer's keys and values `[batch, new, kv_heads, head_dim]`
    /// for positions `len()..len()+new`; returns the layer's buffers, whose
    /// first `len() + new` positions are filled.
    pub fn append(&mut self, layer: usize, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let [b, t, kv, d] = k.dims();
        let (start, end) = (self.len, self.len + t);
        let (kb, vb) = match self.layers[layer].take() {
            Some((kb, vb)) if kb.dims()[1] >= end => (kb, vb),
            old => {
                let cap = end.next_power_of_two().max(MIN_CAPACITY);
                let grow = |old: Option<Tensor<4>>| {
                    let fresh = Tensor::<4>::zeros([b, cap, kv, d], &k.device()).cast(k.dtype());
                    match old {
                        Some(o) if start > 0 => {
                            fresh.slice_assign([0..b, 0..start, 0..kv, 0..d], o.narrow(1, 0, start))
                        }
                        _ => fresh,
                    }
                };
                let (ok, ov) = old.map_or((None, None), |(a, b)| (Some(a), Some(b)));
                (grow(ok), grow(ov))
            }
        };
        // The buffers are owned here alone, so these writes happen in place.
        let kb = kb.slice_assign([0..b, start..end, 0..kv, 0..d], k);
        let vb = vb.slice_assign([0..b, start..end, 0..kv, 0..d], v);
        self.layers[layer] = Some((kb.clone(), vb.clone()));
        (kb, vb)
    }

    /// Called once a forward pass over `new` positions has gone through every
    /// layer.
    pub fn advance(&mut self, new: usize) {
        self.len += new;
    }
}
