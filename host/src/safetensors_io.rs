//! Reading Q, K, V from and writing O, LSE to `.safetensors` files.
//!
//! Input tensors: `q` `[batch, seq_q, heads, head_dim]`, `k` and `v` `[batch, seq_kv, heads_kv,
//! head_dim]` (`heads_kv` divides `heads`: GQA/MQA), all three F32, BF16 or F16, and optionally
//! `sinks` `[heads]` F32 (per-head sink logits, used with `--sinks`). With `--dtype` the tensors must have that dtype (a
//! mismatch is an error, nothing is converted); without it the problem takes the file's dtype,
//! which must then be the same for q, k and v. Output: `o` `[batch, seq_q, heads, head_dim]` in
//! the problem's dtype and `lse` `[batch, heads, seq_q]` F32.

use crate::dtype::Dtype;
use crate::inputs::Qkv;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
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
}

/// Reads `q`, `k`, `v` of dtype `dtype` from `path`.
pub fn read_qkv(path: &Path, dtype: Dtype) -> Result<(FileShape, Qkv), InputError> {
    read_qkv_as(path, Some(dtype)).map(|(s, _, x)| (s, x))
}

/// Reads `q`, `k`, `v` from `path`: of dtype `dtype` when given, else of the file's dtype (the
/// same for all three). Returns the dtype read; 16-bit values are converted to f32 exactly.
pub fn read_qkv_as(path: &Path, dtype: Option<Dtype>) -> Result<(FileShape, Dtype, Qkv), InputError> {
    let bytes = std::fs::read(path).map_err(|source| InputError::Read { path: path.into(), source })?;
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
        let shape = t.shape().to_vec();
        if shape.len() != 4 {
            return Err(InputError::WrongShape {
                path: path.into(),
                name,
                got: shape,
                expected: "4 dimensions [batch, seq, heads, head_dim]".into(),
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
    let shape = FileShape {
        batch: qs[0] as u32,
        seq_q: qs[1] as u32,
        heads: qs[2] as u32,
        head_dim: qs[3] as u32,
        seq_kv: ks[1] as u32,
        heads_kv: ks[2] as u32,
    };
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
/// F32).
pub fn write_outputs(path: &Path, shape: FileShape, dtype: Dtype, o: &[f32], lse: &[f32]) -> Result<(), InputError> {
    let ob = dtype.encode(o);
    let lb = Dtype::F32.encode(lse);
    let err = |e: safetensors::SafeTensorError| InputError::Write { path: path.into(), message: e.to_string() };
    let o_shape = vec![shape.batch as usize, shape.seq_q as usize, shape.heads as usize, shape.head_dim as usize];
    let l_shape = vec![shape.batch as usize, shape.heads as usize, shape.seq_q as usize];
    let ot = TensorView::new(dtype.safetensors(), o_shape, &ob).map_err(err)?;
    let lt = TensorView::new(safetensors::Dtype::F32, l_shape, &lb).map_err(err)?;
    safetensors::serialize_to_file([("o", ot), ("lse", lt)], None, path).map_err(err)
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
    let q = TensorView::new(st, vec![b, shape.seq_q as usize, h, d], &qb).map_err(err)?;
    let k = TensorView::new(st, vec![b, shape.seq_kv as usize, hk, d], &kb).map_err(err)?;
    let v = TensorView::new(st, vec![b, shape.seq_kv as usize, hk, d], &vb).map_err(err)?;
    let mut tensors = vec![("q", q), ("k", k), ("v", v)];
    if !x.sinks.is_empty() {
        tensors.push(("sinks", TensorView::new(safetensors::Dtype::F32, vec![x.sinks.len()], &sb).map_err(err)?));
    }
    safetensors::serialize_to_file(tensors, None, path).map_err(err)
}
