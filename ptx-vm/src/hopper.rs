//! Hopper (sm_90a) asynchronous copies: `mbarrier` objects, the bulk copies
//! `cp.async.bulk{.tensor}` with their tensor maps ([`TensorMap`]), and the async-proxy race check.
//!
//! # mbarrier
//!
//! The state of every `mbarrier` lives in a side table of the block, keyed by its shared-memory
//! offset (the 8 bytes themselves only count as written for initcheck): the expected arrival
//! count, the pending arrival count, the transaction count (tx-count) and the number of completed
//! phases. A phase completes when both the pending arrivals and the tx-count are zero; then the
//! phase number advances (its parity flips) and the pending count is reloaded. Misuse is a
//! finding naming the PTX line: an operation on an address where no `mbarrier.init` ran (or after
//! `mbarrier.inval`), `mbarrier.init` of a barrier whose phase has arrivals or transactions
//! pending, an arrival count larger than the pending count, a tx-count that goes negative once
//! every arrival is in (more bytes completed than were expected) or leaves `±(2^20 − 1)`.
//!
//! A failed `mbarrier.try_wait`/`test_wait` makes its warp yield: the other warps of the block run
//! (the producer can issue its copies) before the warp retries. When a whole round of the block's
//! warps changes no barrier and moves no thread to an exit or a `bar.sync`, over and over, every
//! live warp waits on something no one can provide any more: a "deadlock" finding.
//!
//! # Bulk copies
//!
//! A copy is carried out when it is issued (the VM has no memory latency): the shared destination
//! is written, and the mbarrier's tx-count is decremented by the copy's bytes at once. What makes
//! this faithful is the race check below: a thread that reads the destination before it has
//! observed the barrier phase the copy completes is reported, so no kernel can come to depend on
//! the early completion.
//!
//! # The async-proxy race rule
//!
//! A bulk copy writes shared memory through the async proxy; its writes become visible to a
//! thread that observes the completion of the mbarrier phase the copy's `complete_tx` belongs to
//! (the PTX memory model: the phase completion is a release of the async writes, a successful
//! `try_wait`/`test_wait` an acquire). The VM tracks this per warp, at the 16-byte granularity of
//! bulk copies:
//!
//! * Each warp knows, per barrier, how many phases it has observed complete: by its own
//!   successful `try_wait`/`test_wait` (any lane of the warp; the lanes of a warp reconverge
//!   before they read the tile), by a `bar.sync` (everything any warp of the block had observed,
//!   the barrier is cumulative), or through an mbarrier arrive → wait chain (an arrival carries
//!   the arriving warp's knowledge into the phase, a waiter that observes the phase gains it).
//! * A generic-proxy read or write of shared bytes that a bulk copy wrote, by a warp that has not
//!   observed that copy's phase, is an "async-proxy race" naming both PTX lines.
//! * A bulk copy into shared bytes that another warp accessed, where that access is not ordered
//!   before the copy's issue (by the same chain of arrivals, waits and `bar.sync`, tracked as a
//!   vector clock per warp), is an "async-proxy race" too: the copy may land while the other
//!   warp still reads (the producer reused a stage before the consumers released it).
//!
//! Shared memory written by a bulk copy counts as written for initcheck. Generic racecheck does
//! not see the async writes; since it knows only `bar.sync` intervals, a successful mbarrier wait
//! that synchronises with another warp starts a new racecheck interval as a `bar.sync` would (no
//! false races across mbarrier hand-offs; races across them between warps the hand-off does not
//! order can be missed).

use std::collections::HashMap;

use crate::ir::{Slot, Space, NONE};
use crate::memcheck::{Fault, Mem, RaceOther, SharedMem};
use crate::memory::{self, PARAM_WINDOW, SHARED_WINDOW, WINDOW_SIZE};
use crate::swizzle::Swizzle;

// ------------------------------------------------------------------------------------------------
// Tensor maps
// ------------------------------------------------------------------------------------------------

/// Bytes of an encoded [`TensorMap`] (a `CUtensorMap`).
pub const TENSOR_MAP_BYTES: usize = 128;
/// First four bytes of an encoded [`TensorMap`].
pub const TENSOR_MAP_MAGIC: [u8; 4] = *b"PVTM";
/// Encoding version ([`TensorMap::encode`] bytes 4..6).
pub const TENSOR_MAP_VERSION: u16 = 1;

/// Element type of a tensor map (`CUtensorMapDataType`; the discriminant is the CUDA value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorDataType {
    U8 = 0,
    U16 = 1,
    U32 = 2,
    I32 = 3,
    U64 = 4,
    I64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    Bf16 = 9,
    F32Ftz = 10,
    Tf32 = 11,
    Tf32Ftz = 12,
}

impl TensorDataType {
    /// The type of a `CUtensorMapDataType` value (the packed 4- and 6-bit types are not supported).
    pub fn from_cuda(v: u32) -> Option<TensorDataType> {
        use TensorDataType::*;
        Some(match v {
            0 => U8,
            1 => U16,
            2 => U32,
            3 => I32,
            4 => U64,
            5 => I64,
            6 => F16,
            7 => F32,
            8 => F64,
            9 => Bf16,
            10 => F32Ftz,
            11 => Tf32,
            12 => Tf32Ftz,
            _ => return None,
        })
    }
    /// The `CUtensorMapDataType` value.
    pub fn cuda(self) -> u32 {
        self as u32
    }
    /// Bytes of one element.
    pub fn bytes(self) -> u32 {
        use TensorDataType::*;
        match self {
            U8 => 1,
            U16 | F16 | Bf16 => 2,
            U32 | I32 | F32 | F32Ftz | Tf32 | Tf32Ftz => 4,
            U64 | I64 | F64 => 8,
        }
    }
    /// Whether the type is a floating-point type (the only ones the NaN OOB fill is allowed for).
    pub fn is_float(self) -> bool {
        use TensorDataType::*;
        matches!(self, F16 | F32 | F64 | Bf16 | F32Ftz | Tf32 | Tf32Ftz)
    }
    /// The quiet NaN an out-of-bounds element gets with [`OobFill::NanRequestZeroFma`].
    fn nan_bits(self) -> u64 {
        use TensorDataType::*;
        match self {
            F16 => 0x7FFF,
            Bf16 => 0x7FFF,
            F64 => 0x7FFF_FFFF_FFFF_FFFF,
            _ => 0x7FFF_FFFF,
        }
    }
}

/// What out-of-bounds elements of a box read as (`CUtensorMapFloatOOBfill`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OobFill {
    /// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE` (0): zeros.
    Zero,
    /// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA` (1): a quiet NaN of the element type
    /// (floating-point types only).
    NanRequestZeroFma,
}

impl OobFill {
    pub fn from_cuda(v: u32) -> Option<OobFill> {
        match v {
            0 => Some(OobFill::Zero),
            1 => Some(OobFill::NanRequestZeroFma),
            _ => None,
        }
    }
    pub fn cuda(self) -> u32 {
        match self {
            OobFill::Zero => 0,
            OobFill::NanRequestZeroFma => 1,
        }
    }
}

/// The swizzle of a `CUtensorMapSwizzle` value (0 none, 1 32B, 2 64B, 3 128B; the sm_100 atom
/// variants 4..=6 are not supported).
pub fn swizzle_from_cuda(v: u32) -> Option<Swizzle> {
    match v {
        0 => Some(Swizzle::None),
        1 => Some(Swizzle::B32),
        2 => Some(Swizzle::B64),
        3 => Some(Swizzle::B128),
        _ => None,
    }
}

/// The `CUtensorMapSwizzle` value of a swizzle.
pub fn swizzle_cuda(s: Swizzle) -> u32 {
    match s {
        Swizzle::None => 0,
        Swizzle::B32 => 1,
        Swizzle::B64 => 2,
        Swizzle::B128 => 3,
    }
}

/// A tiled tensor map (what `cuTensorMapEncodeTiled` describes), as the VM reads it from the 128
/// bytes a `cp.async.bulk.tensor` names.
///
/// Dimensions are innermost first (dimension 0 is contiguous in memory). Entries of the arrays
/// past `rank` are ignored (and encoded as 0).
///
/// The VM's encoding ([`TensorMap::encode`], little-endian):
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | magic `PVTM` |
/// | 4..6 | version (1) |
/// | 6 | data type (`CUtensorMapDataType`) |
/// | 7 | rank |
/// | 8 | swizzle (`CUtensorMapSwizzle`) |
/// | 9 | interleave (`CUtensorMapInterleave`, always 0) |
/// | 10 | OOB fill (`CUtensorMapFloatOOBfill`) |
/// | 11 | L2 promotion (`CUtensorMapL2promotion`, recorded, no effect) |
/// | 12..16 | zero |
/// | 16..24 | global address |
/// | 24..64 | global dims, 5 × u64 |
/// | 64..96 | global strides in bytes of dims 1..rank, 4 × u64 |
/// | 96..106 | box dims, 5 × u16 |
/// | 106..111 | element strides, 5 × u8 |
/// | 111..124 | zero |
/// | 124..128 | FNV-1a (32-bit) of bytes 0..124 |
///
/// A `CUtensorMap` from the VM-backed driver is these bytes; anything else (a map encoded by
/// real CUDA, uninitialised memory) fails [`TensorMap::decode`], and a copy that uses it is an
/// "invalid tensor map" finding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMap {
    pub data_type: TensorDataType,
    /// 1..=5.
    pub rank: u32,
    /// Start of the tensor in global memory (16-byte aligned).
    pub global_address: u64,
    /// Elements per dimension, each 1..=2^32.
    pub global_dims: [u64; 5],
    /// Byte strides of dimensions 1..rank (`globalStrides` of `cuTensorMapEncodeTiled`, which
    /// leaves out dimension 0, whose stride is the element size): multiples of 16, below 2^40.
    pub global_strides: [u64; 4],
    /// Elements per dimension of the box one copy moves, each 1..=256.
    pub box_dims: [u32; 5],
    /// Traversal strides, 1..=8 (`elementStrides`); the VM supports only 1 in dimensions 1 and
    /// up (dimension 0's is ignored, as by the hardware).
    pub element_strides: [u32; 5],
    pub swizzle: Swizzle,
    pub oob_fill: OobFill,
    /// `CUtensorMapL2promotion` (0..=3); no effect in the VM.
    pub l2_promotion: u32,
}

fn fnv1a(b: &[u8]) -> u32 {
    let mut h = 0x811C_9DC5u32;
    for &x in b {
        h ^= x as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

impl TensorMap {
    /// A 2-D map of a row-major `rows × cols` matrix with `row_stride` bytes between rows (the
    /// common case): dimension 0 is the column.
    #[allow(clippy::too_many_arguments)]
    pub fn matrix(
        data_type: TensorDataType,
        global_address: u64,
        rows: u64,
        cols: u64,
        row_stride: u64,
        box_rows: u32,
        box_cols: u32,
        swizzle: Swizzle,
    ) -> TensorMap {
        TensorMap {
            data_type,
            rank: 2,
            global_address,
            global_dims: [cols, rows, 0, 0, 0],
            global_strides: [row_stride, 0, 0, 0],
            box_dims: [box_cols, box_rows, 0, 0, 0],
            element_strides: [1, 1, 0, 0, 0],
            swizzle,
            oob_fill: OobFill::Zero,
            l2_promotion: 0,
        }
    }

    /// What `cuTensorMapEncodeTiled` builds from its arguments (raw CUDA enum values; slices of
    /// `rank` entries, `global_strides` of `rank - 1`), validated as it validates them, plus the
    /// VM's own limits (no interleave, element strides of 1). The error says which rule failed.
    #[allow(clippy::too_many_arguments)]
    pub fn from_cuda_tiled(
        data_type: u32,
        rank: u32,
        global_address: u64,
        global_dims: &[u64],
        global_strides: &[u64],
        box_dims: &[u32],
        element_strides: &[u32],
        interleave: u32,
        swizzle: u32,
        l2_promotion: u32,
        oob_fill: u32,
    ) -> Result<TensorMap, String> {
        let data_type = TensorDataType::from_cuda(data_type)
            .ok_or_else(|| format!("tensorDataType {data_type} is not supported (0..=12)"))?;
        if !(1..=5).contains(&rank) {
            return Err(format!("tensorRank {rank} is outside 1..=5"));
        }
        let r = rank as usize;
        if global_dims.len() < r || box_dims.len() < r || element_strides.len() < r || global_strides.len() < r - 1 {
            return Err(format!("fewer array entries than tensorRank {rank} needs"));
        }
        if interleave != 0 {
            return Err(format!("interleave {interleave}: only CU_TENSOR_MAP_INTERLEAVE_NONE is supported"));
        }
        let swizzle = swizzle_from_cuda(swizzle)
            .ok_or_else(|| format!("swizzle {swizzle} is not supported (0..=3: none, 32B, 64B, 128B)"))?;
        let oob_fill = OobFill::from_cuda(oob_fill).ok_or_else(|| format!("oobFill {oob_fill} is not 0 or 1"))?;
        let mut m = TensorMap {
            data_type,
            rank,
            global_address,
            global_dims: [0; 5],
            global_strides: [0; 4],
            box_dims: [0; 5],
            element_strides: [0; 5],
            swizzle,
            oob_fill,
            l2_promotion,
        };
        m.global_dims[..r].copy_from_slice(&global_dims[..r]);
        m.global_strides[..r - 1].copy_from_slice(&global_strides[..r - 1]);
        m.box_dims[..r].copy_from_slice(&box_dims[..r]);
        m.element_strides[..r].copy_from_slice(&element_strides[..r]);
        m.validate()?;
        Ok(m)
    }

    /// The rules of `cuTensorMapEncodeTiled` (and the VM's limits): `Err` names the first one
    /// broken.
    pub fn validate(&self) -> Result<(), String> {
        let r = self.rank as usize;
        if !(1..=5).contains(&self.rank) {
            return Err(format!("rank {} is outside 1..=5", self.rank));
        }
        if !self.global_address.is_multiple_of(16) {
            return Err(format!("globalAddress {:#x} is not 16-byte aligned", self.global_address));
        }
        let es = self.data_type.bytes() as u64;
        for (i, &d) in self.global_dims[..r].iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return Err(format!("globalDim[{i}] = {d} is outside 1..=2^32"));
            }
        }
        let mut prev = es * self.global_dims[0];
        for (i, &s) in self.global_strides[..r - 1].iter().enumerate() {
            if !s.is_multiple_of(16) || s >= 1 << 40 {
                return Err(format!("globalStrides[{i}] = {s} is not a multiple of 16 below 2^40"));
            }
            if s < prev {
                return Err(format!(
                    "globalStrides[{i}] = {s} is smaller than the {prev} bytes the lower dimensions span"
                ));
            }
            prev = s.saturating_mul(self.global_dims[i + 1]);
        }
        for (i, &b) in self.box_dims[..r].iter().enumerate() {
            if !(1..=256).contains(&b) {
                return Err(format!("boxDim[{i}] = {b} is outside 1..=256"));
            }
        }
        let inner = self.box_dims[0] as u64 * es;
        if !inner.is_multiple_of(16) {
            return Err(format!("boxDim[0] × element size = {inner} bytes is not a multiple of 16"));
        }
        if self.swizzle != Swizzle::None && inner > self.swizzle.span() as u64 {
            return Err(format!(
                "the inner box dimension is {inner} bytes, more than the {}-byte swizzle span",
                self.swizzle.span()
            ));
        }
        for (i, &e) in self.element_strides[..r].iter().enumerate() {
            if !(1..=8).contains(&e) {
                return Err(format!("elementStrides[{i}] = {e} is outside 1..=8"));
            }
            if i > 0 && e != 1 {
                return Err(format!("elementStrides[{i}] = {e}: the VM supports only traversal strides of 1"));
            }
        }
        if self.oob_fill == OobFill::NanRequestZeroFma && !self.data_type.is_float() {
            return Err(format!("the NaN OOB fill needs a floating-point type, not {:?}", self.data_type));
        }
        if self.l2_promotion > 3 {
            return Err(format!("l2Promotion {} is outside 0..=3", self.l2_promotion));
        }
        Ok(())
    }

    /// The 128 bytes of the map (see the table above); not validated.
    pub fn encode(&self) -> [u8; TENSOR_MAP_BYTES] {
        let mut b = [0u8; TENSOR_MAP_BYTES];
        b[0..4].copy_from_slice(&TENSOR_MAP_MAGIC);
        b[4..6].copy_from_slice(&TENSOR_MAP_VERSION.to_le_bytes());
        b[6] = self.data_type.cuda() as u8;
        b[7] = self.rank as u8;
        b[8] = swizzle_cuda(self.swizzle) as u8;
        b[9] = 0;
        b[10] = self.oob_fill.cuda() as u8;
        b[11] = self.l2_promotion as u8;
        b[16..24].copy_from_slice(&self.global_address.to_le_bytes());
        let r = (self.rank as usize).min(5);
        for i in 0..r {
            b[24 + 8 * i..32 + 8 * i].copy_from_slice(&self.global_dims[i].to_le_bytes());
            b[96 + 2 * i..98 + 2 * i].copy_from_slice(&(self.box_dims[i].min(u16::MAX as u32) as u16).to_le_bytes());
            b[106 + i] = self.element_strides[i].min(255) as u8;
        }
        for i in 0..r.saturating_sub(1) {
            b[64 + 8 * i..72 + 8 * i].copy_from_slice(&self.global_strides[i].to_le_bytes());
        }
        let h = fnv1a(&b[..124]);
        b[124..128].copy_from_slice(&h.to_le_bytes());
        b
    }

    /// The map in `b`, checked: magic, version, checksum, reserved bytes, then
    /// [`TensorMap::validate`].
    pub fn decode(b: &[u8; TENSOR_MAP_BYTES]) -> Result<TensorMap, String> {
        if b[0..4] != TENSOR_MAP_MAGIC {
            return Err(format!(
                "the 128 bytes are not a ptx-vm tensor map (they start {:02x} {:02x} {:02x} {:02x}, not `PVTM`)",
                b[0], b[1], b[2], b[3]
            ));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != TENSOR_MAP_VERSION {
            return Err(format!("tensor map version {version}, the VM reads version {TENSOR_MAP_VERSION}"));
        }
        let sum = u32::from_le_bytes(b[124..128].try_into().expect("4 bytes"));
        if sum != fnv1a(&b[..124]) {
            return Err("the tensor map's checksum does not match its contents (it was modified or corrupted)".into());
        }
        if b[9] != 0 {
            return Err(format!("interleave {}: only CU_TENSOR_MAP_INTERLEAVE_NONE is supported", b[9]));
        }
        let data_type = TensorDataType::from_cuda(b[6] as u32).ok_or_else(|| format!("data type {}", b[6]))?;
        let swizzle = swizzle_from_cuda(b[8] as u32).ok_or_else(|| format!("swizzle {}", b[8]))?;
        let oob_fill = OobFill::from_cuda(b[10] as u32).ok_or_else(|| format!("OOB fill {}", b[10]))?;
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let m = TensorMap {
            data_type,
            rank: b[7] as u32,
            global_address: u64_at(16),
            global_dims: std::array::from_fn(|i| u64_at(24 + 8 * i)),
            global_strides: std::array::from_fn(|i| u64_at(64 + 8 * i)),
            box_dims: std::array::from_fn(|i| u16::from_le_bytes([b[96 + 2 * i], b[97 + 2 * i]]) as u32),
            element_strides: std::array::from_fn(|i| b[106 + i] as u32),
            swizzle,
            oob_fill,
            l2_promotion: b[11] as u32,
        };
        m.validate()?;
        Ok(m)
    }

    /// Bytes of one box (out-of-bounds elements included): what a copy adds to the tx-count.
    pub fn box_bytes(&self) -> u64 {
        self.box_dims[..self.rank as usize].iter().map(|&b| b as u64).product::<u64>() * self.data_type.bytes() as u64
    }

    /// The global byte address of the element at in-bounds coordinates `g`.
    fn element_address(&self, g: &[i64]) -> u64 {
        let r = self.rank as usize;
        let mut a = self.global_address + g[0] as u64 * self.data_type.bytes() as u64;
        for (x, s) in g[1..r].iter().zip(&self.global_strides) {
            a += *x as u64 * s;
        }
        a
    }

    /// Calls `f(row, coords, lo, hi)` for every row of the box starting at `start` (dimension 0
    /// innermost): `row` is the row's index in the box, `coords` the global coordinates of the
    /// row's first element, and `lo..hi` the box columns of the row that are in bounds (empty
    /// when the row is outside in an outer dimension).
    fn rows(&self, start: &[i64], mut f: impl FnMut(u64, &[i64; 5], u32, u32)) {
        let r = self.rank as usize;
        let nrows: u64 = self.box_dims[1..r].iter().map(|&b| b as u64).product();
        let b0 = self.box_dims[0] as i64;
        let d0 = self.global_dims[0] as i64;
        let lo = (-start[0]).clamp(0, b0);
        let hi = (d0 - start[0]).clamp(lo, b0);
        for row in 0..nrows {
            let mut g = [0i64; 5];
            g[0] = start[0];
            let mut rest = row;
            let mut inside = true;
            for i in 1..r {
                let e = (rest % self.box_dims[i] as u64) as i64;
                rest /= self.box_dims[i] as u64;
                g[i] = start[i] + e;
                inside &= g[i] >= 0 && g[i] < self.global_dims[i] as i64;
            }
            let (l, h) = if inside { (lo as u32, hi as u32) } else { (0, 0) };
            f(row, &g, l, h);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Decoded instructions
// ------------------------------------------------------------------------------------------------

/// An address operand `[a + off]` in state space `sp`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HAddr {
    pub sp: Space,
    pub a: Slot,
    pub off: i64,
}

/// One Hopper instruction, held in [`crate::ir::Program::hopper`] ([`crate::ir::Op::Hopper`]
/// names it and its destination).
#[derive(Clone, Debug)]
pub(crate) enum HInst {
    /// `mbarrier.init [bar], count`.
    MbarInit { bar: HAddr, count: Slot },
    /// `mbarrier.arrive{.expect_tx} state, [bar]{, count | , tx}` (`count` NONE: 1, `tx` NONE: none).
    MbarArrive { bar: HAddr, count: Slot, tx: Slot },
    /// `mbarrier.expect_tx [bar], tx`.
    MbarExpectTx { bar: HAddr, tx: Slot },
    /// `mbarrier.complete_tx [bar], tx`.
    MbarCompleteTx { bar: HAddr, tx: Slot },
    /// `mbarrier.{try,test}_wait{.parity} pred, [bar], state | parity`.
    MbarWait { bar: HAddr, parity: bool, x: Slot },
    /// `mbarrier.inval [bar]`.
    MbarInval { bar: HAddr },
    /// `cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes`.
    TensorLoad { rank: u8, dst: HAddr, map: HAddr, coords: [Slot; 5], bar: HAddr },
    /// `cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group`.
    TensorStore { rank: u8, map: HAddr, coords: [Slot; 5], src: HAddr },
    /// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [bar]`.
    BulkLoad { dst: HAddr, src: HAddr, size: Slot, bar: HAddr },
    /// `cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size`.
    BulkStore { dst: HAddr, src: HAddr, size: Slot },
    /// `setmaxnreg.{inc,dec}.sync.aligned.u32 n`.
    SetMaxNreg { inc: bool, n: u32 },
}

impl HInst {
    /// The register slots the instruction reads.
    pub(crate) fn sources(&self) -> Vec<Slot> {
        let mut v = Vec::new();
        let addr = |a: &HAddr, v: &mut Vec<Slot>| v.push(a.a);
        match self {
            HInst::MbarInit { bar, count } => {
                addr(bar, &mut v);
                v.push(*count);
            }
            HInst::MbarArrive { bar, count, tx } => {
                addr(bar, &mut v);
                v.push(*count);
                v.push(*tx);
            }
            HInst::MbarExpectTx { bar, tx } | HInst::MbarCompleteTx { bar, tx } => {
                addr(bar, &mut v);
                v.push(*tx);
            }
            HInst::MbarWait { bar, x, .. } => {
                addr(bar, &mut v);
                v.push(*x);
            }
            HInst::MbarInval { bar } => addr(bar, &mut v),
            HInst::TensorLoad { rank, dst, map, coords, bar } => {
                addr(dst, &mut v);
                addr(map, &mut v);
                addr(bar, &mut v);
                v.extend_from_slice(&coords[..*rank as usize]);
            }
            HInst::TensorStore { rank, map, coords, src } => {
                addr(map, &mut v);
                addr(src, &mut v);
                v.extend_from_slice(&coords[..*rank as usize]);
            }
            HInst::BulkLoad { dst, src, size, bar } => {
                addr(dst, &mut v);
                addr(src, &mut v);
                addr(bar, &mut v);
                v.push(*size);
            }
            HInst::BulkStore { dst, src, size } => {
                addr(dst, &mut v);
                addr(src, &mut v);
                v.push(*size);
            }
            HInst::SetMaxNreg { .. } => {}
        }
        v.retain(|&s| s != NONE);
        v
    }
}

// ------------------------------------------------------------------------------------------------
// Block state
// ------------------------------------------------------------------------------------------------

/// What a warp knows (the vector clock of the race rule): per warp of the block the clock value
/// of that warp's latest release it has acquired (its own entry: its current clock), and per
/// barrier (by [`Mbar::id`]) the number of phases it has observed complete.
#[derive(Clone, Default, Debug)]
struct Know {
    vc: Vec<u32>,
    seen: Vec<(u32, u64)>,
}

impl Know {
    /// Joins `o` into `self`; true when an entry of another warp grew.
    fn join(&mut self, o: &Know, me: usize) -> bool {
        let mut grew = false;
        for (i, (a, b)) in self.vc.iter_mut().zip(&o.vc).enumerate() {
            if *b > *a {
                *a = *b;
                grew |= i != me;
            }
        }
        for &(id, n) in &o.seen {
            self.observe(id, n);
        }
        grew
    }
    fn observe(&mut self, id: u32, phases: u64) {
        match self.seen.iter_mut().find(|(i, _)| *i == id) {
            Some((_, n)) => *n = (*n).max(phases),
            None => self.seen.push((id, phases)),
        }
    }
    fn seen(&self, id: u32) -> u64 {
        self.seen.iter().find(|(i, _)| *i == id).map_or(0, |&(_, n)| n)
    }
}

/// One mbarrier object.
#[derive(Clone, Debug)]
struct Mbar {
    /// Unique per `mbarrier.init` in the block (knowledge and copies name the incarnation).
    id: u32,
    valid: bool,
    expected: u32,
    pending: u32,
    tx: i64,
    /// Completed phases (the current phase's parity is `phase & 1`).
    phase: u64,
    /// Knowledge the current phase's arrivals and copies released.
    acc: Know,
    /// Knowledge released by the last two completed phases, with their numbers.
    done: [(u64, Know); 2],
    /// Instruction of the `mbarrier.init`.
    init_pc: u32,
}

/// The async writer of a 16-byte chunk of shared memory.
#[derive(Clone, Copy, Default)]
struct ChunkWriter {
    /// [`Mbar::id`] of the barrier the copy completes (0: no async write).
    bar: u32,
    /// The phase the copy belongs to.
    phase: u64,
    pc: u32,
    warp: u32,
    /// Shared offset of the barrier (for messages).
    bar_off: u32,
}

/// The last failed wait of a warp (for the deadlock message).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FailedWait {
    pub pc: u32,
    pub bar_off: u32,
    /// The parity waited for, or the phase of the state operand (`parity == false`).
    pub x: u64,
    pub parity: bool,
}

/// The Hopper state of a block: mbarriers, per-warp knowledge, and the async writes and generic
/// accesses of shared memory by 16-byte chunk (allocated only for programs that use Hopper
/// instructions: [`AsyncState::on`]).
#[derive(Default)]
pub(crate) struct AsyncState {
    /// The program has Hopper instructions: shared accesses take the checked path.
    pub(crate) on: bool,
    nwarps: usize,
    bars: HashMap<u32, Mbar>,
    next_id: u32,
    /// Counts every change of a barrier (the scheduler's progress measure).
    pub(crate) changes: u64,
    know: Vec<Know>,
    writers: Vec<ChunkWriter>,
    /// Per chunk and warp: the warp's clock at its last generic access (0: none), and its pc.
    access: Vec<[u32; 2]>,
    /// Per warp: the last failed wait.
    pub(crate) failed: Vec<Option<FailedWait>>,
    /// Per warp: the `setmaxnreg` it executed, in order (pc, inc, n).
    setmaxnreg: Vec<Vec<(u32, bool, u32)>>,
}

/// The result of a Hopper instruction for the scheduler.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Flow {
    Next,
    /// A wait failed: the warp yields to the other warps of the block.
    Yield,
}

const TX_LIMIT: i64 = (1 << 20) - 1;

impl AsyncState {
    /// A fresh block of `nwarps` warps and `shared_len` bytes of shared memory.
    pub(crate) fn reset(&mut self, nwarps: usize, shared_len: usize, on: bool) {
        self.on = on;
        self.bars.clear();
        self.changes = 0;
        if !on {
            return;
        }
        self.nwarps = nwarps;
        self.next_id = 1;
        self.know.clear();
        self.know.resize(nwarps, Know::default());
        for (w, k) in self.know.iter_mut().enumerate() {
            k.vc = vec![0; nwarps];
            k.vc[w] = 1;
        }
        let chunks = shared_len.div_ceil(16);
        self.writers.clear();
        self.writers.resize(chunks, ChunkWriter::default());
        self.access.clear();
        self.access.resize(chunks * nwarps, [0; 2]);
        self.failed.clear();
        self.failed.resize(nwarps, None);
        self.setmaxnreg.clear();
        self.setmaxnreg.resize(nwarps, Vec::new());
    }

    /// A `bar.sync` released: every warp knows what any warp knew, then each starts a new clock
    /// value.
    pub(crate) fn barrier_sync(&mut self) {
        if !self.on || self.know.is_empty() {
            return;
        }
        let mut all = Know { vc: vec![0; self.nwarps], seen: Vec::new() };
        for k in &self.know {
            all.join(k, usize::MAX);
        }
        for (w, k) in self.know.iter_mut().enumerate() {
            k.vc.clone_from(&all.vc);
            k.seen.clone_from(&all.seen);
            k.vc[w] += 1;
        }
    }

    /// A generic-proxy access of shared bytes `at..at + len` by warp `warp` at instruction `pc`:
    /// `Err` when it touches bytes of a bulk copy whose phase the warp has not observed.
    pub(crate) fn generic(
        &mut self,
        warp: u32,
        pc: u32,
        at: usize,
        len: usize,
        store: bool,
    ) -> Result<(), (String, RaceOther)> {
        let w = warp as usize;
        if w >= self.nwarps {
            return Ok(());
        }
        let k = &self.know[w];
        let t = k.vc[w];
        for c in at / 16..(at + len).div_ceil(16) {
            let cw = self.writers[c];
            if cw.bar != 0 && k.seen(cw.bar) <= cw.phase {
                return Err((
                    format!(
                        "warp {warp} {} shared bytes {}..{} that the bulk copy of warp {} writes; the copy completes \
                         phase {} of the mbarrier at shared offset {}, which warp {warp} has not observed complete \
                         (no successful mbarrier.try_wait/test_wait of that phase orders the {} after the copy)",
                        if store { "writes" } else { "reads" },
                        16 * c,
                        16 * c + 16,
                        cw.warp,
                        cw.phase,
                        cw.bar_off,
                        if store { "write" } else { "read" },
                    ),
                    RaceOther { warp: cw.warp, pc: cw.pc, write: true },
                ));
            }
            self.access[c * self.nwarps + w] = [t, pc];
        }
        Ok(())
    }

    /// A bulk copy by warp `warp` into the 16-byte chunks `chunks`: `Err` when another warp's
    /// access of one of them is not ordered before it. Then records the copy as their writer.
    fn async_write(
        &mut self,
        warp: usize,
        pc: u32,
        chunks: &[usize],
        bar: (u32, u64, u32),
    ) -> Result<(), (usize, String, RaceOther)> {
        let n = self.nwarps;
        let k = &self.know[warp];
        for &c in chunks {
            for r in 0..n {
                let [t, apc] = self.access[c * n + r];
                if r != warp && t > 0 && k.vc[r] < t {
                    return Err((
                        c,
                        format!(
                            "the bulk copy of warp {warp} writes shared bytes {}..{} that warp {r} accessed, and nothing \
                             orders that access before the copy (the consumer's mbarrier arrive and the producer's wait \
                             on it, or a bar.sync, are missing)",
                            16 * c,
                            16 * c + 16
                        ),
                        RaceOther { warp: r as u32, pc: apc, write: false },
                    ));
                }
            }
        }
        for &c in chunks {
            for r in 0..n {
                self.access[c * n + r] = [0, 0];
            }
            self.writers[c] = ChunkWriter { bar: bar.0, phase: bar.1, pc, warp: warp as u32, bar_off: bar.2 };
        }
        Ok(())
    }

    fn bar_mut(&mut self, off: u32) -> Option<&mut Mbar> {
        self.bars.get_mut(&off).filter(|b| b.valid)
    }

    /// Completes the current phase of the barrier at `off` when nothing is pending.
    fn maybe_complete(&mut self, off: u32) {
        let b = self.bars.get_mut(&off).expect("barrier");
        if b.pending == 0 && b.tx == 0 {
            let acc = std::mem::take(&mut b.acc);
            let k = b.phase;
            b.done[(k % 2) as usize] = (k, acc);
            b.phase += 1;
            b.pending = b.expected;
            b.acc = Know { vc: vec![0; self.nwarps], seen: Vec::new() };
        }
    }

    /// A description of the barrier at `off` for messages.
    pub(crate) fn describe(&self, off: u32) -> String {
        match self.bars.get(&off) {
            Some(b) if b.valid => format!(
                "the mbarrier at shared offset {off} is in phase {} (parity {}): {} of {} arrivals pending, tx-count {}",
                b.phase,
                b.phase & 1,
                b.pending,
                b.expected,
                b.tx
            ),
            Some(_) => format!("the mbarrier at shared offset {off} was invalidated"),
            None => format!("no mbarrier was initialised at shared offset {off}"),
        }
    }

    /// At the block's end: every warpgroup whose warps ran `setmaxnreg` ran the same ones in all
    /// four warps. `Err((warp, pc, detail))` otherwise.
    pub(crate) fn block_end(&self) -> Result<(), (usize, u32, String)> {
        if !self.on {
            return Ok(());
        }
        for g in 0..self.nwarps.div_ceil(4) {
            let ws: Vec<usize> = (4 * g..4 * g + 4).collect();
            let Some(first) = ws.iter().find(|&&w| w < self.nwarps && !self.setmaxnreg[w].is_empty()) else {
                continue;
            };
            let seq = &self.setmaxnreg[*first];
            for &w in &ws {
                let other: &[(u32, bool, u32)] = if w < self.nwarps { &self.setmaxnreg[w] } else { &[] };
                if other != &seq[..] {
                    let pc = seq.first().map_or(0, |s| s.0);
                    let missing = if w < self.nwarps {
                        format!("warp {w} of the warpgroup executed {} setmaxnreg instead", other.len())
                    } else {
                        format!("the block has only {} warps, warpgroup {g} is incomplete", self.nwarps)
                    };
                    return Err((
                        *first,
                        pc,
                        format!(
                            "setmaxnreg is .sync.aligned over the warpgroup (warps {}..{}): warp {first} executed {} of \
                             them; {missing}",
                            4 * g,
                            4 * g + 3,
                            seq.len()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------------------------
// Execution
// ------------------------------------------------------------------------------------------------

fn fault(lane: usize, kind: &'static str, addr: u64, size: u32, detail: String) -> Fault {
    Fault::new(lane as u32, kind, addr, size, Some(detail))
}

const MISUSE: &str = "mbarrier misuse";
const RACE: &str = "async-proxy race";
const BAD_MAP: &str = "invalid tensor map";
const MISALIGNED: &str = "misaligned bulk copy";

/// The shared offset of an address operand, checked to lie in the window with `len` bytes and
/// aligned to `align`.
fn shared_offset(
    shared: &SharedMem,
    h: &HAddr,
    r: &[[u64; 32]],
    l: usize,
    len: u64,
    align: u64,
    what: &str,
) -> Result<u32, Fault> {
    let addr = r[h.a as usize][l].wrapping_add(h.off as u64);
    let off = match h.sp {
        Space::Generic if (SHARED_WINDOW..SHARED_WINDOW + WINDOW_SIZE).contains(&addr) => addr - SHARED_WINDOW,
        Space::Generic => {
            return Err(fault(
                l,
                "shared memory out of window",
                addr,
                len as u32,
                format!("the {what} address is not a shared-memory address"),
            ))
        }
        _ => addr & 0xffff_ffff,
    };
    if off % align != 0 {
        let kind = if what == "mbarrier" { "misaligned access" } else { MISALIGNED };
        return Err(fault(l, kind, addr, len as u32, format!("the {what} address must be {align}-byte aligned")));
    }
    if off.checked_add(len).is_none_or(|e| e > shared.bytes.len() as u64) {
        return Err(Fault::new(l as u32, "shared memory out of window", addr, len as u32, None));
    }
    Ok(off as u32)
}

/// [`read_map`] for a `.{rank}d` copy: the map (and its address), or an invalid-map fault when
/// the map's rank is another.
fn read_map_of_rank(
    mem: &mut Mem,
    map: &HAddr,
    r: &[[u64; 32]],
    l: usize,
    rank: u8,
) -> Result<(TensorMap, u64), Fault> {
    let m = read_map(mem, map, r, l)?;
    let maddr = lane_addr(map, r, l);
    if m.rank != rank as u32 {
        return Err(fault(l, BAD_MAP, maddr, 128, format!("a .{rank}d copy with a tensor map of rank {}", m.rank)));
    }
    Ok((m, maddr))
}

/// Reads the 128 bytes of a tensor map (global memory, or the kernel parameters).
fn read_map(mem: &mut Mem, h: &HAddr, r: &[[u64; 32]], l: usize) -> Result<TensorMap, Fault> {
    let addr = r[h.a as usize][l].wrapping_add(h.off as u64);
    let mut b = [0u8; TENSOR_MAP_BYTES];
    let param = match h.sp {
        Space::Param => Some(addr),
        Space::Generic if (PARAM_WINDOW..PARAM_WINDOW + WINDOW_SIZE).contains(&addr) => Some(addr - PARAM_WINDOW),
        _ => None,
    };
    if !addr.is_multiple_of(64) {
        return Err(fault(l, BAD_MAP, addr, 128, "a tensor map must be 64-byte aligned".into()));
    }
    match param {
        Some(o) => {
            let o = o as usize;
            if o + TENSOR_MAP_BYTES > mem.params.len() {
                return Err(Fault::new(l as u32, "out-of-bounds parameter load", addr, 128, None));
            }
            b.copy_from_slice(&mem.params[o..o + TENSOR_MAP_BYTES]);
        }
        None => {
            let p = mem.check_global(addr, TENSOR_MAP_BYTES as u64, l as u32, false)?;
            for (k, c) in b.chunks_exact_mut(8).enumerate() {
                // SAFETY: `check_global` found the 128 bytes in one live allocation; `addr` is
                // 64-byte aligned, so each 8-byte load is aligned.
                let v = unsafe { memory::atomic_load(p.add(8 * k), 8) };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    TensorMap::decode(&b).map_err(|e| fault(l, BAD_MAP, addr, 128, e))
}

/// The barrier at `off` for an operation, or the misuse finding.
fn need_bar<'a>(st: &'a mut AsyncState, off: u32, l: usize, addr: u64, op: &str) -> Result<&'a mut Mbar, Fault> {
    let desc = st.describe(off);
    st.bar_mut(off)
        .ok_or_else(|| fault(l, MISUSE, addr, 8, format!("{op} on an mbarrier that is not initialised: {desc}")))
}

fn lane_addr(h: &HAddr, r: &[[u64; 32]], l: usize) -> u64 {
    r[h.a as usize][l].wrapping_add(h.off as u64)
}

/// Runs one Hopper instruction for the lanes of `exec` of warp `warp` (`live`: its lanes that
/// have not exited); `d` is the instruction's destination.
#[allow(clippy::too_many_arguments)]
pub(crate) fn exec(
    hi: &HInst,
    d: Slot,
    r: &mut [[u64; 32]],
    exec: u32,
    live: u32,
    warp: usize,
    pc: u32,
    mem: &mut Mem,
) -> Result<Flow, Fault> {
    if let HInst::SetMaxNreg { inc, n } = *hi {
        if exec != live {
            return Err(fault(
                exec.trailing_zeros() as usize,
                "warp collective divergence",
                0,
                0,
                format!("setmaxnreg is .sync.aligned: lanes {:#010x} of the warp are not executing it", live & !exec),
            ));
        }
        mem.shared.hopper.setmaxnreg[warp].push((pc, inc, n));
        return Ok(Flow::Next);
    }
    let mut flow = Flow::Next;
    let mut m = exec;
    while m != 0 {
        let l = m.trailing_zeros() as usize;
        m &= m - 1;
        if lane(hi, d, r, l, warp, pc, mem)? == Flow::Yield {
            flow = Flow::Yield;
        }
    }
    Ok(flow)
}

fn lane(
    hi: &HInst,
    d: Slot,
    r: &mut [[u64; 32]],
    l: usize,
    warp: usize,
    pc: u32,
    mem: &mut Mem,
) -> Result<Flow, Fault> {
    let val = |s: Slot, r: &[[u64; 32]]| r[s as usize][l];
    match *hi {
        HInst::MbarInit { bar, count } => {
            let off = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let addr = lane_addr(&bar, r, l);
            let n = val(count, r) & 0xffff_ffff;
            if n == 0 || n > TX_LIMIT as u64 {
                return Err(fault(l, MISUSE, addr, 8, format!("mbarrier.init count {n} is outside 1..=2^20-1")));
            }
            let st = &mut mem.shared.hopper;
            if let Some(b) = st.bars.get(&off).filter(|b| b.valid) {
                if b.pending != b.expected || b.tx != 0 {
                    return Err(fault(
                        l,
                        MISUSE,
                        addr,
                        8,
                        format!("mbarrier.init of a barrier in use: {}", st.describe(off)),
                    ));
                }
            }
            let id = st.next_id;
            st.next_id += 1;
            let nw = st.nwarps;
            let empty = || Know { vc: vec![0; nw], seen: Vec::new() };
            st.bars.insert(
                off,
                Mbar {
                    id,
                    valid: true,
                    expected: n as u32,
                    pending: n as u32,
                    tx: 0,
                    phase: 0,
                    acc: empty(),
                    done: [(u64::MAX, empty()), (u64::MAX, empty())],
                    init_pc: pc,
                },
            );
            st.changes += 1;
            mem.shared.mark_written(off as usize, 8);
            Ok(Flow::Next)
        }
        HInst::MbarInval { bar } => {
            let off = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let addr = lane_addr(&bar, r, l);
            let st = &mut mem.shared.hopper;
            need_bar(st, off, l, addr, "mbarrier.inval")?.valid = false;
            st.changes += 1;
            Ok(Flow::Next)
        }
        HInst::MbarArrive { bar, count, tx } => {
            let off = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let addr = lane_addr(&bar, r, l);
            let n = if count == NONE { 1 } else { val(count, r) & 0xffff_ffff };
            let t = if tx == NONE { 0 } else { (val(tx, r) & 0xffff_ffff) as i64 };
            let st = &mut mem.shared.hopper;
            let nw = st.nwarps;
            let k = st.know.get(warp).cloned();
            let b = need_bar(st, off, l, addr, "mbarrier.arrive")?;
            if n == 0 || n > b.pending as u64 {
                let desc =
                    format!("phase {}: {} of {} arrivals pending, tx-count {}", b.phase, b.pending, b.expected, b.tx);
                return Err(fault(
                    l,
                    MISUSE,
                    addr,
                    8,
                    format!("mbarrier.arrive with count {n} on the mbarrier at shared offset {off} ({desc})"),
                ));
            }
            if t > TX_LIMIT || b.tx + t > TX_LIMIT {
                return Err(fault(l, MISUSE, addr, 8, format!("the tx-count {} + {t} exceeds 2^20-1", b.tx)));
            }
            b.tx += t;
            b.pending -= n as u32;
            if b.pending == 0 && b.tx < 0 {
                let msg = format!(
                    "the last arrival of phase {} on the mbarrier at shared offset {off} leaves its tx-count at {}: more \
                     bytes completed than were expected",
                    b.phase, b.tx
                );
                return Err(fault(l, "mbarrier tx-count underflow", addr, 8, msg));
            }
            let state = (b.phase & 0xffff_ffff) | (b.id as u64) << 32;
            if let Some(k) = k {
                b.acc.join(&k, usize::MAX);
            }
            st.changes += 1;
            if warp < nw {
                st.know[warp].vc[warp] += 1;
            }
            st.maybe_complete(off);
            if d != NONE {
                r[d as usize][l] = state;
            }
            Ok(Flow::Next)
        }
        HInst::MbarExpectTx { bar, tx } | HInst::MbarCompleteTx { bar, tx } => {
            let complete = matches!(hi, HInst::MbarCompleteTx { .. });
            let off = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let addr = lane_addr(&bar, r, l);
            let t = (val(tx, r) & 0xffff_ffff) as i64;
            let st = &mut mem.shared.hopper;
            let op = if complete { "mbarrier.complete_tx" } else { "mbarrier.expect_tx" };
            let b = need_bar(st, off, l, addr, op)?;
            if complete {
                tx_complete(st, off, t, l, addr)?;
            } else {
                if b.tx + t > TX_LIMIT {
                    return Err(fault(l, MISUSE, addr, 8, format!("the tx-count {} + {t} exceeds 2^20-1", b.tx)));
                }
                b.tx += t;
                st.changes += 1;
            }
            Ok(Flow::Next)
        }
        HInst::MbarWait { bar, parity, x } => {
            let off = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let addr = lane_addr(&bar, r, l);
            let xv = val(x, r);
            let st = &mut mem.shared.hopper;
            let b = need_bar(st, off, l, addr, "mbarrier wait")?;
            let c = b.phase;
            // The phase the wait observes complete (None: it returns false, or true with nothing
            // to observe: the parity of the phase before the first).
            let (ok, observed) = if parity {
                let p = xv & 1;
                let ok = (c & 1) != p;
                (ok, if ok && c > 0 { Some(c - 1) } else { None })
            } else {
                let sid = (xv >> 32) as u32;
                if sid != b.id {
                    return Err(fault(
                        l,
                        MISUSE,
                        addr,
                        8,
                        format!(
                            "the state operand {xv:#x} did not come from an arrive on this mbarrier (its current \
                             incarnation was initialised at PTX instruction {})",
                            b.init_pc
                        ),
                    ));
                }
                // The state names the phase (its low 32 bits) the arrival belonged to.
                let sp = (c & !0xffff_ffff) | (xv & 0xffff_ffff);
                let sp = if sp > c { sp - (1 << 32) } else { sp };
                let ok = c > sp;
                (ok, if ok { Some(sp) } else { None })
            };
            if !ok {
                if warp < st.failed.len() {
                    st.failed[warp] = Some(FailedWait { pc, bar_off: off, x: xv, parity });
                }
                r[d as usize][l] = 0;
                return Ok(Flow::Yield);
            }
            if let Some(k) = observed {
                let id = b.id;
                let done = b.done.iter().find(|(p, _)| *p == k).map(|(_, kn)| kn.clone());
                if warp < st.nwarps {
                    let me = &mut st.know[warp];
                    let grew = done.is_some_and(|kn| me.join(&kn, warp));
                    me.observe(id, k + 1);
                    if grew && mem.shared.racecheck_on() {
                        // The wait orders another warp's accesses before this warp's: what
                        // racecheck's barrier intervals cannot express (see the module docs).
                        mem.shared.race.next_epoch();
                    }
                }
            }
            r[d as usize][l] = 1;
            Ok(Flow::Next)
        }
        HInst::TensorLoad { rank, dst, map, coords, bar } => {
            let boff = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let baddr = lane_addr(&bar, r, l);
            need_bar(&mut mem.shared.hopper, boff, l, baddr, "cp.async.bulk.tensor")?;
            let (m, _) = read_map_of_rank(mem, &map, r, l, rank)?;
            let total = m.box_bytes();
            let doff = shared_offset(mem.shared, &dst, r, l, total, 128, "cp.async.bulk.tensor destination")?;
            let start: Vec<i64> = coords[..rank as usize].iter().map(|&s| val(s, r) as u32 as i32 as i64).collect();
            let es = m.data_type.bytes() as usize;
            let mut buf = vec![0u8; total as usize];
            if m.oob_fill == OobFill::NanRequestZeroFma {
                let nan = m.data_type.nan_bits().to_le_bytes();
                for e in buf.chunks_exact_mut(es) {
                    e.copy_from_slice(&nan[..es]);
                }
            }
            let row_bytes = m.box_dims[0] as usize * es;
            let mut err = None;
            m.rows(&start, |row, g, lo, hi| {
                if err.is_some() || lo >= hi {
                    return;
                }
                let mut gg = *g;
                gg[0] += lo as i64;
                let a = m.element_address(&gg);
                let n = (hi - lo) as usize * es;
                match mem.check_global(a, n as u64, l as u32, false) {
                    Ok(p) => {
                        let at = row as usize * row_bytes + lo as usize * es;
                        for (k, e) in buf[at..at + n].chunks_exact_mut(es).enumerate() {
                            // SAFETY: `check_global` found the row's bytes in one live allocation;
                            // the address is a multiple of the element size (16-byte aligned base
                            // and strides).
                            let v = unsafe { memory::atomic_load(p.add(k * es), es as u8) };
                            e.copy_from_slice(&v.to_le_bytes()[..es]);
                        }
                    }
                    Err(f) => err = Some(f),
                }
            });
            if let Some(f) = err {
                return Err(f);
            }
            async_fill(mem, &buf, doff, m.swizzle, warp, pc, l, (boff, baddr))?;
            Ok(Flow::Next)
        }
        HInst::BulkLoad { dst, src, size, bar } => {
            let boff = shared_offset(mem.shared, &bar, r, l, 8, 8, "mbarrier")?;
            let baddr = lane_addr(&bar, r, l);
            need_bar(&mut mem.shared.hopper, boff, l, baddr, "cp.async.bulk")?;
            let n = val(size, r) & 0xffff_ffff;
            let saddr = lane_addr(&src, r, l);
            if !n.is_multiple_of(16) || !saddr.is_multiple_of(16) {
                return Err(fault(
                    l,
                    MISALIGNED,
                    saddr,
                    n as u32,
                    format!("cp.async.bulk needs a size ({n}) and a source address that are multiples of 16"),
                ));
            }
            let doff = shared_offset(mem.shared, &dst, r, l, n, 16, "cp.async.bulk destination")?;
            let mut buf = vec![0u8; n as usize];
            if n > 0 {
                let p = mem.check_global(saddr, n, l as u32, false)?;
                for (k, c) in buf.chunks_exact_mut(8).enumerate() {
                    // SAFETY: checked in one live allocation; 16-byte aligned source.
                    let v = unsafe { memory::atomic_load(p.add(8 * k), 8) };
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
            async_fill(mem, &buf, doff, Swizzle::None, warp, pc, l, (boff, baddr))?;
            Ok(Flow::Next)
        }
        HInst::TensorStore { rank, map, coords, src } => {
            let (m, _) = read_map_of_rank(mem, &map, r, l, rank)?;
            let total = m.box_bytes();
            let soff = shared_offset(mem.shared, &src, r, l, total, 128, "cp.async.bulk.tensor source")?;
            let saddr = lane_addr(&src, r, l);
            let start: Vec<i64> = coords[..rank as usize].iter().map(|&s| val(s, r) as u32 as i32 as i64).collect();
            let es = m.data_type.bytes() as usize;
            let row_bytes = m.box_dims[0] as usize * es;
            let len = mem.shared.bytes.len();
            let mut err = None;
            m.rows(&start, |row, g, lo, hi| {
                if err.is_some() || lo >= hi {
                    return;
                }
                let mut gg = *g;
                gg[0] += lo as i64;
                let a = m.element_address(&gg);
                let n = (hi - lo) as usize * es;
                let p = match mem.check_global(a, n as u64, l as u32, true) {
                    Ok(p) => p,
                    Err(f) => {
                        err = Some(f);
                        return;
                    }
                };
                for k in 0..(hi - lo) as usize {
                    let logical = soff as usize + row as usize * row_bytes + (lo as usize + k) * es;
                    let s = m.swizzle.apply(logical as u32) as usize;
                    if s + es > len {
                        err = Some(Fault::new(l as u32, "shared memory out of window", s as u64, es as u32, None));
                        return;
                    }
                    if !mem.shared.is_written(s, es) {
                        err = Some(fault(
                            l,
                            "uninitialized shared memory read",
                            saddr,
                            es as u32,
                            format!("the bulk tensor store reads shared bytes {s}..{} that nothing wrote", s + es),
                        ));
                        return;
                    }
                    let mut v = [0u8; 8];
                    v[..es].copy_from_slice(&mem.shared.bytes[s..s + es]);
                    // SAFETY: checked in one live allocation; element-aligned.
                    unsafe { memory::atomic_store(p.add(k * es), es as u8, u64::from_le_bytes(v)) };
                }
            });
            if let Some(f) = err {
                return Err(f);
            }
            Ok(Flow::Next)
        }
        HInst::BulkStore { dst, src, size } => {
            let n = val(size, r) & 0xffff_ffff;
            let daddr = lane_addr(&dst, r, l);
            if !n.is_multiple_of(16) || !daddr.is_multiple_of(16) {
                return Err(fault(
                    l,
                    MISALIGNED,
                    daddr,
                    n as u32,
                    format!("cp.async.bulk needs a size ({n}) and a destination address that are multiples of 16"),
                ));
            }
            let soff = shared_offset(mem.shared, &src, r, l, n, 16, "cp.async.bulk source")? as usize;
            if n == 0 {
                return Ok(Flow::Next);
            }
            if !mem.shared.is_written(soff, n as usize) {
                return Err(fault(
                    l,
                    "uninitialized shared memory read",
                    lane_addr(&src, r, l),
                    n as u32,
                    format!("the bulk store reads shared bytes {soff}..{} that nothing wrote", soff + n as usize),
                ));
            }
            let p = mem.check_global(daddr, n, l as u32, true)?;
            for k in 0..(n / 8) as usize {
                let v = u64::from_le_bytes(mem.shared.bytes[soff + 8 * k..soff + 8 * k + 8].try_into().expect("8"));
                // SAFETY: checked in one live allocation; 16-byte aligned.
                unsafe { memory::atomic_store(p.add(8 * k), 8, v) };
            }
            Ok(Flow::Next)
        }
        HInst::SetMaxNreg { .. } => Ok(Flow::Next),
    }
}

/// `complete_tx` of `t` bytes on the barrier at `off`.
fn tx_complete(st: &mut AsyncState, off: u32, t: i64, l: usize, addr: u64) -> Result<(), Fault> {
    let b = st.bars.get_mut(&off).expect("checked barrier");
    let after = b.tx - t;
    if (after < 0 && b.pending == 0) || after < -TX_LIMIT {
        return Err(fault(
            l,
            "mbarrier tx-count underflow",
            addr,
            8,
            format!(
                "{t} bytes complete on the mbarrier at shared offset {off} in phase {} whose tx-count is {} with {} of {} \
                 arrivals pending: more bytes arrive than were expected (expect_tx too small, or a copy larger than \
                 announced)",
                b.phase, b.tx, b.pending, b.expected
            ),
        ));
    }
    b.tx = after;
    st.changes += 1;
    st.maybe_complete(off);
    Ok(())
}

/// The destination side of a bulk copy: `buf` (the logical box) written to shared memory from
/// offset `doff` under `swizzle`, with the race checks, initcheck marks and the `complete_tx` of
/// `buf.len()` bytes on the barrier `(offset, address)`.
#[allow(clippy::too_many_arguments)]
fn async_fill(
    mem: &mut Mem,
    buf: &[u8],
    doff: u32,
    swizzle: Swizzle,
    warp: usize,
    pc: u32,
    l: usize,
    bar: (u32, u64),
) -> Result<(), Fault> {
    let len = mem.shared.bytes.len();
    let mut chunks = Vec::with_capacity(buf.len() / 16);
    for j in 0..buf.len() / 16 {
        let s = swizzle.apply(doff + 16 * j as u32) as usize;
        if s + 16 > len {
            return Err(Fault::new(l as u32, "shared memory out of window", s as u64, 16, None));
        }
        chunks.push(s / 16);
    }
    let st = &mut mem.shared.hopper;
    let b = st.bars.get(&bar.0).expect("checked barrier");
    let target = (b.id, b.phase, bar.0);
    if warp < st.nwarps {
        if let Err((c, msg, other)) = st.async_write(warp, pc, &chunks, target) {
            return Err(Fault { other: Some(other), ..fault(l, RACE, (16 * c) as u64, 16, msg) });
        }
        let k = st.know[warp].clone();
        st.bars.get_mut(&bar.0).expect("barrier").acc.join(&k, usize::MAX);
        st.know[warp].vc[warp] += 1;
    }
    for (j, &c) in chunks.iter().enumerate() {
        mem.shared.bytes[16 * c..16 * c + 16].copy_from_slice(&buf[16 * j..16 * j + 16]);
        mem.shared.mark_written(16 * c, 16);
    }
    tx_complete(&mut mem.shared.hopper, bar.0, buf.len() as i64, l, bar.1)
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    fn map() -> TensorMap {
        TensorMap::from_cuda_tiled(9, 3, 0x1000, &[64, 10, 3], &[128, 1280], &[64, 8, 2], &[1, 1, 1], 0, 3, 0, 0)
            .unwrap()
    }

    pub fn encode_decode_round_trip_and_corruption() {
        let m = map();
        let b = m.encode();
        assert_eq!(&b[0..4], b"PVTM");
        assert_eq!(TensorMap::decode(&b).unwrap(), m);
        for at in [0usize, 7, 20, 70, 100, 126] {
            let mut c = b;
            c[at] ^= 0x10;
            assert!(TensorMap::decode(&c).is_err(), "byte {at}");
        }
        assert!(TensorMap::decode(&[0u8; 128]).unwrap_err().contains("PVTM"));
    }

    pub fn validation_follows_cu_tensor_map_encode_tiled() {
        let ok = |dt, rank, addr, dims: &[u64], strides: &[u64], bx: &[u32], sw| {
            TensorMap::from_cuda_tiled(dt, rank, addr, dims, strides, bx, &[1; 5], 0, sw, 0, 0)
        };
        assert!(ok(9, 2, 0x1000, &[64, 4], &[128], &[64, 4], 3).is_ok());
        assert!(ok(9, 2, 0x1008, &[64, 4], &[128], &[64, 4], 3).unwrap_err().contains("16-byte"));
        assert!(ok(9, 2, 0x1000, &[64, 4], &[136], &[64, 4], 3).unwrap_err().contains("multiple of 16"));
        assert!(ok(9, 2, 0x1000, &[64, 4], &[1 << 40], &[64, 4], 3).unwrap_err().contains("2^40"));
        assert!(ok(9, 2, 0x1000, &[64, 4], &[128], &[64, 257], 3).unwrap_err().contains("1..=256"));
        assert!(ok(9, 2, 0x1000, &[64, 4], &[128], &[4, 4], 0).unwrap_err().contains("multiple of 16"));
        assert!(ok(7, 2, 0x1000, &[64, 4], &[256], &[64, 4], 3).unwrap_err().contains("swizzle span"));
        assert!(ok(7, 2, 0x1000, &[64, 4], &[256], &[32, 4], 3).is_ok());
        assert!(ok(7, 2, 0x1000, &[64, 4], &[64], &[32, 4], 0).unwrap_err().contains("smaller"));
        assert!(ok(7, 6, 0x1000, &[64, 4], &[256], &[32, 4], 0).is_err());
        assert!(ok(13, 2, 0x1000, &[64, 4], &[256], &[32, 4], 0).is_err());
        assert!(ok(7, 2, 0x1000, &[0, 4], &[256], &[32, 4], 0).is_err());
        let e = TensorMap::from_cuda_tiled(7, 2, 0x1000, &[64, 4], &[256], &[32, 4], &[1, 2], 0, 0, 0, 0);
        assert!(e.unwrap_err().contains("traversal"));
        let e = TensorMap::from_cuda_tiled(0, 2, 0x1000, &[64, 4], &[256], &[32, 4], &[1, 1], 0, 0, 0, 1);
        assert!(e.unwrap_err().contains("floating-point"));
        let e = TensorMap::from_cuda_tiled(7, 2, 0x1000, &[64, 4], &[256], &[32, 4], &[1, 1], 1, 0, 0, 0);
        assert!(e.unwrap_err().contains("interleave"));
    }

    pub fn rows_clip_to_the_tensor() {
        let m = TensorMap::from_cuda_tiled(7, 2, 0x1000, &[10, 5], &[48], &[8, 4], &[1, 1], 0, 0, 0, 0).unwrap();
        let mut seen = Vec::new();
        m.rows(&[-3, 3], |row, g, lo, hi| seen.push((row, g[1], lo, hi)));
        assert_eq!(seen, vec![(0, 3, 3, 8), (1, 4, 3, 8), (2, 5, 0, 0), (3, 6, 0, 0)]);
        let mut seen = Vec::new();
        m.rows(&[6, -1], |row, g, lo, hi| seen.push((row, g[1], lo, hi)));
        assert_eq!(seen, vec![(0, -1, 0, 0), (1, 0, 0, 4), (2, 1, 0, 4), (3, 2, 0, 4)]);
    }
}
