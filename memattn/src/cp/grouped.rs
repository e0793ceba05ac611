//! [`Communicator`] over a transport whose transfers are *grouped* and *rendezvous*, as NCCL's:
//! a send completes only when the peer has posted the matching receive, the sizes must be agreed
//! beforehand, transfers between two ranks match in the order they were posted, and the
//! transfers posted in one group progress together (a group completes when all of them have).
//!
//! [`Grouped`] turns such a transport into the [`Communicator`] the attention code is written
//! against:
//! - a send is queued on the rank (it returns at once, as the trait promises);
//! - a receive of a message that has not arrived yet *flushes*: in three groups it sends every
//!   queued message's count, then their `(tag, length)` headers, then the payloads, to the
//!   peers they are for, while receiving the same three from the peer asked for; what arrives
//!   is kept by `(peer, tag)`;
//! - [`Communicator::exchange_all`] (every collective) flushes to and from every other rank at
//!   once.
//!
//! This is free of deadlock when the ranks' calls pair up: a rank's receive from `p` flushes
//! while `p` flushes to it (the ring: every rank sends to `r + 1`, then receives from `r - 1`;
//! sends queued since are carried along), and collectives are called by every rank. Every send
//! must be followed by a receive or a collective on its rank (the strategies of [`super`] are).
//!
//! [`Rendezvous`] is that transport in memory, with NCCL's rules enforced (a send is complete
//! only once received; a size that differs from the sender's is an error; a group that would
//! wait forever fails after a timeout instead of hanging), so the adapter above, which NCCL
//! runs ([`super::nccl`], feature `nccl`), is tested on one CPU with every strategy.

use super::{Communicator, CpError};
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A transport of grouped, rendezvous transfers (NCCL's point-to-point model).
pub trait GroupedP2p: Send + Sync {
    /// This rank's index, `0..world`.
    fn rank(&self) -> usize;
    /// Ranks in the world.
    fn world(&self) -> usize;
    /// Runs one group: posts every send (`(peer, bytes)`) and every receive (`(peer, bytes
    /// expected)`, the sizes agreed with the peers), and returns once all have completed, the
    /// received buffers in `recvs`' order. Zero-length transfers are not posted on either side.
    fn group(&self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>, CpError>;
}

/// A message queued on its rank until the next flush: peer, tag, bytes.
type Queued = (usize, u64, Vec<u8>);

#[derive(Default)]
struct State {
    queued: Vec<Queued>,
    inbox: HashMap<(usize, u64), VecDeque<Vec<u8>>>,
}

/// A [`Communicator`] over a [`GroupedP2p`] transport (module docs).
pub struct Grouped<T> {
    p2p: T,
    state: Mutex<State>,
}

impl<T: GroupedP2p> Grouped<T> {
    /// A communicator over `p2p`, with nothing queued.
    pub fn new(p2p: T) -> Self {
        Grouped { p2p, state: Mutex::new(State::default()) }
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.p2p
    }

    /// Sends every queued message for a peer in `to` (each peer gets a count, possibly 0) and
    /// receives what each peer in `from` sends, into the inbox.
    fn flush(&self, st: &mut State, to: &[usize], from: &[usize]) -> Result<(), CpError> {
        let rank = self.p2p.rank();
        let (mine, kept): (Vec<Queued>, Vec<Queued>) =
            std::mem::take(&mut st.queued).into_iter().partition(|m| to.contains(&m.0));
        st.queued = kept;
        let for_peer = |p: usize| mine.iter().filter(move |m| m.0 == p);
        // (1) How many messages each peer gets.
        let counts: Vec<[u8; 8]> = to.iter().map(|&p| (for_peer(p).count() as u64).to_le_bytes()).collect();
        let sends: Vec<(usize, &[u8])> = to.iter().zip(&counts).map(|(&p, c)| (p, &c[..])).collect();
        let recvs: Vec<(usize, usize)> = from.iter().map(|&p| (p, 8)).collect();
        let got = self.p2p.group(&sends, &recvs)?;
        let n_in: Vec<usize> = got.iter().map(|c| u64_at(c, 0) as usize).collect();
        // (2) Each message's tag and length.
        let headers: Vec<Vec<u8>> = to
            .iter()
            .map(|&p| {
                for_peer(p).flat_map(|m| [m.1.to_le_bytes(), (m.2.len() as u64).to_le_bytes()]).flatten().collect()
            })
            .collect();
        let sends: Vec<(usize, &[u8])> = to.iter().zip(&headers).map(|(&p, h)| (p, &h[..])).collect();
        let recvs: Vec<(usize, usize)> = from.iter().zip(&n_in).map(|(&p, &n)| (p, 16 * n)).collect();
        let got = self.p2p.group(&sends, &recvs)?;
        // (3) The payloads, in the order of the headers.
        let mut sends: Vec<(usize, &[u8])> = Vec::new();
        for &p in to {
            sends.extend(for_peer(p).map(|m| (p, &m.2[..])));
        }
        let mut recvs = Vec::new();
        let mut tags = Vec::new();
        for (&p, h) in from.iter().zip(&got) {
            for i in 0..h.len() / 16 {
                let (tag, len) = (u64_at(h, 16 * i), u64_at(h, 16 * i + 8));
                let len = usize::try_from(len)
                    .map_err(|_| CpError::Comm { rank, why: format!("rank {p} announced a message of {len} bytes") })?;
                recvs.push((p, len));
                tags.push((p, tag));
            }
        }
        let got = self.p2p.group(&sends, &recvs)?;
        for (key, data) in tags.into_iter().zip(got) {
            st.inbox.entry(key).or_default().push_back(data);
        }
        Ok(())
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn take(st: &mut State, peer: usize, tag: u64) -> Option<Vec<u8>> {
    let q = st.inbox.get_mut(&(peer, tag))?;
    let d = q.pop_front();
    if q.is_empty() {
        st.inbox.remove(&(peer, tag));
    }
    d
}

impl<T: GroupedP2p> Communicator for Grouped<T> {
    fn rank(&self) -> usize {
        self.p2p.rank()
    }
    fn world(&self) -> usize {
        self.p2p.world()
    }
    fn send(&self, peer: usize, tag: u64, data: Vec<u8>) -> Result<(), CpError> {
        if peer >= self.world() || peer == self.rank() {
            return Err(CpError::Comm {
                rank: self.rank(),
                why: format!("send to rank {peer} in a world of {} (not to itself)", self.world()),
            });
        }
        self.state.lock().unwrap_or_else(|e| e.into_inner()).queued.push((peer, tag, data));
        Ok(())
    }
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CpError> {
        let rank = self.rank();
        if peer >= self.world() || peer == rank {
            return Err(CpError::Comm {
                rank,
                why: format!("receive from rank {peer} in a world of {}", self.world()),
            });
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = take(&mut st, peer, tag) {
            return Ok(d);
        }
        let mut to: Vec<usize> = st.queued.iter().map(|m| m.0).collect();
        to.sort_unstable();
        to.dedup();
        self.flush(&mut st, &to, &[peer])?;
        take(&mut st, peer, tag).ok_or_else(|| CpError::Comm {
            rank,
            why: format!(
                "rank {peer} sent no message {tag} when this rank received from it (their calls do not pair up)"
            ),
        })
    }
    fn exchange_all(&self, tag: u64, mut parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, CpError> {
        let (rank, world) = (self.rank(), self.world());
        if parts.len() != world {
            return Err(CpError::Layout(format!("an exchange of {} parts in a world of {world}", parts.len())));
        }
        let others: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for &p in &others {
            st.queued.push((p, tag, std::mem::take(&mut parts[p])));
        }
        self.flush(&mut st, &others, &others)?;
        let mut out = Vec::with_capacity(world);
        for (p, part) in parts.into_iter().enumerate() {
            out.push(if p == rank {
                part
            } else {
                take(&mut st, p, tag).ok_or_else(|| CpError::Comm {
                    rank,
                    why: format!("rank {p} sent no message {tag} in an exchange with every rank"),
                })?
            });
        }
        Ok(out)
    }
}

/// A transfer in flight between two [`Rendezvous`] ranks: the bytes and the sender's
/// completion signal.
type Packet = (Vec<u8>, Sender<()>);

/// One ordered link `from -> to`: transfers match in the order they were posted.
struct Link {
    tx: Mutex<Sender<Packet>>,
    rx: Mutex<Receiver<Packet>>,
}

/// NCCL's point-to-point rules in memory (module docs): a group's sends complete only when the
/// peers have received them, a receive of another size than was sent is an error, and a group
/// that cannot complete fails after the timeout (default 60 s) naming the peer it waits for,
/// where NCCL would hang.
pub struct Rendezvous {
    rank: usize,
    links: Arc<Vec<Vec<Link>>>,
    timeout: Duration,
}

impl Rendezvous {
    /// The `world` ranks of one world (rank `i` at index `i`).
    pub fn world(world: usize) -> Vec<Rendezvous> {
        let links: Arc<Vec<Vec<Link>>> = Arc::new(
            (0..world)
                .map(|_| {
                    (0..world)
                        .map(|_| {
                            let (tx, rx) = mpsc::channel();
                            Link { tx: Mutex::new(tx), rx: Mutex::new(rx) }
                        })
                        .collect()
                })
                .collect(),
        );
        (0..world).map(|rank| Rendezvous { rank, links: links.clone(), timeout: Duration::from_secs(60) }).collect()
    }

    /// Sets how long a group waits before it fails.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The ranks of a world as [`Communicator`]s ([`Grouped`] over each).
    pub fn communicators(world: usize, timeout: Duration) -> Vec<Grouped<Rendezvous>> {
        Rendezvous::world(world).into_iter().map(|r| Grouped::new(r.with_timeout(timeout))).collect()
    }
}

impl GroupedP2p for Rendezvous {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.links.len()
    }
    fn group(&self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>, CpError> {
        let (rank, world) = (self.rank, self.links.len());
        let err = |why: String| CpError::Comm { rank, why };
        for p in sends.iter().map(|s| s.0).chain(recvs.iter().map(|r| r.0)) {
            if p >= world || p == rank {
                return Err(err(format!("a transfer with rank {p} in a world of {world}")));
            }
        }
        // Post every send of the group first: the group's transfers progress together.
        let mut pending: Vec<(usize, Receiver<()>)> = Vec::new();
        for &(p, data) in sends {
            if data.is_empty() {
                continue;
            }
            let (done_tx, done_rx) = mpsc::channel();
            let link = &self.links[rank][p];
            link.tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .send((data.to_vec(), done_tx))
                .map_err(|_| err(format!("rank {p} is gone")))?;
            pending.push((p, done_rx));
        }
        // Then complete the receives, in any order, and wait for every send to be received.
        let mut out: Vec<Option<Vec<u8>>> = recvs.iter().map(|&(_, n)| (n == 0).then(Vec::new)).collect();
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut progress = false;
            for (i, &(p, n)) in recvs.iter().enumerate() {
                // Transfers from one peer match in order: only the first open receive of `p`.
                if out[i].is_some() || recvs[..i].iter().zip(&out[..i]).any(|((q, _), o)| *q == p && o.is_none()) {
                    continue;
                }
                let packet = self.links[p][rank].rx.lock().unwrap_or_else(|e| e.into_inner()).try_recv();
                match packet {
                    Ok((data, done)) => {
                        if data.len() != n {
                            return Err(err(format!(
                                "rank {p} sent {} bytes where this rank posted a receive of {n} (NCCL would corrupt or hang)",
                                data.len()
                            )));
                        }
                        let _ = done.send(());
                        out[i] = Some(data);
                        progress = true;
                    }
                    Err(TryRecvError::Empty) => {}
                    Err(TryRecvError::Disconnected) => return Err(err(format!("rank {p} is gone"))),
                }
            }
            pending.retain(|(_, done)| !matches!(done.try_recv(), Ok(()) | Err(TryRecvError::Disconnected)));
            if pending.is_empty() && out.iter().all(Option::is_some) {
                return Ok(out.into_iter().map(|o| o.unwrap_or_default()).collect());
            }
            if Instant::now() >= deadline {
                let waiting: Vec<String> = recvs
                    .iter()
                    .zip(&out)
                    .filter(|(_, o)| o.is_none())
                    .map(|((p, n), _)| format!("a receive of {n} bytes from rank {p}"))
                    .chain(pending.iter().map(|(p, _)| format!("rank {p} to receive this rank's send")))
                    .collect();
                return Err(err(format!(
                    "a group did not complete within {:?} (it would hang on NCCL): waiting for {}",
                    self.timeout,
                    waiting.join(", ")
                )));
            }
            if !progress {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::cp::{all_gather, run_ranks};

    pub fn a_ring_and_an_all_gather_pair_up() {
        let outs = run_ranks(Rendezvous::communicators(3, Duration::from_secs(20)), |c| {
            let (r, w) = (c.rank(), c.world());
            c.send((r + 1) % w, 7, vec![r as u8; 5 + r]).unwrap();
            c.send((r + 1) % w, 8, vec![]).unwrap();
            let got = c.recv((r + w - 1) % w, 8).unwrap();
            assert!(got.is_empty());
            let got = c.recv((r + w - 1) % w, 7).unwrap();
            let all = all_gather(c, 9, vec![10 + r as u8]).unwrap();
            (got, all)
        });
        for (r, (got, all)) in outs.iter().enumerate() {
            let prev = (r + 2) % 3;
            assert_eq!(got, &vec![prev as u8; 5 + prev]);
            assert_eq!(all, &vec![vec![10], vec![11], vec![12]]);
        }
    }

    pub fn rendezvous_reports_a_group_that_would_hang() {
        // Rank 0 sends to rank 1, which never receives: on NCCL rank 0's group waits forever.
        let outs = run_ranks(
            Rendezvous::world(2).into_iter().map(|r| r.with_timeout(Duration::from_millis(200))).collect(),
            |t| {
                if t.rank() == 0 {
                    t.group(&[(1, &[1, 2, 3][..])], &[]).map(|_| ())
                } else {
                    Ok(())
                }
            },
        );
        let why = outs[0].clone().unwrap_err().to_string();
        assert!(why.contains("would hang on NCCL") && why.contains("rank 1 to receive"), "{why}");
        // A size other than the sender's is refused.
        let outs = run_ranks(Rendezvous::world(2), |t| {
            if t.rank() == 0 {
                t.group(&[(1, &[1, 2, 3][..])], &[]).map(|_| ())
            } else {
                t.group(&[], &[(0, 4)]).map(|_| ())
            }
        });
        assert!(outs[1]
            .clone()
            .unwrap_err()
            .to_string()
            .contains("sent 3 bytes where this rank posted a receive of 4"));
    }

    pub fn calls_that_do_not_pair_up_fail_instead_of_hanging() {
        // Rank 0 receives from 1 while rank 1 receives from 0 and neither has sent: both flushes
        // wait for a count the other never posts.
        let outs = run_ranks(Rendezvous::communicators(2, Duration::from_millis(300)), |c| {
            c.recv(1 - c.rank(), 1).map(|_| ())
        });
        for o in outs {
            assert!(o.unwrap_err().to_string().contains("would hang on NCCL"));
        }
    }
}
