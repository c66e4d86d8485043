//! The same seed, actor id and slot give byte-identical rollouts: the slot
//! RNG (problems, per-group sampling seeds) is derived from them alone, not
//! from the OS nonce of the group ids. Alone in its binary because the
//! device's seed (initial weights) is process-wide.

use std::sync::{Arc, atomic::AtomicBool};

use bapo_actor::{
    UpdateMode,
    rollout::{Outcome, generate},
    run::slot_rng,
    subscription::Versioned,
};
use bapo_policy::SamplingParams;
use rand::Rng;

/// What a slot would send for its first `groups` groups: the drawn
/// problem index, then per response its token ids and log-probs as bits.
fn rollouts(seed: u64, slot: usize, groups: usize) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
    let start = Arc::new(Versioned::new(
        0,
        1,
        bapo_policy::testing::tiny_policy(seed),
    ));
    let mut rng = slot_rng("actor-0", slot, seed, false);
    let mut out = Vec::new();
    for _ in 0..groups {
        // The slot's order of draws: the problem, then the group's seed.
        let problem: u64 = rng.random();
        let params = SamplingParams {
            temperature: 1.0,
            max_new_tokens: 6,
            seed: rng.random(),
            ..Default::default()
        };
        let prompt = [1, 2 + (problem % 40) as u32, 3];
        let Outcome::Done { responses, .. } = generate(
            start.clone(),
            &mut || None,
            &prompt,
            3,
            &params,
            UpdateMode::Partial,
            &AtomicBool::new(false),
        ) else {
            panic!("not aborted")
        };
        for r in responses {
            let bits = r.logprobs.iter().map(|x| x.to_bits()).collect();
            out.push((problem, r.tokens, bits));
        }
    }
    out
}

#[test]
fn the_same_seed_gives_byte_identical_rollouts() {
    let a = rollouts(11, 0, 3);
    assert_eq!(a.len(), 9);
    assert!(
        a.iter()
            .all(|(_, t, lp)| !t.is_empty() && t.len() == lp.len())
    );
    assert_eq!(a, rollouts(11, 0, 3), "same seed and slot, other rollouts");
    // Another seed, or another slot, draws another stream.
    assert_ne!(a, rollouts(12, 0, 3));
    let first = |seed, slot| slot_rng("actor-0", slot, seed, false).random::<u64>();
    assert_ne!(first(11, 0), first(11, 1));
    assert_ne!(
        first(11, 0),
        slot_rng("actor-1", 0, 11, false).random::<u64>()
    );
    // Asked for, the OS's entropy makes two slots with the same seed differ.
    let os = || slot_rng("actor-0", 0, 11, true).random::<u64>();
    assert_ne!(os(), os());
}
