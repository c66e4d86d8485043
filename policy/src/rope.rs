//! Rotary position embeddings in the Hugging Face layout ("rotate half":
//! the two halves of a head are the real and imaginary parts), which is what
//! Llama and Qwen2 checkpoints on the Hub expect. Burn's `RotaryEncoding`
//! rotates interleaved pairs instead, so it cannot load those weights as is.
//!
//! The tables are derived from the config, not learned: they live beside
//! the weights, not in the module record.

use burn::prelude::*;

use crate::packing::Segments;

/// Rotary tables gathered for packed rows ([`Rope::segment_tables`]).
#[derive(Debug, Clone)]
pub struct SegmentTables {
    cos: Tensor<4>,
    sin: Tensor<4>,
}

#[derive(Debug, Clone)]
pub struct Rope {
    /// `[max_positions, head_dim]`.
    cos: Tensor<2>,
    sin: Tensor<2>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64, max_positions: usize, device: &Device) -> Self {
        let half = head_dim / 2;
        // As HF: inv_freq in f32 from an integer range.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * head_dim);
        let mut sin = Vec::with_capacity(max_positions * head_dim);
        for p in 0..max_positions {
            // The same frequencies for both halves of the head.
            for _half in 0..2 {
                for f in &inv_freq {
                    let angle = p as f32 * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let shape = [max_positions, head_dim];
        Self {
            cos: Tensor::from_data(TensorData::new(cos, shape), device),
            sin: Tensor::from_data(TensorData::new(sin, shape), device),
        }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` of shape `[batch, seq, heads, head_dim]` (the layout the
    /// projections produce) whose first position is absolute position
    /// `start`.
    pub fn apply(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let [_, t, _, d] = x.dims();
        let (cos, sin) = self.tables(start, t);
        // The tables are f32; a lower compute dtype rotates in its own.
        let dt = x.dtype();
        let at = |table: Tensor<2>| table.reshape([1, t, 1, d]).cast(dt);
        Self::rotate(x, at(cos), at(sin), d)
    }

    /// The tables of rows that pack several sequences (`[rows, width, 1,
    /// head_dim]` each, f32): each token at its position within its
    /// sequence; `None` for whole rows, which [`Rope::apply`] serves. Made
    /// once per pass and shared by every layer (it gathers on the host's
    /// positions and uploads them).
    pub fn segment_tables(&self, segments: &Segments) -> Option<SegmentTables> {
        if segments.is_whole() {
            return None;
        }
        let (b, t, d) = (segments.rows(), segments.width(), self.cos.dims()[1]);
        let positions = segments.positions();
        let longest = positions.iter().copied().max().unwrap_or(0) as usize + 1;
        assert!(
            longest <= self.max_positions(),
            "position {longest} beyond max_position_embeddings {}",
            self.max_positions()
        );
        let at =
            Tensor::<1, Int>::from_data(TensorData::new(positions, [b * t]), &self.cos.device());
        let gather = |table: &Tensor<2>| table.clone().select(0, at.clone()).reshape([b, t, 1, d]);
        Some(SegmentTables {
            cos: gather(&self.cos),
            sin: gather(&self.sin),
        })
    }

    /// Rotates `x` `[rows, width, heads, head_dim]` by `tables`.
    pub fn apply_tables(x: Tensor<4>, tables: &SegmentTables) -> Tensor<4> {
        let (d, dt) = (x.dims()[3], x.dtype());
        let cos = tables.cos.clone().cast(dt);
        let sin = tables.sin.clone().cast(dt);
        Self::rotate(x, cos, sin, d)
    }

    fn tables(&self, start: usize, t: usize) -> (Tensor<2>, Tensor<2>) {
        assert!(
            start + t <= self.max_positions(),
            "position {} beyond max_position_embeddings {}",
            start + t,
            self.max_positions()
        );
        (
            self.cos.clone().narrow(0, start, t),
            self.sin.clone().narrow(0, start, t),
        )
    }

    fn rotate(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>, d: usize) -> Tensor<4> {
        let half = d / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos + rotated * sin
    }
}
