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

/// `new` as the words that differ from `base` (`word` bytes each).
pub fn diff(base: &[u8], new: &[u8], word: usize) -> Result<Vec<u8>, DeltaError> {
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
    for (i, (b, n)) in base
        .chunks_exact(word)
        .zip(new.chunks_exact(word))
        .enumerate()
    {
        if b != n {
            put_varint(&mut body, i as u64 - last);
            body.extend_from_slice(n);
            last = i as u64;
            count += 1;
        }
    }
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(word as u8);
    out.extend_from_slice(&crc32fast::hash(base).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(new).to_le_bytes());
    out.extend_from_slice(&(new.len() as u64).to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// The payload `delta` builds from `base`, checked against both CRCs.
pub fn apply(base: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeltaError> {
    let malformed = DeltaError::Malformed;
    if delta.len() < HEADER || delta[..4] != MAGIC {
        return Err(malformed("no delta header"));
    }
    let word = delta[4] as usize;
    let u32_at = |i: usize| u32::from_le_bytes(delta[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(delta[i..i + 8].try_into().expect("8 bytes"));
    let (want, result_crc) = (u32_at(5), u32_at(9));
    let (len, count) = (u64_at(13), u64_at(21));
    let held = crc32fast::hash(base);
    if held != want {
        return Err(DeltaError::WrongBase { want, held });
    }
    if len != base.len() as u64 {
        return Err(DeltaError::Layout {
            base: base.len(),
            new: len as usize,
        });
    }
    if !matches!(word, 2 | 4) || !base.len().is_multiple_of(word) {
        return Err(DeltaError::Word(word));
    }
    let mut out = base.to_vec();
    let (mut at, mut index) = (HEADER, 0u64);
    for _ in 0..count {
        let gap = get_varint(delta, &mut at).ok_or(malformed("a gap cut short"))?;
        index = index
            .checked_add(gap)
            .ok_or(malformed("an index overflows"))?;
        let start = usize::try_from(index)
            .ok()
            .and_then(|i| i.checked_mul(word))
            .filter(|&s| s + word <= out.len())
            .ok_or(malformed("an index past the payload"))?;
        let value = delta
            .get(at..at + word)
            .ok_or(malformed("a word cut short"))?;
        out[start..start + word].copy_from_slice(value);
        at += word;
    }
    if at != delta.len() {
        return Err(malformed("bytes after the last word"));
    }
    if crc32fast::hash(&out) != result_crc {
        return Err(DeltaError::WrongResult);
    }
    Ok(out)
}

/// How many words a delta changes (its header's count), if it is one.
pub fn changed_words(delta: &[u8]) -> Option<u64> {
    (delta.len() >= HEADER && delta[..4] == MAGIC)
        .then(|| u64::from_le_bytes(delta[21..29].try_into().expect("8 bytes")))
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
