//! A weight patch for an inference engine: the elements that changed
//! between two versions of one model, in transformers' names and layout,
//! as one safetensors file the engine's weight transfer reads (bapo's
//! `bapo_shm` engine, `actor/vllm/bapo_vllm_ext.py`). Made from two
//! payloads of the weight stream by [`crate::hf_layout::Layout::patch`].
//!
//! For each tensor with a change: `<name>@idx` (I64, flat indices into
//! the HF tensor, each once, in no set order) and `<name>@val` (the new
//! values, in the payload's dtype: the engine casts them), and the
//! tensor's shape in the header metadata under `shape:<name>`
//! (`"576,1536"`). Tensors that did not change are absent.

use std::collections::HashMap;

use safetensors::{Dtype, tensor::TensorView};

/// Suffixes and metadata prefix of the patch format (the engine reads
/// the same names).
pub const INDICES: &str = "@idx";
pub const VALUES: &str = "@val";
pub const SHAPE: &str = "shape:";

#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("reading an export: {0}")]
    Read(String),
    #[error("the exports differ in layout: {0}")]
    Layout(String),
}

/// A patch and what it holds.
#[derive(Debug)]
pub struct Patch {
    /// The safetensors file.
    pub bytes: Vec<u8>,
    /// Elements changed, of all elements.
    pub changed: usize,
    pub total: usize,
}

/// Flat indices (little-endian i64 bytes, element `i` at `index(i)`) and
/// new values of the elements of `word` bytes whose bits differ.
pub(crate) fn changed_elements(
    old: &[u8],
    new: &[u8],
    word: usize,
    index: impl Fn(usize) -> usize,
) -> (Vec<u8>, Vec<u8>) {
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    crate::delta::each_changed_word(old, new, word, |i, w| {
        idx.extend_from_slice(&(index(i) as i64).to_le_bytes());
        val.extend_from_slice(w);
    });
    (idx, val)
}

/// A tensor's changes: name, dtype, shape, indices, values.
pub(crate) type Change = (String, Dtype, Vec<usize>, Vec<u8>, Vec<u8>);

pub(crate) fn serialize(changes: &[Change]) -> Result<Vec<u8>, PatchError> {
    let mut views = Vec::new();
    let mut meta = HashMap::new();
    for (name, dtype, shape, idx, val) in changes {
        let n = idx.len() / 8;
        let bad = |e: safetensors::SafeTensorError| PatchError::Layout(e.to_string());
        views.push((
            format!("{name}{INDICES}"),
            TensorView::new(Dtype::I64, vec![n], idx).map_err(bad)?,
        ));
        views.push((
            format!("{name}{VALUES}"),
            TensorView::new(*dtype, vec![n], val).map_err(bad)?,
        ));
        let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
        meta.insert(format!("{SHAPE}{name}"), dims.join(","));
    }
    safetensors::serialize(views, Some(meta)).map_err(|e| PatchError::Layout(e.to_string()))
}

#[cfg(test)]
mod tests {
    use safetensors::SafeTensors;

    use super::*;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn indices(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|i| i.to_le_bytes()).collect()
    }

    #[test]
    fn a_patch_holds_the_changed_elements_by_name() {
        let (old, new) = (bytes(&[1.0, 2.0, 3.0]), bytes(&[1.0, 2.5, 3.0]));
        let (idx, val) = changed_elements(&old, &new, 4, |i| i);
        let change = ("a".to_string(), Dtype::F32, vec![3], idx, val);
        let patch = serialize(&[change]).unwrap();
        let t = SafeTensors::deserialize(&patch).unwrap();
        let mut names: Vec<_> = t.names().into_iter().map(str::to_string).collect();
        names.sort();
        assert_eq!(names, ["a@idx", "a@val"]);
        assert_eq!(t.tensor("a@idx").unwrap().data(), 1i64.to_le_bytes());
        assert_eq!(t.tensor("a@val").unwrap().data(), 2.5f32.to_le_bytes());
        let (_, meta) = SafeTensors::read_metadata(&patch).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["shape:a"], "3");
    }

    #[test]
    fn changes_past_the_first_block_keep_their_index() {
        let old: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let mut new = old.clone();
        new[33] = -1.0;
        new[39] = -2.0;
        let (idx, val) = changed_elements(&bytes(&old), &bytes(&new), 4, |i| i);
        assert_eq!(idx, indices(&[33, 39]));
        assert_eq!(val, bytes(&[-1.0, -2.0]));
        // And where the tensor's order differs from the stored one.
        let (idx, _) = changed_elements(&bytes(&old), &bytes(&new), 4, |i| 100 - i);
        assert_eq!(idx, indices(&[67, 61]));
    }
}
