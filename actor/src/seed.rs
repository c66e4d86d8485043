//! Seeds derived from names: the same actor, slot, member and turn draw
//! the same samples on every run.

/// FNV-1a, a stable 64-bit hash of a string (seeds per slot, episode
/// and turn).
pub fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
