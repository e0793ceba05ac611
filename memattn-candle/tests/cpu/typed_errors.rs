//! memattn's refusals reach a candle engine as the typed `AttnError`, with their values:
//! `memattn_candle::attn_error` finds it in the candle error, through the wrappers candle and an
//! engine add (context, `candle_core::Context`, a backtrace), and says `None` for errors of the
//! candle side.

use candle_core::{Context, DType, Device, Tensor};
use memattn_candle::memattn::attn::ShapeRule;
use memattn_candle::memattn::problem::{KernelKind, ProblemError};
use memattn_candle::{attn_error, AttnError};

fn randn(shape: (usize, usize, usize, usize)) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

#[test]
fn a_head_dim_the_kernels_refuse_is_the_typed_error_with_its_values() {
    let q = randn((1, 8, 2, 84));
    let e = memattn_candle::flash_attn(&q, &q, &q, 0.1, false).unwrap_err();
    let check = |e: &candle_core::Error| match attn_error(e) {
        Some(AttnError::Problem(ProblemError::UnsupportedHeadDim { kernel, got, supported })) => {
            assert_eq!((*kernel, *got), (KernelKind::Flash, 84));
            assert!(supported.contains("32, 64, 96, 128, 192 and 256"), "{supported}");
        }
        other => panic!("expected UnsupportedHeadDim {{ got: 84 }}, found {other:?} in {e}"),
    };
    check(&e);
    // The message is memattn's own, as it was before the error kept its type.
    assert!(e.to_string().contains("head_dim 84 is not supported by the flash kernel"), "{e}");
    // Through candle's wrappers: a context, then a context added by `candle_core::Context` on a
    // `Result` (which boxes the candle error as a `std::error::Error`), then a backtrace.
    let e = e.context("layer 3");
    check(&e);
    let e = Err::<(), _>(e).context("decode step 7").unwrap_err();
    assert!(matches!(e, candle_core::Error::WrappedContext { .. } | candle_core::Error::WithBacktrace { .. }));
    check(&e);
    let e = candle_core::Error::WithBacktrace {
        inner: Box::new(e),
        backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
    };
    check(&e);
}

#[test]
fn a_kv_head_count_that_does_not_divide_q_names_the_tensor_and_both_counts() {
    let (q, kv) = (randn((1, 16, 4, 64)), randn((1, 20, 3, 64)));
    let e = memattn_candle::flash_attn(&q, &kv, &kv, 0.125, false).unwrap_err();
    match attn_error(&e) {
        Some(AttnError::Shape { tensor, got, why }) => {
            assert_eq!((*tensor, *got), ("k", [1, 20, 3, 64]));
            assert_eq!(why, &ShapeRule::HeadsDivide { got: 3, q: 4 });
        }
        other => panic!("expected a Shape refusal of k, found {other:?} in {e}"),
    }
}

#[test]
fn a_backward_head_dim_without_kernels_is_typed_through_the_backward_context() {
    let bf = |t: Tensor| candle_core::Var::from_tensor(&t.to_dtype(DType::BF16).unwrap()).unwrap();
    let (q, k, v) = (bf(randn((1, 4, 1, 160))), bf(randn((1, 4, 1, 160))), bf(randn((1, 4, 1, 160))));
    let o = memattn_candle::flash_attn(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.125, false).unwrap();
    let e = o.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap_err();
    assert!(e.to_string().contains("memattn flash_attn backward"), "{e}");
    match attn_error(&e) {
        Some(AttnError::Problem(ProblemError::UnsupportedHeadDim {
            kernel: KernelKind::Flash,
            got: 160,
            supported,
        })) => {
            assert!(supported.contains("bf16 backward kernels are compiled for head_dim 32, 64 and 128"), "{supported}")
        }
        other => panic!("expected the backward's UnsupportedHeadDim {{ got: 160 }}, found {other:?} in {e}"),
    }
}

#[test]
fn errors_of_the_candle_side_are_not_attn_errors() {
    let q = randn((1, 8, 2, 64));
    // An argument this crate checks before memattn sees the call.
    let seqlens = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let e = memattn_candle::flash_attn_varlen(&q, &q, &q, &seqlens, &seqlens, 8, 8, 0.1, false).unwrap_err();
    assert!(e.to_string().contains("1-d u32"), "{e}");
    assert!(attn_error(&e).is_none(), "{e}");
    // candle's own.
    let e = q.reshape((3, 5)).unwrap_err();
    assert!(attn_error(&e).is_none(), "{e}");
}
