//! Per-token arrays on the wire: little-endian fixed-width values packed into
//! protobuf `bytes` fields (4 bytes each). Every party packs and unpacks them
//! through these functions, so the layout is defined once.

use bytes::Bytes;

/// A `bytes` field whose length is not a whole number of 4-byte values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackError {
    pub len: usize,
}

impl std::error::Error for PackError {}

impl std::fmt::Display for PackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes is not a whole number of 4-byte little-endian values",
            self.len
        )
    }
}

/// Number of 4-byte values in a packed field.
pub fn count(b: &[u8]) -> Result<usize, PackError> {
    if b.len().is_multiple_of(4) {
        Ok(b.len() / 4)
    } else {
        Err(PackError { len: b.len() })
    }
}

pub fn pack_u32(v: &[u32]) -> Bytes {
    v.iter()
        .flat_map(|x| x.to_le_bytes())
        .collect::<Vec<u8>>()
        .into()
}

pub fn pack_f32(v: &[f32]) -> Bytes {
    v.iter()
        .flat_map(|x| x.to_le_bytes())
        .collect::<Vec<u8>>()
        .into()
}

/// The values of a packed u32 field (a trailing partial value is ignored;
/// check with [`count`] first).
pub fn u32s(b: &[u8]) -> impl ExactSizeIterator<Item = u32> + '_ {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// The values of a packed f32 field (see [`u32s`]).
pub fn f32s(b: &[u8]) -> impl ExactSizeIterator<Item = f32> + '_ {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

pub fn unpack_u32(b: &[u8]) -> Result<Vec<u32>, PackError> {
    count(b)?;
    Ok(u32s(b).collect())
}

pub fn unpack_f32(b: &[u8]) -> Result<Vec<f32>, PackError> {
    count(b)?;
    Ok(f32s(b).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_is_little_endian() {
        let v = [0u32, 1, 0xdead_beef, u32::MAX];
        let b = pack_u32(&v);
        assert_eq!(&b[4..8], &[1, 0, 0, 0]);
        assert_eq!(unpack_u32(&b).unwrap(), v);
        let f = [-0.5f32, 0.0, f32::NAN.abs(), -1e-30];
        let back = unpack_f32(&pack_f32(&f)).unwrap();
        assert_eq!(back.len(), 4);
        assert_eq!(back[0], -0.5);
        assert!(back[2].is_nan());
    }

    #[test]
    fn ragged_length_is_an_error_naming_it() {
        let e = unpack_u32(&[1, 2, 3, 4, 5]).unwrap_err();
        assert_eq!(e.len, 5);
        assert!(e.to_string().contains("5 bytes"));
        assert_eq!(count(&[]).unwrap(), 0);
    }
}
