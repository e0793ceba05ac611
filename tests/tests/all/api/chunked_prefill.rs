//! Chunked prefill over a paged cache (`Kernels::flash_attn_varlen_paged`): a mixed batch of
//! prefill chunks and decode rows against an f64 reference written here from the definitions
//! (keys gathered through the block table, bottom-right causal and windows against each
//! sequence's key count, soft cap, sinks); the index rules.

use crate::common;
use common::data;
use memattn::attn::{AttnError, AttnOpts, IndexTensor, Kernels, SinksView, TensorView};
use memattn::Dtype;

struct Case {
    dtype: Dtype,
    heads: usize,
    heads_kv: usize,
    d: usize,
    page: usize,
    /// Query tokens of each sequence (a decode row is 1).
    chunks: Vec<usize>,
    /// Keys of each sequence (the chunk's own included).
    keys: Vec<usize>,
    causal: bool,
    window: (i32, i32),
    softcap: f32,
    sinks: bool,
}

/// A shuffled block table: sequence `b`'s pages, `max_pages` per row (unused entries hold a
/// page past the end, which must never be read).
fn table(keys: &[usize], page: usize) -> (Vec<u32>, usize, usize) {
    let need: Vec<usize> = keys.iter().map(|&k| k.div_ceil(page)).collect();
    let (max_pages, num_pages) = (need.iter().copied().max().unwrap().max(1), need.iter().sum::<usize>() + 1);
    // Page p of the pool goes to the sequences in a scrambled order (7 is prime to the counts here).
    let mut order: Vec<u32> = (0..num_pages as u32 - 1).collect();
    order.sort_by_key(|&p| (p as usize * 7919) % (num_pages * 13 + 1));
    let mut t = vec![u32::MAX / 2; keys.len() * max_pages];
    let mut next = 0;
    for (b, &n) in need.iter().enumerate() {
        for s in 0..n {
            t[b * max_pages + s] = order[next];
            next += 1;
        }
    }
    (t, max_pages, num_pages)
}

/// O `[total_q, heads, d]` and LSE `[heads, total_q]` in f64, from the definitions.
#[allow(clippy::too_many_arguments)]
fn reference(
    c: &Case,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    bt: &[u32],
    max_pages: usize,
    sinks: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let (h, hk, d, page) = (c.heads, c.heads_kv, c.d, c.page);
    let total: usize = c.chunks.iter().sum();
    let scale = 1.0 / (d as f64).sqrt();
    let (mut o, mut lse) = (vec![0f64; total * h * d], vec![0f64; h * total]);
    let mut row0 = 0;
    for (b, (&n, &len)) in c.chunks.iter().zip(&c.keys).enumerate() {
        let key = |j: usize, head: usize| {
            let p = bt[b * max_pages + j / page] as usize;
            ((p * page + j % page) * hk + head) * d
        };
        for i in 0..n {
            let diag = i as i64 + len as i64 - n as i64;
            for head in 0..h {
                let kh = head / (h / hk);
                let qi = ((row0 + i) * h + head) * d;
                let mut s = Vec::new();
                for j in 0..len {
                    let jj = j as i64;
                    let right = if c.causal { 0 } else { c.window.1 };
                    if (right >= 0 && jj > diag + right as i64) || (c.window.0 >= 0 && jj < diag - c.window.0 as i64) {
                        continue;
                    }
                    let dot: f64 = (0..d).map(|e| q[qi + e] as f64 * kc[key(j, kh) + e] as f64).sum::<f64>() * scale;
                    let x = if c.softcap > 0.0 { c.softcap as f64 * (dot / c.softcap as f64).tanh() } else { dot };
                    s.push((j, x));
                }
                let sink = if c.sinks { sinks[head] as f64 } else { f64::NEG_INFINITY };
                let m = s.iter().map(|e| e.1).fold(sink, f64::max);
                let out = &mut lse[head * total + row0 + i];
                if m == f64::NEG_INFINITY {
                    *out = f64::NEG_INFINITY;
                    continue;
                }
                let l: f64 = s.iter().map(|e| (e.1 - m).exp()).sum::<f64>() + (sink - m).exp();
                *out = m + l.ln();
                for &(j, x) in &s {
                    let w = (x - m).exp() / l;
                    for e in 0..d {
                        o[qi + e] += w * vc[key(j, kh) + e] as f64;
                    }
                }
            }
        }
        row0 += n;
    }
    (o, lse)
}

fn run(kernels: &Kernels, c: &Case) {
    let (h, hk, d, page, dt) = (c.heads, c.heads_kv, c.d, c.page, c.dtype);
    let total: usize = c.chunks.iter().sum();
    let (bt, max_pages, num_pages) = table(&c.keys, page);
    let q = data(total * h * d, 31, dt);
    let kc = data(num_pages * page * hk * d, 32, dt);
    let vc = data(num_pages * page * hk * d, 33, dt);
    let sinks: Vec<f32> = (0..h).map(|i| i as f32 * 0.7 - 1.0).collect();
    let (qb, kb, vb) = (
        kernels.vm_upload_as(dt, &q).unwrap(),
        kernels.vm_upload_as(dt, &kc).unwrap(),
        kernels.vm_upload_as(dt, &vc).unwrap(),
    );
    let sb = kernels.vm_upload(&sinks).unwrap();
    let sv = SinksView::vm(&sb, h).unwrap();
    let mut cu = vec![0u32];
    for &n in &c.chunks {
        cu.push(cu.last().unwrap() + n as u32);
    }
    let index = |v: &[u32]| kernels.index_tensor(v, None).unwrap();
    let used: Vec<u32> = c.keys.iter().map(|&k| k as u32).collect();
    let (cu, used, bti) = (index(&cu), index(&used), index(&bt));
    let side = |w: i32| u32::try_from(w).ok();
    let mut opts = AttnOpts::new().causal(c.causal).window(side(c.window.0), side(c.window.1));
    if c.softcap > 0.0 {
        opts = opts.softcap(c.softcap);
    }
    if c.sinks {
        opts = opts.sinks(&sv);
    }
    let max_q = *c.chunks.iter().max().unwrap();
    let (o, lse) = kernels
        .flash_attn_varlen_paged(
            &TensorView::vm(&qb, dt, [1, total, h, d]).unwrap(),
            &TensorView::vm(&kb, dt, [num_pages, page, hk, d]).unwrap(),
            &TensorView::vm(&vb, dt, [num_pages, page, hk, d]).unwrap(),
            &cu,
            &used,
            &bti,
            max_q,
            &opts,
        )
        .unwrap();
    let (o, lse) = (o.to_vec_f32().unwrap(), lse.to_vec_f32().unwrap());
    let (ro, rl) = reference(c, &q, &kc, &vc, &bt, max_pages, &sinks);
    // O: the 16-bit output rounding plus P rounded to 16 bits in the P V product (values in [-1, 1)).
    let tol = 2.0 * dt.unit_roundoff();
    let mut worst = 0f64;
    for (e, (&g, &w)) in o.iter().zip(&ro).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(err <= tol, "{dt} d {d} page {page}: o[{e}] = {g}, reference {w}");
        worst = worst.max(err);
    }
    for (r, (&g, &w)) in lse.iter().zip(&rl).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{r}]");
        } else {
            assert!(
                (g as f64 - w).abs() <= 1e-4 * w.abs().max(1.0),
                "{dt} d {d} page {page}: lse[{r}] = {g}, reference {w}"
            );
        }
    }
    assert!(ro.iter().any(|v| v.abs() > 0.1), "real values");
    eprintln!(
        "{dt} d {d} page {page} chunks {:?} keys {:?}: max |o - ref| {worst:.2e} (bound {tol:.2e})",
        c.chunks, c.keys
    );
}

/// vLLM's mixed batch: two prefill chunks (one the whole prompt, one continuing a longer
/// sequence) and three decode rows, one of which sees a single key, over pages of 1, 16 and 256.
#[test]
fn a_mixed_batch_of_prefill_chunks_and_decode_rows() {
    let kernels = Kernels::vm().unwrap();
    for (dtype, d, page, heads, heads_kv) in [
        (Dtype::Bf16, 64, 16, 8, 2),
        (Dtype::F16, 128, 1, 4, 4),
        (Dtype::Bf16, 128, 256, 6, 2),
        (Dtype::F16, 64, 7, 4, 1),
    ] {
        let c = Case {
            dtype,
            heads,
            heads_kv,
            d,
            page,
            chunks: vec![150, 1, 70, 1, 1],
            keys: vec![150, 301, 400, 1, 33],
            causal: true,
            window: (-1, -1),
            softcap: 0.0,
            sinks: false,
        };
        run(&kernels, &c);
    }
}

/// The same batch with a window, the soft cap and sinks, and a chunk longer than its keys (its
/// first rows see nothing: O = 0, LSE the sink's logit).
#[test]
fn a_mixed_batch_with_window_softcap_sinks_and_masked_rows() {
    let kernels = Kernels::vm().unwrap();
    let c = Case {
        dtype: Dtype::Bf16,
        heads: 4,
        heads_kv: 2,
        d: 64,
        page: 16,
        chunks: vec![90, 1, 40, 1],
        keys: vec![60, 200, 300, 17],
        causal: true,
        window: (50, -1),
        softcap: 5.0,
        sinks: true,
    };
    run(&kernels, &c);
    let c = Case { sinks: false, window: (-1, -1), softcap: 0.0, causal: false, ..c };
    run(&kernels, &c);
}

#[test]
fn the_index_rules_are_checked_before_the_launch() {
    let kernels = Kernels::vm().unwrap();
    let (h, d, page) = (2, 64, 16);
    let kb = kernels.vm_upload_as(Dtype::Bf16, &vec![0.5; 4 * page * h * d]).unwrap();
    let qb = kernels.vm_upload_as(Dtype::Bf16, &vec![0.5; 5 * h * d]).unwrap();
    let kv = TensorView::vm(&kb, Dtype::Bf16, [4, page, h, d]).unwrap();
    let q = TensorView::vm(&qb, Dtype::Bf16, [1, 5, h, d]).unwrap();
    let index = |v: &[u32]| -> IndexTensor { kernels.index_tensor(v, None).unwrap() };
    let call = |cu: &[u32], used: &[u32], bt: &[u32], max_q: usize| {
        kernels
            .flash_attn_varlen_paged(&q, &kv, &kv, &index(cu), &index(used), &index(bt), max_q, &AttnOpts::new())
            .map(|_| ())
    };
    assert!(call(&[0, 4, 5], &[20, 3], &[0, 1, 2, 2], 4).is_ok());
    let e = call(&[0, 4, 5], &[20, 3], &[0, 9, 2, 2], 4).unwrap_err();
    assert!(matches!(e, AttnError::KvCache { .. }) && e.to_string().contains("page"), "{e}");
    let e = call(&[0, 4, 5], &[40, 3], &[0, 1, 2, 2], 4).unwrap_err().to_string();
    assert!(e.contains("page"), "{e}");
    let e = call(&[0, 4, 6], &[20, 3], &[0, 1, 2, 2], 4).unwrap_err().to_string();
    assert!(e.contains("last prefix sum"), "{e}");
    let e = call(&[0, 4, 5], &[20, 3], &[0, 1, 2, 2], 3).unwrap_err().to_string();
    assert!(e.contains("max_seqlen_q"), "{e}");
    let e = call(&[0, 4, 5], &[20], &[0, 1, 2, 2], 4).unwrap_err().to_string();
    assert!(e.contains("seqused_k"), "{e}");
    let f32q = kernels.vm_upload(&vec![0.5; 5 * h * d]).unwrap();
    let e = kernels
        .flash_attn_varlen_paged(
            &TensorView::vm(&f32q, Dtype::F32, [1, 5, h, d]).unwrap(),
            &kv,
            &kv,
            &index(&[0, 5]),
            &index(&[5]),
            &index(&[0]),
            5,
            &AttnOpts::new(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("bf16 or f16"), "{e}");
}
