//! Learner incarnations: which process lifetimes a set of weights descends
//! from. The type is the wire crate's ([`bapo_proto::lineage`]), shared
//! with the buffer so both check a lineage by the same rules; what is the
//! learner's own is drawing its incarnation id.

pub use bapo_proto::lineage::{Incarnation, Lineage, LineageError};

/// A random nonzero incarnation id, from the thread generator (seeded from
/// the OS): two learner processes must not draw the same one, and no seed
/// in a config file may make them.
pub fn draw_id() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_ids_are_nonzero_and_differ() {
        let (a, b) = (draw_id(), draw_id());
        assert!(a != 0 && b != 0 && a != b);
    }
}
