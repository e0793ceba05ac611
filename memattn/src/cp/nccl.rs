//! Context-parallel ranks over NCCL (feature `nccl`): [`world`] makes one [`super::Communicator`] per
//! CUDA stream (one GPU each) with cudarc's `nccl` module, NCCL loaded at run time as the
//! driver is, so a build needs no NCCL.
//!
//! The transport is [`NcclP2p`]: each [`GroupedP2p::group`] copies its sends to device buffers,
//! posts every `ncclSend`/`ncclRecv` between `ncclGroupStart` and `ncclGroupEnd` on the rank's
//! stream, waits for the stream and copies what arrived back to the host. [`Grouped`] above it
//! carries the strategies' messages (queued sends, counts, headers, payloads), the same adapter
//! the tests run on [`super::Rendezvous`], which enforces NCCL's rules in memory. The messages
//! pass through host memory, as the in-process ranks' do: the attention code is written once
//! against host bytes, so this is NCCL's transport, not yet its device-to-device speed.

use super::{CpError, Grouped, GroupedP2p};
use cudarc::driver::CudaStream;
use cudarc::nccl::{group_end, group_start, Comm};
use std::sync::{Arc, Mutex};

/// The NCCL library names cudarc tries; [`world`] checks one loads before any NCCL call (cudarc
/// panics when none does).
pub fn library_candidates() -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates("nccl");
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// Whether an NCCL library loads (one of [`library_candidates`]).
pub fn available() -> bool {
    library_candidates().iter().any(|name| {
        // SAFETY: loading NCCL runs its initialisers, as cudarc's own loading does.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// One rank's NCCL communicator and stream.
struct Inner {
    comm: Comm,
    stream: Arc<CudaStream>,
}

/// NCCL point-to-point transfers of one rank (module docs).
pub struct NcclP2p {
    rank: usize,
    world: usize,
    inner: Mutex<Inner>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use it at
// once; the mutex serialises every call, and cudarc binds the stream's context on each call.
unsafe impl Send for NcclP2p {}
unsafe impl Sync for NcclP2p {}

fn nccl_err(rank: usize, what: &str, e: impl std::fmt::Debug) -> CpError {
    CpError::Comm { rank, why: format!("NCCL: {what}: {e:?}") }
}

/// The ranks of one world in this process, rank `i` on `streams[i]` (one GPU each;
/// `ncclCommInitAll`). Fails with the library names tried when NCCL does not load.
pub fn world(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Grouped<NcclP2p>>, CpError> {
    if !available() {
        return Err(CpError::Comm {
            rank: 0,
            why: format!(
                "no NCCL library loads (tried {}); pip's nvidia-nccl-cu12 ships libnccl.so.2: \
                 put a libnccl.so link to it on LD_LIBRARY_PATH",
                library_candidates().join(", ")
            ),
        });
    }
    let n = streams.len();
    let comms = Comm::from_devices(streams.clone()).map_err(|e| nccl_err(0, "ncclCommInitAll", e))?;
    Ok(comms
        .into_iter()
        .zip(streams)
        .enumerate()
        .map(|(rank, (comm, stream))| {
            Grouped::new(NcclP2p { rank, world: n, inner: Mutex::new(Inner { comm, stream }) })
        })
        .collect())
}

impl NcclP2p {
    /// Sends `bytes` bytes of a known pattern to this rank itself through NCCL (one group of a
    /// send and a receive) and checks what arrives: the transport's own path (device copies,
    /// the group, the stream, the copies back) on one GPU, where a world of one rank otherwise
    /// transfers nothing.
    pub fn check_loopback(&self, bytes: usize) -> Result<(), CpError> {
        let data: Vec<u8> = (0..bytes).map(|i| (i.wrapping_mul(131) ^ (i >> 8)) as u8).collect();
        let got = self.group(&[(self.rank, &data)], &[(self.rank, bytes)])?;
        match got.first() {
            Some(g) if *g == data => Ok(()),
            Some(g) => Err(CpError::Comm {
                rank: self.rank,
                why: format!(
                    "NCCL loopback: {} of {bytes} bytes differ",
                    g.iter().zip(&data).filter(|(a, b)| a != b).count() + g.len().abs_diff(bytes)
                ),
            }),
            None => Err(CpError::Comm { rank: self.rank, why: "NCCL loopback: nothing received".into() }),
        }
    }
}

impl GroupedP2p for NcclP2p {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn group(&self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>, CpError> {
        let rank = self.rank;
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let stream = &inner.stream;
        let peer = |p: usize| {
            i32::try_from(p).map_err(|_| CpError::Comm { rank, why: format!("rank {p} is past NCCL's limit") })
        };
        let mut send_bufs = Vec::new();
        for &(p, data) in sends.iter().filter(|(_, d)| !d.is_empty()) {
            send_bufs.push((peer(p)?, stream.clone_htod(data).map_err(|e| nccl_err(rank, "copying a send", e))?));
        }
        let mut recv_bufs = Vec::new();
        for &(p, n) in recvs {
            recv_bufs.push(if n == 0 {
                None
            } else {
                Some((peer(p)?, stream.alloc_zeros::<u8>(n).map_err(|e| nccl_err(rank, "allocating a receive", e))?))
            });
        }
        group_start().map_err(|e| nccl_err(rank, "ncclGroupStart", e))?;
        let mut posted = Ok(());
        for (p, buf) in &send_bufs {
            if let Err(e) = inner.comm.send(buf, *p) {
                posted = Err(nccl_err(rank, "ncclSend", e));
                break;
            }
        }
        if posted.is_ok() {
            for (p, buf) in recv_bufs.iter_mut().flatten() {
                if let Err(e) = inner.comm.recv(buf, *p) {
                    posted = Err(nccl_err(rank, "ncclRecv", e));
                    break;
                }
            }
        }
        // The group is closed whatever happened inside it.
        let ended = group_end().map_err(|e| nccl_err(rank, "ncclGroupEnd", e));
        posted?;
        ended?;
        stream.synchronize().map_err(|e| nccl_err(rank, "waiting for the group", e))?;
        recv_bufs
            .into_iter()
            .map(|b| match b {
                None => Ok(Vec::new()),
                Some((_, buf)) => stream.clone_dtoh(&buf).map_err(|e| nccl_err(rank, "copying a receive back", e)),
            })
            .collect()
    }
}
