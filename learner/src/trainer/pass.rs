//! One forward/backward pass: its rows and where each sits in the pass's
//! `[lines, width]` token grid. Unpacked, each row is a line of its own,
//! padded to the longest; packed (`pack_sequences`), the pass is one line
//! holding its rows side by side, which the model sees as separate
//! sequences (`bapo_policy::packing`).

use std::borrow::Cow;

use bapo_policy::{Policy, burn::prelude::*, model::Transformer, packing::Segments, rope::Rope};

use super::Row;

pub(super) struct Pass<'r> {
    pub rows: Cow<'r, [Row]>,
    /// The line and column of each row's first token.
    at: Vec<(usize, usize)>,
    lines: usize,
    width: usize,
    /// `None` when every line holds one row.
    segments: Option<Segments>,
}

impl<'r> Pass<'r> {
    /// One row a line.
    pub fn plain(rows: Cow<'r, [Row]>) -> Self {
        let width = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(1);
        Self {
            at: (0..rows.len()).map(|i| (i, 0)).collect(),
            lines: rows.len(),
            width,
            segments: None,
            rows,
        }
    }

    /// `rows[i]` for each `i` of `line`, side by side in one row.
    pub fn packed(rows: &[Row], line: &[usize]) -> Self {
        let lens: Vec<usize> = line.iter().map(|&i| rows[i].tokens.len()).collect();
        let width = lens.iter().sum::<usize>().max(1);
        let mut at = Vec::with_capacity(line.len());
        let mut col = 0;
        for len in &lens {
            at.push((0, col));
            col += len;
        }
        Self {
            rows: Cow::Owned(line.iter().map(|&i| rows[i].clone()).collect()),
            at,
            lines: 1,
            width,
            segments: Some(Segments::of_lengths(&[lens], width)),
        }
    }

    pub fn segments(&self) -> Option<&Segments> {
        self.segments.as_ref()
    }

    /// The `[lines, width]` token ids, 0 where nothing is placed.
    pub fn tokens(&self, device: &Device) -> Tensor<2, Int> {
        let mut grid = vec![vec![0u32; self.width]; self.lines];
        for (r, &(line, col)) in self.rows.iter().zip(&self.at) {
            grid[line][col..col + r.tokens.len()].copy_from_slice(&r.tokens);
        }
        Policy::tokens(&grid, device)
    }

    /// Logits `[lines, width, vocab]` of `tokens` (this pass's) under
    /// `model`, each placed row seeing only itself.
    pub fn logits(&self, model: &Transformer, tokens: Tensor<2, Int>, rope: &Rope) -> Tensor<3> {
        match &self.segments {
            Some(s) => model.forward_packed(tokens, rope, s),
            None => model.forward(tokens, rope, None),
        }
    }

    /// Copies each row's response positions out of a `[lines, t]` grid of
    /// next-token values into `flat` (indexed by the rows' offsets).
    pub fn scatter_response(&self, grid: &[f32], flat: &mut [f64]) {
        let t = grid.len() / self.lines.max(1);
        for (r, &(line, col)) in self.rows.iter().zip(&self.at) {
            let at = line * t + col + r.start;
            for j in 0..r.len {
                flat[r.offset + j] = grid[at + j] as f64;
            }
        }
    }

    /// A `[lines, t]` grid, `f(row, j)` at each row's response positions,
    /// 0 elsewhere.
    pub fn response_grid(&self, t: usize, f: impl Fn(&Row, usize) -> f32) -> Vec<f32> {
        let mut g = vec![0.0; self.lines * t];
        for (r, &(line, col)) in self.rows.iter().zip(&self.at) {
            let at = line * t + col + r.start;
            for j in 0..r.len {
                g[at + j] = f(r, j);
            }
        }
        g
    }

    /// Tokens of the rows, and what the pass computes on.
    fn sizes(&self) -> (usize, usize) {
        let real = self.rows.iter().map(|r| r.tokens.len()).sum();
        (real, self.lines * self.width)
    }
}

/// How a step's passes were cut: their count, and the share of the
/// tokens they computed on that was padding.
pub(super) fn metrics(passes: &[Pass<'_>]) -> [(String, f64); 2] {
    let (real, computed) = passes
        .iter()
        .map(Pass::sizes)
        .fold((0, 0), |(a, b), (r, c)| (a + r, b + c));
    [
        ("micro_batches".into(), passes.len() as f64),
        (
            "padding_fraction".into(),
            1.0 - real as f64 / computed.max(1) as f64,
        ),
    ]
}
