//! Several sequences packed into one row of a training pass.
//!
//! Why: a pass pads its rows to its longest one, and the padding costs
//! compute and activation memory like real tokens. Packing puts short
//! sequences side by side in one row, so a pass of unequal lengths holds
//! almost no padding (verl's `use_remove_padding`, NeMo-RL's sequence
//! packing). Each packed sequence must then see only itself: attention is
//! block-diagonal (causal within a segment, nothing across), and rotary
//! positions restart at 0 where a segment starts. With those two, a
//! sequence's logits are the same packed or alone.
//!
//! A row's segments cover the whole row: segment `k` runs from its start
//! to the next one's, the last to the row's end. Padding after the last
//! sequence is thus part of the last segment, exactly as an unpacked row's
//! padding follows its sequence (it sees the sequence; the sequence does
//! not see it, and nothing reads its outputs).

use std::sync::Arc;

use burn::prelude::*;

/// The segment starts of each row of a `[rows, width]` pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segments {
    /// Per row, ascending starts, the first 0, all below `width`.
    starts: Arc<Vec<Vec<usize>>>,
    width: usize,
}

impl Segments {
    /// `rows` rows of one sequence each: plain causal attention.
    pub fn whole(rows: usize, width: usize) -> Self {
        Self {
            starts: Arc::new(vec![vec![0]; rows]),
            width,
        }
    }

    /// Rows holding sequences of the given lengths, each row's packed from
    /// column 0 in order. Panics if a row's lengths exceed `width` or a
    /// length is 0 (a caller's bug: the packer places whole sequences).
    pub fn of_lengths(rows: &[Vec<usize>], width: usize) -> Self {
        let starts = rows
            .iter()
            .map(|lens| {
                assert!(!lens.is_empty(), "a packed row holds at least one sequence");
                let mut at = 0;
                let mut starts = Vec::with_capacity(lens.len());
                for &len in lens {
                    assert!(len > 0, "a packed sequence has at least one token");
                    starts.push(at);
                    at += len;
                }
                assert!(
                    at <= width,
                    "packed sequences of {at} tokens exceed the row's {width}"
                );
                starts
            })
            .collect();
        Self {
            starts: Arc::new(starts),
            width,
        }
    }

    pub fn rows(&self) -> usize {
        self.starts.len()
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// Whether every row is one sequence (no packing): then attention is
    /// plain causal and positions are `0..width`.
    pub fn is_whole(&self) -> bool {
        self.starts.iter().all(|s| s.len() == 1)
    }

    /// The `(start, len)` of each segment of row `r`.
    pub fn of_row(&self, r: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let s = &self.starts[r];
        s.iter().enumerate().map(move |(k, &a)| {
            let end = s.get(k + 1).copied().unwrap_or(self.width);
            (a, end - a)
        })
    }

    /// Each token's position within its segment, `[rows × width]`.
    pub fn positions(&self) -> Vec<i64> {
        let mut p = Vec::with_capacity(self.rows() * self.width);
        for r in 0..self.rows() {
            for (_, len) in self.of_row(r) {
                p.extend(0..len as i64);
            }
        }
        p
    }

    /// `[rows, heads, width, width]`, true where query `i` must not see key
    /// `j`: a later position, or another segment.
    pub fn mask(&self, heads: usize, device: &Device) -> Tensor<4, Bool> {
        let (b, t) = (self.rows(), self.width);
        let mut m = vec![true; b * t * t];
        for r in 0..b {
            for (a, len) in self.of_row(r) {
                for i in a..a + len {
                    m[(r * t + i) * t + a..=(r * t + i) * t + i].fill(false);
                }
            }
        }
        Tensor::<3, Bool>::from_data(TensorData::new(m, [b, t, t]), device)
            .unsqueeze_dim::<4>(1)
            .expand([b, heads, t, t])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_their_rows_and_positions_restart() {
        let s = Segments::of_lengths(&[vec![3, 2], vec![4]], 6);
        assert_eq!(s.of_row(0).collect::<Vec<_>>(), [(0, 3), (3, 3)]);
        assert_eq!(s.of_row(1).collect::<Vec<_>>(), [(0, 6)]);
        assert_eq!(s.positions(), [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5]);
        assert!(!s.is_whole());
        assert!(Segments::whole(2, 6).is_whole());
    }

    #[test]
    fn the_mask_is_causal_within_a_segment_and_blind_across() {
        let s = Segments::of_lengths(&[vec![2, 2]], 4);
        let m = s.mask(1, &Device::default()).into_data();
        let seen: Vec<bool> = m.iter::<bool>().map(|masked| !masked).collect();
        #[rustfmt::skip]
        let expected = [
            true,  false, false, false,
            true,  true,  false, false,
            false, false, true,  false,
            false, false, true,  true,
        ];
        assert_eq!(seen, expected);
    }

    #[test]
    #[should_panic(expected = "exceed the row")]
    fn a_row_cannot_hold_more_than_its_width() {
        Segments::of_lengths(&[vec![3, 3]], 5);
    }
}
