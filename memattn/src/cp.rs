//! Context parallelism: one sequence's attention over `world` ranks, each holding a slice of the
//! sequence, with K/V (ring, zigzag) or heads (Ulysses) travelling between ranks, and decode over
//! a KV cache sharded by sequence.
//!
//! The attention code is written once against [`Communicator`]; [`InProcess`] is the
//! implementation tests and learners use (one thread and one VM device per rank, messages passed
//! between them in memory), so a world of 4 ranks runs and is checked on one CPU. [`Grouped`]
//! carries the same messages over a transport with NCCL's rules (sends complete only when
//! received, sizes agreed, transfers in groups): `nccl::world` (feature `nccl`) over NCCL on one
//! GPU per rank, and [`Rendezvous`], those rules enforced in memory, which the tests run every
//! strategy on. The counts and headers [`Grouped`] adds (8 bytes per peer and flush, 16 per
//! message) are not in [`CpStats`], which counts the strategies' messages.
//!
//! # Strategies
//! - [`Strategy::Ring`]: rank `r` holds the contiguous slice `r` of the queries and of the keys.
//!   In `world` steps every K/V slice visits every rank: at step `t` rank `r` holds rank
//!   `(r - t) mod world`'s K/V, posts it to rank `r + 1` before computing with it (so the transfer
//!   overlaps the compute), computes a partial `(O, LSE)` for its queries and merges it into its
//!   running state in f32 (`lse = m + ln(e^(lse_a - m) + e^(lse_b - m))`). With a causal mask the
//!   rank holding the last slice works at every step and rank 0 only at the first: plain ring is
//!   unbalanced.
//! - [`Strategy::Zigzag`]: the same ring over `2 · world` pieces, rank `r` holding pieces `r` and
//!   `2 · world - 1 - r`, so every rank has one early and one late piece and causal work is
//!   balanced.
//! - [`Strategy::Ulysses`]: rank `r` holds the contiguous slice `r` of every head; an all-to-all
//!   gives it the whole sequence of heads `r · H/world ..` (and their K/V heads), it runs ordinary
//!   attention, and a second all-to-all returns each rank its rows. Needs `heads` and `heads_kv`
//!   divisible by `world`.
//!
//! # The backward
//! [`attention_backward`] runs the same ring again (ring, zigzag): each K/V block travels with
//! the f32 sums of its dK and dV, every rank adding its blocks' share computed by the
//! single-device backward with the final O and LSE of its rows; dQ stays on its rank. Ulysses
//! reverses its all-to-all around one single-device backward per rank's heads. The
//! module's tests and `memattn run --cp N --backward` check the gathered gradients against the
//! f64 ones.
//!
//! # Masks on a block
//! A block pairs a slice of queries (global rows `qs..qs + lq`) with a slice of keys
//! (`ks..ks + lk`). The global rule (bottom-right causal, windows, `docs/semantics.md`) sees key
//! `t` from row `r` iff `r + G - left <= t <= r + G + right` with `G = seq_kv - seq_q`. In the
//! block's own coordinates the diagonal is `D = qs - ks + G`; the kernels align a block's diagonal
//! to its bottom-right corner (`lk - lq`). So each block is launched on a prefix of its queries
//! and keys chosen so that the corner lies on (or within the window around) `D`, with the window
//! shifted by the difference: the global mask exactly, with no kernel change. A block no row of
//! which sees a key is skipped; the per-step report names each block full, diagonal, partial or
//! skipped.
//!
//! # Communication volume (what [`CpStats`] counts, per rank)
//! With `e` bytes per element, `B` batch, `Hk` K/V heads, `d` head dim, and `n_p` the keys (or
//! query rows) rank `p` holds:
//! - ring and zigzag: rank `r` sends `world - 1` K/V blocks, those of ranks `r, r-1, ..,
//!   r-world+2`: `2 · B · Hk · d · e · (seq_kv - n_(r+1))` bytes, and receives as many (those of
//!   `r-1, .., r-world+1`: `2 · B · Hk · d · e · (seq_kv - n_r)`). Equal slices:
//!   `2 · B · Hk · d · e · seq_kv · (world - 1) / world`.
//! - Ulysses: rank `r` sends, to each other rank, its rows of that rank's heads of q, k and v
//!   (`B · n_r · (H + 2 Hk) / world · d · e`) and, on the way back, that rank's rows of its own
//!   heads of o and lse in f32 (`B · n_p · H / world · (4 d + 4)`).
//! - sharded decode: each rank sends its partial state, o and lse in f32, to every other rank:
//!   `(world - 1) · B · seq_q · H · (d + 1) · 4` bytes.
//!
//! The merge runs in f32 on the host copy of each partial state (a block's output is read back
//! after its launch); the K/V blocks travel in the inputs' dtype.

use crate::attn::{AttnError, AttnOpts, DeviceBuffer, IndexTensor, Kernels, TensorView};
use crate::problem::Problem;
use crate::Dtype;
use std::collections::HashMap;

pub(crate) mod grouped;
#[cfg(feature = "nccl")]
pub mod nccl;
pub use grouped::{Grouped, GroupedP2p, Rendezvous};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why a context-parallel call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CpError {
    /// An attention call of a block was refused or failed.
    #[error("rank {rank}: {source}")]
    Attn {
        /// The rank whose call failed.
        rank: usize,
        /// The attention call's error.
        source: Box<AttnError>,
    },
    /// A message did not arrive, or a peer is gone.
    #[error("rank {rank}: {why}")]
    Comm {
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong.
        why: String,
    },
    /// The problem cannot be split this way (names the rule).
    #[error("{0}")]
    Layout(String),
}

impl CpError {
    /// An attention call's error on `rank`.
    pub fn attn(rank: usize, source: AttnError) -> CpError {
        CpError::Attn { rank, source: Box::new(source) }
    }
}

/// How the sequence is split and what travels between ranks (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Contiguous slices; K/V blocks travel around a ring.
    Ring,
    /// The ring over `2 · world` pieces, two per rank, balancing causal work.
    Zigzag,
    /// All-to-all of heads: each rank attends over the whole sequence for its heads.
    Ulysses,
}

impl Strategy {
    /// The three strategies.
    pub const ALL: [Strategy; 3] = [Strategy::Ring, Strategy::Zigzag, Strategy::Ulysses];
    /// The lowercase name (`ring`, `zigzag`, `ulysses`), as `Display` writes it and `FromStr` reads it.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ring => "ring",
            Strategy::Zigzag => "zigzag",
            Strategy::Ulysses => "ulysses",
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ring" => Ok(Strategy::Ring),
            "zigzag" => Ok(Strategy::Zigzag),
            "ulysses" => Ok(Strategy::Ulysses),
            _ => Err(format!("unknown context-parallel strategy `{s}` (ring, zigzag or ulysses)")),
        }
    }
}

/// Point-to-point messages between the ranks of one world. A send returns at once (the message
/// is posted); a receive waits for the message of that peer and tag. Collectives
/// ([`all_gather`], [`all_to_all`]) are composed from these.
pub trait Communicator: Send + Sync {
    /// This rank's index, `0..world`.
    fn rank(&self) -> usize;
    /// Ranks in the world.
    fn world(&self) -> usize;
    /// Posts `data` to `peer` under `tag`.
    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<(), CpError>;
    /// Waits for `peer`'s message `tag`.
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CpError>;
    /// Sends `parts[p]` to every other rank `p` under `tag` and returns what each rank sent this
    /// one, in rank order (this rank's own part kept): the step every collective is made of.
    /// Every rank of the world calls it together. The default posts the sends, then receives; a
    /// transport whose sends complete only when received (NCCL, [`Grouped`]) runs it as one
    /// group, so that no rank waits on a peer that is itself waiting.
    fn exchange_all(&self, tag: u64, mut parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, CpError> {
        let (r, w) = (self.rank(), self.world());
        for (p, part) in parts.iter_mut().enumerate() {
            if p != r {
                self.send(p, tag, std::mem::take(part))?;
            }
        }
        let mut out = Vec::with_capacity(w);
        for (p, part) in parts.into_iter().enumerate() {
            out.push(if p == r { part } else { self.recv(p, tag)? });
        }
        Ok(out)
    }
}

type Msg = (usize, u64, Vec<u8>);
/// A rank's receiver and the messages that arrived before they were asked for.
type Inbox = (mpsc::Receiver<Msg>, HashMap<(usize, u64), Vec<u8>>);

/// One rank of an in-process world: messages travel through channels between threads.
pub struct InProcess {
    rank: usize,
    peers: Vec<mpsc::Sender<Msg>>,
    inbox: Mutex<Inbox>,
    timeout: Duration,
}

impl InProcess {
    /// The `world` ranks of one world (rank `i` at index `i`); a receive that waits longer than
    /// 10 minutes fails (a peer that stopped).
    pub fn world(world: usize) -> Vec<InProcess> {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| mpsc::channel::<Msg>()).unzip();
        rxs.into_iter()
            .enumerate()
            .map(|(rank, rx)| InProcess {
                rank,
                peers: txs.clone(),
                inbox: Mutex::new((rx, HashMap::new())),
                timeout: Duration::from_secs(600),
            })
            .collect()
    }

    /// Sets how long a receive waits before it fails.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl Communicator for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.peers.len()
    }
    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<(), CpError> {
        let tx = self.peers.get(peer).ok_or_else(|| CpError::Comm {
            rank: self.rank,
            why: format!("send to rank {peer} in a world of {}", self.peers.len()),
        })?;
        tx.send((self.rank, tag, data))
            .map_err(|_| CpError::Comm { rank: self.rank, why: format!("rank {peer} has stopped") })
    }
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CpError> {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(d) = inbox.1.remove(&(peer, tag)) {
                return Ok(d);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match inbox.0.recv_timeout(left) {
                Ok((from, t, d)) => {
                    inbox.1.insert((from, t), d);
                }
                Err(_) => {
                    return Err(CpError::Comm {
                        rank: self.rank,
                        why: format!("no message {tag} from rank {peer} within {:?}", self.timeout),
                    });
                }
            }
        }
    }
}

/// Runs `f` on every rank of an in-process world of `world` ranks, each on its own thread, and
/// returns the results in rank order.
pub fn run_in_process<R: Send>(world: usize, f: impl Fn(&InProcess) -> R + Sync) -> Vec<R> {
    run_ranks(InProcess::world(world), f)
}

/// Runs `f` on every rank of a world (`comms[i]` is rank `i`: [`InProcess::world`],
/// [`Grouped`] over [`Rendezvous::world`] or NCCL), each on its own thread, and returns the
/// results in rank order.
pub fn run_ranks<C: Sync, R: Send>(comms: Vec<C>, f: impl Fn(&C) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// Sends `data` to every other rank and returns every rank's data, in rank order.
pub fn all_gather(comm: &dyn Communicator, tag: u64, data: Vec<u8>) -> Result<Vec<Vec<u8>>, CpError> {
    comm.exchange_all(tag, vec![data; comm.world()])
}

/// Sends `parts[p]` to rank `p` and returns what each rank sent this one (its own part kept).
pub fn all_to_all(comm: &dyn Communicator, tag: u64, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, CpError> {
    let w = comm.world();
    if parts.len() != w {
        return Err(CpError::Layout(format!("all_to_all with {} parts in a world of {w}", parts.len())));
    }
    comm.exchange_all(tag, parts)
}

/// [`all_to_all`] counting into `st` the bytes this rank sends to and receives from the others.
fn exchange(
    comm: &dyn Communicator,
    tag: u64,
    parts: Vec<Vec<u8>>,
    st: &mut StepStats,
) -> Result<Vec<Vec<u8>>, CpError> {
    let rank = comm.rank();
    let others =
        |x: &[Vec<u8>]| x.iter().enumerate().filter(|(i, _)| *i != rank).map(|(_, m)| m.len() as u64).sum::<u64>();
    st.bytes_sent += others(&parts);
    let got = all_to_all(comm, tag, parts)?;
    st.bytes_received += others(&got);
    Ok(got)
}

/// The cu_seqlens of packed sequences, q's and k's, as index tensors on `kernels`' device.
fn cu_seqlens(kernels: &Kernels, vl: &crate::problem::Varlen) -> Result<(IndexTensor, IndexTensor), AttnError> {
    Ok((
        kernels.index_tensor(&crate::problem::Varlen::cu(vl.seqlens_q), None)?,
        kernels.index_tensor(&crate::problem::Varlen::cu(vl.seqlens_kv), None)?,
    ))
}

/// Global rows `start..start + len` of one piece of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The first global row.
    pub start: usize,
    /// Rows in the piece.
    pub len: usize,
}

/// The pieces of a sequence of `len` rows that `rank` holds, in local order: ring and Ulysses
/// the contiguous slice `rank·len/world .. (rank+1)·len/world`, zigzag pieces `rank` and
/// `2·world-1-rank` of `2·world` (piece `i` is `i·len/(2 world) .. (i+1)·len/(2 world)`).
pub fn segments(strategy: Strategy, len: usize, world: usize, rank: usize) -> Vec<Segment> {
    let piece = |i: usize, n: usize| {
        let (a, b) = (i * len / n, (i + 1) * len / n);
        Segment { start: a, len: b - a }
    };
    match strategy {
        Strategy::Ring | Strategy::Ulysses => vec![piece(rank, world)],
        Strategy::Zigzag => vec![piece(rank, 2 * world), piece(2 * world - 1 - rank, 2 * world)],
    }
}

/// One sequence of the problem: `nb` batch entries (dense) or one packed sequence (varlen).
#[derive(Clone, Copy, Debug)]
struct Seq {
    nb: usize,
    sq: usize,
    skv: usize,
}

fn seqs(p: &Problem) -> Vec<Seq> {
    match p.varlen {
        Some(v) => v
            .seqlens_q
            .iter()
            .zip(v.seqlens_kv)
            .map(|(&q, &k)| Seq { nb: 1, sq: q as usize, skv: k as usize })
            .collect(),
        None => vec![Seq { nb: p.batch as usize, sq: p.seq_q as usize, skv: p.seq_kv as usize }],
    }
}

/// A rank's local rows: for each sequence, its pieces with their local row offsets, and the total.
#[derive(Clone, Debug)]
struct Local {
    /// Per sequence: (global segment, local row offset).
    pieces: Vec<Vec<(Segment, usize)>>,
    rows: usize,
}

fn local(strategy: Strategy, lens: impl Iterator<Item = usize>, world: usize, rank: usize) -> Local {
    let mut pieces = Vec::new();
    let mut off = 0;
    for len in lens {
        let mut v = Vec::new();
        for s in segments(strategy, len, world, rank) {
            v.push((s, off));
            off += s.len;
        }
        pieces.push(v);
    }
    Local { pieces, rows: off }
}

/// How a block was computed (the per-step report).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// Every row sees every key: no mask.
    Full,
    /// The diagonal block of a causal problem (same rows, same keys).
    Diagonal,
    /// A masked block (window, or a causal block off the diagonal).
    Partial,
    /// No row sees a key: not launched.
    Skipped,
}

/// One step of one rank: what it sent and received and how long its compute took.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Bytes of the strategy's messages this rank sent in the step.
    pub bytes_sent: u64,
    /// Bytes of the strategy's messages this rank received in the step.
    pub bytes_received: u64,
    /// Seconds of this rank's block launches and merges in the step.
    pub compute_s: f64,
    /// Blocks by kind (pairs of a query piece and a key piece).
    pub blocks: Vec<BlockKind>,
    /// Query-key pairs the step's blocks see (the work, up to the mask's precision).
    pub visible_pairs: u64,
}

/// What one rank did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CpStats {
    /// Its steps, in order.
    pub steps: Vec<StepStats>,
}

impl CpStats {
    /// Bytes sent over all steps.
    pub fn bytes_sent(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes_sent).sum()
    }
    /// Bytes received over all steps.
    pub fn bytes_received(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes_received).sum()
    }
    /// Seconds of compute over all steps.
    pub fn compute_s(&self) -> f64 {
        self.steps.iter().map(|s| s.compute_s).sum()
    }
}

/// One rank's result: its rows of `o` (f32, in the local layout of its q: `[batch, rows, heads,
/// head_dim]`, varlen `[rows, heads, head_dim]`), `lse` (`[batch, heads, rows]`, varlen `[heads,
/// rows]`) and what it did.
#[derive(Clone, Debug)]
pub struct CpOutput {
    /// The rank's rows of O (f32).
    pub o: Vec<f32>,
    /// The rank's rows of LSE (f32, natural log).
    pub lse: Vec<f32>,
    /// What the rank sent, received and computed.
    pub stats: CpStats,
}

/// Options of the context-parallel calls beyond the problem.
#[derive(Clone, Debug, Default)]
pub struct CpOpts {
    /// Test hook: leave out the merge of this step's blocks (a test proves the check sees it).
    #[doc(hidden)]
    pub drop_merge_step: Option<usize>,
}

/// The rows (`[batch, seq, heads, d]`, varlen `[total, heads, d]`) of a global host tensor that
/// `rank` holds under `strategy`, in its local order: the shard a rank is given. `heads` is the
/// tensor's (query or K/V) head count; `keys` picks the key lengths (k, v) instead of the query
/// lengths.
pub fn shard(
    p: &Problem,
    strategy: Strategy,
    world: usize,
    rank: usize,
    keys: bool,
    heads: usize,
    x: &[f32],
) -> Vec<f32> {
    let row = heads * p.head_dim as usize;
    let mut out = Vec::new();
    let mut global_off = 0;
    for s in seqs(p) {
        let len = if keys { s.skv } else { s.sq };
        for b in 0..s.nb {
            for seg in segments(strategy, len, world, rank) {
                let at = (global_off + b * len + seg.start) * row;
                out.extend_from_slice(&x[at..at + seg.len * row]);
            }
        }
        global_off += s.nb * len;
    }
    out
}

/// Reassembles the global `o` and `lse` (the single-device layouts) from every rank's
/// [`CpOutput`] (rank order).
pub fn gather(p: &Problem, strategy: Strategy, outs: &[CpOutput]) -> (Vec<f32>, Vec<f32>) {
    let world = outs.len();
    let (h, d) = (p.heads as usize, p.head_dim as usize);
    let total_rows: usize = seqs(p).iter().map(|s| s.nb * s.sq).sum();
    let mut o = vec![0f32; total_rows * h * d];
    let mut lse = vec![0f32; total_rows * h];
    let varlen = p.varlen.is_some();
    for (rank, out) in outs.iter().enumerate() {
        let loc = local(strategy, seqs(p).iter().map(|s| s.sq), world, rank);
        let mut global_off = 0;
        for (si, s) in seqs(p).iter().enumerate() {
            for (seg, loff) in &loc.pieces[si] {
                for b in 0..s.nb {
                    for i in 0..seg.len {
                        let (lr, gr) = (b * loc.rows + loff + i, global_off + b * s.sq + seg.start + i);
                        o[gr * h * d..][..h * d].copy_from_slice(&out.o[lr * h * d..][..h * d]);
                        for hh in 0..h {
                            let (li, gi) = if varlen {
                                (hh * loc.rows + loff + i, hh * total_rows + gr)
                            } else {
                                ((b * h + hh) * loc.rows + loff + i, (b * h + hh) * s.sq + seg.start + i)
                            };
                            lse[gi] = out.lse[li];
                        }
                    }
                }
            }
            global_off += s.nb * s.sq;
        }
    }
    (o, lse)
}

/// The running f32 state of a rank's rows.
struct Acc {
    o: Vec<f32>,
    lse: Vec<f32>,
    rows: usize,
    heads: usize,
    d: usize,
    varlen: bool,
}

impl Acc {
    fn new(batch: usize, rows: usize, heads: usize, d: usize, varlen: bool) -> Acc {
        let nb = if varlen { 1 } else { batch };
        Acc {
            o: vec![0.0; nb * rows * heads * d],
            lse: vec![f32::NEG_INFINITY; nb * rows * heads],
            rows,
            heads,
            d,
            varlen,
        }
    }
    fn lse_at(&self, b: usize, h: usize, row: usize) -> usize {
        if self.varlen {
            h * self.rows + row
        } else {
            (b * self.heads + h) * self.rows + row
        }
    }
    /// Merges one block's `o` (`[nb, n, heads, d]`) and `lse` (`[nb, heads, n]`) into rows
    /// `row0..row0 + n` of batch entries `b0..b0 + nb`.
    fn merge(&mut self, b0: usize, nb: usize, row0: usize, n: usize, o: &[f32], lse: &[f32]) {
        let (h, d) = (self.heads, self.d);
        for b in 0..nb {
            for i in 0..n {
                for hh in 0..h {
                    let l_new = lse[(b * h + hh) * n + i];
                    let at = self.lse_at(b0 + b, hh, row0 + i);
                    let l_acc = self.lse[at];
                    let m = l_acc.max(l_new);
                    if m == f32::NEG_INFINITY {
                        continue;
                    }
                    let l = m + ((l_acc - m).exp() + (l_new - m).exp()).ln();
                    let (wa, wn) = ((l_acc - l).exp(), (l_new - l).exp());
                    let oa = (((b0 + b) * self.rows + row0 + i) * h + hh) * d;
                    let on = ((b * n + i) * h + hh) * d;
                    for x in 0..d {
                        self.o[oa + x] = wa * self.o[oa + x] + wn * o[on + x];
                    }
                    self.lse[at] = l;
                }
            }
        }
    }
    /// Adds each head's sink logit to its rows' denominators.
    fn add_sinks(&mut self, batch: usize, sinks: &[f32], head0: usize) {
        let nb = if self.varlen { 1 } else { batch };
        let (h, d) = (self.heads, self.d);
        for b in 0..nb {
            for hh in 0..h {
                let s = sinks[head0 + hh];
                for i in 0..self.rows {
                    let at = self.lse_at(b, hh, i);
                    let l = self.lse[at];
                    let m = l.max(s);
                    let nl = m + ((l - m).exp() + (s - m).exp()).ln();
                    let w = (l - nl).exp();
                    let oa = ((b * self.rows + i) * h + hh) * d;
                    for x in &mut self.o[oa..oa + d] {
                        *x *= w;
                    }
                    self.lse[at] = nl;
                }
            }
        }
    }
}

/// The window of `p` as signed bounds (`None` unbounded); causal sets the right side to 0.
fn window(p: &Problem) -> (Option<i64>, Option<i64>) {
    let side = |w: i32| (w >= 0).then_some(w as i64);
    let right = if p.causal { Some(0) } else { side(p.window.1) };
    (side(p.window.0), right)
}

/// The launch of one block: the query and key prefixes and the kernel's window, or `None` when
/// no row of the block sees a key. `diag` is the block's diagonal `D` (module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
struct BlockPlan {
    rows: usize,
    keys: usize,
    left: Option<i64>,
    right: Option<i64>,
    kind: BlockKind,
    visible: u64,
}

fn plan_block(lq: usize, lk: usize, diag: i64, win: (Option<i64>, Option<i64>)) -> Option<BlockPlan> {
    if lq == 0 || lk == 0 {
        return None;
    }
    let (wl, wr) = win;
    let (lq_i, lk_i) = (lq as i64, lk as i64);
    let e = lk_i - lq_i - diag;
    let (rows, keys) = match (wl, wr) {
        (_, Some(r)) if e > r => (lq_i, lq_i + diag + r),
        (Some(l), _) if e < -l => (lk_i - diag + l, lk_i),
        _ => (lq_i, lk_i),
    };
    let (rows, keys) = (rows.min(lq_i), keys.min(lk_i));
    if rows <= 0 || keys <= 0 {
        return None;
    }
    let e = keys - rows - diag;
    let left = wl.map(|l| l + e);
    let right = wr.map(|r| r - e);
    // Pairs seen, counted from the global rule.
    let mut visible = 0u64;
    for a in 0..rows {
        let lo = wl.map_or(0, |l| (a + diag - l).max(0));
        let hi = wr.map_or(keys - 1, |r| (a + diag + r).min(keys - 1));
        visible += (hi - lo + 1).max(0) as u64;
    }
    if visible == 0 {
        return None;
    }
    let full = visible == (lq as u64) * (lk as u64);
    let kind = if full {
        BlockKind::Full
    } else if diag == 0 && lq == lk && wl.is_none() && wr == Some(0) {
        BlockKind::Diagonal
    } else {
        BlockKind::Partial
    };
    Some(BlockPlan { rows: rows as usize, keys: keys as usize, left, right, kind, visible })
}

/// A tensor's local rows on a rank's device: `[nb, rows, heads, d]` rows `row0..` of a buffer
/// whose batch entries are `batch_rows` rows apart.
struct Region<'a> {
    buf: &'a DeviceBuffer,
    batch_rows: usize,
    heads: usize,
}

impl Region<'_> {
    fn view(
        &self,
        dtype: Dtype,
        d: usize,
        b0: usize,
        nb: usize,
        row0: usize,
        rows: usize,
    ) -> Result<TensorView<'_>, AttnError> {
        let row = self.heads * d;
        TensorView::device(self.buf, dtype, [nb, rows, self.heads, d])?
            .with_strides([self.batch_rows * row, row, d, 1])
            .offset((b0 * self.batch_rows + row0) * row)
    }
}

/// Runs one block and merges it; returns its kind and the pairs it sees.
#[allow(clippy::too_many_arguments)]
fn run_block(
    kernels: &Kernels,
    p: &Problem,
    q: &Region<'_>,
    k: &Region<'_>,
    v: &Region<'_>,
    (b0, nb): (usize, usize),
    (qseg, qoff): (Segment, usize),
    (kseg, koff): (Segment, usize),
    g: i64,
    acc: &mut Acc,
    merge: bool,
) -> Result<(BlockKind, u64), AttnError> {
    let diag = qseg.start as i64 - kseg.start as i64 + g;
    let Some(bp) = plan_block(qseg.len, kseg.len, diag, window(p)) else {
        return Ok((BlockKind::Skipped, 0));
    };
    let d = p.head_dim as usize;
    let qv = q.view(p.dtype, d, b0, nb, qoff, bp.rows)?;
    let kv = k.view(p.dtype, d, b0, nb, koff, bp.keys)?;
    let vv = v.view(p.dtype, d, b0, nb, koff, bp.keys)?;
    let side = |w: Option<i64>| w.map(|w| u32::try_from(w).unwrap_or(u32::MAX));
    let mut opts = AttnOpts::new().softmax_scale(p.softmax_scale()).window(side(bp.left), side(bp.right));
    if p.softcap > 0.0 {
        opts = opts.softcap(p.softcap);
    }
    let (o, lse) = kernels.flash_attn(&qv, &kv, &vv, &opts)?;
    let (o, lse) = (o.to_vec_f32()?, lse.to_vec_f32()?);
    if merge {
        acc.merge(b0, nb, qoff, bp.rows, &o, &lse);
    }
    Ok((bp.kind, bp.visible))
}

fn attn_err(rank: usize) -> impl Fn(AttnError) -> CpError {
    move |source| CpError::attn(rank, source)
}

/// Checks what every strategy needs of the problem and the world.
fn check(p: &Problem, strategy: Strategy, world: usize, sinks: &[f32]) -> Result<(), CpError> {
    if world == 0 {
        return Err(CpError::Layout("a world of 0 ranks".into()));
    }
    if p.sinks && sinks.len() != p.heads as usize {
        return Err(CpError::Layout(format!("{} sink logits for {} heads (one per head)", sinks.len(), p.heads)));
    }
    if strategy == Strategy::Ulysses {
        let (h, hk) = (p.heads as usize, p.kv_heads() as usize);
        if h % world != 0 || hk % world != 0 {
            return Err(CpError::Layout(format!(
                "Ulysses splits heads across ranks: heads ({h}) and heads_kv ({hk}) must both be divisible by the \
                 world size {world} (use ring or zigzag, which split the sequence)"
            )));
        }
    }
    Ok(())
}

/// Context-parallel attention on one rank: `q`, `k`, `v` are this rank's shard (see [`shard`])
/// in `p.dtype` on `kernels`' device, in the local layout (`[batch, rows, heads, head_dim]`,
/// varlen `[rows, heads, head_dim]` with the rank's pieces of each sequence in order); `p` is the
/// whole problem (global lengths, mask, GQA, soft cap, varlen); `sinks` the per-head sink logits
/// when `p.sinks`. Every rank of the world calls it with the same `p` and `strategy`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    kernels: &Kernels,
    comm: &dyn Communicator,
    p: &Problem,
    strategy: Strategy,
    q: &DeviceBuffer,
    k: &DeviceBuffer,
    v: &DeviceBuffer,
    sinks: &[f32],
    opts: &CpOpts,
) -> Result<CpOutput, CpError> {
    let world = comm.world();
    check(p, strategy, world, sinks)?;
    match strategy {
        Strategy::Ring | Strategy::Zigzag => ring(kernels, comm, p, strategy, q, k, v, sinks, opts),
        Strategy::Ulysses => ulysses(kernels, comm, p, q, k, v, sinks),
    }
}

#[allow(clippy::too_many_arguments)]
fn ring(
    kernels: &Kernels,
    comm: &dyn Communicator,
    p: &Problem,
    strategy: Strategy,
    q: &DeviceBuffer,
    k: &DeviceBuffer,
    v: &DeviceBuffer,
    sinks: &[f32],
    opts: &CpOpts,
) -> Result<CpOutput, CpError> {
    let (rank, world) = (comm.rank(), comm.world());
    let err = attn_err(rank);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let e = p.dtype.size_bytes() as usize;
    let ss = seqs(p);
    let varlen = p.varlen.is_some();
    let lq = local(strategy, ss.iter().map(|s| s.sq), world, rank);
    let kv_local = |owner: usize| local(strategy, ss.iter().map(|s| s.skv), world, owner);
    let batch = p.batch as usize;
    let nb_total = if varlen { 1 } else { batch };
    let mut acc = Acc::new(batch, lq.rows, h, d, varlen);
    let qr = Region { buf: q, batch_rows: lq.rows, heads: h };
    // The K/V block this rank holds now: its owner, its bytes (k then v) and its device copies.
    let own = kv_local(rank);
    let kv_bytes = nb_total * own.rows * hk * d * e;
    let mut cur_bytes = k.read_bytes(kv_bytes).map_err(&err)?;
    cur_bytes.extend(v.read_bytes(kv_bytes).map_err(&err)?);
    let mut cur: Option<(DeviceBuffer, DeviceBuffer)> = None;
    let mut stats = CpStats::default();
    for t in 0..world {
        let owner = (rank + world - t) % world;
        let mut st = StepStats::default();
        // Post the block to the next rank before computing with it: the transfer overlaps the compute.
        if t + 1 < world {
            st.bytes_sent = cur_bytes.len() as u64;
            comm.send((rank + 1) % world, t as u64, cur_bytes.clone())?;
        }
        let started = Instant::now();
        let lk = kv_local(owner);
        let (kb, vb) = match &cur {
            Some((kb, vb)) => (kb, vb),
            None => (k, v),
        };
        let kr = Region { buf: kb, batch_rows: lk.rows, heads: hk };
        let vr = Region { buf: vb, batch_rows: lk.rows, heads: hk };
        let merge = opts.drop_merge_step != Some(t);
        for (si, s) in ss.iter().enumerate() {
            let g = s.skv as i64 - s.sq as i64;
            let b0 = 0;
            for &qp in &lq.pieces[si] {
                for &kp in &lk.pieces[si] {
                    let (kind, vis) =
                        run_block(kernels, p, &qr, &kr, &vr, (b0, s.nb), qp, kp, g, &mut acc, merge).map_err(&err)?;
                    st.blocks.push(kind);
                    st.visible_pairs += vis * s.nb as u64 * h as u64;
                }
            }
        }
        st.compute_s = started.elapsed().as_secs_f64();
        if t + 1 < world {
            let half = nb_total * kv_local((owner + world - 1) % world).rows * hk * d * e;
            let (kb, vb, data) = receive_kv(kernels, comm, t as u64, half)?;
            st.bytes_received = data.len() as u64;
            cur = Some((kb, vb));
            cur_bytes = data;
        }
        stats.steps.push(st);
    }
    if p.sinks {
        acc.add_sinks(batch, sinks, 0);
    }
    Ok(CpOutput { o: acc.o, lse: acc.lse, stats })
}

/// Receives the K/V block of message `tag` from the previous rank of the ring (`half` bytes of
/// K, then as many of V) onto `kernels`' device: the two device copies and the bytes (which go
/// on to the next rank).
fn receive_kv(
    kernels: &Kernels,
    comm: &dyn Communicator,
    tag: u64,
    half: usize,
) -> Result<(DeviceBuffer, DeviceBuffer, Vec<u8>), CpError> {
    let (rank, world) = (comm.rank(), comm.world());
    let err = attn_err(rank);
    let data = comm.recv((rank + world - 1) % world, tag)?;
    if data.len() != 2 * half {
        return Err(CpError::Comm {
            rank,
            why: format!("a K/V block of {} bytes where {} were expected", data.len(), 2 * half),
        });
    }
    let kb = kernels.alloc(half as u64).map_err(&err)?;
    let vb = kernels.alloc(half as u64).map_err(&err)?;
    kb.write_bytes(&data[..half]).map_err(&err)?;
    vb.write_bytes(&data[half..]).map_err(&err)?;
    Ok((kb, vb, data))
}

/// Heads `[h0, h0 + n)` of rows `[nb, rows, heads, d]` (elements of `e` bytes), as bytes.
fn heads_of(x: &[u8], nb_rows: usize, heads: usize, d: usize, e: usize, h0: usize, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(nb_rows * n * d * e);
    for r in 0..nb_rows {
        let at = (r * heads + h0) * d * e;
        out.extend_from_slice(&x[at..at + n * d * e]);
    }
    out
}

fn ulysses(
    kernels: &Kernels,
    comm: &dyn Communicator,
    p: &Problem,
    q: &DeviceBuffer,
    k: &DeviceBuffer,
    v: &DeviceBuffer,
    sinks: &[f32],
) -> Result<CpOutput, CpError> {
    let (rank, world) = (comm.rank(), comm.world());
    let err = attn_err(rank);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let (hw, hkw) = (h / world, hk / world);
    let e = p.dtype.size_bytes() as usize;
    let ss = seqs(p);
    let varlen = p.varlen.is_some();
    let batch = p.batch as usize;
    let nb = if varlen { 1 } else { batch };
    let locs_q: Vec<Local> = (0..world).map(|r| local(Strategy::Ulysses, ss.iter().map(|s| s.sq), world, r)).collect();
    let locs_k: Vec<Local> = (0..world).map(|r| local(Strategy::Ulysses, ss.iter().map(|s| s.skv), world, r)).collect();
    let (mq, mk) = (&locs_q[rank], &locs_k[rank]);
    let mut stats = CpStats::default();
    let mut st = StepStats::default();
    // First all-to-all: to rank p, this rank's rows of p's heads of q, k and v.
    let qb = q.read_bytes(nb * mq.rows * h * d * e).map_err(&err)?;
    let kb = k.read_bytes(nb * mk.rows * hk * d * e).map_err(&err)?;
    let vb = v.read_bytes(nb * mk.rows * hk * d * e).map_err(&err)?;
    let parts: Vec<Vec<u8>> = (0..world)
        .map(|peer| {
            let mut m = heads_of(&qb, nb * mq.rows, h, d, e, peer * hw, hw);
            m.extend(heads_of(&kb, nb * mk.rows, hk, d, e, peer * hkw, hkw));
            m.extend(heads_of(&vb, nb * mk.rows, hk, d, e, peer * hkw, hkw));
            m
        })
        .collect();
    let got = exchange(comm, 1 << 32, parts, &mut st)?;
    // Assemble the whole sequence of this rank's heads: [nb, seq, hw, d] (varlen packed).
    let (tq, tk): (usize, usize) = (ss.iter().map(|s| s.sq).sum(), ss.iter().map(|s| s.skv).sum());
    let (rows_q, rows_k) = if varlen { (tq, tk) } else { (p.seq_q as usize, p.seq_kv as usize) };
    let mut fq = vec![0u8; nb * rows_q * hw * d * e];
    let mut fk = vec![0u8; nb * rows_k * hkw * d * e];
    let mut fv = vec![0u8; nb * rows_k * hkw * d * e];
    for (src, m) in got.iter().enumerate() {
        let (lq, lk) = (&locs_q[src], &locs_k[src]);
        let (nq, nk) = (nb * lq.rows * hw * d * e, nb * lk.rows * hkw * d * e);
        if m.len() != nq + 2 * nk {
            return Err(CpError::Comm {
                rank,
                why: format!("an all-to-all part of {} bytes from rank {src}", m.len()),
            });
        }
        let place =
            |dst: &mut [u8], part: &[u8], loc: &Local, lens: &dyn Fn(&Seq) -> usize, width: usize, grows: usize| {
                let row = width * d * e;
                let mut goff = 0;
                for (si, s) in ss.iter().enumerate() {
                    for &(seg, loff) in &loc.pieces[si] {
                        for b in 0..s.nb {
                            let (lr, gr) = (b * loc.rows + loff, b * grows + goff + seg.start);
                            dst[gr * row..(gr + seg.len) * row].copy_from_slice(&part[lr * row..(lr + seg.len) * row]);
                        }
                    }
                    if varlen {
                        goff += lens(s);
                    }
                }
            };
        place(&mut fq, &m[..nq], lq, &|s| s.sq, hw, rows_q);
        place(&mut fk, &m[nq..nq + nk], lk, &|s| s.skv, hkw, rows_k);
        place(&mut fv, &m[nq + nk..], lk, &|s| s.skv, hkw, rows_k);
    }
    let started = Instant::now();
    let up = |bytes: &[u8]| -> Result<DeviceBuffer, CpError> {
        let b = kernels.alloc(bytes.len() as u64).map_err(&err)?;
        b.write_bytes(bytes).map_err(&err)?;
        Ok(b)
    };
    let (dq, dk, dv) = (up(&fq)?, up(&fk)?, up(&fv)?);
    let qv = TensorView::device(&dq, p.dtype, [nb, rows_q, hw, d]).map_err(&err)?;
    let kv = TensorView::device(&dk, p.dtype, [nb, rows_k, hkw, d]).map_err(&err)?;
    let vv = TensorView::device(&dv, p.dtype, [nb, rows_k, hkw, d]).map_err(&err)?;
    let mut opts =
        AttnOpts::new().softmax_scale(p.softmax_scale()).window_size(p.window.0, p.window.1).causal(p.causal);
    if p.softcap > 0.0 {
        opts = opts.softcap(p.softcap);
    }
    let (o, lse) = match p.varlen {
        Some(vl) => {
            let (cq, ck) = cu_seqlens(kernels, &vl).map_err(&err)?;
            kernels.flash_attn_varlen(&qv, &kv, &vv, &cq, &ck, p.seq_q as usize, p.seq_kv as usize, &opts)
        }
        None => kernels.flash_attn(&qv, &kv, &vv, &opts),
    }
    .map_err(&err)?;
    let (o, lse) = (o.to_vec_f32().map_err(&err)?, lse.to_vec_f32().map_err(&err)?);
    st.compute_s = started.elapsed().as_secs_f64();
    st.blocks.push(BlockKind::Full);
    stats.steps.push(st);
    // Second all-to-all: to rank p, p's rows of this rank's heads, o (f32) then lse.
    let mut st = StepStats::default();
    let parts: Vec<Vec<u8>> = (0..world)
        .map(|peer| {
            let loc = &locs_q[peer];
            let mut m = Vec::with_capacity(nb * loc.rows * hw * (d + 1) * 4);
            let mut goff = 0;
            for (si, s) in ss.iter().enumerate() {
                for &(seg, _) in &loc.pieces[si] {
                    for b in 0..s.nb {
                        let gr = b * rows_q + goff + seg.start;
                        for x in &o[gr * hw * d..(gr + seg.len) * hw * d] {
                            m.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                }
                if varlen {
                    goff += s.sq;
                }
            }
            let mut goff = 0;
            for (si, s) in ss.iter().enumerate() {
                for &(seg, _) in &loc.pieces[si] {
                    for b in 0..s.nb {
                        for hh in 0..hw {
                            for i in 0..seg.len {
                                let at = (b * hw + hh) * rows_q + goff + seg.start + i;
                                m.extend_from_slice(&lse[at].to_le_bytes());
                            }
                        }
                    }
                }
                if varlen {
                    goff += s.sq;
                }
            }
            m
        })
        .collect();
    let got = exchange(comm, 2 << 32, parts, &mut st)?;
    let mut acc = Acc::new(batch, mq.rows, h, d, varlen);
    for (src, m) in got.iter().enumerate() {
        let f: Vec<f32> = Dtype::F32.decode(m);
        let n_o = nb * mq.rows * hw * d;
        if f.len() != n_o + nb * mq.rows * hw {
            return Err(CpError::Comm { rank, why: format!("a returned part of {} bytes from rank {src}", m.len()) });
        }
        let (po, pl) = f.split_at(n_o);
        // Walk the same order the sender wrote.
        let mut n = 0;
        for (si, s) in ss.iter().enumerate() {
            for &(seg, loff) in &mq.pieces[si] {
                for b in 0..s.nb {
                    for i in 0..seg.len {
                        let lr = b * mq.rows + loff + i;
                        for hh in 0..hw {
                            let dst = (lr * h + src * hw + hh) * d;
                            acc.o[dst..dst + d].copy_from_slice(&po[n..n + d]);
                            n += d;
                        }
                    }
                }
            }
        }
        let mut n = 0;
        for (si, s) in ss.iter().enumerate() {
            for &(seg, loff) in &mq.pieces[si] {
                for b in 0..s.nb {
                    for hh in 0..hw {
                        for i in 0..seg.len {
                            let at = acc.lse_at(b, src * hw + hh, loff + i);
                            acc.lse[at] = pl[n];
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    stats.steps.push(st);
    if p.sinks {
        acc.add_sinks(batch, sinks, 0);
    }
    Ok(CpOutput { o: acc.o, lse: acc.lse, stats })
}

/// One rank's gradients from [`attention_backward`]: `dq` in the local layout of its q, `dk`
/// and `dv` in the local layout of its k and v (all f32), `d_sinks` this rank's rows' share of
/// the sinks' gradient (one per head; the ranks' shares add up to it, [`gather_grads`]), and
/// what it sent and received.
#[derive(Clone, Debug)]
pub struct CpGrads {
    /// dQ of the rank's query rows.
    pub dq: Vec<f32>,
    /// dK of the rank's keys.
    pub dk: Vec<f32>,
    /// dV of the rank's keys.
    pub dv: Vec<f32>,
    /// The rank's share of the sinks' gradient, one per head (empty without sinks).
    pub d_sinks: Vec<f32>,
    /// What the rank sent, received and computed.
    pub stats: CpStats,
}

/// The backward of [`attention`] on one rank, ring and zigzag: the same ring once more, each
/// K/V block travelling with the f32 sums of its dK and dV. `q`, `k`, `v` are the rank's shard
/// as for [`attention`]; `o` and `lse` its rows of the forward's result ([`CpOutput`]: the
/// merged, final values); `d_o` its rows of the upstream gradient (like `q`, in `p.dtype`).
///
/// At step `t` rank `r` holds rank `(r - t) mod world`'s K/V and the dK/dV its earlier holders
/// summed. For every block of its queries against those keys (the forward's block plans) it runs
/// the single-device backward ([`Kernels::flash_attn_backward`]) with the final O and LSE of its
/// rows, so `P = exp(S - LSE)` and `D = rowsum(dO ∘ O)` are the whole problem's: dQ stays on the
/// rank and is summed over the steps in f32; the block's dK and dV join the travelling sums. The
/// K/V block is posted to rank `r + 1` before the compute (as in the forward), the sums after
/// it; after the last step each sum reaches its owner. The sinks' gradient, `-Σ_i P_sink,i D_i`
/// over the rank's rows, is computed on the host from the same O, dO and LSE.
///
/// Bytes per rank beyond the forward's K/V traffic: `world` dK/dV sums in f32,
/// `2 · B · Hk · d · 4 · seq_kv` in all for equal slices ([`analytic_backward_bytes`]).
/// Ulysses runs the forward's all-to-all in reverse around a single-device backward of the whole
/// sequence of each rank's heads (q, k, v, dO, O and LSE out; dq, dk, dv back, in f32).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    kernels: &Kernels,
    comm: &dyn Communicator,
    p: &Problem,
    strategy: Strategy,
    q: &DeviceBuffer,
    k: &DeviceBuffer,
    v: &DeviceBuffer,
    o: &[f32],
    lse: &[f32],
    d_o: &DeviceBuffer,
    sinks: &[f32],
) -> Result<CpGrads, CpError> {
    let (rank, world) = (comm.rank(), comm.world());
    check(p, strategy, world, sinks)?;
    if strategy == Strategy::Ulysses {
        return ulysses_backward(kernels, comm, p, q, k, v, o, lse, d_o, sinks);
    }
    let err = attn_err(rank);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let e = p.dtype.size_bytes() as usize;
    let ss = seqs(p);
    let varlen = p.varlen.is_some();
    let batch = p.batch as usize;
    let nb_total = if varlen { 1 } else { batch };
    let lq = local(strategy, ss.iter().map(|s| s.sq), world, rank);
    let kv_local = |owner: usize| local(strategy, ss.iter().map(|s| s.skv), world, owner);
    if o.len() != nb_total * lq.rows * h * d || lse.len() != nb_total * lq.rows * h {
        return Err(CpError::Layout(format!(
            "o of {} and lse of {} values for {} local rows of {h} heads x {d}",
            o.len(),
            lse.len(),
            nb_total * lq.rows
        )));
    }
    // The final O in the inputs' dtype, as the single-device backward takes it.
    let o_dev = kernels.upload_as(p.dtype, o).map_err(&err)?;
    let qr = Region { buf: q, batch_rows: lq.rows, heads: h };
    let or = Region { buf: &o_dev, batch_rows: lq.rows, heads: h };
    let dor = Region { buf: d_o, batch_rows: lq.rows, heads: h };
    let lse_at = |b: usize, hh: usize, row: usize| {
        if varlen {
            hh * lq.rows + row
        } else {
            (b * h + hh) * lq.rows + row
        }
    };
    let mut dq = vec![0f32; nb_total * lq.rows * h * d];
    let own = kv_local(rank);
    let kv_bytes = nb_total * own.rows * hk * d * e;
    let mut cur_bytes = k.read_bytes(kv_bytes).map_err(&err)?;
    cur_bytes.extend(v.read_bytes(kv_bytes).map_err(&err)?);
    let mut cur: Option<(DeviceBuffer, DeviceBuffer)> = None;
    // The travelling f32 sums of the held block's dK and dV ([nb, rows, hk, d] each).
    let mut dkv = vec![0f32; 2 * nb_total * own.rows * hk * d];
    let mut stats = CpStats::default();
    const KV_TAG: u64 = 3 << 32;
    const DKV_TAG: u64 = 4 << 32;
    for t in 0..world {
        let owner = (rank + world - t) % world;
        let mut st = StepStats::default();
        if t + 1 < world {
            st.bytes_sent += cur_bytes.len() as u64;
            comm.send((rank + 1) % world, KV_TAG + t as u64, cur_bytes.clone())?;
        }
        let started = Instant::now();
        let lk = kv_local(owner);
        let (kb, vb) = match &cur {
            Some((kb, vb)) => (kb, vb),
            None => (k, v),
        };
        let kr = Region { buf: kb, batch_rows: lk.rows, heads: hk };
        let vr = Region { buf: vb, batch_rows: lk.rows, heads: hk };
        let half = nb_total * lk.rows * hk * d;
        for (si, s) in ss.iter().enumerate() {
            let g = s.skv as i64 - s.sq as i64;
            for &(qseg, qoff) in &lq.pieces[si] {
                for &(kseg, koff) in &lk.pieces[si] {
                    let diag = qseg.start as i64 - kseg.start as i64 + g;
                    let Some(bp) = plan_block(qseg.len, kseg.len, diag, window(p)) else {
                        st.blocks.push(BlockKind::Skipped);
                        continue;
                    };
                    let nb = s.nb;
                    let qv = qr.view(p.dtype, d, 0, nb, qoff, bp.rows).map_err(&err)?;
                    let ov = or.view(p.dtype, d, 0, nb, qoff, bp.rows).map_err(&err)?;
                    let dov = dor.view(p.dtype, d, 0, nb, qoff, bp.rows).map_err(&err)?;
                    let kv = kr.view(p.dtype, d, 0, nb, koff, bp.keys).map_err(&err)?;
                    let vv = vr.view(p.dtype, d, 0, nb, koff, bp.keys).map_err(&err)?;
                    // The block's rows of the final LSE, [nb, h, rows].
                    let mut l = Vec::with_capacity(nb * h * bp.rows);
                    for b in 0..nb {
                        for hh in 0..h {
                            l.extend((0..bp.rows).map(|i| lse[lse_at(b, hh, qoff + i)]));
                        }
                    }
                    let lse_dev = kernels.upload_as(Dtype::F32, &l).map_err(&err)?;
                    let lse_view = crate::attn::LseView::vm(&lse_dev, nb, h, bp.rows).map_err(&err)?;
                    let side = |w: Option<i64>| w.map(|w| u32::try_from(w).unwrap_or(u32::MAX));
                    let mut opts =
                        AttnOpts::new().softmax_scale(p.softmax_scale()).window(side(bp.left), side(bp.right));
                    if p.softcap > 0.0 {
                        opts = opts.softcap(p.softcap);
                    }
                    let gr = kernels
                        .flash_attn_backward(&qv, &kv, &vv, &ov, &lse_view, &dov, &opts, &crate::attn::BwdOpts::new())
                        .map_err(&err)?;
                    let (gq, gk, gv) = (
                        gr.dq.to_vec_f32().map_err(&err)?,
                        gr.dk.to_vec_f32().map_err(&err)?,
                        gr.dv.to_vec_f32().map_err(&err)?,
                    );
                    for b in 0..nb {
                        for i in 0..bp.rows {
                            let (src, dst) = ((b * bp.rows + i) * h * d, (b * lq.rows + qoff + i) * h * d);
                            for (x, y) in dq[dst..dst + h * d].iter_mut().zip(&gq[src..src + h * d]) {
                                *x += *y;
                            }
                        }
                        for j in 0..bp.keys {
                            let (src, dst) = ((b * bp.keys + j) * hk * d, (b * lk.rows + koff + j) * hk * d);
                            for c in 0..hk * d {
                                dkv[dst + c] += gk[src + c];
                                dkv[half + dst + c] += gv[src + c];
                            }
                        }
                    }
                    st.blocks.push(bp.kind);
                    st.visible_pairs += bp.visible * nb as u64 * h as u64;
                }
            }
        }
        st.compute_s = started.elapsed().as_secs_f64();
        // The sums go on with the block: to the next rank, or (after the last step) home.
        let sums: Vec<u8> = dkv.iter().flat_map(|x| x.to_le_bytes()).collect();
        if world > 1 {
            st.bytes_sent += sums.len() as u64;
            comm.send((rank + 1) % world, DKV_TAG + t as u64, sums)?;
            let data = comm.recv((rank + world - 1) % world, DKV_TAG + t as u64)?;
            st.bytes_received += data.len() as u64;
            // Received: the sums of block (owner - 1), or after the last step this rank's own.
            let next_owner = (owner + world - 1) % world;
            let want = 2 * nb_total * kv_local(next_owner).rows * hk * d * 4;
            if data.len() != want {
                return Err(CpError::Comm {
                    rank,
                    why: format!("dK/dV sums of {} bytes where {want} were expected", data.len()),
                });
            }
            dkv = Dtype::F32.decode(&data);
        }
        if t + 1 < world {
            let half = nb_total * kv_local((owner + world - 1) % world).rows * hk * d * e;
            let (kb, vb, data) = receive_kv(kernels, comm, KV_TAG + t as u64, half)?;
            st.bytes_received += data.len() as u64;
            cur = Some((kb, vb));
            cur_bytes = data;
        }
        stats.steps.push(st);
    }
    // After `world` steps the sums in hand are this rank's own block's.
    let n = nb_total * own.rows * hk * d;
    let (dk, dv) = (dkv[..n].to_vec(), dkv[n..2 * n].to_vec());
    let d_sinks = sinks_share(p, nb_total, lq.rows, &o_dev, d_o, lse, sinks).map_err(&err)?;
    Ok(CpGrads { dq, dk, dv, d_sinks, stats })
}

/// The sinks' share of a rank's rows (`rows` local rows of `nb` batch entries): `-Σ_i exp(sink -
/// LSE_i) · rowsum(dO_i ∘ O_i)` per head, with O and dO as the kernels read them (in the inputs'
/// dtype, from `o` and `d_o` on the device); empty without sinks.
fn sinks_share(
    p: &Problem,
    nb: usize,
    rows: usize,
    o: &DeviceBuffer,
    d_o: &DeviceBuffer,
    lse: &[f32],
    sinks: &[f32],
) -> Result<Vec<f32>, AttnError> {
    if !p.sinks {
        return Ok(Vec::new());
    }
    let (h, d) = (p.heads as usize, p.head_dim as usize);
    let n = nb * rows * h * d * p.dtype.size_bytes() as usize;
    let (od, dod) = (p.dtype.decode(&o.read_bytes(n)?), p.dtype.decode(&d_o.read_bytes(n)?));
    let varlen = p.varlen.is_some();
    Ok((0..h)
        .map(|hh| {
            let mut acc = 0f64;
            for b in 0..nb {
                for i in 0..rows {
                    let l = lse[if varlen { hh * rows + i } else { (b * h + hh) * rows + i }];
                    if l == f32::NEG_INFINITY {
                        continue;
                    }
                    let at = ((b * rows + i) * h + hh) * d;
                    let dd: f64 = (0..d).map(|c| od[at + c] as f64 * dod[at + c] as f64).sum();
                    acc -= ((sinks[hh] - l) as f64).exp() * dd;
                }
            }
            acc as f32
        })
        .collect())
}

/// Ulysses' backward ([`attention_backward`]): the forward's all-to-all reversed around a
/// single-device backward. To every rank `p` go this rank's rows of `p`'s heads of q, k, v, dO, O
/// (in the inputs' dtype) and LSE (f32); `p` runs the backward over the whole sequence of its
/// heads; back come, in f32, this rank's rows of `p`'s heads of dq, dk and dv.
#[allow(clippy::too_many_arguments)]
fn ulysses_backward(
    kernels: &Kernels,
    comm: &dyn Communicator,
    p: &Problem,
    q: &DeviceBuffer,
    k: &DeviceBuffer,
    v: &DeviceBuffer,
    o: &[f32],
    lse: &[f32],
    d_o: &DeviceBuffer,
    sinks: &[f32],
) -> Result<CpGrads, CpError> {
    let (rank, world) = (comm.rank(), comm.world());
    let err = attn_err(rank);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let (hw, hkw) = (h / world, hk / world);
    let e = p.dtype.size_bytes() as usize;
    let ss = seqs(p);
    let varlen = p.varlen.is_some();
    let nb = if varlen { 1 } else { p.batch as usize };
    let locs_q: Vec<Local> = (0..world).map(|r| local(Strategy::Ulysses, ss.iter().map(|s| s.sq), world, r)).collect();
    let locs_k: Vec<Local> = (0..world).map(|r| local(Strategy::Ulysses, ss.iter().map(|s| s.skv), world, r)).collect();
    let (mq, mk) = (&locs_q[rank], &locs_k[rank]);
    if o.len() != nb * mq.rows * h * d || lse.len() != nb * mq.rows * h {
        return Err(CpError::Layout(format!(
            "o of {} and lse of {} values for {} local rows",
            o.len(),
            lse.len(),
            nb * mq.rows
        )));
    }
    let lse_at =
        |b: usize, hh: usize, row: usize| if varlen { hh * mq.rows + row } else { (b * h + hh) * mq.rows + row };
    let mut stats = CpStats::default();
    let mut st = StepStats::default();
    let nq = nb * mq.rows * h * d * e;
    let qb = q.read_bytes(nq).map_err(&err)?;
    let dob = d_o.read_bytes(nq).map_err(&err)?;
    let ob = p.dtype.encode(o);
    let kb = k.read_bytes(nb * mk.rows * hk * d * e).map_err(&err)?;
    let vb = v.read_bytes(nb * mk.rows * hk * d * e).map_err(&err)?;
    let parts: Vec<Vec<u8>> = (0..world)
        .map(|peer| {
            let rq = |x: &[u8]| heads_of(x, nb * mq.rows, h, d, e, peer * hw, hw);
            let rk = |x: &[u8]| heads_of(x, nb * mk.rows, hk, d, e, peer * hkw, hkw);
            let mut m = rq(&qb);
            m.extend(rk(&kb));
            m.extend(rk(&vb));
            m.extend(rq(&dob));
            m.extend(rq(&ob));
            for b in 0..nb {
                for hh in peer * hw..(peer + 1) * hw {
                    for i in 0..mq.rows {
                        m.extend_from_slice(&lse[lse_at(b, hh, i)].to_le_bytes());
                    }
                }
            }
            m
        })
        .collect();
    let got = exchange(comm, 5 << 32, parts, &mut st)?;
    // The whole sequence of this rank's heads: [nb, seq, hw, d] (varlen packed); LSE [nb, hw, seq].
    let (tq, tk): (usize, usize) = (ss.iter().map(|s| s.sq).sum(), ss.iter().map(|s| s.skv).sum());
    let (rows_q, rows_k) = if varlen { (tq, tk) } else { (p.seq_q as usize, p.seq_kv as usize) };
    // Global row (within its batch entry) of each local row of `loc`, per batch entry.
    let global_rows = |loc: &Local, lens: &dyn Fn(&Seq) -> usize| -> Vec<usize> {
        let mut out = vec![0; loc.rows];
        let mut goff = 0;
        for (si, s) in ss.iter().enumerate() {
            for &(seg, loff) in &loc.pieces[si] {
                for i in 0..seg.len {
                    out[loff + i] = goff + seg.start + i;
                }
            }
            if varlen {
                goff += lens(s);
            }
        }
        out
    };
    let mut fq = vec![0u8; nb * rows_q * hw * d * e];
    let mut fdo = fq.clone();
    let mut fo = fq.clone();
    let mut fk = vec![0u8; nb * rows_k * hkw * d * e];
    let mut fv = fk.clone();
    let mut flse = vec![0f32; nb * hw * rows_q];
    for (src, m) in got.iter().enumerate() {
        let (lq, lk) = (&locs_q[src], &locs_k[src]);
        let (gq, gk) = (global_rows(lq, &|s| s.sq), global_rows(lk, &|s| s.skv));
        let (sq_, sk_) = (nb * lq.rows * hw * d * e, nb * lk.rows * hkw * d * e);
        if m.len() != 3 * sq_ + 2 * sk_ + nb * lq.rows * hw * 4 {
            return Err(CpError::Comm {
                rank,
                why: format!("an all-to-all part of {} bytes from rank {src}", m.len()),
            });
        }
        let mut at = 0;
        let mut take = |n: usize| {
            let r = &m[at..at + n];
            at += n;
            r
        };
        let (pq, pk, pv, pdo, po) = (take(sq_), take(sk_), take(sk_), take(sq_), take(sq_));
        let pl = Dtype::F32.decode(take(nb * lq.rows * hw * 4));
        let rq = hw * d * e;
        for b in 0..nb {
            for (lr, &gr) in gq.iter().enumerate() {
                let (from, to) = ((b * lq.rows + lr) * rq, (b * rows_q + gr) * rq);
                fq[to..to + rq].copy_from_slice(&pq[from..from + rq]);
                fdo[to..to + rq].copy_from_slice(&pdo[from..from + rq]);
                fo[to..to + rq].copy_from_slice(&po[from..from + rq]);
                for hh in 0..hw {
                    flse[(b * hw + hh) * rows_q + gr] = pl[(b * hw + hh) * lq.rows + lr];
                }
            }
            let rk = hkw * d * e;
            for (lr, &gr) in gk.iter().enumerate() {
                let (from, to) = ((b * lk.rows + lr) * rk, (b * rows_k + gr) * rk);
                fk[to..to + rk].copy_from_slice(&pk[from..from + rk]);
                fv[to..to + rk].copy_from_slice(&pv[from..from + rk]);
            }
        }
    }
    let started = Instant::now();
    let up = |bytes: &[u8]| -> Result<DeviceBuffer, CpError> {
        let b = kernels.alloc(bytes.len() as u64).map_err(&err)?;
        b.write_bytes(bytes).map_err(&err)?;
        Ok(b)
    };
    let (bq, bk, bv, bdo, bo) = (up(&fq)?, up(&fk)?, up(&fv)?, up(&fdo)?, up(&fo)?);
    let blse = kernels.upload_as(Dtype::F32, &flse).map_err(&err)?;
    let view = |b, heads, rows| TensorView::device(b, p.dtype, [nb, rows, heads, d]).map_err(&err);
    let (qv, kv, vv, dov, ov) = (
        view(&bq, hw, rows_q)?,
        view(&bk, hkw, rows_k)?,
        view(&bv, hkw, rows_k)?,
        view(&bdo, hw, rows_q)?,
        view(&bo, hw, rows_q)?,
    );
    let lse_view = crate::attn::LseView::vm(&blse, nb, hw, rows_q).map_err(&err)?;
    let mut opts =
        AttnOpts::new().softmax_scale(p.softmax_scale()).window_size(p.window.0, p.window.1).causal(p.causal);
    if p.softcap > 0.0 {
        opts = opts.softcap(p.softcap);
    }
    let bwd = crate::attn::BwdOpts::new();
    let (gq, gk, gv) = match p.varlen {
        Some(vl) => {
            let (cq, ck) = cu_seqlens(kernels, &vl).map_err(&err)?;
            let (dq, dk, dv) = (
                kernels.alloc((fq.len()) as u64).map_err(&err)?,
                kernels.alloc(fk.len() as u64).map_err(&err)?,
                kernels.alloc(fk.len() as u64).map_err(&err)?,
            );
            let vm =
                |b, heads, rows| crate::attn::TensorViewMut::device(b, p.dtype, [nb, rows, heads, d]).map_err(&err);
            kernels
                .flash_attn_varlen_backward_into(
                    &qv,
                    &kv,
                    &vv,
                    &cq,
                    &ck,
                    p.seq_q as usize,
                    p.seq_kv as usize,
                    &ov,
                    &lse_view,
                    &dov,
                    &mut vm(&dq, hw, rows_q)?,
                    &mut vm(&dk, hkw, rows_k)?,
                    &mut vm(&dv, hkw, rows_k)?,
                    &opts,
                    &bwd,
                )
                .map_err(&err)?;
            let read = |b: &DeviceBuffer, n: usize| -> Result<Vec<f32>, CpError> {
                Ok(p.dtype.decode(&b.read_bytes(n).map_err(&err)?))
            };
            (read(&dq, fq.len())?, read(&dk, fk.len())?, read(&dv, fk.len())?)
        }
        None => {
            let g = kernels.flash_attn_backward(&qv, &kv, &vv, &ov, &lse_view, &dov, &opts, &bwd).map_err(&err)?;
            (g.dq.to_vec_f32().map_err(&err)?, g.dk.to_vec_f32().map_err(&err)?, g.dv.to_vec_f32().map_err(&err)?)
        }
    };
    st.compute_s = started.elapsed().as_secs_f64();
    st.blocks.push(BlockKind::Full);
    stats.steps.push(st);
    // Back: to rank `peer`, its rows of this rank's heads of dq, dk, dv in f32.
    let mut st = StepStats::default();
    let parts: Vec<Vec<u8>> = (0..world)
        .map(|peer| {
            let (lq, lk) = (&locs_q[peer], &locs_k[peer]);
            let mut m = Vec::new();
            for b in 0..nb {
                for gr in global_rows(lq, &|s| s.sq) {
                    let at = (b * rows_q + gr) * hw * d;
                    gq[at..at + hw * d].iter().for_each(|x| m.extend_from_slice(&x.to_le_bytes()));
                }
            }
            for g in [&gk, &gv] {
                for b in 0..nb {
                    for gr in global_rows(lk, &|s| s.skv) {
                        let at = (b * rows_k + gr) * hkw * d;
                        g[at..at + hkw * d].iter().for_each(|x| m.extend_from_slice(&x.to_le_bytes()));
                    }
                }
            }
            m
        })
        .collect();
    let got = exchange(comm, 6 << 32, parts, &mut st)?;
    let mut dq = vec![0f32; nb * mq.rows * h * d];
    let mut dk = vec![0f32; nb * mk.rows * hk * d];
    let mut dv = dk.clone();
    for (src, m) in got.iter().enumerate() {
        let f = Dtype::F32.decode(m);
        let (nq_, nk_) = (nb * mq.rows * hw * d, nb * mk.rows * hkw * d);
        if f.len() != nq_ + 2 * nk_ {
            return Err(CpError::Comm { rank, why: format!("a returned part of {} bytes from rank {src}", m.len()) });
        }
        for (row, chunk) in f[..nq_].chunks(hw * d).enumerate() {
            let at = (row * h + src * hw) * d;
            dq[at..at + hw * d].copy_from_slice(chunk);
        }
        for (i, out) in [&mut dk, &mut dv].into_iter().enumerate() {
            for (row, chunk) in f[nq_ + i * nk_..nq_ + (i + 1) * nk_].chunks(hkw * d).enumerate() {
                let at = (row * hk + src * hkw) * d;
                out[at..at + hkw * d].copy_from_slice(chunk);
            }
        }
    }
    stats.steps.push(st);
    let o_dev = kernels.upload_as(p.dtype, o).map_err(&err)?;
    let d_sinks = sinks_share(p, nb, mq.rows, &o_dev, d_o, lse, sinks).map_err(&err)?;
    Ok(CpGrads { dq, dk, dv, d_sinks, stats })
}

/// The inverse of [`shard`]: the global rows of a tensor from every rank's local rows (rank
/// order), e.g. dq (`keys` false, `heads` the query heads) or dk and dv (`keys` true).
pub fn unshard(p: &Problem, strategy: Strategy, keys: bool, heads: usize, parts: &[Vec<f32>]) -> Vec<f32> {
    let world = parts.len();
    let row = heads * p.head_dim as usize;
    let total: usize = seqs(p).iter().map(|s| s.nb * if keys { s.skv } else { s.sq }).sum();
    let mut out = vec![0f32; total * row];
    for (rank, part) in parts.iter().enumerate() {
        let mut global_off = 0;
        let mut n = 0;
        for s in seqs(p) {
            let len = if keys { s.skv } else { s.sq };
            for b in 0..s.nb {
                for seg in segments(strategy, len, world, rank) {
                    let at = (global_off + b * len + seg.start) * row;
                    out[at..at + seg.len * row].copy_from_slice(&part[n..n + seg.len * row]);
                    n += seg.len * row;
                }
            }
            global_off += s.nb * len;
        }
    }
    out
}

/// The whole problem's gradients from every rank's [`CpGrads`] (rank order): dq like q, dk and
/// dv like k and v (the single-device layouts), and the sinks' gradient summed over the ranks.
pub fn gather_grads(p: &Problem, strategy: Strategy, grads: &[CpGrads]) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (h, hk) = (p.heads as usize, p.kv_heads() as usize);
    let pick = |f: fn(&CpGrads) -> &Vec<f32>| grads.iter().map(|g| f(g).clone()).collect::<Vec<_>>();
    let dq = unshard(p, strategy, false, h, &pick(|g| &g.dq));
    let dk = unshard(p, strategy, true, hk, &pick(|g| &g.dk));
    let dv = unshard(p, strategy, true, hk, &pick(|g| &g.dv));
    let mut ds = vec![0f32; if p.sinks { h } else { 0 }];
    for g in grads {
        for (a, b) in ds.iter_mut().zip(&g.d_sinks) {
            *a += *b;
        }
    }
    (dq, dk, dv, ds)
}

/// Decode over a KV cache sharded by sequence: every rank holds all of `q` (`[batch, seq_q,
/// heads, head_dim]`, the new tokens, bottom-right aligned to the `p.seq_kv` cached keys) and its
/// contiguous slice of the cache (`k_shard`, `v_shard`: `[batch, n_r, heads_kv, head_dim]`, the
/// ring slice of [`segments`]). Each rank computes its partial state (the decode kernel over its
/// slice, or a masked prefill block where a window leaves some rows without keys), the states
/// are all-gathered (f32) and merged in rank order, so every rank returns the whole `o` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    kernels: &Kernels,
    comm: &dyn Communicator,
    p: &Problem,
    q: &DeviceBuffer,
    k_shard: &DeviceBuffer,
    v_shard: &DeviceBuffer,
    sinks: &[f32],
) -> Result<CpOutput, CpError> {
    let (rank, world) = (comm.rank(), comm.world());
    check(p, Strategy::Ring, world, sinks)?;
    if p.varlen.is_some() {
        return Err(CpError::Layout("sharded decode takes a dense batch (no packed sequences)".into()));
    }
    let err = attn_err(rank);
    let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let seg = segments(Strategy::Ring, skv, world, rank)[0];
    let mut st = StepStats::default();
    let started = Instant::now();
    let g = skv as i64 - sq as i64;
    let diag = -(seg.start as i64) + g;
    let plan = plan_block(sq, seg.len, diag, window(p));
    let mut acc = Acc::new(b, sq, h, d, false);
    if let Some(bp) = plan {
        st.blocks.push(bp.kind);
        st.visible_pairs = bp.visible * (b * h) as u64;
        let mut opts = AttnOpts::new().softmax_scale(p.softmax_scale());
        if p.softcap > 0.0 {
            opts = opts.softcap(p.softcap);
        }
        let side = |w: Option<i64>| w.map(|w| u32::try_from(w).unwrap_or(u32::MAX));
        let opts = opts.window(side(bp.left), side(bp.right));
        let qv = TensorView::device(q, p.dtype, [b, sq, h, d]).map_err(&err)?;
        let (o, lse) = if bp.rows == sq && matches!(p.head_dim, 64 | 128) {
            // The decode kernel over the slice's first `keys` keys.
            let mut kc = crate::attn::TensorViewMut::device(k_shard, p.dtype, [b, seg.len, hk, d]).map_err(&err)?;
            let mut vc = crate::attn::TensorViewMut::device(v_shard, p.dtype, [b, seg.len, hk, d]).map_err(&err)?;
            let lens = kernels.index_tensor(&vec![bp.keys as u32; b], None).map_err(&err)?;
            kernels.flash_attn_with_kvcache(&qv, &mut kc, &mut vc, None, None, &lens, None, &opts).map_err(&err)?
        } else {
            let kr = Region { buf: k_shard, batch_rows: seg.len, heads: hk };
            let vr = Region { buf: v_shard, batch_rows: seg.len, heads: hk };
            let qr = Region { buf: q, batch_rows: sq, heads: h };
            let qv = qr.view(p.dtype, d, 0, b, 0, bp.rows).map_err(&err)?;
            let kv = kr.view(p.dtype, d, 0, b, 0, bp.keys).map_err(&err)?;
            let vv = vr.view(p.dtype, d, 0, b, 0, bp.keys).map_err(&err)?;
            kernels.flash_attn(&qv, &kv, &vv, &opts).map_err(&err)?
        };
        let (o, lse) = (o.to_vec_f32().map_err(&err)?, lse.to_vec_f32().map_err(&err)?);
        acc.merge(0, b, 0, bp.rows, &o, &lse);
    } else {
        st.blocks.push(BlockKind::Skipped);
    }
    st.compute_s = started.elapsed().as_secs_f64();
    // All-gather the partial states and merge them in rank order (the same on every rank).
    let mut msg = Dtype::F32.encode(&acc.o);
    msg.extend(Dtype::F32.encode(&acc.lse));
    st.bytes_sent = msg.len() as u64 * (world as u64 - 1);
    let states = all_gather(comm, 3 << 32, msg)?;
    st.bytes_received = states.iter().enumerate().filter(|(i, _)| *i != rank).map(|(_, m)| m.len() as u64).sum();
    let mut merged = Acc::new(b, sq, h, d, false);
    let n_o = b * sq * h * d;
    for (src, m) in states.iter().enumerate() {
        let f = Dtype::F32.decode(m);
        if f.len() != n_o + b * sq * h {
            return Err(CpError::Comm { rank, why: format!("a partial state of {} bytes from rank {src}", m.len()) });
        }
        merged.merge(0, b, 0, sq, &f[..n_o], &f[n_o..]);
    }
    if p.sinks {
        merged.add_sinks(b, sinks, 0);
    }
    Ok(CpOutput { o: merged.o, lse: merged.lse, stats: CpStats { steps: vec![st] } })
}

/// The bytes rank `rank` sends and receives in [`attention_backward`]. Ring and zigzag: the
/// forward's K/V traffic ([`analytic_bytes`]) plus, when `world > 1`, one f32 dK/dV sum of every
/// K/V block in each direction: `2 · Hk · d · 4 · (B · seq_kv)` (varlen: the keys of every
/// sequence). Ulysses: to each other rank `p`, this rank's `B · n_r` rows of `p`'s heads of q,
/// dO, O (`3 · H/W · d · e`) and LSE (`4 · H/W`) and its keys' rows of k and v
/// (`2 · Hk/W · d · e`); back, `p`'s rows of this rank's heads of dq (`H/W · d · 4`) and its keys'
/// rows of dk, dv (`2 · Hk/W · d · 4`).
pub fn analytic_backward_bytes(p: &Problem, strategy: Strategy, world: usize, rank: usize) -> (u64, u64) {
    if strategy == Strategy::Ulysses {
        // Out: q, dO, O (e bytes) and LSE (4) of this rank's rows and k, v of its keys, for each
        // other rank's heads; back: that rank's rows of this rank's heads of dq, dk, dv (f32).
        let (hw, hkw) = (p.heads as u64 / world as u64, p.kv_heads() as u64 / world as u64);
        let (d, e) = (p.head_dim as u64, p.dtype.size_bytes());
        let held = |r: usize, keys: bool| -> u64 {
            seqs(p)
                .iter()
                .map(|s| {
                    let len = if keys { s.skv } else { s.sq };
                    s.nb as u64 * segments(strategy, len, world, r).iter().map(|g| g.len as u64).sum::<u64>()
                })
                .sum()
        };
        let out = |q: u64, k: u64| q * hw * (3 * d * e + 4) + 2 * k * hkw * d * e;
        let back = |q: u64, k: u64| q * hw * d * 4 + 2 * k * hkw * d * 4;
        let (qr, kr) = (held(rank, false), held(rank, true));
        let (mut sent, mut recv) = (0, 0);
        for peer in (0..world).filter(|&x| x != rank) {
            let (qp, kp) = (held(peer, false), held(peer, true));
            sent += out(qr, kr) + back(qp, kp);
            recv += out(qp, kp) + back(qr, kr);
        }
        return (sent, recv);
    }
    let (sent, recv) = analytic_bytes(p, strategy, world, rank, false);
    if world <= 1 {
        return (sent, recv);
    }
    let keys: u64 = seqs(p).iter().map(|s| (s.nb * s.skv) as u64).sum();
    let sums = 2 * p.kv_heads() as u64 * p.head_dim as u64 * 4 * keys;
    (sent + sums, recv + sums)
}

/// The communication volume of the module docs, per rank: `(sent, received)` bytes of `strategy`
/// over `world` ranks (`decode`: the sharded decode's all-gather). Equals what [`CpStats`]
/// counts on every rank.
pub fn analytic_bytes(p: &Problem, strategy: Strategy, world: usize, rank: usize, decode: bool) -> (u64, u64) {
    let (h, hk, d) = (p.heads as u64, p.kv_heads() as u64, p.head_dim as u64);
    let e = p.dtype.size_bytes();
    let w = world as u64;
    let ss = seqs(p);
    let held = |lens: &dyn Fn(&Seq) -> usize, r: usize, s: Strategy| -> u64 {
        ss.iter().map(|q| q.nb as u64 * segments(s, lens(q), world, r).iter().map(|g| g.len as u64).sum::<u64>()).sum()
    };
    let total = |lens: &dyn Fn(&Seq) -> usize| -> u64 { ss.iter().map(|q| (q.nb * lens(q)) as u64).sum() };
    if decode {
        let b = p.batch as u64;
        let x = (w - 1) * b * p.seq_q as u64 * h * (d + 1) * 4;
        return (x, x);
    }
    match strategy {
        Strategy::Ring | Strategy::Zigzag => {
            if world == 1 {
                return (0, 0);
            }
            let kv = |r: usize| held(&|s| s.skv, r, strategy);
            let skv = total(&|s| s.skv);
            let unit = 2 * hk * d * e;
            (unit * (skv - kv((rank + 1) % world)), unit * (skv - kv(rank)))
        }
        Strategy::Ulysses => {
            let (hw, hkw) = (h / w, hk / w);
            let q_r = held(&|s| s.sq, rank, strategy);
            let k_r = held(&|s| s.skv, rank, strategy);
            let mut sent = 0;
            let mut recv = 0;
            for peer in (0..world).filter(|&x| x != rank) {
                let q_p = held(&|s| s.sq, peer, strategy);
                let k_p = held(&|s| s.skv, peer, strategy);
                sent += (q_r * hw + 2 * k_r * hkw) * d * e + q_p * hw * (d * 4 + 4);
                recv += (q_p * hw + 2 * k_p * hkw) * d * e + q_r * hw * (d * 4 + 4);
            }
            (sent, recv)
        }
    }
}

/// Query-key pairs each rank sees at each step (`[rank][step]`, all batch entries and heads),
/// from the block geometry alone (nothing runs): the work of the overlap model.
pub fn work(p: &Problem, strategy: Strategy, world: usize) -> Vec<Vec<u64>> {
    let ss = seqs(p);
    let h = p.heads as u64;
    match strategy {
        Strategy::Ring | Strategy::Zigzag => (0..world)
            .map(|rank| {
                (0..world)
                    .map(|t| {
                        let owner = (rank + world - t) % world;
                        let mut pairs = 0;
                        for s in &ss {
                            let g = s.skv as i64 - s.sq as i64;
                            for qs in segments(strategy, s.sq, world, rank) {
                                for ks in segments(strategy, s.skv, world, owner) {
                                    let diag = qs.start as i64 - ks.start as i64 + g;
                                    if let Some(bp) = plan_block(qs.len, ks.len, diag, window(p)) {
                                        pairs += bp.visible * s.nb as u64 * h;
                                    }
                                }
                            }
                        }
                        pairs
                    })
                    .collect()
            })
            .collect(),
        Strategy::Ulysses => {
            let mut total = 0;
            for s in &ss {
                if let Some(bp) = plan_block(s.sq, s.skv, s.skv as i64 - s.sq as i64, window(p)) {
                    total += bp.visible * s.nb as u64 * h;
                }
            }
            (0..world).map(|_| vec![total / world as u64]).collect()
        }
    }
}

/// The link and device of the overlap model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes per second one rank sends to another (one direction), in GB/s (10⁹ bytes).
    pub gbps: f64,
    /// Sustained attention throughput of one device in TFLOP/s (4 · head_dim FLOPs per
    /// query-key pair: two GEMMs).
    pub tflops: f64,
}

impl Link {
    /// NVLink 4 of H100/H200 (900 GB/s both ways: 450 one way), FA2-class bf16 attention
    /// (400 TFLOP/s).
    pub const NVLINK_H100: Link = Link { gbps: 450.0, tflops: 400.0 };
    /// PCIe 5.0 x16 (64 GB/s one way), the same device.
    pub const PCIE5: Link = Link { gbps: 64.0, tflops: 400.0 };
}

/// The overlap model's estimate for one strategy ([`model`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// The strategy modelled.
    pub strategy: Strategy,
    /// Modelled seconds: ring and zigzag the sum over steps of the slowest rank's
    /// `max(compute, transfer)` (the transfer of the next block overlaps the compute); Ulysses
    /// the two all-to-alls plus the compute.
    pub seconds: f64,
    /// All the work spread evenly over the ranks, no communication.
    pub ideal_seconds: f64,
    /// `ideal_seconds / seconds`.
    pub fraction: f64,
    /// The most bytes one rank sends.
    pub max_bytes_sent: u64,
}

/// The fraction of ideal speed `strategy` reaches on `world` ranks over `link` (see
/// [`Estimate`]), or why the strategy does not apply (Ulysses' head rule).
pub fn model(p: &Problem, strategy: Strategy, world: usize, link: Link) -> Result<Estimate, CpError> {
    check(p, strategy, world, &vec![0.0; if p.sinks { p.heads as usize } else { 0 }])?;
    let flop = 4.0 * p.head_dim as f64;
    let rate = link.tflops * 1e12;
    let bw = link.gbps * 1e9;
    let w = work(p, strategy, world);
    let total: u64 = w.iter().flatten().sum();
    let ideal = total as f64 * flop / rate / world as f64;
    let bytes: Vec<u64> = (0..world).map(|r| analytic_bytes(p, strategy, world, r, false).0).collect();
    let max_bytes_sent = bytes.iter().copied().max().unwrap_or(0);
    let seconds = match strategy {
        Strategy::Ring | Strategy::Zigzag => {
            let kv = |r: usize| -> u64 {
                let ss = seqs(p);
                let rows: u64 = ss
                    .iter()
                    .map(|s| {
                        s.nb as u64 * segments(strategy, s.skv, world, r).iter().map(|g| g.len as u64).sum::<u64>()
                    })
                    .sum();
                rows * 2 * p.kv_heads() as u64 * p.head_dim as u64 * p.dtype.size_bytes()
            };
            (0..world)
                .map(|t| {
                    (0..world)
                        .map(|r| {
                            let compute = w[r][t] as f64 * flop / rate;
                            let transfer = if t + 1 < world { kv((r + world - t) % world) as f64 / bw } else { 0.0 };
                            compute.max(transfer)
                        })
                        .fold(0.0, f64::max)
                })
                .sum()
        }
        Strategy::Ulysses => {
            let compute = w.iter().map(|r| r[0]).max().unwrap_or(0) as f64 * flop / rate;
            compute + max_bytes_sent as f64 / bw
        }
    };
    let fraction = if seconds > 0.0 { ideal / seconds } else { 1.0 };
    Ok(Estimate { strategy, seconds, ideal_seconds: ideal, fraction, max_bytes_sent })
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn segments_cover_the_sequence_once() {
        for s in Strategy::ALL {
            for world in 1..6 {
                for len in [0, 1, 7, 64, 100] {
                    let mut seen = vec![0; len];
                    for r in 0..world {
                        for g in segments(s, len, world, r) {
                            for x in &mut seen[g.start..g.start + g.len] {
                                *x += 1;
                            }
                        }
                    }
                    assert!(seen.iter().all(|&c| c == 1), "{s} world {world} len {len}");
                }
            }
        }
        // Zigzag: rank 0 of 2 holds pieces 0 and 3 of 4.
        assert_eq!(
            segments(Strategy::Zigzag, 8, 2, 0),
            vec![Segment { start: 0, len: 2 }, Segment { start: 6, len: 2 }]
        );
    }

    /// Every block plan sees exactly the pairs of the global rule, through the kernels' rule
    /// ([`kernels_gpu::mask::key_range`]) on the launched prefixes.
    pub fn block_plans_reproduce_the_global_mask() {
        let sides = [None, Some(0), Some(1), Some(3), Some(9)];
        for lq in 1..7usize {
            for lk in 1..7usize {
                for diag in -9i64..12 {
                    for wl in sides {
                        for wr in sides {
                            let want = |a: i64, b: i64| {
                                wl.is_none_or(|l| b >= a + diag - l) && wr.is_none_or(|r| b <= a + diag + r)
                            };
                            let plan = plan_block(lq, lk, diag, (wl, wr));
                            let any = (0..lq as i64).any(|a| (0..lk as i64).any(|b| want(a, b)));
                            let Some(bp) = plan else {
                                assert!(!any, "skipped a visible block: lq {lq} lk {lk} D {diag} w {wl:?},{wr:?}");
                                continue;
                            };
                            assert!(bp.left.is_none_or(|l| l >= 0) && bp.right.is_none_or(|r| r >= 0));
                            let side = |w: Option<i64>| w.map_or(-1, |w| w as i32);
                            for a in 0..lq as i64 {
                                let (s, e) = if (a as usize) < bp.rows {
                                    kernels_gpu::mask::key_range(
                                        false,
                                        side(bp.left),
                                        side(bp.right),
                                        a as u32,
                                        bp.rows as u32,
                                        bp.keys as u32,
                                    )
                                } else {
                                    (0, 0)
                                };
                                for b in 0..lk as i64 {
                                    assert_eq!(
                                        want(a, b),
                                        b >= s && b < e,
                                        "lq {lq} lk {lk} D {diag} w {wl:?},{wr:?} a {a} b {b} plan {bp:?}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The model at ring-flash-attention's setting (8 ranks, causal, a long sequence): plain
    /// ring about half of ideal (its last rank works every step), zigzag close to ideal.
    pub fn overlap_model_orders_the_strategies() {
        let p = Problem {
            batch: 1,
            heads: 32,
            heads_kv: Some(8),
            seq_q: 65536,
            seq_kv: 65536,
            head_dim: 128,
            causal: true,
            dtype: Dtype::Bf16,
            ..Problem::default()
        };
        let ring = model(&p, Strategy::Ring, 8, Link::NVLINK_H100).unwrap();
        let zig = model(&p, Strategy::Zigzag, 8, Link::NVLINK_H100).unwrap();
        let uly = model(&p, Strategy::Ulysses, 8, Link::NVLINK_H100).unwrap();
        assert!((0.5..0.6).contains(&ring.fraction), "{ring:?}");
        assert!(zig.fraction > 0.9, "{zig:?}");
        assert!(uly.fraction > 0.8 && uly.fraction < 1.0, "{uly:?}");
        // Over PCIe too, no strategy is modelled faster than ideal.
        for s in Strategy::ALL {
            let e = model(&p, s, 8, Link::PCIE5).unwrap();
            assert!(e.fraction <= 1.0 + 1e-12 && e.fraction > 0.0);
        }
        // One rank: ideal.
        assert!((model(&p, Strategy::Ring, 1, Link::NVLINK_H100).unwrap().fraction - 1.0).abs() < 1e-12);
        // The work adds up to the causal triangle.
        let w = work(&p, Strategy::Zigzag, 8);
        assert_eq!(w.iter().flatten().sum::<u64>(), 32 * 65536 * 65537 / 2);
    }

    pub fn strategies_parse_and_print() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>(), Ok(s));
        }
        assert!("stripe".parse::<Strategy>().unwrap_err().contains("ring, zigzag or ulysses"));
    }
}
