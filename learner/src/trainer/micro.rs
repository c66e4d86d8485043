//! How a step's sequences are cut into forward/backward passes.
//!
//! Each pass pads its rows to its longest one, so the tensor a pass
//! computes on is `rows × longest` tokens, and activation memory grows
//! with that product, not with the number of rows. A fixed count of
//! sequences (`micro_batch_seqs`) must be chosen for the longest batch the
//! actors may ever send, and then wastes memory and compute on every
//! shorter one. A token budget (`micro_batch_tokens`, as verl's
//! `use_dynamic_bsz` and slime's `--max-tokens-per-gpu`) bounds the padded
//! tokens of each pass instead, so a pass of short answers holds many and
//! one of long answers few.
//!
//! Under a budget, rows are also grouped by length (longest first, each
//! into the first pass it fits), so rows of like length share a pass and
//! little is spent on padding. Where the loss is computed per micro-batch
//! (`search_scope = "micro_batch"`), a micro-batch is a unit of the
//! method, so rows keep their order and only the cut points move.
//!
//! Gradients accumulate over the passes of a step with the step's global
//! denominators, so any plan gives the same loss and gradients up to
//! float summation order (`micro_batch_plans_give_the_same_step` checks).

/// The limits of one pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Limits {
    /// Rows per pass at most.
    pub seqs: usize,
    /// Padded tokens (`rows × longest`) per pass at most; 0: no budget.
    /// A row longer than the budget gets a pass of its own.
    pub tokens: usize,
    /// Keep rows in order, cutting only between them.
    pub in_order: bool,
}

/// Indices of the rows (of lengths `lens`) of each pass, ascending
/// within a pass.
pub(super) fn plan(lens: &[usize], limits: Limits) -> Vec<Vec<usize>> {
    // Longest first under a budget. Cutting this order wherever the next
    // row does not fit is first-fit decreasing: a pass a row did not fit
    // never takes a later (shorter) one, as its limit depends on its first
    // row and its count only.
    let order = if limits.tokens > 0 && !limits.in_order {
        longest_first(lens)
    } else {
        (0..lens.len()).collect()
    };
    let (seqs, budget) = (limits.seqs.max(1), limits.tokens);
    let mut passes: Vec<Vec<usize>> = Vec::new();
    let mut longest = 0;
    for i in order {
        let fits = |p: &Vec<usize>| {
            let rows = p.len() + 1;
            rows <= seqs && (budget == 0 || rows * longest.max(lens[i]) <= budget)
        };
        match passes.last_mut() {
            Some(p) if fits(p) => p.push(i),
            _ => {
                passes.push(vec![i]);
                longest = 0;
            }
        }
        longest = longest.max(lens[i]);
    }
    for p in &mut passes {
        p.sort_unstable();
    }
    passes
}

/// Rows of each pass when they share one row of the pass
/// (`pack_sequences`): at most `limits.tokens` tokens and `limits.seqs`
/// rows a pass, filled first-fit decreasing (longest first, each into the
/// first pass with room). A row over the budget gets a pass of its own.
pub(super) fn pack(lens: &[usize], limits: Limits) -> Vec<Vec<usize>> {
    let (seqs, budget) = (limits.seqs.max(1), limits.tokens);
    // Each pass's tokens so far and its rows.
    let mut passes: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in longest_first(lens) {
        let len = lens[i];
        match passes
            .iter_mut()
            .find(|(used, rows)| rows.len() < seqs && used + len <= budget)
        {
            Some((used, rows)) => {
                *used += len;
                rows.push(i);
            }
            None => passes.push((len, vec![i])),
        }
    }
    passes.into_iter().map(|(_, rows)| rows).collect()
}

/// Row indices, longest first (ties in order).
fn longest_first(lens: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    order
}

/// Padded tokens of a plan: what its passes compute on.
#[cfg(test)]
pub(super) fn padded_tokens(lens: &[usize], plan: &[Vec<usize>]) -> usize {
    plan.iter()
        .map(|p| p.len() * p.iter().map(|&i| lens[i]).max().unwrap_or(0))
        .sum()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn limits(seqs: usize, tokens: usize, in_order: bool) -> Limits {
        Limits {
            seqs,
            tokens,
            in_order,
        }
    }

    #[test]
    fn without_a_budget_passes_are_fixed_counts_in_order() {
        let p = plan(&[5, 1, 9, 2, 2], limits(2, 0, false));
        assert_eq!(p, [vec![0, 1], vec![2, 3], vec![4]]);
    }

    #[test]
    fn a_budget_groups_rows_of_like_length() {
        // Budget 20: the 10s pair up, the 4s and 5s share a pass of 4 rows
        // padded to 5; in order, each long row would pad short ones.
        let lens = [10, 4, 10, 5, 4, 4];
        let p = plan(&lens, limits(64, 20, false));
        assert_eq!(p, [vec![0, 2], vec![1, 3, 4, 5]]);
        assert_eq!(padded_tokens(&lens, &p), 40);
        let o = plan(&lens, limits(64, 20, true));
        assert_eq!(o, [vec![0, 1], vec![2, 3], vec![4, 5]]);
        assert_eq!(padded_tokens(&lens, &o), 48);
    }

    #[test]
    fn a_row_over_the_budget_gets_a_pass_of_its_own() {
        let p = plan(&[3, 50, 3], limits(64, 10, false));
        assert_eq!(p, [vec![1], vec![0, 2]]);
        let p = plan(&[3, 50, 3], limits(64, 10, true));
        assert_eq!(p, [vec![0], vec![1], vec![2]]);
    }

    #[test]
    fn the_row_cap_holds_under_a_budget() {
        let p = plan(&[1; 5], limits(2, 1000, false));
        assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 1]);
    }

    proptest! {
        /// Every row in exactly one pass; every pass within the limits
        /// unless it is one row; in order, passes are consecutive runs.
        #[test]
        fn plans_cover_every_row_once_within_limits(
            lens in proptest::collection::vec(1usize..300, 0..60),
            seqs in 1usize..20,
            tokens in 0usize..2000,
            in_order in any::<bool>(),
        ) {
            let p = plan(&lens, limits(seqs, tokens, in_order));
            let mut seen: Vec<usize> = p.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
            for pass in &p {
                prop_assert!(!pass.is_empty() && pass.len() <= seqs);
                let longest = pass.iter().map(|&i| lens[i]).max().unwrap_or(0);
                if tokens > 0 && pass.len() > 1 {
                    prop_assert!(pass.len() * longest <= tokens);
                }
            }
            if in_order {
                let flat: Vec<usize> = p.iter().flatten().copied().collect();
                prop_assert_eq!(flat, (0..lens.len()).collect::<Vec<_>>());
            }
        }

    }

    #[test]
    fn packing_fills_each_pass_first_fit_decreasing() {
        // Budget 15: 10+5, 6+6+3, then 4 has no room left but in a new pass.
        let lens = [6, 10, 4, 5, 6, 3];
        let p = pack(&lens, limits(64, 15, false));
        assert_eq!(p, [vec![1, 3], vec![0, 4, 5], vec![2]]);
    }

    #[test]
    fn packing_keeps_the_row_cap_and_gives_a_long_row_its_own_pass() {
        let p = pack(&[2, 2, 2], limits(2, 100, false));
        assert_eq!(p, [vec![0, 1], vec![2]]);
        let p = pack(&[50, 3, 3], limits(64, 10, false));
        assert_eq!(p, [vec![0], vec![1, 2]]);
    }

    proptest! {
        #[test]
        fn packed_passes_hold_every_row_once_within_their_limits(
            lens in proptest::collection::vec(1usize..100, 0..40),
            seqs in 1usize..20,
            tokens in 1usize..2000,
        ) {
            let p = pack(&lens, limits(seqs, tokens, false));
            let mut seen: Vec<usize> = p.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
            for pass in &p {
                prop_assert!(!pass.is_empty() && pass.len() <= seqs);
                let used: usize = pass.iter().map(|&i| lens[i]).sum();
                prop_assert!(pass.len() == 1 || used <= tokens);
            }
        }
    }
}
