//! Weight deltas: a version's payload as the words that changed since a
//! base payload of the same layout (the same model, the same encoding),
//! for subscribers that already hold the base. Most bf16 weights keep
//! their bits from one RL step to the next (a step of `lr` moves a weight
//! `w` visibly only where `lr ≳ |w|·2⁻⁹`), so the changed words, each as
//! a varint gap and the word, are a fraction of the payload.
//!
//! A delta names its base by the base's CRC32 and carries the result's:
//! applied to any other base, or corrupted on the way, it is refused
//! instead of producing wrong weights, and the subscriber asks for a full
//! snapshot.

/// `b"BPDL"`, then the word size, base CRC, result CRC, length, count.
const MAGIC: [u8; 4] = *b"BPDL";
const HEADER: usize = 4 + 1 + 4 + 4 + 8 + 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    #[error("the base payload has {base} bytes but the new one {new}: not the same layout")]
    Layout { base: usize, new: usize },
    #[error("word size {0} (2 for bf16/f16, 4 for f32) does not divide the payload")]
    Word(usize),
    #[error("the delta was made against another base (CRC {want:08x}, held {held:08x})")]
    WrongBase { want: u32, held: u32 },
    #[error("the delta is malformed: {0}")]
    Malformed(&'static str),
    #[error("the weights the delta builds do not match its checksum: corrupted on the way")]
    WrongResult,
}

impl DeltaError {
    /// A short label for metrics: `base` (made against other bytes),
    /// `checksum` (the result is not what the learner made) or
    /// `malformed`.
    pub fn reason(&self) -> &'static str {
        match self {
            DeltaError::WrongBase { .. } => "base",
            DeltaError::WrongResult => "checksum",
            _ => "malformed",
        }
    }
}

/// `new` as the words that differ from `base` (`word` bytes each).
pub fn diff(base: &[u8], new: &[u8], word: usize) -> Result<Vec<u8>, DeltaError> {
    diff_known(base, crc32fast::hash(base), new, crc32fast::hash(new), word)
}

/// [`diff`] for payloads whose CRC32s are known already (the weights
/// header carries them), saving two passes over the weights.
pub fn diff_known(
    base: &[u8],
    base_crc: u32,
    new: &[u8],
    new_crc: u32,
    word: usize,
) -> Result<Vec<u8>, DeltaError> {
    if base.len() != new.len() {
        return Err(DeltaError::Layout {
            base: base.len(),
            new: new.len(),
        });
    }
    if !matches!(word, 2 | 4) || !new.len().is_multiple_of(word) {
        return Err(DeltaError::Word(word));
    }
    let mut body = Vec::new();
    let (mut last, mut count) = (0u64, 0u64);
    each_changed_word(base, new, word, |index, nw| {
        let index = index as u64;
        put_varint(&mut body, index - last);
        body.extend_from_slice(nw);
        last = index;
        count += 1;
    });
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(word as u8);
    out.extend_from_slice(&base_crc.to_le_bytes());
    out.extend_from_slice(&new_crc.to_le_bytes());
    out.extend_from_slice(&(new.len() as u64).to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Calls `each(index, new word)`, in ascending order, for every word of
/// `word` bytes whose bits differ between `base` and `new` (of one
/// length). Equal blocks are skipped whole (a vectorised compare): most of
/// the weights do not change from one step to the next. Shared by deltas
/// and engine patches ([`crate::hf_patch`]).
pub(crate) fn each_changed_word(
    base: &[u8],
    new: &[u8],
    word: usize,
    mut each: impl FnMut(usize, &[u8]),
) {
    const BLOCK: usize = 64;
    for (b, (bb, nb)) in base.chunks(BLOCK).zip(new.chunks(BLOCK)).enumerate() {
        if bb == nb {
            continue;
        }
        let first = b * BLOCK / word;
        for (i, (bw, nw)) in bb.chunks_exact(word).zip(nb.chunks_exact(word)).enumerate() {
            if bw != nw {
                each(first + i, nw);
            }
        }
    }
}

/// The payload `delta` builds from `base`, checked against both CRCs.
pub fn apply(base: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeltaError> {
    let mut out = base.to_vec();
    apply_in_place(&mut out, delta)?;
    Ok(out)
}

/// What a delta's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaHeader {
    /// Bytes per word: 2 (bf16) or 4 (f32).
    pub word: usize,
    /// CRC32 of the payload the delta applies to.
    pub base_crc: u32,
    /// CRC32 of the payload it builds.
    pub result_crc: u32,
    /// Length of both payloads.
    pub len: u64,
    /// Words it changes.
    pub count: u64,
}

impl DeltaHeader {
    /// Reads the header of `delta`, or says why it is none.
    pub fn read(delta: &[u8]) -> Result<Self, DeltaError> {
        if delta.len() < HEADER || delta[..4] != MAGIC {
            return Err(DeltaError::Malformed("no delta header"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(delta[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(delta[i..i + 8].try_into().expect("8 bytes"));
        Ok(Self {
            word: delta[4] as usize,
            base_crc: u32_at(5),
            result_crc: u32_at(9),
            len: u64_at(13),
            count: u64_at(21),
        })
    }
}

/// Applies `delta` to `payload` where it lies, without a second copy of
/// the weights (at 7B in bf16 a copy is 14 GB).
///
/// Everything that can be checked before a byte changes is: the base's
/// CRC, the layout, and every index and word of the delta. `payload` is
/// untouched when one of those fails. Only the result's CRC is known
/// after the writes: on [`DeltaError::WrongResult`] `payload` holds
/// neither version and must be dropped (the subscriber then asks for a
/// full snapshot).
pub fn apply_in_place(payload: &mut [u8], delta: &[u8]) -> Result<(), DeltaError> {
    apply_in_place_known(payload, crc32fast::hash(payload), delta)
}

/// [`apply_in_place`] to a payload whose CRC32 is `held` (a subscriber
/// knows the CRC of the bytes it keeps: checked when they arrived or
/// were built), saving a pass over the weights.
pub fn apply_in_place_known(payload: &mut [u8], held: u32, delta: &[u8]) -> Result<(), DeltaError> {
    let h = DeltaHeader::read(delta)?;
    if held != h.base_crc {
        return Err(DeltaError::WrongBase {
            want: h.base_crc,
            held,
        });
    }
    if h.len != payload.len() as u64 {
        return Err(DeltaError::Layout {
            base: payload.len(),
            new: h.len as usize,
        });
    }
    if !matches!(h.word, 2 | 4) || !payload.len().is_multiple_of(h.word) {
        return Err(DeltaError::Word(h.word));
    }
    // A dry run first: a malformed delta must leave the payload as it was.
    words(delta, h, payload.len(), |_, _| {})?;
    words(delta, h, payload.len(), |start, value| {
        payload[start..start + value.len()].copy_from_slice(value)
    })?;
    if crc32fast::hash(payload) != h.result_crc {
        return Err(DeltaError::WrongResult);
    }
    Ok(())
}

/// Walks the (byte offset, new word) pairs of `delta`, checking each
/// against a payload of `len` bytes.
fn words(
    delta: &[u8],
    h: DeltaHeader,
    len: usize,
    mut each: impl FnMut(usize, &[u8]),
) -> Result<(), DeltaError> {
    let malformed = DeltaError::Malformed;
    let (mut at, mut index) = (HEADER, 0u64);
    for _ in 0..h.count {
        let gap = get_varint(delta, &mut at).ok_or(malformed("a gap cut short"))?;
        index = index
            .checked_add(gap)
            .ok_or(malformed("an index overflows"))?;
        let start = usize::try_from(index)
            .ok()
            .and_then(|i| i.checked_mul(h.word))
            .filter(|&s| s.checked_add(h.word).is_some_and(|e| e <= len))
            .ok_or(malformed("an index past the payload"))?;
        let value = delta
            .get(at..at + h.word)
            .ok_or(malformed("a word cut short"))?;
        each(start, value);
        at += h.word;
    }
    if at != delta.len() {
        return Err(malformed("bytes after the last word"));
    }
    Ok(())
}

/// How many words a delta changes (its header's count), if it is one.
pub fn changed_words(delta: &[u8]) -> Option<u64> {
    DeltaHeader::read(delta).ok().map(|h| h.count)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn words(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn a_delta_holds_only_the_changed_words() {
        let base = words(&[1, 2, 3, 4, 5, 6]);
        let new = words(&[1, 9, 3, 4, 5, 7]);
        let d = diff(&base, &new, 2).unwrap();
        assert_eq!(changed_words(&d), Some(2));
        // Header, then (gap 1, word 9) and (gap 4, word 7).
        assert_eq!(&d[HEADER..], &[1, 9, 0, 4, 7, 0]);
        assert_eq!(apply(&base, &d).unwrap(), new);
        let same = diff(&base, &base, 2).unwrap();
        assert_eq!(same.len(), HEADER);
        assert_eq!(apply(&base, &same).unwrap(), base);
    }

    #[test]
    fn another_base_or_a_corrupted_delta_is_refused() {
        let base = words(&[1, 2, 3, 4]);
        let new = words(&[1, 2, 8, 4]);
        let d = diff(&base, &new, 2).unwrap();
        let other = words(&[1, 2, 3, 5]);
        assert!(matches!(
            apply(&other, &d),
            Err(DeltaError::WrongBase { .. })
        ));
        let mut flipped = d.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(apply(&base, &flipped), Err(DeltaError::WrongResult));
        let cut = &d[..d.len() - 1];
        assert!(matches!(apply(&base, cut), Err(DeltaError::Malformed(_))));
        assert!(matches!(
            apply(&base, b"nope"),
            Err(DeltaError::Malformed(_))
        ));
        assert!(matches!(
            diff(&base, &words(&[1]), 2),
            Err(DeltaError::Layout { .. })
        ));
        assert_eq!(diff(&[0; 6], &[0; 6], 4), Err(DeltaError::Word(4)));
    }

    #[test]
    fn a_malformed_delta_leaves_the_payload_as_it_was() {
        let base = words(&[1, 2, 3, 4]);
        let new = words(&[7, 2, 3, 8]);
        let d = diff(&base, &new, 2).unwrap();
        // The first word is fine, the second is cut short: nothing written.
        let mut held = base.clone();
        assert!(apply_in_place(&mut held, &d[..d.len() - 1]).is_err());
        assert_eq!(held, base);
        apply_in_place(&mut held, &d).unwrap();
        assert_eq!(held, new);
        // Applied twice, the base is no longer the one named.
        assert!(matches!(
            apply_in_place(&mut held, &d),
            Err(DeltaError::WrongBase { .. })
        ));
        assert_eq!(held, new);
    }

    /// A subscriber that names the CRC of the bytes it keeps is held to
    /// it: a delta made against other bytes is refused before a write.
    #[test]
    fn a_known_crc_must_be_the_base_the_delta_names() {
        let (base, new) = (words(&[1, 2, 3]), words(&[1, 5, 3]));
        let d = diff(&base, &new, 2).unwrap();
        let mut held = base.clone();
        let other = crc32fast::hash(&new);
        assert!(matches!(
            apply_in_place_known(&mut held, other, &d),
            Err(DeltaError::WrongBase { .. })
        ));
        assert_eq!(held, base);
        apply_in_place_known(&mut held, crc32fast::hash(&base), &d).unwrap();
        assert_eq!(held, new);
    }

    proptest! {
        /// Any change of any words, f32 or bf16, round-trips; and no
        /// byte string applied as a delta panics.
        #[test]
        fn deltas_round_trip(
            base in prop::collection::vec(any::<u8>(), 0..64).prop_map(|mut v| { v.truncate(v.len() / 4 * 4); v }),
            flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            word in prop::sample::select(vec![2usize, 4]),
            junk in prop::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut new = base.clone();
            for (i, b) in flips {
                if !new.is_empty() {
                    let n = new.len();
                    new[i % n] = b;
                }
            }
            let d = diff(&base, &new, word).unwrap();
            prop_assert_eq!(apply(&base, &d).unwrap(), new);
            let _ = apply(&base, &junk);
        }
    }
}
