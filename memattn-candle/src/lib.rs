//! candle ops running memattn's prebuilt PTX attention kernels: no nvcc, no CUDA C++ at build time.
//!
//! [`flash_attn`] has the signature of `candle_flash_attn::flash_attn`, so switching is a one-line
//! change of the `use`; [`flash_attn_with_lse`] also returns the log-sum-exp of each query row
//! (natural log, `[batch, heads, seq_q]` f32), which candle-flash-attn drops.
//!
//! | tensor | shape | notes |
//! | --- | --- | --- |
//! | `q` | `[batch, seq_q, heads, head_dim]` | f32, bf16 or f16; head_dim 32, 64, 96, 128, 192 or 256; last dim contiguous (other strides are passed to the kernel as they are) |
//! | `k`, `v` | `[batch, seq_kv, heads, head_dim]` | same dtype as `q`; as many heads as `q` (grouped-query attention is refused until the kernels have it: repeat k/v heads meanwhile) |
//! | result | `[batch, seq_q, heads, head_dim]` | q's dtype, contiguous |
//! | LSE | `[batch, heads, seq_q]` | f32, natural log |
//!
//! The causal mask is bottom-right aligned (query `i` sees key `j` iff `j <= i + seq_kv - seq_q`),
//! as in candle-flash-attn and FlashAttention ≥ 2.1.
//!
//! On a candle CPU device the op runs the same PTX in memattn's PTX VM (slow, exact, with
//! memcheck: for tests and CI without a GPU). With the `cuda` feature, on a candle CUDA device it
//! launches on candle's own stream in candle's context; nothing waits for it.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! let q = Tensor::randn(0f32, 1.0, (1, 24, 2, 64), &Device::Cpu)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 40, 2, 64), &Device::Cpu)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 40, 2, 64), &Device::Cpu)?;
//! let (o, lse) = memattn_candle::flash_attn_with_lse(&q, &k, &v, 0.125, true)?;
//! assert_eq!((o.dims(), lse.dims(), lse.dtype()), (&[1, 24, 2, 64][..], &[1, 2, 24][..], DType::F32));
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use memattn::attn::{AttnOpts, Kernels, TensorView};
use memattn::Dtype;
use std::sync::{Mutex, OnceLock};

/// `softmax(q kᵀ · softmax_scale [causal mask]) v`, as `candle_flash_attn::flash_attn`.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    Ok(flash_attn_with_lse(q, k, v, softmax_scale, causal)?.0)
}

/// As [`flash_attn`], also returning the LSE of each query row: `[batch, heads, seq_q]` f32,
/// natural log (`-inf` for a row that sees no key).
pub fn flash_attn_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let op = FlashAttn { softmax_scale, causal, lse: Mutex::new(None) };
    let o = q.apply_op3_no_bwd(k, v, &op)?;
    let (b, _, h, _) = q.dims4()?;
    let sq = q.dim(1)?;
    let lse = op.lse.lock().map_err(|_| candle_core::Error::Msg("memattn: LSE lock poisoned".into()))?.take();
    let lse = lse.ok_or_else(|| candle_core::Error::Msg("memattn: the op produced no LSE".into()))?;
    Ok((o, Tensor::from_storage(lse, (b, h, sq), BackpropOp::none(), false)))
}

/// The candle op behind [`flash_attn`] (forward only). Its LSE is kept for the caller of
/// `apply_op3`, which [`flash_attn_with_lse`] is.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub causal: bool,
    lse: Mutex<Option<Storage>>,
}

fn wrap(e: memattn::attn::AttnError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

fn no_kernel(d: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!("memattn flash_attn: dtype {d:?} has no kernel (f32, bf16 and f16 have)"))
}

fn dtype_of(d: DType) -> Result<Dtype> {
    match d {
        DType::F32 => Ok(Dtype::F32),
        DType::BF16 => Ok(Dtype::Bf16),
        DType::F16 => Ok(Dtype::F16),
        other => Err(no_kernel(other)),
    }
}

fn dims4(l: &Layout, what: &str) -> Result<[usize; 4]> {
    match l.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        other => Err(candle_core::Error::Msg(format!(
            "memattn flash_attn: {what} must be 4-d [batch, seq, heads, head_dim], got shape {other:?}"
        ))),
    }
}

fn strides4(l: &Layout) -> [usize; 4] {
    let s = l.stride();
    [s[0], s[1], s[2], s[3]]
}

/// The process's VM kernels (the PTX is parsed once).
fn vm_kernels() -> Result<&'static Kernels> {
    static VM: OnceLock<std::result::Result<Kernels, String>> = OnceLock::new();
    VM.get_or_init(|| Kernels::vm().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| candle_core::Error::Msg(format!("memattn: the PTX VM did not start: {e}")))
}

/// The storage's elements from the layout's start on, as f32 (16-bit values exactly).
fn host_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let start = l.start_offset();
    Ok(match s {
        CpuStorage::F32(x) => x[start..].to_vec(),
        CpuStorage::BF16(x) => x[start..].iter().map(|v| v.to_f32()).collect(),
        CpuStorage::F16(x) => x[start..].iter().map(|v| v.to_f32()).collect(),
        other => return Err(no_kernel(other.dtype())),
    })
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "memattn-flash-attn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let kernels = vm_kernels()?;
        let mut bufs = Vec::with_capacity(3);
        for ((s, l), what) in [(s1, l1), (s2, l2), (s3, l3)].into_iter().zip(["q", "k", "v"]) {
            let dtype = dtype_of(s.dtype())?;
            let shape = dims4(l, what)?;
            bufs.push((kernels.vm_upload_as(dtype, &host_f32(s, l)?).map_err(wrap)?, dtype, shape, strides4(l)));
        }
        let views: Vec<TensorView<'_>> = bufs
            .iter()
            .map(|(b, dtype, shape, strides)| TensorView::vm(b, *dtype, *shape).map(|v| v.with_strides(*strides)))
            .collect::<std::result::Result<_, _>>()
            .map_err(wrap)?;
        let opts = AttnOpts::new().softmax_scale(self.softmax_scale).causal(self.causal);
        let (o, lse) = kernels.flash_attn(&views[0], &views[1], &views[2], &opts).map_err(wrap)?;
        let o_host = o.to_vec_f32().map_err(wrap)?;
        let out = match s1.dtype() {
            DType::BF16 => CpuStorage::BF16(o_host.iter().map(|&x| half::bf16::from_f32(x)).collect()),
            DType::F16 => CpuStorage::F16(o_host.iter().map(|&x| half::f16::from_f32(x)).collect()),
            _ => CpuStorage::F32(o_host),
        };
        let lse = CpuStorage::F32(lse.to_vec_f32().map_err(wrap)?);
        *self.lse.lock().map_err(|_| candle_core::Error::Msg("memattn: LSE lock poisoned".into()))? =
            Some(Storage::Cpu(lse));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => cuda::fwd::<f32>(self, s1, l1, s2, l2, s3, l3),
            DType::BF16 => cuda::fwd::<half::bf16>(self, s1, l1, s2, l2, s3, l3),
            DType::F16 => cuda::fwd::<half::f16>(self, s1, l1, s2, l2, s3, l3),
            other => Err(no_kernel(other)),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::CudaStorage;
    use memattn::attn::{Element, LseViewMut, TensorViewMut};
    use std::collections::HashMap;
    use std::sync::Arc;

    /// memattn's kernels per CUDA context (loaded once per context).
    fn kernels_for(ctx: &Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>) -> Result<Arc<Kernels>> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        let mut map = CACHE
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| candle_core::Error::Msg("memattn: kernel cache lock poisoned".into()))?;
        let key = ctx.cu_ctx() as usize;
        if let Some(k) = map.get(&key) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::cuda(ctx).map_err(wrap)?);
        map.insert(key, k.clone());
        Ok(k)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fwd<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
        op: &FlashAttn,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let stream = s1.device.cuda_stream();
        let kernels = kernels_for(stream.context())?;
        let (qs, ks, vs) = (s1.as_cuda_slice::<T>()?, s2.as_cuda_slice::<T>()?, s3.as_cuda_slice::<T>()?);
        let view = |s, l: &Layout, what| -> Result<TensorView<'_>> {
            TensorView::cuda(s, &stream, dims4(l, what)?)
                .and_then(|v| v.with_strides(strides4(l)).offset(l.start_offset()))
                .map_err(wrap)
        };
        let (q, k, v) = (view(qs, l1, "q")?, view(ks, l2, "k")?, view(vs, l3, "v")?);
        let [b, sq, h, d] = dims4(l1, "q")?;
        let mut o = stream.alloc_zeros::<T>(b * sq * h * d).map_err(candle_core::Error::wrap)?;
        let mut lse = stream.alloc_zeros::<f32>(b * h * sq).map_err(candle_core::Error::wrap)?;
        {
            let mut ov = TensorViewMut::cuda(&mut o, &stream, [b, sq, h, d]).map_err(wrap)?;
            let mut lv = LseViewMut::cuda(&mut lse, &stream, b, h, sq).map_err(wrap)?;
            let opts = AttnOpts::new().softmax_scale(op.softmax_scale).causal(op.causal);
            kernels.flash_attn_into(&q, &k, &v, &mut ov, &mut lv, &opts).map_err(wrap)?;
        }
        let lse = CudaStorage::wrap_cuda_slice(lse, s1.device.clone());
        *op.lse.lock().map_err(|_| candle_core::Error::Msg("memattn: LSE lock poisoned".into()))? =
            Some(Storage::Cuda(lse));
        Ok((CudaStorage::wrap_cuda_slice(o, s1.device.clone()), l1.shape().clone()))
    }
}
