//! Launch parameters shared by the unit tests that run the committed kernels.

use kernels_gpu::abi::{AttnParams, Strides};

/// Causal attention over one sequence of `seq` tokens, `heads` heads of `head_dim`, BSHD
/// layout, Q/K/V/O at `qkvo` and the LSE at `lse`, scale 0.125.
pub(crate) fn causal_bshd(qkvo: [u64; 4], lse: u64, heads: u32, seq: u32, head_dim: u32) -> AttnParams {
    let st = Strides::bshd(seq as u64, heads as u64, head_dim as u64);
    AttnParams {
        q: qkvo[0],
        k: qkvo[1],
        v: qkvo[2],
        o: qkvo[3],
        lse,
        q_strides: st,
        k_strides: st,
        v_strides: st,
        o_strides: st,
        batch: 1,
        heads,
        seq_q: seq,
        seq_kv: seq,
        head_dim,
        causal: 1,
        softmax_scale: 0.125,
        ..AttnParams::default()
    }
}
