//! The last versions as deltas, so a subscriber holding any of them is
//! brought to the newest by what changed instead of the whole model.
//!
//! Each publish of a whole model (not a LoRA base or adapters) adds one
//! link: the delta from the version before it, in the wire encoding. The
//! chain keeps links while their bytes together stay under one full
//! payload: a subscriber further behind is cheaper to send a snapshot.
//! A link that is itself larger than the payload (a big step, a new
//! encoding) breaks the chain: every subscriber then gets a snapshot.
//!
//! Every link names the CRC32 of the payload it applies to and of the one
//! it builds, so a subscriber can only ever end on bytes whose checksum is
//! the learner's for that version.

use std::{collections::VecDeque, sync::Arc};

use bytes::Bytes;

/// One version as the delta from the version before it.
#[derive(Debug)]
pub struct Link {
    /// The version the delta applies to, and its payload's CRC32.
    pub from_version: u64,
    pub from_crc: u32,
    /// The version it builds.
    pub version: u64,
    /// That version's 32-byte weights header (length and CRC32 of the
    /// whole payload the delta builds).
    pub header: Bytes,
    /// `bapo_policy::delta` bytes.
    pub delta: Bytes,
}

/// The newest links, oldest first; their bytes together stay under the
/// size of one full payload.
#[derive(Debug, Default)]
pub struct Chain {
    links: VecDeque<Arc<Link>>,
    bytes: usize,
}

impl Chain {
    /// Adds `link` (the delta to the newest version), dropping the oldest
    /// links while the chain costs more than `full` bytes. A link larger
    /// than `full` on its own empties the chain.
    pub fn push(&mut self, link: Link, full: usize) {
        if self
            .links
            .back()
            .is_some_and(|l| l.version != link.from_version)
        {
            self.clear();
        }
        self.bytes += link.delta.len();
        self.links.push_back(Arc::new(link));
        while self.bytes >= full {
            let Some(old) = self.links.pop_front() else {
                break;
            };
            self.bytes -= old.delta.len();
        }
    }

    /// Forgets every link: no subscriber can be brought forward by deltas
    /// any more (the next version is sent whole).
    pub fn clear(&mut self) {
        self.links.clear();
        self.bytes = 0;
    }

    /// The links as they are now, shared with the version they end at.
    pub fn links(&self) -> Arc<[Arc<Link>]> {
        self.links.iter().cloned().collect()
    }
}

/// The links that bring a subscriber holding `version` (its payload of
/// CRC32 `crc`) to the end of `links`, or `None` when it must be sent a
/// snapshot: it holds none of the versions the chain starts from, or its
/// bytes are not the ones the chain was made from.
pub fn route(links: &[Arc<Link>], version: u64, crc: u32) -> Option<&[Arc<Link>]> {
    let at = links
        .iter()
        .position(|l| l.from_version == version && l.from_crc == crc)?;
    Some(&links[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(from: u64, bytes: usize) -> Link {
        Link {
            from_version: from,
            from_crc: from as u32 * 10,
            version: from + 1,
            header: Bytes::new(),
            delta: Bytes::from(vec![0; bytes]),
        }
    }

    #[test]
    fn a_subscriber_is_routed_from_the_version_it_holds() {
        let mut c = Chain::default();
        for v in 1..=4 {
            c.push(link(v, 10), 100);
        }
        let links = c.links();
        let route_from = |v: u64, crc: u32| route(&links, v, crc).map(|r| r.len());
        assert_eq!(route_from(1, 10), Some(4));
        assert_eq!(route_from(3, 30), Some(2));
        // The newest itself is not in the chain as a start: nothing to send.
        assert_eq!(route_from(5, 50), None);
        // The right version with other bytes gets a snapshot.
        assert_eq!(route_from(3, 31), None);
        assert_eq!(route_from(0, 0), None);
    }

    #[test]
    fn the_chain_never_costs_a_full_payload() {
        let mut c = Chain::default();
        for v in 1..=5 {
            c.push(link(v, 30), 100);
        }
        // 3 links are 90 bytes; a fourth would reach the payload's 100.
        let links = c.links();
        assert_eq!(links.len(), 3);
        assert_eq!(links[0].from_version, 3);
        // A link as large as the payload leaves nothing to route by.
        c.push(link(6, 100), 100);
        assert!(c.links().is_empty());
        // A link that does not follow the last one starts a new chain.
        c.push(link(7, 10), 100);
        c.push(link(9, 10), 100);
        assert_eq!(c.links().len(), 1);
    }
}
