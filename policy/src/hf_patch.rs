//! A weight patch for an inference engine: the elements that changed
//! between two exports of one model ([`crate::hf::to_safetensors`]), in
//! transformers' names, as one safetensors file the engine's weight
//! transfer reads (bapo's `bapo_shm` engine, `actor/vllm/bapo_vllm_ext.py`).
//!
//! For each tensor with a change: `<name>@idx` (I64, flat indices in
//! ascending order, each once) and `<name>@val` (the new values, in the
//! export's dtype), and the tensor's shape in the header metadata under
//! `shape:<name>` (`"576,1536"`). Tensors that did not change are absent.

use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

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

/// The patch that turns the export `old` into `new` (same names, shapes
/// and dtypes). Elements compare by their bits, so a patch applied to
/// `old` gives `new` exactly.
pub fn diff(old: &[u8], new: &[u8]) -> Result<Patch, PatchError> {
    let read = |b| SafeTensors::deserialize(b).map_err(|e| PatchError::Read(e.to_string()));
    let (old, new) = (read(old)?, read(new)?);
    let mut names: Vec<String> = new.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut changes = Vec::new();
    let (mut changed, mut total) = (0, 0);
    for name in names {
        let n = new
            .tensor(&name)
            .map_err(|e| PatchError::Read(e.to_string()))?;
        let o = old
            .tensor(&name)
            .map_err(|_| PatchError::Layout(format!("{name} is new")))?;
        if o.shape() != n.shape() || o.dtype() != n.dtype() {
            return Err(PatchError::Layout(format!("{name} changed shape or dtype")));
        }
        let word = n.dtype().bitsize() / 8;
        total += n.data().len() / word;
        let (idx, val) = changed_elements(o.data(), n.data(), word);
        if !idx.is_empty() {
            changed += idx.len() / 8;
            changes.push((name, n.dtype(), n.shape().to_vec(), idx, val));
        }
    }
    Ok(Patch {
        bytes: serialize(&changes)?,
        changed,
        total,
    })
}

/// Flat indices (little-endian i64 bytes) and new values of the elements
/// of `word` bytes whose bits differ. Equal blocks are skipped whole (a
/// vectorised compare): after a small step most elements are unchanged.
fn changed_elements(old: &[u8], new: &[u8], word: usize) -> (Vec<u8>, Vec<u8>) {
    const BLOCK: usize = 64;
    let (mut idx, mut val) = (Vec::new(), Vec::new());
    for (b, (ob, nb)) in old.chunks(BLOCK).zip(new.chunks(BLOCK)).enumerate() {
        if ob == nb {
            continue;
        }
        let first = b * BLOCK / word;
        for (i, (o, n)) in ob.chunks_exact(word).zip(nb.chunks_exact(word)).enumerate() {
            if o != n {
                idx.extend_from_slice(&((first + i) as i64).to_le_bytes());
                val.extend_from_slice(n);
            }
        }
    }
    (idx, val)
}

type Change = (String, Dtype, Vec<usize>, Vec<u8>, Vec<u8>);

fn serialize(changes: &[Change]) -> Result<Vec<u8>, PatchError> {
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
    use super::*;

    fn export(tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
        let bytes: Vec<(String, Vec<u8>, usize)> = tensors
            .iter()
            .map(|(n, v)| {
                let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                (n.to_string(), b, v.len())
            })
            .collect();
        let views: Vec<_> = bytes
            .iter()
            .map(|(n, b, len)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, vec![*len], b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn a_patch_holds_the_changed_elements_by_name() {
        let old = export(&[("a", vec![1.0, 2.0, 3.0]), ("b", vec![4.0, 5.0])]);
        let new = export(&[("a", vec![1.0, 2.5, 3.0]), ("b", vec![4.0, 5.0])]);
        let p = diff(&old, &new).unwrap();
        assert_eq!((p.changed, p.total), (1, 5));
        let t = SafeTensors::deserialize(&p.bytes).unwrap();
        let mut names: Vec<_> = t.names().into_iter().map(str::to_string).collect();
        names.sort();
        assert_eq!(names, ["a@idx", "a@val"]);
        assert_eq!(t.tensor("a@idx").unwrap().data(), 1i64.to_le_bytes());
        assert_eq!(t.tensor("a@val").unwrap().data(), 2.5f32.to_le_bytes());
        let (_, meta) = SafeTensors::read_metadata(&p.bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["shape:a"], "3");
    }

    #[test]
    fn changes_past_the_first_block_keep_their_index() {
        let old: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let mut new = old.clone();
        new[33] = -1.0;
        new[39] = -2.0;
        let p = diff(&export(&[("w", old)]), &export(&[("w", new)])).unwrap();
        let t = SafeTensors::deserialize(&p.bytes).unwrap();
        let idx: Vec<u8> = [33i64, 39].iter().flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(t.tensor("w@idx").unwrap().data(), &idx[..]);
        let val: Vec<u8> = [-1f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(t.tensor("w@val").unwrap().data(), &val[..]);
    }

    #[test]
    fn exports_of_other_models_are_refused() {
        let old = export(&[("a", vec![1.0, 2.0])]);
        let new = export(&[("a", vec![1.0, 2.0, 3.0])]);
        assert!(matches!(diff(&old, &new), Err(PatchError::Layout(_))));
        let other = export(&[("b", vec![1.0, 2.0])]);
        assert!(matches!(diff(&old, &other), Err(PatchError::Layout(_))));
    }
}
