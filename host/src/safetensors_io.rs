//! Reading Q, K, V from and writing O, LSE to `.safetensors` files.
//!
//! Input tensors: `q` `[batch, seq_q, heads, head_dim]`, `k` and `v` `[batch, seq_kv, heads_kv,
//! head_dim]` (`heads_kv` divides `heads`: GQA/MQA), all three F32, BF16 or F16, and optionally
//! `sinks` `[heads]` F32 (per-head sink logits, used with `--sinks`). Varlen files hold packed
//! `q [total_q, heads, head_dim]`, `k`, `v [total_kv, heads_kv, head_dim]` and `cu_seqlens_q`,
//! `cu_seqlens_kv` (I32 or U32, `batch + 1` prefix sums, first 0, non-decreasing, last = the
//! packed length); their outputs are `o [total_q, heads, head_dim]` and `lse [heads, total_q]`. With `--dtype` the tensors must have that dtype (a
//! mismatch is an error, nothing is converted); without it the problem takes the file's dtype,
//! which must then be the same for q, k and v. Output: `o` `[batch, seq_q, heads, head_dim]` in
//! the problem's dtype and `lse` `[batch, heads, seq_q]` F32.

use crate::dtype::Dtype;
use crate::inputs::Qkv;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

/// The safetensors dtype of a [`Dtype`], and back (the library has no safetensors dependency).
pub trait SafetensorsDtype: Sized {
    /// The safetensors dtype tensors of this type are stored as.
    fn safetensors(self) -> safetensors::Dtype;
    /// The dtype of a safetensors tensor, if it is one the kernels take.
    fn from_safetensors(d: safetensors::Dtype) -> Option<Self>;
}

impl SafetensorsDtype for Dtype {
    fn safetensors(self) -> safetensors::Dtype {
        match self {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::Bf16 => safetensors::Dtype::BF16,
            Dtype::F16 => safetensors::Dtype::F16,
        }
    }
    fn from_safetensors(d: safetensors::Dtype) -> Option<Dtype> {
        match d {
            safetensors::Dtype::F32 => Some(Dtype::F32),
            safetensors::Dtype::BF16 => Some(Dtype::Bf16),
            safetensors::Dtype::F16 => Some(Dtype::F16),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("cannot write {path}: {message}")]
    Write { path: PathBuf, message: String },
    #[error("{path} is not a valid safetensors file: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error("{path} has no tensor `{name}` (found: {found})")]
    MissingTensor { path: PathBuf, name: &'static str, found: String },
    #[error("{path}: tensor `{name}` is {got:?}, expected {expected} (for --dtype {dtype})")]
    WrongDtype {
        path: PathBuf,
        name: &'static str,
        got: safetensors::Dtype,
        expected: safetensors::Dtype,
        dtype: Dtype,
    },
    #[error("{path}: tensor `{name}` is {got:?}; inputs must be F32, BF16 or F16")]
    UnsupportedDtype { path: PathBuf, name: &'static str, got: safetensors::Dtype },
    #[error("{path}: tensor `{name}` is {got:?} but q is {q:?}; q, k and v must share one dtype (F32, BF16 or F16)")]
    MixedDtypes { path: PathBuf, name: &'static str, got: safetensors::Dtype, q: safetensors::Dtype },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected}")]
    WrongShape { path: PathBuf, name: &'static str, got: Vec<usize>, expected: String },
    #[error("{path}: tensor `{name}` dimension {dim} is {got}, larger than the kernels' u32 limit")]
    TooLarge { path: PathBuf, name: &'static str, dim: usize, got: usize },
}

/// Shape found in an input file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileShape {
    pub batch: u32,
    pub heads: u32,
    pub seq_q: u32,
    pub seq_kv: u32,
    pub head_dim: u32,
    /// Heads of `k` and `v`.
    pub heads_kv: u32,
    /// Varlen file: the sequence lengths (then `batch`, `seq_q`, `seq_kv` are the count and the
    /// longest lengths).
    pub varlen: Option<crate::problem::Varlen>,
}

/// Reads `q`, `k`, `v` of dtype `dtype` from `path`.
pub fn read_qkv(path: &Path, dtype: Dtype) -> Result<(FileShape, Qkv), InputError> {
    read_qkv_as(path, Some(dtype)).map(|(s, _, x)| (s, x))
}

/// Reads `q`, `k`, `v` from `path`: of dtype `dtype` when given, else of the file's dtype (the
/// same for all three). Returns the dtype read; 16-bit values are converted to f32 exactly.
pub fn read_qkv_as(path: &Path, dtype: Option<Dtype>) -> Result<(FileShape, Dtype, Qkv), InputError> {
    let bytes = crate::files::read_regular(path, crate::files::MAX_INPUT_BYTES, "input file")?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| InputError::Malformed { path: path.into(), message: e.to_string() })?;
    let found = || {
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        if names.is_empty() {
            "no tensors".to_string()
        } else {
            names.join(", ")
        }
    };
    let tensor = |name: &'static str| -> Result<TensorView<'_>, InputError> {
        st.tensor(name).map_err(|_| InputError::MissingTensor { path: path.into(), name, found: found() })
    };
    let (dtype, inferred) = match dtype {
        Some(d) => (d, false),
        None => {
            let q = tensor("q")?.dtype();
            let d = Dtype::from_safetensors(q).ok_or(InputError::UnsupportedDtype {
                path: path.into(),
                name: "q",
                got: q,
            })?;
            (d, true)
        }
    };
    let varlen = st.tensor("cu_seqlens_q").is_ok();
    let get = |name: &'static str| -> Result<(Vec<usize>, Vec<f32>), InputError> {
        let t = tensor(name)?;
        if inferred && t.dtype() != dtype.safetensors() {
            return Err(InputError::MixedDtypes { path: path.into(), name, got: t.dtype(), q: dtype.safetensors() });
        }
        if t.dtype() != dtype.safetensors() {
            return Err(InputError::WrongDtype {
                path: path.into(),
                name,
                got: t.dtype(),
                expected: dtype.safetensors(),
                dtype,
            });
        }
        let mut shape = t.shape().to_vec();
        if varlen && shape.len() == 3 {
            shape.insert(0, 1); // packed [total, heads, d] as [1, total, heads, d]
        }
        if shape.len() != 4 {
            return Err(InputError::WrongShape {
                path: path.into(),
                name,
                got: t.shape().to_vec(),
                expected: if varlen {
                    "3 dimensions [total, heads, head_dim] (a varlen file: it has cu_seqlens_q)".into()
                } else {
                    "4 dimensions [batch, seq, heads, head_dim]".into()
                },
            });
        }
        for (dim, &n) in shape.iter().enumerate() {
            if n > u32::MAX as usize {
                return Err(InputError::TooLarge { path: path.into(), name, dim, got: n });
            }
        }
        Ok((shape, dtype.decode(t.data())))
    };
    let (qs, q) = get("q")?;
    let (ks, k) = get("k")?;
    let (vs, v) = get("v")?;
    let mut shape = FileShape {
        batch: qs[0] as u32,
        seq_q: qs[1] as u32,
        heads: qs[2] as u32,
        head_dim: qs[3] as u32,
        seq_kv: ks[1] as u32,
        heads_kv: ks[2] as u32,
        varlen: None,
    };
    if varlen {
        let cu = |name: &'static str| -> Result<Vec<u32>, InputError> {
            let t = tensor(name)?;
            let bad = |expected: String| InputError::WrongShape {
                path: path.into(),
                name,
                got: t.shape().to_vec(),
                expected,
            };
            if t.shape().len() != 1 {
                return Err(bad("1 dimension [batch + 1] of I32 or U32 prefix sums".into()));
            }
            let words = t.data().chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
            match t.dtype() {
                safetensors::Dtype::U32 => Ok(words.map(u32::from_le_bytes).collect()),
                safetensors::Dtype::I32 => words
                    .map(i32::from_le_bytes)
                    .map(|x| u32::try_from(x).map_err(|_| bad(format!("non-negative prefix sums (found {x})"))))
                    .collect(),
                other => Err(bad(format!("dtype I32 or U32 (got {other:?})"))),
            }
        };
        let malformed = |message: String| InputError::Malformed { path: path.into(), message };
        let (cq, ck) = (cu("cu_seqlens_q")?, cu("cu_seqlens_kv")?);
        let lq = crate::problem::Varlen::lens_from_cu(&cq, "cu_seqlens_q").map_err(|e| malformed(e.to_string()))?;
        let lk = crate::problem::Varlen::lens_from_cu(&ck, "cu_seqlens_kv").map_err(|e| malformed(e.to_string()))?;
        if lq.len() != lk.len() {
            return Err(malformed(format!(
                "cu_seqlens_q has {} entries and cu_seqlens_kv {}; both need batch + 1",
                cq.len(),
                ck.len()
            )));
        }
        for (name, last, total) in
            [("cu_seqlens_q", cq[cq.len() - 1], qs[1]), ("cu_seqlens_kv", ck[ck.len() - 1], ks[1])]
        {
            if last as usize != total {
                return Err(malformed(format!(
                    "{name} ends at {last} but the packed tensor has {total} rows; the last prefix sum must equal the packed length"
                )));
            }
        }
        let leak = |v: Vec<u32>| -> &'static [u32] { Box::leak(v.into_boxed_slice()) };
        shape.batch = lq.len() as u32;
        shape.seq_q = lq.iter().copied().max().unwrap_or(0);
        shape.seq_kv = lk.iter().copied().max().unwrap_or(0);
        shape.varlen = Some(crate::problem::Varlen { seqlens_q: leak(lq), seqlens_kv: leak(lk) });
    }
    let want_kv = [qs[0], ks[1], ks[2], qs[3]];
    for (name, s) in [("k", &ks), ("v", &vs)] {
        if s.as_slice() != want_kv {
            return Err(InputError::WrongShape {
                path: path.into(),
                name,
                got: s.clone(),
                expected: format!("{want_kv:?} (batch and head_dim of q; seq and heads of k)"),
            });
        }
    }
    if ks[2] == 0 || qs[2] % ks[2] != 0 {
        return Err(InputError::WrongShape {
            path: path.into(),
            name: "k",
            got: ks.clone(),
            expected: format!("heads_kv (dimension 2) dividing q's heads {} (GQA/MQA)", qs[2]),
        });
    }
    let sinks = match st.tensor("sinks") {
        Err(_) => Vec::new(),
        Ok(t) => {
            if t.dtype() != safetensors::Dtype::F32 {
                return Err(InputError::WrongShape {
                    path: path.into(),
                    name: "sinks",
                    got: t.shape().to_vec(),
                    expected: format!("F32 [{}] (got dtype {:?})", qs[2], t.dtype()),
                });
            }
            if t.shape() != [qs[2]] {
                return Err(InputError::WrongShape {
                    path: path.into(),
                    name: "sinks",
                    got: t.shape().to_vec(),
                    expected: format!("[{}] (one f32 logit per query head)", qs[2]),
                });
            }
            Dtype::F32.decode(t.data())
        }
    };
    Ok((shape, dtype, Qkv { q, k, v, sinks }))
}

/// Writes `o` (`[batch, seq_q, heads, head_dim]`, in `dtype`) and `lse` (`[batch, heads, seq_q]`,
/// F32), atomically ([`crate::files::write_atomic`]): an existing file is replaced whole or not
/// at all.
pub fn write_outputs(path: &Path, shape: FileShape, dtype: Dtype, o: &[f32], lse: &[f32]) -> Result<(), InputError> {
    let ob = dtype.encode(o);
    let lb = Dtype::F32.encode(lse);
    let err = |e: safetensors::SafeTensorError| InputError::Write { path: path.into(), message: e.to_string() };
    let (o_shape, l_shape) = match shape.varlen {
        Some(v) => {
            let total: usize = v.seqlens_q.iter().map(|&x| x as usize).sum();
            (vec![total, shape.heads as usize, shape.head_dim as usize], vec![shape.heads as usize, total])
        }
        None => (
            vec![shape.batch as usize, shape.seq_q as usize, shape.heads as usize, shape.head_dim as usize],
            vec![shape.batch as usize, shape.heads as usize, shape.seq_q as usize],
        ),
    };
    let ot = TensorView::new(dtype.safetensors(), o_shape, &ob).map_err(err)?;
    let lt = TensorView::new(safetensors::Dtype::F32, l_shape, &lb).map_err(err)?;
    let bytes = safetensors::serialize([("o", ot), ("lse", lt)], None).map_err(err)?;
    Ok(crate::files::write_atomic(path, &bytes, "output file")?)
}

/// Writes `q`, `k`, `v` as F32 (for tests and for preparing inputs).
pub fn write_qkv(path: &Path, shape: FileShape, x: &Qkv) -> Result<(), InputError> {
    write_qkv_as(path, shape, Dtype::F32, x)
}

/// Writes `q`, `k`, `v` in `dtype` (16-bit types round each value to nearest).
pub fn write_qkv_as(path: &Path, shape: FileShape, dtype: Dtype, x: &Qkv) -> Result<(), InputError> {
    let err = |e: safetensors::SafeTensorError| InputError::Write { path: path.into(), message: e.to_string() };
    let (b, h, d) = (shape.batch as usize, shape.heads as usize, shape.head_dim as usize);
    let hk = shape.heads_kv as usize;
    let (qb, kb, vb) = (dtype.encode(&x.q), dtype.encode(&x.k), dtype.encode(&x.v));
    let sb = Dtype::F32.encode(&x.sinks);
    let st = dtype.safetensors();
    let enc_cu =
        |lens: &[u32]| -> Vec<u8> { crate::problem::Varlen::cu(lens).iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (cqb, ckb) = match shape.varlen {
        Some(vl) => (enc_cu(vl.seqlens_q), enc_cu(vl.seqlens_kv)),
        None => (Vec::new(), Vec::new()),
    };
    let (qshape, kshape) = match shape.varlen {
        Some(vl) => {
            let sum = |l: &[u32]| l.iter().map(|&x| x as usize).sum::<usize>();
            (vec![sum(vl.seqlens_q), h, d], vec![sum(vl.seqlens_kv), hk, d])
        }
        None => (vec![b, shape.seq_q as usize, h, d], vec![b, shape.seq_kv as usize, hk, d]),
    };
    let q = TensorView::new(st, qshape, &qb).map_err(err)?;
    let k = TensorView::new(st, kshape.clone(), &kb).map_err(err)?;
    let v = TensorView::new(st, kshape, &vb).map_err(err)?;
    let mut tensors = vec![("q", q), ("k", k), ("v", v)];
    if shape.varlen.is_some() {
        let n = cqb.len() / 4;
        tensors.push(("cu_seqlens_q", TensorView::new(safetensors::Dtype::U32, vec![n], &cqb).map_err(err)?));
        tensors.push(("cu_seqlens_kv", TensorView::new(safetensors::Dtype::U32, vec![n], &ckb).map_err(err)?));
    }
    if !x.sinks.is_empty() {
        tensors.push(("sinks", TensorView::new(safetensors::Dtype::F32, vec![x.sinks.len()], &sb).map_err(err)?));
    }
    safetensors::serialize_to_file(tensors, None, path).map_err(err)
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn dtypes_map_to_safetensors_and_back() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_safetensors(d.safetensors()), Some(d));
        }
        assert_eq!(Dtype::Bf16.safetensors(), safetensors::Dtype::BF16);
        assert_eq!(Dtype::from_safetensors(safetensors::Dtype::I32), None);
    }
}
