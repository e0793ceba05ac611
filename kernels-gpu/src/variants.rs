//! The variant table: the one place a kernel variant is listed.
//!
//! Each row names a PTX entry point, its family, its element type and its tile item (see
//! [`crate::tiles`]). Everything else derives from the table: [`KernelId`] and [`KernelId::ALL`],
//! the entry names, launch geometry and dynamic shared memory ([`Variant::launch`]), whether the
//! kernel must use tensor cores (checked in the SASS by `cargo xtask ptxas`), the host's kernel
//! selection ([`KernelId::flash_for`], [`KernelId::flash`], [`KernelId::naive`]; a row's
//! [`WindowRule`] says which windows it is chosen for), the tile record each entry exports into
//! the PTX ([`TileRecord`]), and — on nvptx64 — the `extern "ptx-kernel"` entry points themselves,
//! which call the family's generic body with the tile's constants.
//!
//! Adding a variant of an existing family (another head dim, say) is one row here plus, if the
//! family has no tile for it yet, one tile item in `tiles.rs`. See `docs/adding-a-kernel.md`.

use crate::tiles::*;

/// Element type of Q, K, V and O (LSE and the naive score matrix are always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    Bf16,
    F16,
    /// Decode rows only: an FP8 e4m3 KV cache (one byte per element, see [`crate::fp8`]) with
    /// bf16 Q, O, `k_new` and `v_new`.
    Fp8E4m3,
    /// Decode rows only: an FP8 e5m2 KV cache with bf16 Q, O, `k_new` and `v_new`.
    Fp8E5m2,
}

impl Elem {
    pub const fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
            Elem::F16 => "f16",
            Elem::Fp8E4m3 => "fp8_e4m3",
            Elem::Fp8E5m2 => "fp8_e5m2",
        }
    }
    /// Element type of Q and O: the type itself, bf16 for an FP8 cache.
    pub const fn qo(self) -> Elem {
        match self {
            Elem::Fp8E4m3 | Elem::Fp8E5m2 => Elem::Bf16,
            e => e,
        }
    }
    const fn eq(self, other: Elem) -> bool {
        self as u8 == other as u8
    }
}

/// A kernel family: one generic body, instantiated once per row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `saxpy_f32`, the smoke kernel (its own signature; written by hand in `smoke.rs`).
    Smoke,
    /// Naive step 1: `S = scale * Q Kᵀ` into the materialised score matrix.
    NaiveScores,
    /// Naive step 2: row softmax of S in place, writing LSE.
    NaiveSoftmax,
    /// Naive step 3: `O = P V`.
    NaivePv,
    /// Naive backward step 1: P recomputed from LSE into a materialised matrix (`naive_bwd.rs`;
    /// takes `NaiveBwdParams`).
    NaiveBwdP,
    /// Naive backward step 2: `dS · ds/dx` into a second matrix (`naive_bwd.rs`).
    NaiveBwdDs,
    /// Naive backward step 3: `dQ = dS K` (`naive_bwd.rs`).
    NaiveBwdDq,
    /// Naive backward step 4: `dK = dSᵀ Q`, `dV = Pᵀ dO`, GQA summed (`naive_bwd.rs`).
    NaiveBwdDkv,
    /// Fused memory-efficient forward, f32 SIMT (`flash_fwd_f32.rs`).
    FlashF32,
    /// Fused forward on tensor cores, `mma.sync` m16n8k16 (`flash_fwd_mma.rs`).
    FlashMma,
    /// Split-KV decode forward over a KV cache, SIMT (`decode_fwd.rs`; takes `DecodeParams`).
    DecodeFwd,
    /// The split-KV combine by log-sum-exp (`merge_states.rs`; takes `MergeParams`).
    MergeStates,
    /// KV-cache append of `k_new`, `v_new` (`decode_append.rs`; takes `DecodeParams`).
    DecodeAppend,
    /// Split-KV decode forward on tensor cores, `mma.sync` m16n8k16 (`decode_mma.rs`; takes
    /// `DecodeParams`, writes the partials `merge_states` combines, as `DecodeFwd` does).
    DecodeMma,
    /// Rotary embedding of `q` and `k_new` into copies before a KV-cache call's append
    /// (`decode_rotary.rs`; takes `DecodeParams`).
    DecodeRotary,
    /// Backward preprocess: `D = rowsum(dO ∘ O)`, the dQ accumulator zeroed
    /// (`flash_bwd_f32.rs`; takes `BwdParams`).
    BwdPre,
    /// Backward main kernel, f32 SIMT: dK, dV per key block, dQ by atomics (`flash_bwd_f32.rs`).
    FlashBwdF32,
    /// Backward convert: dQ accumulator to dQ (`flash_bwd_f32.rs`).
    BwdConvert,
    /// Backward main kernel on tensor cores, bf16/f16, one warp per 16 keys
    /// (`flash_bwd_mma.rs`; takes `BwdParams`): d32, and the compact rows of GPUs whose blocks
    /// get at most 99 KiB of shared memory.
    FlashBwdMma,
    /// Backward main kernel on tensor cores, bf16/f16, FlashAttention-2's two-dimensional warp
    /// layout (`flash_bwd_tc.rs`; takes `BwdParams`).
    FlashBwdTc,
    /// Fused forward for Hopper, TMA + `wgmma` + warp specialisation (`flash_fwd_sm90.rs`;
    /// takes `Sm90Params`; in the `sm_90a` module).
    FlashSm90,
    /// `DecodeMma` for an e4m3 cache built into the `sm_90a` module (`decode_mma.rs`): the same
    /// kernel with the cache widened by `cvt.rn.f16x2.e4m3x2` (sm_89+), one instruction per pair.
    DecodeMmaSm90,
    /// The device-side index check of a KV-cache call whose indices the host did not read
    /// (`kv_check.rs`; takes `DecodeParams`): sets the status words the call's other kernels
    /// obey.
    DecodeCheck,
    /// Stores the Hopper forward's tensor maps, given by value, into the slot its next launch
    /// reads (`tensor_maps.rs`; takes `TensorMapsParams`; in the `sm_90a` module).
    TensorMapStore,
}

/// The PTX module a row's entry point is built into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PtxModule {
    /// `memattn_kernels.ptx`, `.target sm_80`: every GPU from the A100 on.
    Sm80,
    /// `memattn_kernels_sm90.ptx`, `.target sm_90a`: Hopper only (H100, H200).
    Sm90a,
}

impl PtxModule {
    pub const ALL: [PtxModule; 2] = [PtxModule::Sm80, PtxModule::Sm90a];
    /// The `-C target-cpu` the module is built for.
    pub const fn target_cpu(self) -> &'static str {
        match self {
            PtxModule::Sm80 => "sm_80",
            PtxModule::Sm90a => "sm_90a",
        }
    }
    /// The committed file's name under `kernels-gpu/ptx/`.
    pub const fn file_name(self) -> &'static str {
        match self {
            PtxModule::Sm80 => "memattn_kernels.ptx",
            PtxModule::Sm90a => "memattn_kernels_sm90.ptx",
        }
    }
    /// The lowest compute capability (major, minor) that can load the module.
    pub const fn min_compute_capability(self) -> (u32, u32) {
        match self {
            PtxModule::Sm80 => (8, 0),
            PtxModule::Sm90a => (9, 0),
        }
    }
}

impl Family {
    pub const fn name(self) -> &'static str {
        match self {
            Family::Smoke => "smoke",
            Family::NaiveScores => "naive_scores",
            Family::NaiveSoftmax => "naive_softmax",
            Family::NaivePv => "naive_pv",
            Family::NaiveBwdP => "naive_bwd_p",
            Family::NaiveBwdDs => "naive_bwd_ds",
            Family::NaiveBwdDq => "naive_bwd_dq",
            Family::NaiveBwdDkv => "naive_bwd_dkv",
            Family::FlashF32 => "flash_f32",
            Family::FlashMma => "flash_mma",
            Family::DecodeFwd => "decode_fwd",
            Family::MergeStates => "merge_states",
            Family::DecodeAppend => "decode_append",
            Family::DecodeMma => "decode_mma",
            Family::DecodeRotary => "decode_rotary",
            Family::BwdPre => "bwd_pre",
            Family::FlashBwdF32 => "flash_bwd_f32",
            Family::BwdConvert => "bwd_convert",
            Family::FlashBwdMma => "flash_bwd_mma",
            Family::FlashBwdTc => "flash_bwd_tc",
            Family::FlashSm90 => "flash_sm90",
            Family::DecodeMmaSm90 => "decode_mma_sm90",
            Family::TensorMapStore => "tensor_map_store",
            Family::DecodeCheck => "decode_check",
        }
    }
    const fn eq(self, other: Family) -> bool {
        self as u8 == other as u8
    }
}

/// The tile item of a variant; the enum variant is the family's tile type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tile {
    Smoke(SmokeTile),
    NaiveScores(NaiveScoresTile),
    NaiveSoftmax(NaiveSoftmaxTile),
    NaivePv(NaivePvTile),
    NaiveBwdP(NaiveScoresTile),
    NaiveBwdDs(NaiveSoftmaxTile),
    NaiveBwdDq(NaivePvTile),
    NaiveBwdDkv(NaiveBwdKvTile),
    FlashF32(FlashF32Tile),
    FlashMma(FlashMmaTile),
    DecodeFwd(DecodeTile),
    MergeStates(MergeTile),
    DecodeAppend(AppendTile),
    DecodeMma(DecodeMmaTile),
    DecodeRotary(AppendTile),
    DecodeCheck(AppendTile),
    BwdPre(BwdRowsTile),
    FlashBwdF32(FlashBwdF32Tile),
    BwdConvert(BwdRowsTile),
    FlashBwdMma(FlashBwdMmaTile),
    FlashBwdTc(FlashBwdTcTile),
    FlashSm90(FlashSm90Tile),
    TensorMapStore(SmokeTile),
}

/// Which windows a row is chosen for, by [`KernelId::flash_for`]. A row without a rule in the
/// table is [`WindowRule::Any`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowRule {
    /// Every problem of the row's family, dtype and head dim: the default row, the one full and
    /// causal attention run on. Each (family, dtype, head dim) has exactly one.
    Any,
    /// Only windows bounded on both sides (causal counts as `right = 0`) of at most `keys` keys,
    /// `left + right + 1 <= keys`. A block of `BR` rows then visits about `BR + left + right`
    /// keys; a row with fewer rows per block than the default row's wastes fewer keys on the
    /// span, which pays for loading each K/V tile for fewer rows only while the span is short.
    Narrow { keys: u32 },
}

impl WindowRule {
    /// Whether a problem with window `(left, right)` (`-1` unbounded, causal already folded in as
    /// `right = 0`) is one this row is chosen for.
    pub const fn admits(self, left: i32, right: i32) -> bool {
        match self {
            WindowRule::Any => true,
            // The window spans `left + right + 1` keys.
            WindowRule::Narrow { keys } => left >= 0 && right >= 0 && (left as u64 + right as u64) < keys as u64,
        }
    }
    const fn is_any(self) -> bool {
        matches!(self, WindowRule::Any)
    }
}

/// One row of the variant table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub id: KernelId,
    /// The PTX entry-point name.
    pub name: &'static str,
    pub family: Family,
    pub elem: Elem,
    pub tile: Tile,
    /// Which windows the host chooses this row for ([`KernelId::flash_for`]).
    pub window: WindowRule,
}

/// The shape a launch covers (`seq_q` query rows and `seq_kv` keys per head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub batch: u32,
    pub heads: u32,
    pub seq_q: u32,
    pub seq_kv: u32,
}

impl Variant {
    /// Head dim the variant is compiled for (`None`: any, up to [`NAIVE_MAX_HEAD_DIM`]).
    pub const fn head_dim(&self) -> Option<u32> {
        match self.tile {
            Tile::FlashF32(t) => Some(t.head_dim),
            Tile::FlashMma(t) => Some(t.head_dim),
            Tile::DecodeFwd(t) => Some(t.head_dim),
            Tile::DecodeMma(t) => Some(t.head_dim),
            Tile::FlashBwdF32(t) => Some(t.head_dim),
            Tile::FlashBwdMma(t) => Some(t.head_dim),
            Tile::FlashBwdTc(t) => Some(t.head_dim),
            Tile::FlashSm90(t) => Some(t.head_dim),
            _ => None,
        }
    }

    /// Bytes of the kernel's by-value parameter struct (its one `.param`): [`crate::abi::AttnParams`]
    /// for naive and flash, [`crate::decode_abi::DecodeParams`] for decode and append,
    /// [`crate::decode_abi::MergeParams`] for the combine; the smoke kernel's four scalars take 24.
    pub const fn param_bytes(&self) -> usize {
        match self.family {
            Family::Smoke => 24,
            Family::DecodeFwd
            | Family::DecodeAppend
            | Family::DecodeMma
            | Family::DecodeRotary
            | Family::DecodeCheck
            | Family::DecodeMmaSm90 => crate::decode_abi::DECODE_PARAMS_BYTES,
            Family::MergeStates => crate::decode_abi::MERGE_PARAMS_BYTES,
            Family::NaiveBwdP | Family::NaiveBwdDs | Family::NaiveBwdDq | Family::NaiveBwdDkv => {
                crate::abi::NAIVE_BWD_PARAMS_BYTES
            }
            Family::BwdPre | Family::FlashBwdF32 | Family::BwdConvert | Family::FlashBwdMma | Family::FlashBwdTc => {
                crate::abi::BWD_PARAMS_BYTES
            }
            Family::FlashSm90 => crate::abi::SM90_PARAMS_BYTES,
            Family::TensorMapStore => crate::abi::TENSOR_MAPS_PARAMS_BYTES,
            _ => crate::abi::ATTN_PARAMS_BYTES,
        }
    }

    /// Whether the kernel is written for tensor cores (its SASS must contain HMMA, or HGMMA
    /// for the Hopper forward).
    pub const fn tensor_cores(&self) -> bool {
        matches!(
            self.tile,
            Tile::FlashMma(_) | Tile::DecodeMma(_) | Tile::FlashBwdMma(_) | Tile::FlashBwdTc(_) | Tile::FlashSm90(_)
        )
    }

    /// The PTX module the entry point is in.
    pub const fn module(&self) -> PtxModule {
        match self.family {
            Family::FlashSm90 | Family::DecodeMmaSm90 | Family::TensorMapStore => PtxModule::Sm90a,
            _ => PtxModule::Sm80,
        }
    }

    /// Threads per block.
    pub const fn threads(&self) -> u32 {
        match self.tile {
            Tile::Smoke(t) | Tile::TensorMapStore(t) => t.threads,
            Tile::NaiveScores(t) => t.threads,
            Tile::NaiveSoftmax(t) => t.threads(),
            Tile::NaivePv(t) => t.threads,
            Tile::NaiveBwdP(t) => t.threads,
            Tile::NaiveBwdDs(t) => t.threads(),
            Tile::NaiveBwdDq(t) => t.threads,
            Tile::NaiveBwdDkv(t) => t.threads,
            Tile::FlashF32(t) => t.threads(),
            Tile::FlashMma(t) => t.threads(),
            Tile::DecodeFwd(t) => t.threads(),
            Tile::MergeStates(t) => t.threads(),
            Tile::DecodeAppend(t) | Tile::DecodeRotary(t) | Tile::DecodeCheck(t) => t.threads,
            Tile::DecodeMma(t) => t.threads(),
            Tile::BwdPre(t) | Tile::BwdConvert(t) => t.threads(),
            Tile::FlashBwdF32(t) => t.threads(),
            Tile::FlashBwdMma(t) => t.threads(),
            Tile::FlashBwdTc(t) => t.threads(),
            Tile::FlashSm90(_) => FlashSm90Tile::THREADS,
        }
    }

    /// Blocks per SM the kernel is built for (0: no launch bounds beyond the sm_90a module's
    /// `.maxntid`; otherwise `.maxntid` and `.minnctapersm`). See
    /// [`FlashMmaTile::min_blocks_per_sm`].
    pub const fn min_blocks_per_sm(&self) -> u32 {
        match self.tile {
            Tile::FlashMma(t) => t.min_blocks_per_sm,
            _ => 0,
        }
    }

    /// Dynamic shared memory the launch requests (the tile's staging area), in bytes.
    pub const fn dynamic_smem_bytes(&self) -> u32 {
        match self.tile {
            Tile::FlashF32(t) => t.smem_bytes(),
            Tile::FlashMma(t) => t.smem_bytes(),
            Tile::DecodeFwd(t) => t.smem_bytes(),
            Tile::DecodeMma(t) => t.smem_bytes(),
            Tile::FlashBwdF32(t) => t.smem_bytes(),
            Tile::FlashBwdMma(t) => t.smem_bytes(),
            Tile::FlashBwdTc(t) => t.smem_bytes(),
            Tile::FlashSm90(t) => t.smem_bytes(),
            _ => 0,
        }
    }

    /// Query rows one block owns (flash families), 0 otherwise.
    pub const fn block_rows(&self) -> u32 {
        match self.tile {
            Tile::FlashF32(t) => t.br,
            Tile::FlashMma(t) => t.br,
            Tile::DecodeFwd(t) => t.br(),
            Tile::DecodeMma(t) => t.br(),
            Tile::FlashBwdF32(t) => t.br,
            Tile::FlashBwdMma(t) => t.br,
            Tile::FlashBwdTc(_) => FlashBwdTcTile::BR,
            Tile::FlashSm90(_) => FlashSm90Tile::BR,
            Tile::BwdPre(t) | Tile::BwdConvert(t) => t.rows,
            _ => 0,
        }
    }

    /// Keys per tile step (flash families), 0 otherwise.
    pub const fn block_cols(&self) -> u32 {
        match self.tile {
            Tile::FlashF32(t) => t.bc,
            Tile::FlashMma(t) => t.bc,
            Tile::DecodeFwd(t) => t.bc,
            Tile::DecodeMma(t) => t.bc,
            Tile::FlashBwdF32(t) => t.bc,
            Tile::FlashBwdMma(t) => t.bc(),
            Tile::FlashBwdTc(t) => t.bc,
            Tile::FlashSm90(t) => t.bc,
            _ => 0,
        }
    }

    /// Grid, block and dynamic shared memory of one attention launch; `None` for the smoke kernel
    /// (see [`saxpy_launch`]) and the decode families, whose grids depend on the split plan and the
    /// cache (see [`DecodeTile::launch`], [`MergeTile::launch`], [`AppendTile::launch`]). Grid extents are computed in 64 bits and saturate at `u32::MAX`, so
    /// an oversized shape shows up as a grid over the device limit, never as a wrapped small grid.
    pub const fn launch(&self, s: LaunchShape) -> Option<LaunchDims> {
        let bh = sat_u32(s.batch as u64 * s.heads as u64);
        let block = [self.threads(), 1, 1];
        let dynamic_smem_bytes = self.dynamic_smem_bytes();
        let grid = match self.tile {
            Tile::Smoke(_)
            | Tile::TensorMapStore(_)
            | Tile::DecodeFwd(_)
            | Tile::MergeStates(_)
            | Tile::DecodeAppend(_)
            | Tile::DecodeMma(_)
            | Tile::DecodeRotary(_)
            | Tile::DecodeCheck(_) => return None,
            // The backward's grids: [`FlashBwdF32Tile::launch`] (over keys and K/V heads) and
            // [`BwdRowsTile::launch`] (over query rows), through [`KernelId::flash_bwd`].
            Tile::BwdPre(_)
            | Tile::FlashBwdF32(_)
            | Tile::BwdConvert(_)
            | Tile::FlashBwdMma(_)
            | Tile::FlashBwdTc(_) => return None,
            Tile::NaiveScores(t) => [s.seq_q, s.seq_kv.div_ceil(t.threads), bh],
            Tile::NaiveSoftmax(t) => [s.seq_q.div_ceil(t.rows), 1, bh],
            Tile::NaivePv(_) => [s.seq_q, 1, bh],
            Tile::NaiveBwdP(t) => [s.seq_q, s.seq_kv.div_ceil(t.threads), bh],
            Tile::NaiveBwdDs(t) => [s.seq_q.div_ceil(t.rows), 1, bh],
            Tile::NaiveBwdDq(_) => [s.seq_q, 1, bh],
            // Over keys and K/V heads: [`NaiveBwdKvTile::launch`], through [`KernelId::naive_bwd`].
            Tile::NaiveBwdDkv(_) => return None,
            Tile::FlashF32(t) => return Some(t.launch(s.batch, s.heads, s.seq_q)),
            Tile::FlashMma(t) => return Some(t.launch(s.batch, s.heads, s.seq_q)),
            Tile::FlashSm90(t) => return Some(t.launch(s.batch, s.heads, s.seq_q)),
        };
        Some(LaunchDims { grid, block, dynamic_smem_bytes })
    }

    /// The record of this variant's tile that the kernel build exports into the PTX.
    pub const fn tile_record(&self) -> TileRecord {
        TileRecord {
            threads: self.threads(),
            block_rows: self.block_rows(),
            block_cols: self.block_cols(),
            dynamic_smem_bytes: self.dynamic_smem_bytes(),
            head_dim: match self.head_dim() {
                Some(d) => d,
                None => 0,
            },
        }
    }
}

const fn sat_u32(x: u64) -> u32 {
    if x > u32::MAX as u64 {
        u32::MAX
    } else {
        x as u32
    }
}

/// The tile constants a kernel was compiled with, exported into the PTX as the global
/// `memattn_tile_<entry>` (5 × u32, little-endian: threads, block rows, block cols, dynamic shared
/// memory bytes, head dim). The host compares it with its own table before launching a `--ptx`
/// module, so a module built from other tiles is refused with a clear message instead of failing
/// inside the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct TileRecord {
    pub threads: u32,
    pub block_rows: u32,
    pub block_cols: u32,
    pub dynamic_smem_bytes: u32,
    pub head_dim: u32,
}

impl TileRecord {
    /// Prefix of the exported global's name; the entry name follows.
    pub const SYMBOL_PREFIX: &'static str = "memattn_tile_";
    pub const fn to_array(self) -> [u32; 5] {
        [self.threads, self.block_rows, self.block_cols, self.dynamic_smem_bytes, self.head_dim]
    }
    pub const fn from_array(a: [u32; 5]) -> Self {
        TileRecord { threads: a[0], block_rows: a[1], block_cols: a[2], dynamic_smem_bytes: a[3], head_dim: a[4] }
    }
}

macro_rules! count {
    () => { 0usize };
    ($head:tt $($tail:tt)*) => { 1usize + count!($($tail)*) };
}

/// Expands the table into [`KernelId`], [`VARIANTS`] and (on nvptx64) the entry points with their
/// tile records.
macro_rules! kernel_table {
    ($( $(#[$doc:meta])* $id:ident = $name:ident : $family:ident($tile:expr), $elem:ident $(, $rule:expr)?; )*) => {
        /// Every kernel entry point in the PTX module, one per row of the variant table.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum KernelId {
            $( $(#[$doc])* $id, )*
        }

        /// The variant table, in [`KernelId`] order.
        pub const VARIANTS: [Variant; count!($($id)*)] = [
            $( Variant {
                id: KernelId::$id,
                name: stringify!($name),
                family: Family::$family,
                elem: Elem::$elem,
                tile: crate::variants::tile_of!($family, $tile),
                window: crate::variants::rule_or_any!($($rule)?),
            }, )*
        ];

        impl KernelId {
            /// Every kernel, in table order.
            pub const ALL: [KernelId; count!($($id)*)] = [ $( KernelId::$id, )* ];
        }

        $(
            crate::variants::module_entry!($family, $name, $elem, $tile);
        )*
    };
}

/// A row's entry point, in the build of its module: the `sm_90a` rows when the crate is built
/// with `--cfg memattn_sm90` (`cargo xtask build-ptx`'s second build), every other row without.
macro_rules! module_entry {
    // The Hopper rows of `crate::timeline::TIMELINE_KERNELS`: also in the sm_90a timeline build.
    (FlashSm90, flash_fwd_bf16_sm90_d128, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", memattn_sm90))]
        crate::variants::entry!(FlashSm90, flash_fwd_bf16_sm90_d128, $($rest)*);
    };
    (FlashSm90, flash_fwd_f16_sm90_d128, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", memattn_sm90))]
        crate::variants::entry!(FlashSm90, flash_fwd_f16_sm90_d128, $($rest)*);
    };
    (FlashSm90, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", memattn_sm90, not(memattn_timeline)))]
        crate::variants::entry!(FlashSm90, $($rest)*);
    };
    (DecodeMmaSm90, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", memattn_sm90, not(memattn_timeline)))]
        crate::variants::entry!(DecodeMma, $($rest)*);
    };
    (TensorMapStore, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", memattn_sm90))]
        crate::variants::entry!(TensorMapStore, $($rest)*);
    };
    // The rows of `crate::timeline::TIMELINE_KERNELS`: also in the timeline build.
    (FlashMma, flash_fwd_bf16_d128, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", not(memattn_sm90)))]
        crate::variants::entry!(FlashMma, flash_fwd_bf16_d128, $($rest)*);
    };
    (FlashMma, flash_fwd_f16_d128, $($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", not(memattn_sm90)))]
        crate::variants::entry!(FlashMma, flash_fwd_f16_d128, $($rest)*);
    };
    ($($rest:tt)*) => {
        #[cfg(all(target_arch = "nvptx64", not(memattn_sm90), not(memattn_timeline)))]
        crate::variants::entry!($($rest)*);
    };
}
pub(crate) use module_entry;

/// A row's [`Tile`]: the enum variant of its family's tile type (`DecodeMmaSm90` rows have the
/// `DecodeMma` tile).
macro_rules! tile_of {
    (DecodeMmaSm90, $tile:expr) => {
        Tile::DecodeMma($tile)
    };
    ($family:ident, $tile:expr) => {
        Tile::$family($tile)
    };
}
pub(crate) use tile_of;

/// A row's [`WindowRule`]: the one it names, else [`WindowRule::Any`].
macro_rules! rule_or_any {
    () => {
        WindowRule::Any
    };
    ($rule:expr) => {
        $rule
    };
}
pub(crate) use rule_or_any;

/// The entry point of one row on nvptx64: a `#[no_mangle] extern "ptx-kernel"` function calling
/// the family's generic body with the tile's constants, and the exported [`TileRecord`].
#[cfg(target_arch = "nvptx64")]
macro_rules! entry {
    (FlashSm90, $name:ident, $elem:ident, $tile:expr) => {
        crate::variants::entry_sm90!($name, $elem, $tile);
    };
    (Smoke, $name:ident, $elem:ident, $tile:expr) => {
        // Written by hand in `smoke.rs` (it takes four scalar parameters, not `AttnParams`).
        crate::variants::tile_record!($name);
    };
    (TensorMapStore, $name:ident, $elem:ident, $tile:expr) => {
        // Written by hand in `tensor_maps.rs` (it takes `TensorMapsParams`).
        crate::variants::tile_record!($name);
    };
    (NaiveScores, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_scores`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::AttnParams) {
            const T: NaiveScoresTile = $tile;
            unsafe { crate::naive_scores::scores::<crate::device::$elem, { T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (NaiveSoftmax, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_softmax`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::AttnParams) {
            const T: NaiveSoftmaxTile = $tile;
            unsafe { crate::naive_softmax::softmax::<{ T.rows }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (NaivePv, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_pv`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::AttnParams) {
            const T: NaivePvTile = $tile;
            unsafe { crate::naive_pv::pv::<crate::device::$elem, { T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (NaiveBwdP, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_bwd`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::NaiveBwdParams) {
            const T: NaiveScoresTile = $tile;
            unsafe { crate::naive_bwd::probs::<{ T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (NaiveBwdDs, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_bwd`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::NaiveBwdParams) {
            const T: NaiveSoftmaxTile = $tile;
            unsafe { crate::naive_bwd::ds::<{ T.rows }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (NaiveBwdDq, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_bwd`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::NaiveBwdParams) {
            const T: NaivePvTile = $tile;
            unsafe { crate::naive_bwd::dq::<{ T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (NaiveBwdDkv, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::naive_bwd`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::NaiveBwdParams) {
            const T: NaiveBwdKvTile = $tile;
            unsafe { crate::naive_bwd::dkv::<{ T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (FlashF32, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_fwd_f32`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::AttnParams) {
            const T: FlashF32Tile = $tile;
            unsafe {
                crate::flash_fwd_f32::flash_fwd::<
                    { T.head_dim as usize },
                    { T.br as usize },
                    { T.bc as usize },
                    { T.threads_per_row as usize },
                    { T.dims_per_thread() as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
    (FlashMma, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_fwd_mma`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::AttnParams) {
            const T: FlashMmaTile = $tile;
            // A KV-cache call whose device-side index check refused it (prefill over a cache).
            if unsafe { crate::device::kv_refused(p.status) } {
                return;
            }
            unsafe {
                crate::flash_fwd_mma::flash_fwd::<
                    crate::device::$elem,
                    { T.head_dim as usize },
                    { T.br as usize },
                    { T.bc as usize },
                    { T.threads() as usize },
                    { (T.head_dim / 16) as usize },
                    { (T.head_dim / 8) as usize },
                    { (T.bc / 8) as usize },
                    { T.m_tiles() as usize },
                    { T.q_reg_ksteps as usize },
                    { T.keys_backward },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
    (DecodeFwd, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::decode_fwd`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::decode_abi::DecodeParams) {
            const T: DecodeTile = $tile;
            if unsafe { crate::device::kv_refused(p.status) } {
                return;
            }
            unsafe {
                crate::decode_fwd::decode_fwd::<
                    crate::decode_fwd::elem::$elem,
                    { T.head_dim as usize },
                    { T.br() as usize },
                    { T.bc as usize },
                    { T.threads_per_row as usize },
                    { T.dims_per_thread() as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
    (MergeStates, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::merge_states`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::decode_abi::MergeParams) {
            const T: MergeTile = $tile;
            if unsafe { crate::device::kv_refused(p.status) } {
                return;
            }
            unsafe { crate::merge_states::merge_states::<crate::device::$elem, { T.rows }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (DecodeAppend, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::decode_append`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::decode_abi::DecodeParams) {
            const T: AppendTile = $tile;
            if unsafe { crate::device::kv_refused(p.status) } {
                return;
            }
            unsafe { crate::decode_append::append::<crate::decode_fwd::elem::$elem, { T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (DecodeRotary, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::decode_rotary`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::decode_abi::DecodeParams) {
            const T: AppendTile = $tile;
            if unsafe { crate::device::kv_refused(p.status) } {
                return;
            }
            unsafe { crate::decode_rotary::rotary::<crate::device::$elem, { T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (DecodeCheck, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::kv_check`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::decode_abi::DecodeParams) {
            const T: AppendTile = $tile;
            unsafe { crate::kv_check::check::<crate::device::$elem, { T.threads }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (DecodeMma, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::decode_mma`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::decode_abi::DecodeParams) {
            const T: DecodeMmaTile = $tile;
            if unsafe { crate::device::kv_refused(p.status) } {
                return;
            }
            unsafe {
                crate::decode_mma::decode_mma::<
                    crate::decode_fwd::elem::$elem,
                    { T.head_dim as usize },
                    { T.bc as usize },
                    { (T.head_dim / 16) as usize },
                    { (T.head_dim / 8) as usize },
                    { (T.keys_per_warp() / 8) as usize },
                    { (T.bc * T.head_dim / 8 / T.threads()) as usize },
                    { T.stages as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
    (BwdPre, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_bwd_f32`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::BwdParams) {
            const T: BwdRowsTile = $tile;
            unsafe { crate::flash_bwd_f32::preprocess::<crate::device::$elem, { T.rows as usize }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (BwdConvert, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_bwd_f32`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::BwdParams) {
            const T: BwdRowsTile = $tile;
            unsafe { crate::flash_bwd_f32::convert_dq::<crate::device::$elem, { T.rows as usize }>(&p) }
        }
        crate::variants::tile_record!($name);
    };
    (FlashBwdF32, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_bwd_f32`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::BwdParams) {
            const T: FlashBwdF32Tile = $tile;
            unsafe {
                crate::flash_bwd_f32::flash_bwd::<
                    { T.head_dim as usize },
                    { T.br as usize },
                    { T.bc as usize },
                    { T.threads_per_key as usize },
                    { T.dims_per_thread() as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
    (FlashBwdMma, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_bwd_mma`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::BwdParams) {
            const T: FlashBwdMmaTile = $tile;
            unsafe {
                crate::flash_bwd_mma::flash_bwd::<
                    crate::device::$elem,
                    { T.head_dim as usize },
                    { T.br as usize },
                    { T.bc() as usize },
                    { T.threads() as usize },
                    { (T.head_dim / 16) as usize },
                    { (T.head_dim / 8) as usize },
                    { (T.br / 8) as usize },
                    { T.dq_dtiles() as usize },
                    { T.dkv_dtiles() as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
    (FlashBwdTc, $name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_bwd_tc`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::BwdParams) {
            const T: FlashBwdTcTile = $tile;
            unsafe {
                crate::flash_bwd_tc::flash_bwd::<
                    crate::device::$elem,
                    { T.head_dim as usize },
                    { T.bc as usize },
                    { (T.head_dim / 16) as usize },
                    { (T.bc / 64) as usize },
                    { T.dkv_key_warps() as usize },
                    { T.dkv_dtiles() as usize },
                    { (T.head_dim / 16) as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
}
#[cfg(target_arch = "nvptx64")]
pub(crate) use entry;

/// The Hopper rows' entry points (in the `sm_90a` build only, see [`module_entry`]).
#[cfg(all(target_arch = "nvptx64", memattn_sm90))]
macro_rules! entry_sm90 {
    ($name:ident, $elem:ident, $tile:expr) => {
        #[doc = concat!("`", stringify!($name), "`: see [`crate::flash_fwd_sm90`].")]
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: crate::abi::Sm90Params) {
            const T: FlashSm90Tile = $tile;
            unsafe {
                crate::flash_fwd_sm90::flash_fwd_sm90::<
                    crate::device::$elem,
                    { T.head_dim as usize },
                    { T.bc as usize },
                    { (T.bc / 8) as usize },
                    { (T.head_dim / 8) as usize },
                >(&p)
            }
        }
        crate::variants::tile_record!($name);
    };
}
#[cfg(all(target_arch = "nvptx64", memattn_sm90))]
pub(crate) use entry_sm90;

/// Exports `memattn_tile_<name>`: the [`TileRecord`] of the row whose entry is `name`.
#[cfg(target_arch = "nvptx64")]
macro_rules! tile_record {
    ($name:ident) => {
        const _: () = {
            #[export_name = concat!("memattn_tile_", stringify!($name))]
            #[used]
            pub static TILE_RECORD: [u32; 5] = match KernelId::from_name_const(stringify!($name)) {
                Some(k) => k.variant().tile_record().to_array(),
                None => panic!("entry missing from the table"),
            };
        };
    };
}
#[cfg(target_arch = "nvptx64")]
pub(crate) use tile_record;

// The narrow-window rows' rules. Warps skip the key tiles outside their own rows' windows, so a
// narrow window costs each warp its rows plus the window whatever the block's height; the narrow
// rows (fewer warps, or Bc 32 at d192/d256) win only where a finer block or key tile wastes less
// than its extra K/V loads cost. Each bound is the measured crossover: VM thread-instructions,
// bf16, seq 4096, causal windows `(L, 0)`, the narrow row against the default row
// (`memattn --backend vm --json run --dtype bf16 --head-dim D --seq 4096 --heads 1 --window L,0`).
// At d64 the default row is the cheaper one at every L measured (7 to 511), so d64 has no narrow
// row (docs/semantics.md, "Which kernel runs").

/// d32 (Br 64 against 128): windows of at most 96 keys. 7.80 M / 7.83 M at `L = 7`, 8.57 M /
/// 8.59 M at `L = 63`, 10.79 M / 10.77 M at `L = 127`, 15.14 M / 15.02 M at `L = 255`.
pub const NARROW_WINDOW_D32: WindowRule = WindowRule::Narrow { keys: 96 };

/// d96 (Br 96 against 192): windows of at most 192 keys. 10.05 M / 10.44 M at `L = 7`, 11.58 M /
/// 11.90 M at `L = 63`, 15.14 M / 15.34 M at `L = 127`, 22.10 M / 22.06 M at `L = 255`. Against
/// today's default row (Br 64, 4 warps x 16 rows, three blocks per SM) the narrow row takes fewer
/// VM instructions at every `L` measured: 10.76 M / 15.09 M at `L = 7`, 15.86 M / 21.98 M at
/// `L = 127`, 22.82 M / 30.86 M at `L = 255`, 36.04 M / 47.75 M at `L = 511`; the rule stays at
/// 192 keys until a GPU measures the crossover (the narrow row runs at 255 registers).
pub const NARROW_WINDOW_D96: WindowRule = WindowRule::Narrow { keys: 192 };

/// d128 (Br 64 against 256): windows of at most 96 keys. 11.75 M / 12.10 M at `L = 7`, 13.72 M /
/// 13.86 M at `L = 63`, 18.14 M / 17.87 M at `L = 127`, 26.76 M / 25.71 M at `L = 255`.
pub const NARROW_WINDOW_D128: WindowRule = WindowRule::Narrow { keys: 96 };

/// d192 (Bc 32 against 64 in the 96-row block the default row had then: a finer key tile wastes less of a narrow
/// window, at the cost of more key tiles per key): windows of at most 320 keys. 15.6 M / 18.2 M at `L = 31`, 36.1 M / 36.7 M at `L = 255`, 47.2 M / 46.8 M at `L = 383`,
/// 58.0 M / 56.6 M at `L = 511`. Against today's default row (Br 64, 4 warps x 16 rows, Bc 64,
/// two blocks per SM) the narrow row takes fewer VM instructions at every `L` measured: 16.26 M /
/// 20.94 M at `L = 7`, 38.31 M / 42.99 M at `L = 255`, 60.71 M / 66.31 M at `L = 511`; the rule
/// stays at 320 keys until a GPU measures the crossover (the narrow row: 6 warps, one block per SM).
pub const NARROW_WINDOW_D192: WindowRule = WindowRule::Narrow { keys: 320 };

/// d256 (Bc 32 against 64, the same 128-row block): windows of at most 192 keys. 18.8 M / 21.6 M at
/// `L = 31`, 29.9 M / 31.3 M at `L = 127`, 44.3 M / 44.2 M at `L = 255`, 71.8 M / 68.7 M at
/// `L = 511`.
pub const NARROW_WINDOW_D256: WindowRule = WindowRule::Narrow { keys: 192 };

// The table. Rows: `Id = entry_name: Family(TILE_ITEM), Elem;`, or with a [`WindowRule`] after
// the element type for a row chosen only for some windows (`KernelId::flash_for`).
kernel_table! {
    /// Smoke test kernel: `y[i] = a * x[i] + y[i]` (see `smoke.rs`).
    Saxpy = saxpy_f32: Smoke(SAXPY), F32;
    /// Naive step 1: `S = scale * Q Kᵀ` with the causal mask as `-inf`.
    NaiveScoresF32 = naive_scores_f32: NaiveScores(NAIVE_SCORES), F32;
    /// Naive step 2: row softmax of S in place, writing LSE (shared by every dtype).
    NaiveSoftmaxF32 = naive_softmax_f32: NaiveSoftmax(NAIVE_SOFTMAX), F32;
    /// Naive step 3: `O = P V`.
    NaivePvF32 = naive_pv_f32: NaivePv(NAIVE_PV), F32;
    /// Fused memory-efficient forward, f32 SIMT, head_dim 64.
    FlashFwdF32D64 = flash_fwd_f32_d64: FlashF32(FLASH_F32_D64), F32;
    /// Fused memory-efficient forward, f32 SIMT, head_dim 128.
    FlashFwdF32D128 = flash_fwd_f32_d128: FlashF32(FLASH_F32_D128), F32;
    /// Fused forward on tensor cores (`mma.sync`), bf16 in/out, f32 accumulation, head_dim 64.
    FlashFwdBf16D64 = flash_fwd_bf16_d64: FlashMma(FLASH_MMA_D64), Bf16;
    /// Tensor-core forward, bf16, head_dim 128.
    FlashFwdBf16D128 = flash_fwd_bf16_d128: FlashMma(FLASH_MMA_D128), Bf16;
    /// Tensor-core forward, f16 in/out, f32 accumulation, head_dim 64.
    FlashFwdF16D64 = flash_fwd_f16_d64: FlashMma(FLASH_MMA_D64), F16;
    /// Tensor-core forward, f16, head_dim 128.
    FlashFwdF16D128 = flash_fwd_f16_d128: FlashMma(FLASH_MMA_D128), F16;
    /// Tensor-core forward, bf16, head_dim 32.
    FlashFwdBf16D32 = flash_fwd_bf16_d32: FlashMma(FLASH_MMA_D32), Bf16;
    /// Tensor-core forward, bf16, head_dim 96.
    FlashFwdBf16D96 = flash_fwd_bf16_d96: FlashMma(FLASH_MMA_D96), Bf16;
    /// Tensor-core forward, bf16, head_dim 192.
    FlashFwdBf16D192 = flash_fwd_bf16_d192: FlashMma(FLASH_MMA_D192), Bf16;
    /// Tensor-core forward, bf16, head_dim 256.
    FlashFwdBf16D256 = flash_fwd_bf16_d256: FlashMma(FLASH_MMA_D256), Bf16;
    /// Tensor-core forward, f16, head_dim 32.
    FlashFwdF16D32 = flash_fwd_f16_d32: FlashMma(FLASH_MMA_D32), F16;
    /// Tensor-core forward, f16, head_dim 96.
    FlashFwdF16D96 = flash_fwd_f16_d96: FlashMma(FLASH_MMA_D96), F16;
    /// Tensor-core forward, f16, head_dim 192.
    FlashFwdF16D192 = flash_fwd_f16_d192: FlashMma(FLASH_MMA_D192), F16;
    /// Tensor-core forward, f16, head_dim 256.
    FlashFwdF16D256 = flash_fwd_f16_d256: FlashMma(FLASH_MMA_D256), F16;
    /// Tensor-core forward, bf16, head_dim 32, 64-row blocks: chosen for narrow windows.
    FlashFwdBf16D32Window = flash_fwd_bf16_d32_window: FlashMma(FLASH_MMA_D32_WINDOW), Bf16, NARROW_WINDOW_D32;
    /// Tensor-core forward, f16, head_dim 32, 64-row blocks: chosen for narrow windows.
    FlashFwdF16D32Window = flash_fwd_f16_d32_window: FlashMma(FLASH_MMA_D32_WINDOW), F16, NARROW_WINDOW_D32;
    /// Tensor-core forward, bf16, head_dim 96, 96-row blocks: chosen for narrow windows.
    FlashFwdBf16D96Window = flash_fwd_bf16_d96_window: FlashMma(FLASH_MMA_D96_WINDOW), Bf16, NARROW_WINDOW_D96;
    /// Tensor-core forward, f16, head_dim 96, 96-row blocks: chosen for narrow windows.
    FlashFwdF16D96Window = flash_fwd_f16_d96_window: FlashMma(FLASH_MMA_D96_WINDOW), F16, NARROW_WINDOW_D96;
    /// Tensor-core forward, bf16, head_dim 128, 64-row blocks: chosen for narrow windows.
    FlashFwdBf16D128Window = flash_fwd_bf16_d128_window: FlashMma(FLASH_MMA_D128_WINDOW), Bf16, NARROW_WINDOW_D128;
    /// Tensor-core forward, f16, head_dim 128, 64-row blocks: chosen for narrow windows.
    FlashFwdF16D128Window = flash_fwd_f16_d128_window: FlashMma(FLASH_MMA_D128_WINDOW), F16, NARROW_WINDOW_D128;
    /// Tensor-core forward, bf16, head_dim 192, key tiles of 32: chosen for narrow windows.
    FlashFwdBf16D192Window = flash_fwd_bf16_d192_window: FlashMma(FLASH_MMA_D192_WINDOW), Bf16, NARROW_WINDOW_D192;
    /// Tensor-core forward, f16, head_dim 192, key tiles of 32: chosen for narrow windows.
    FlashFwdF16D192Window = flash_fwd_f16_d192_window: FlashMma(FLASH_MMA_D192_WINDOW), F16, NARROW_WINDOW_D192;
    /// Tensor-core forward, bf16, head_dim 256, key tiles of 32: chosen for narrow windows.
    FlashFwdBf16D256Window = flash_fwd_bf16_d256_window: FlashMma(FLASH_MMA_D256_WINDOW), Bf16, NARROW_WINDOW_D256;
    /// Tensor-core forward, f16, head_dim 256, key tiles of 32: chosen for narrow windows.
    FlashFwdF16D256Window = flash_fwd_f16_d256_window: FlashMma(FLASH_MMA_D256_WINDOW), F16, NARROW_WINDOW_D256;
    /// Fused forward, f32 SIMT, head_dim 32.
    FlashFwdF32D32 = flash_fwd_f32_d32: FlashF32(FLASH_F32_D32), F32;
    /// Fused forward, f32 SIMT, head_dim 96.
    FlashFwdF32D96 = flash_fwd_f32_d96: FlashF32(FLASH_F32_D96), F32;
    /// Fused forward, f32 SIMT, head_dim 192.
    FlashFwdF32D192 = flash_fwd_f32_d192: FlashF32(FLASH_F32_D192), F32;
    /// Fused forward, f32 SIMT, head_dim 256.
    FlashFwdF32D256 = flash_fwd_f32_d256: FlashF32(FLASH_F32_D256), F32;
    /// Naive step 1 with bf16 Q, K (S stays f32).
    NaiveScoresBf16 = naive_scores_bf16: NaiveScores(NAIVE_SCORES), Bf16;
    /// Naive step 1 with f16 Q, K.
    NaiveScoresF16 = naive_scores_f16: NaiveScores(NAIVE_SCORES), F16;
    /// Naive step 3 with bf16 V, O (P stays f32).
    NaivePvBf16 = naive_pv_bf16: NaivePv(NAIVE_PV), Bf16;
    /// Naive step 3 with f16 V, O.
    NaivePvF16 = naive_pv_f16: NaivePv(NAIVE_PV), F16;
    /// Naive backward step 1: P recomputed from the forward's LSE, materialised (f32).
    NaiveBwdPF32 = naive_bwd_p_f32: NaiveBwdP(NAIVE_BWD_P), F32;
    /// Naive backward step 2: `D = rowsum(dO ∘ O)` and `dS · ds/dx`, materialised (f32).
    NaiveBwdDsF32 = naive_bwd_ds_f32: NaiveBwdDs(NAIVE_BWD_DS), F32;
    /// Naive backward step 3: `dQ = dS K` (f32).
    NaiveBwdDqF32 = naive_bwd_dq_f32: NaiveBwdDq(NAIVE_BWD_DQ), F32;
    /// Naive backward step 4: `dK = dSᵀ Q`, `dV = Pᵀ dO`, summed over the GQA group (f32).
    NaiveBwdDkvF32 = naive_bwd_dkv_f32: NaiveBwdDkv(NAIVE_BWD_DKV), F32;
    /// Split-KV decode over a KV cache (contiguous or paged, GQA packed), f32, head_dim 64.
    DecodeFwdF32D64 = decode_fwd_f32_d64: DecodeFwd(DECODE_D64), F32;
    /// Split-KV decode, f32, head_dim 128.
    DecodeFwdF32D128 = decode_fwd_f32_d128: DecodeFwd(DECODE_D128), F32;
    /// Split-KV decode, bf16 cache/Q/O (f32 SIMT arithmetic), head_dim 64.
    DecodeFwdBf16D64 = decode_fwd_bf16_d64: DecodeFwd(DECODE_D64), Bf16;
    /// Split-KV decode, bf16, head_dim 128.
    DecodeFwdBf16D128 = decode_fwd_bf16_d128: DecodeFwd(DECODE_D128), Bf16;
    /// Split-KV decode, f16 cache/Q/O (f32 SIMT arithmetic), head_dim 64.
    DecodeFwdF16D64 = decode_fwd_f16_d64: DecodeFwd(DECODE_D64), F16;
    /// Split-KV decode, f16, head_dim 128.
    DecodeFwdF16D128 = decode_fwd_f16_d128: DecodeFwd(DECODE_D128), F16;
    /// Split-KV decode, f32 SIMT, head_dim 32.
    DecodeFwdF32D32 = decode_fwd_f32_d32: DecodeFwd(DECODE_D32), F32;
    /// Split-KV decode, bf16 (f32 SIMT arithmetic), head_dim 32: no tensor-core decode row here.
    DecodeFwdBf16D32 = decode_fwd_bf16_d32: DecodeFwd(DECODE_D32), Bf16;
    /// Split-KV decode, f16 (f32 SIMT arithmetic), head_dim 32: no tensor-core decode row here.
    DecodeFwdF16D32 = decode_fwd_f16_d32: DecodeFwd(DECODE_D32), F16;
    /// Split-KV decode, f32 SIMT, head_dim 96.
    DecodeFwdF32D96 = decode_fwd_f32_d96: DecodeFwd(DECODE_D96), F32;
    /// Split-KV decode, bf16 (f32 SIMT arithmetic), head_dim 96: no tensor-core decode row here.
    DecodeFwdBf16D96 = decode_fwd_bf16_d96: DecodeFwd(DECODE_D96), Bf16;
    /// Split-KV decode, f16 (f32 SIMT arithmetic), head_dim 96: no tensor-core decode row here.
    DecodeFwdF16D96 = decode_fwd_f16_d96: DecodeFwd(DECODE_D96), F16;
    /// Split-KV decode, f32 SIMT, head_dim 192.
    DecodeFwdF32D192 = decode_fwd_f32_d192: DecodeFwd(DECODE_D192), F32;
    /// Split-KV decode, bf16 (f32 SIMT arithmetic), head_dim 192: no tensor-core decode row here.
    DecodeFwdBf16D192 = decode_fwd_bf16_d192: DecodeFwd(DECODE_D192), Bf16;
    /// Split-KV decode, f16 (f32 SIMT arithmetic), head_dim 192: no tensor-core decode row here.
    DecodeFwdF16D192 = decode_fwd_f16_d192: DecodeFwd(DECODE_D192), F16;
    /// Split-KV decode, f32 SIMT, head_dim 256.
    DecodeFwdF32D256 = decode_fwd_f32_d256: DecodeFwd(DECODE_D256), F32;
    /// Split-KV decode, bf16 (f32 SIMT arithmetic), head_dim 256: no tensor-core decode row here.
    DecodeFwdBf16D256 = decode_fwd_bf16_d256: DecodeFwd(DECODE_D256), Bf16;
    /// Split-KV decode, f16 (f32 SIMT arithmetic), head_dim 256: no tensor-core decode row here.
    DecodeFwdF16D256 = decode_fwd_f16_d256: DecodeFwd(DECODE_D256), F16;
    /// Combine of split partials by log-sum-exp, O in f32.
    MergeStatesF32 = merge_states_f32: MergeStates(MERGE), F32;
    /// Combine, O in bf16.
    MergeStatesBf16 = merge_states_bf16: MergeStates(MERGE), Bf16;
    /// Combine, O in f16.
    MergeStatesF16 = merge_states_f16: MergeStates(MERGE), F16;
    /// Append `k_new`, `v_new` into an f32 KV cache.
    DecodeAppendF32 = decode_append_f32: DecodeAppend(APPEND), F32;
    /// Append into a bf16 KV cache.
    DecodeAppendBf16 = decode_append_bf16: DecodeAppend(APPEND), Bf16;
    /// Append into an f16 KV cache.
    DecodeAppendF16 = decode_append_f16: DecodeAppend(APPEND), F16;
    /// Rotary embedding of q and k_new before a KV-cache call's append, f32.
    DecodeRotaryF32 = decode_rotary_f32: DecodeRotary(APPEND), F32;
    /// Rotary embedding, bf16 (f32 arithmetic, rounded to bf16).
    DecodeRotaryBf16 = decode_rotary_bf16: DecodeRotary(APPEND), Bf16;
    /// Rotary embedding, f16.
    DecodeRotaryF16 = decode_rotary_f16: DecodeRotary(APPEND), F16;
    /// Device-side index check of a KV-cache call (NaN outputs when refused), f32 O.
    DecodeCheckF32 = decode_check_f32: DecodeCheck(APPEND), F32;
    /// Device-side index check, bf16 O (bf16 and FP8 caches).
    DecodeCheckBf16 = decode_check_bf16: DecodeCheck(APPEND), Bf16;
    /// Device-side index check, f16 O.
    DecodeCheckF16 = decode_check_f16: DecodeCheck(APPEND), F16;
    /// Split-KV decode over an FP8 e4m3 cache (dequantised on staging), bf16 Q/O, head_dim 64.
    DecodeFwdFp8E4m3D64 = decode_fwd_fp8_e4m3_d64: DecodeFwd(DECODE_D64), Fp8E4m3;
    /// Split-KV decode over an FP8 e4m3 cache, bf16 Q/O, head_dim 128.
    DecodeFwdFp8E4m3D128 = decode_fwd_fp8_e4m3_d128: DecodeFwd(DECODE_D128), Fp8E4m3;
    /// Split-KV decode over an FP8 e5m2 cache, bf16 Q/O, head_dim 64.
    DecodeFwdFp8E5m2D64 = decode_fwd_fp8_e5m2_d64: DecodeFwd(DECODE_D64), Fp8E5m2;
    /// Split-KV decode over an FP8 e5m2 cache, bf16 Q/O, head_dim 128.
    DecodeFwdFp8E5m2D128 = decode_fwd_fp8_e5m2_d128: DecodeFwd(DECODE_D128), Fp8E5m2;
    /// Append bf16 `k_new`, `v_new` into an FP8 e4m3 cache (quantised: `encode(x / scale)`).
    DecodeAppendFp8E4m3 = decode_append_fp8_e4m3: DecodeAppend(APPEND), Fp8E4m3;
    /// Append bf16 `k_new`, `v_new` into an FP8 e5m2 cache.
    DecodeAppendFp8E5m2 = decode_append_fp8_e5m2: DecodeAppend(APPEND), Fp8E5m2;
    /// Tensor-core split-KV decode over an FP8 e4m3 cache (widened to f16 on staging; f16
    /// `mma.sync`, no FP8 instructions), bf16 Q/O, head_dim 64.
    DecodeMmaFp8E4m3D64 = decode_mma_fp8_e4m3_d64: DecodeMma(DECODE_MMA_D64), Fp8E4m3;
    /// Tensor-core decode over an FP8 e4m3 cache, head_dim 128.
    DecodeMmaFp8E4m3D128 = decode_mma_fp8_e4m3_d128: DecodeMma(DECODE_MMA_D128), Fp8E4m3;
    /// Tensor-core decode over an FP8 e5m2 cache, head_dim 64.
    DecodeMmaFp8E5m2D64 = decode_mma_fp8_e5m2_d64: DecodeMma(DECODE_MMA_D64), Fp8E5m2;
    /// Tensor-core decode over an FP8 e5m2 cache, head_dim 128.
    DecodeMmaFp8E5m2D128 = decode_mma_fp8_e5m2_d128: DecodeMma(DECODE_MMA_D128), Fp8E5m2;
    /// Split-KV decode on tensor cores (`mma.sync`), bf16 cache/Q/O, f32 accumulation, head_dim 64.
    DecodeMmaBf16D64 = decode_mma_bf16_d64: DecodeMma(DECODE_MMA_D64), Bf16;
    /// Tensor-core split-KV decode, bf16, head_dim 128.
    DecodeMmaBf16D128 = decode_mma_bf16_d128: DecodeMma(DECODE_MMA_D128), Bf16;
    /// Tensor-core split-KV decode, f16, head_dim 64.
    DecodeMmaF16D64 = decode_mma_f16_d64: DecodeMma(DECODE_MMA_D64), F16;
    /// Tensor-core split-KV decode, f16, head_dim 128.
    DecodeMmaF16D128 = decode_mma_f16_d128: DecodeMma(DECODE_MMA_D128), F16;
    /// Backward preprocess, f32 O and dO: `D = rowsum(dO ∘ O)`, the dQ accumulator zeroed.
    BwdPreF32 = flash_bwd_pre_f32: BwdPre(BWD_ROWS), F32;
    /// Backward main kernel, f32 SIMT, head_dim 32.
    FlashBwdF32D32 = flash_bwd_f32_d32: FlashBwdF32(FLASH_BWD_F32_D32), F32;
    /// Backward main kernel, f32 SIMT, head_dim 64.
    FlashBwdF32D64 = flash_bwd_f32_d64: FlashBwdF32(FLASH_BWD_F32_D64), F32;
    /// Backward main kernel, f32 SIMT, head_dim 96.
    FlashBwdF32D96 = flash_bwd_f32_d96: FlashBwdF32(FLASH_BWD_F32_D96), F32;
    /// Backward main kernel, f32 SIMT, head_dim 128.
    FlashBwdF32D128 = flash_bwd_f32_d128: FlashBwdF32(FLASH_BWD_F32_D128), F32;
    /// Backward main kernel, f32 SIMT, head_dim 192.
    FlashBwdF32D192 = flash_bwd_f32_d192: FlashBwdF32(FLASH_BWD_F32_D192), F32;
    /// Backward main kernel, f32 SIMT, head_dim 256.
    FlashBwdF32D256 = flash_bwd_f32_d256: FlashBwdF32(FLASH_BWD_F32_D256), F32;
    /// Backward convert: the f32 dQ accumulator to an f32 dQ.
    BwdConvertF32 = flash_bwd_dq_f32: BwdConvert(BWD_ROWS), F32;
    /// Backward preprocess, bf16 O and dO.
    BwdPreBf16 = flash_bwd_pre_bf16: BwdPre(BWD_ROWS), Bf16;
    /// Backward preprocess, f16 O and dO.
    BwdPreF16 = flash_bwd_pre_f16: BwdPre(BWD_ROWS), F16;
    /// Backward main kernel on tensor cores (`mma.sync`), bf16, head_dim 32.
    FlashBwdBf16D32 = flash_bwd_bf16_d32: FlashBwdMma(FLASH_BWD_MMA_D32), Bf16;
    /// Backward main kernel on tensor cores, f16, head_dim 32.
    FlashBwdF16D32 = flash_bwd_f16_d32: FlashBwdMma(FLASH_BWD_MMA_D32), F16;
    /// Backward main kernel on tensor cores, FlashAttention-2's warp layout, bf16, head_dim 64.
    FlashBwdBf16D64 = flash_bwd_bf16_d64: FlashBwdTc(FLASH_BWD_TC_D64), Bf16;
    /// Backward main kernel on tensor cores, FlashAttention-2's warp layout, f16, head_dim 64.
    FlashBwdF16D64 = flash_bwd_f16_d64: FlashBwdTc(FLASH_BWD_TC_D64), F16;
    /// Backward main kernel on tensor cores, FlashAttention-2's warp layout, bf16, head_dim 128.
    FlashBwdBf16D128 = flash_bwd_bf16_d128: FlashBwdTc(FLASH_BWD_TC_D128), Bf16;
    /// Backward main kernel on tensor cores, FlashAttention-2's warp layout, f16, head_dim 128.
    FlashBwdF16D128 = flash_bwd_f16_d128: FlashBwdTc(FLASH_BWD_TC_D128), F16;
    /// The compact backward main kernel (one warp per 16 keys, 28 KiB of shared memory), bf16,
    /// head_dim 64: for GPUs whose blocks get less than `flash_bwd_bf16_d64`'s 128 KiB.
    FlashBwdBf16D64Compact = flash_bwd_bf16_d64_compact: FlashBwdMma(FLASH_BWD_MMA_D64), Bf16;
    /// The compact backward main kernel, f16, head_dim 64.
    FlashBwdF16D64Compact = flash_bwd_f16_d64_compact: FlashBwdMma(FLASH_BWD_MMA_D64), F16;
    /// The compact backward main kernel (52 KiB of shared memory), bf16, head_dim 128.
    FlashBwdBf16D128Compact = flash_bwd_bf16_d128_compact: FlashBwdMma(FLASH_BWD_MMA_D128), Bf16;
    /// The compact backward main kernel, f16, head_dim 128.
    FlashBwdF16D128Compact = flash_bwd_f16_d128_compact: FlashBwdMma(FLASH_BWD_MMA_D128), F16;
    /// Backward convert: the f32 dQ accumulator to a bf16 dQ.
    BwdConvertBf16 = flash_bwd_dq_bf16: BwdConvert(BWD_ROWS), Bf16;
    /// Backward convert: the f32 dQ accumulator to an f16 dQ.
    BwdConvertF16 = flash_bwd_dq_f16: BwdConvert(BWD_ROWS), F16;
    /// Hopper forward (TMA, `wgmma`, warp-specialised; the `sm_90a` module), bf16, head_dim 64.
    FlashFwdBf16Sm90D64 = flash_fwd_bf16_sm90_d64: FlashSm90(FLASH_SM90_D64), Bf16;
    /// Hopper forward, bf16, head_dim 128.
    FlashFwdBf16Sm90D128 = flash_fwd_bf16_sm90_d128: FlashSm90(FLASH_SM90_D128), Bf16;
    /// Hopper forward, bf16, head_dim 256.
    FlashFwdBf16Sm90D256 = flash_fwd_bf16_sm90_d256: FlashSm90(FLASH_SM90_D256), Bf16;
    /// Hopper forward, f16, head_dim 64.
    FlashFwdF16Sm90D64 = flash_fwd_f16_sm90_d64: FlashSm90(FLASH_SM90_D64), F16;
    /// Hopper forward, f16, head_dim 128.
    FlashFwdF16Sm90D128 = flash_fwd_f16_sm90_d128: FlashSm90(FLASH_SM90_D128), F16;
    /// Hopper forward, f16, head_dim 256.
    FlashFwdF16Sm90D256 = flash_fwd_f16_sm90_d256: FlashSm90(FLASH_SM90_D256), F16;
    /// The e4m3-cache decode at d64 for Hopper (`cvt.rn.f16x2.e4m3x2`).
    DecodeMmaFp8E4m3Sm90D64 = decode_mma_fp8_e4m3_sm90_d64: DecodeMmaSm90(DECODE_MMA_D64), Fp8E4m3;
    /// The e4m3-cache decode at d128 for Hopper (`cvt.rn.f16x2.e4m3x2`).
    DecodeMmaFp8E4m3Sm90D128 = decode_mma_fp8_e4m3_sm90_d128: DecodeMmaSm90(DECODE_MMA_D128), Fp8E4m3;
    /// Stores the Hopper forward's three tensor maps (a kernel parameter) into the slot the
    /// forward launch after it reads; one thread (its elem is unused: the maps are bytes).
    TensorMapsStore = tensor_maps_store: TensorMapStore(TENSOR_MAPS_STORE), F32;
}

/// A head dim without a kernel of its own runs on the next compiled one when it is a multiple of
/// this ([`KernelId::padded_head_dim`]): 16-bit rows of 8 elements are the 16-byte chunks the
/// tensor-core kernels copy, so a chunk is wholly inside the head dim or wholly past it.
pub const PAD_MULTIPLE: u32 = 8;

/// The largest head dim any kernel runs (the widest rows of the table).
pub const MAX_HEAD_DIM: u32 = 256;

impl KernelId {
    /// This kernel's row of the table.
    pub const fn variant(self) -> &'static Variant {
        &VARIANTS[self as usize]
    }

    /// The PTX entry-point name.
    pub const fn name(self) -> &'static str {
        self.variant().name
    }

    /// Dynamic shared memory the host requests for this kernel (the tile's staging area).
    pub const fn dynamic_smem_bytes(self) -> u32 {
        self.variant().dynamic_smem_bytes()
    }

    pub fn from_name(name: &str) -> Option<KernelId> {
        Self::from_name_const(name)
    }

    /// [`KernelId::from_name`] usable in constants.
    pub const fn from_name_const(name: &str) -> Option<KernelId> {
        let mut i = 0;
        while i < VARIANTS.len() {
            if str_eq(VARIANTS[i].name, name) {
                return Some(VARIANTS[i].id);
            }
            i += 1;
        }
        None
    }

    /// The default row ([`WindowRule::Any`]) of `family` with element type `elem` and (if given)
    /// head dim `head_dim`.
    pub const fn find(family: Family, elem: Elem, head_dim: Option<u32>) -> Option<KernelId> {
        Self::find_where(family, elem, head_dim, None)
    }

    /// The first row of `family`, `elem` and `head_dim` whose rule is not [`WindowRule::Any`] and
    /// admits `window` (when `window` is `Some`), or the default row (when it is `None`).
    const fn find_where(
        family: Family,
        elem: Elem,
        head_dim: Option<u32>,
        window: Option<(i32, i32)>,
    ) -> Option<KernelId> {
        let mut i = 0;
        while i < VARIANTS.len() {
            let v = &VARIANTS[i];
            let dim_ok = match (head_dim, v.head_dim()) {
                (Some(want), Some(have)) => want == have,
                (None, None) => true,
                _ => false,
            };
            let rule_ok = match window {
                None => v.window.is_any(),
                Some((left, right)) => !v.window.is_any() && v.window.admits(left, right),
            };
            if v.family.eq(family) && v.elem.eq(elem) && dim_ok && rule_ok {
                return Some(v.id);
            }
            i += 1;
        }
        None
    }

    /// The head dim of the kernel a problem of head dim `head_dim` runs on, among the default
    /// rows of `families` for `elem`: `head_dim` itself when a row is compiled for it; else,
    /// for a multiple of [`PAD_MULTIPLE`] up to [`MAX_HEAD_DIM`] (and not an FP8 cache), the
    /// smallest compiled head dim above it. Such a kernel reads only the problem's `head_dim`
    /// columns ([`crate::abi::AttnParams::head_dim`], [`crate::decode_abi::DecodeParams`]'s):
    /// the columns up to its own head dim are zero in its tiles (they add nothing to `q·k`) and
    /// its output there is not stored, so the caller's tensors keep their head dim and nothing is
    /// copied. `None` when no row fits.
    pub const fn padded_head_dim(families: &[Family], elem: Elem, head_dim: u32) -> Option<u32> {
        let fp8 = elem.eq(Elem::Fp8E4m3) || elem.eq(Elem::Fp8E5m2);
        let pad_ok = !fp8 && head_dim > 0 && head_dim.is_multiple_of(PAD_MULTIPLE) && head_dim <= MAX_HEAD_DIM;
        let mut best: Option<u32> = None;
        let mut i = 0;
        while i < VARIANTS.len() {
            let v = &VARIANTS[i];
            let mut fam_ok = false;
            let mut f = 0;
            while f < families.len() {
                fam_ok = fam_ok || v.family.eq(families[f]);
                f += 1;
            }
            if let (true, true, true, Some(have)) = (fam_ok, v.elem.eq(elem), v.window.is_any(), v.head_dim()) {
                if have == head_dim || (pad_ok && have > head_dim) {
                    best = match best {
                        Some(b) if b <= have => Some(b),
                        _ => Some(have),
                    };
                }
            }
            i += 1;
        }
        best
    }

    /// The default fused forward kernel for `elem` and `head_dim` (the row full and causal
    /// attention run on): the f32 SIMT family for f32, the tensor-core family for 16-bit types;
    /// a head dim without a row of its own runs on the next one ([`KernelId::padded_head_dim`]).
    /// `None` when the table has no such row.
    pub const fn flash(elem: Elem, head_dim: u32) -> Option<KernelId> {
        let family = Self::flash_family(elem);
        match Self::padded_head_dim(&[family], elem, head_dim) {
            Some(d) => Self::find(family, elem, Some(d)),
            None => None,
        }
    }

    /// The fused forward kernel a problem of `elem`, `head_dim` and window `(left, right)` runs
    /// (`-1` unbounded; causal folded in as `right = 0`): a row whose [`WindowRule`] admits the
    /// window when the table has one for this dtype and head dim, otherwise the default row
    /// ([`KernelId::flash`]). `None` when the table has neither.
    pub const fn flash_for(elem: Elem, head_dim: u32, window: (i32, i32)) -> Option<KernelId> {
        let head_dim = match Self::padded_head_dim(&[Self::flash_family(elem)], elem, head_dim) {
            Some(d) => d,
            None => return None,
        };
        match Self::find_where(Self::flash_family(elem), elem, Some(head_dim), Some(window)) {
            Some(k) => Some(k),
            None => Self::flash(elem, head_dim),
        }
    }

    /// The Hopper forward (`sm_90a` module) for `elem` and `head_dim`, if the table has one
    /// (its own head dims only: a padded head dim runs on [`KernelId::flash`]).
    pub const fn flash_sm90(elem: Elem, head_dim: u32) -> Option<KernelId> {
        Self::find(Family::FlashSm90, elem, Some(head_dim))
    }

    const fn flash_family(elem: Elem) -> Family {
        if elem.eq(Elem::F32) {
            Family::FlashF32
        } else {
            Family::FlashMma
        }
    }

    /// The three naive kernels for `elem`: scores and P·V in `elem`, the shared f32 softmax.
    pub const fn naive(elem: Elem) -> Option<[KernelId; 3]> {
        match (
            Self::find(Family::NaiveScores, elem, None),
            Self::find(Family::NaiveSoftmax, Elem::F32, None),
            Self::find(Family::NaivePv, elem, None),
        ) {
            (Some(s), Some(m), Some(p)) => Some([s, m, p]),
            _ => None,
        }
    }

    /// The naive backward's four kernels for `elem`, in launch order: `[P, dS, dQ, dK and dV]`.
    /// `None` when the table has no such rows (only f32 has them).
    pub const fn naive_bwd(elem: Elem) -> Option<[KernelId; 4]> {
        match (
            Self::find(Family::NaiveBwdP, elem, None),
            Self::find(Family::NaiveBwdDs, elem, None),
            Self::find(Family::NaiveBwdDq, elem, None),
            Self::find(Family::NaiveBwdDkv, elem, None),
        ) {
            (Some(a), Some(b), Some(c), Some(d)) => Some([a, b, c, d]),
            _ => None,
        }
    }

    /// The decode kernels for `elem` and `head_dim`: `[decode forward, merge_states,
    /// decode_append]`, the forward the tensor-core family (`DecodeMma`) where the table has it
    /// (bf16, f16), the SIMT one (`DecodeFwd`) otherwise (f32, the FP8 caches, whose combine
    /// writes bf16 O: [`Elem::qo`]).
    ///
    /// A head dim without a row runs on the next head dim either family has
    /// ([`KernelId::padded_head_dim`]).
    pub const fn decode(elem: Elem, head_dim: u32) -> Option<[KernelId; 3]> {
        let head_dim = match Self::padded_head_dim(&[Family::DecodeMma, Family::DecodeFwd], elem, head_dim) {
            Some(d) => d,
            None => return None,
        };
        match Self::decode_at(Family::DecodeMma, elem, head_dim) {
            Some(k) => Some(k),
            None => Self::decode_at(Family::DecodeFwd, elem, head_dim),
        }
    }

    /// The Hopper row of the decode forward `fwd` (a `DecodeMma` row whose cache the `sm_90a`
    /// module widens with FP8 conversions: e4m3), or `fwd` itself.
    pub const fn decode_on_sm90(fwd: KernelId) -> KernelId {
        let v = fwd.variant();
        if !v.family.eq(Family::DecodeMma) {
            return fwd;
        }
        match Self::find(Family::DecodeMmaSm90, v.elem, v.head_dim()) {
            Some(k) => k,
            None => fwd,
        }
    }

    /// The decode kernels with the forward of `family` (`DecodeFwd` or `DecodeMma`), at
    /// `head_dim` or the next head dim the family has ([`KernelId::padded_head_dim`]).
    pub const fn decode_with(family: Family, elem: Elem, head_dim: u32) -> Option<[KernelId; 3]> {
        if !family.eq(Family::DecodeFwd) && !family.eq(Family::DecodeMma) {
            return None;
        }
        match Self::padded_head_dim(&[family], elem, head_dim) {
            Some(d) => Self::decode_at(family, elem, d),
            None => None,
        }
    }

    /// The decode kernels with the forward of `family` compiled for exactly `head_dim`.
    const fn decode_at(family: Family, elem: Elem, head_dim: u32) -> Option<[KernelId; 3]> {
        match (
            Self::find(family, elem, Some(head_dim)),
            Self::find(Family::MergeStates, elem.qo(), None),
            Self::find(Family::DecodeAppend, elem, None),
        ) {
            (Some(f), Some(m), Some(a)) => Some([f, m, a]),
            _ => None,
        }
    }

    /// The backward kernels for `elem` and `head_dim`, in launch order: `[preprocess, main,
    /// convert]`, the main kernel f32 SIMT (`FlashBwdF32`) for f32 and on tensor cores for bf16
    /// and f16 (`FlashBwdTc`, FlashAttention-2's warp layout, where the table has it, else
    /// `FlashBwdMma`), on a GPU that gives a block any amount of shared memory
    /// ([`KernelId::flash_bwd_for`] with the device's limit). `None` when the table has no main
    /// kernel for them.
    pub const fn flash_bwd(elem: Elem, head_dim: u32) -> Option<[KernelId; 3]> {
        Self::flash_bwd_for(elem, head_dim, u32::MAX)
    }

    /// [`KernelId::flash_bwd`] on a device whose blocks may opt in to `max_smem_bytes` of
    /// dynamic shared memory: the `FlashBwdTc` row when its tile fits, else the compact
    /// `FlashBwdMma` row (sm_86, sm_89 and sm_120 blocks get 99 KiB), as FlashAttention-2 picks
    /// its backward tiles by the device's shared memory.
    ///
    /// A head dim without a row runs on the next head dim the main kernels have
    /// ([`KernelId::padded_head_dim`]).
    pub const fn flash_bwd_for(elem: Elem, head_dim: u32, max_smem_bytes: u32) -> Option<[KernelId; 3]> {
        let families = [Family::FlashBwdF32, Family::FlashBwdTc, Family::FlashBwdMma];
        let head_dim = match Self::padded_head_dim(&families, elem, head_dim) {
            Some(d) => d,
            None => return None,
        };
        let main = if elem.eq(Elem::F32) {
            Self::find(Family::FlashBwdF32, elem, Some(head_dim))
        } else {
            match Self::find(Family::FlashBwdTc, elem, Some(head_dim)) {
                Some(k) if k.variant().dynamic_smem_bytes() <= max_smem_bytes => Some(k),
                _ => Self::find(Family::FlashBwdMma, elem, Some(head_dim)),
            }
        };
        match (Self::find(Family::BwdPre, elem, None), main, Self::find(Family::BwdConvert, elem, None)) {
            (Some(a), Some(m), Some(c)) => Some([a, m, c]),
            _ => None,
        }
    }

    /// Head dims the backward kernels of `elem` are compiled for, ascending.
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn flash_bwd_head_dims(elem: Elem) -> Vec<u32> {
        let mut dims: Vec<u32> = VARIANTS
            .iter()
            .filter(|v| {
                matches!(v.family, Family::FlashBwdF32 | Family::FlashBwdMma | Family::FlashBwdTc) && v.elem == elem
            })
            .filter_map(|v| v.head_dim())
            .collect();
        dims.sort_unstable();
        dims.dedup();
        dims
    }

    /// Head dims the decode kernels of `elem` are compiled for, ascending.
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn decode_head_dims(elem: Elem) -> Vec<u32> {
        let mut dims: Vec<u32> = VARIANTS
            .iter()
            .filter(|v| matches!(v.family, Family::DecodeFwd | Family::DecodeMma) && v.elem == elem)
            .filter_map(|v| v.head_dim())
            .collect();
        dims.sort_unstable();
        dims.dedup();
        dims
    }

    /// Head dims the flash kernels of `elem` are compiled for, ascending.
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn flash_head_dims(elem: Elem) -> Vec<u32> {
        let mut dims: Vec<u32> = VARIANTS
            .iter()
            .filter(|v| matches!(v.family, Family::FlashF32 | Family::FlashMma) && v.elem == elem)
            .filter_map(|v| v.head_dim())
            .collect();
        dims.sort_unstable();
        dims.dedup();
        dims
    }
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

// The table is consistent: ids in order, names unique, every tile passes its checks.
const _: () = {
    let mut i = 0;
    while i < VARIANTS.len() {
        assert!(VARIANTS[i].id as usize == i, "table order");
        let mut j = i + 1;
        while j < VARIANTS.len() {
            assert!(!str_eq(VARIANTS[i].name, VARIANTS[j].name), "entry names are unique");
            j += 1;
        }
        match VARIANTS[i].tile {
            Tile::FlashF32(t) => t.check(),
            Tile::FlashMma(t) => t.check(),
            Tile::DecodeFwd(t) => t.check(),
            Tile::DecodeMma(t) => t.check(),
            Tile::FlashBwdF32(t) => t.check(),
            Tile::FlashBwdMma(t) => t.check(),
            Tile::FlashBwdTc(t) => t.check(),
            _ => {}
        }
        // A row chosen only for some windows falls back to a default row of its kind, and no
        // two default rows compete for one (family, dtype, head dim).
        let (v, mut defaults) = (&VARIANTS[i], 0);
        let mut j = 0;
        while j < VARIANTS.len() {
            let w = &VARIANTS[j];
            let same_dim = match (v.head_dim(), w.head_dim()) {
                (Some(a), Some(b)) => a == b,
                (None, None) => true,
                _ => false,
            };
            if w.family.eq(v.family) && w.elem.eq(v.elem) && same_dim && w.window.is_any() {
                defaults += 1;
            }
            j += 1;
        }
        assert!(defaults == 1, "each (family, dtype, head dim) has exactly one WindowRule::Any row");
        i += 1;
    }
};

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn the_backward_picks_its_main_kernel_by_shared_memory() {
        let main = |e, d, smem| KernelId::flash_bwd_for(e, d, smem).map(|k| k[1].name());
        for (e, x) in [(Elem::Bf16, "bf16"), (Elem::F16, "f16")] {
            for d in [64, 128] {
                // 128 KiB tiles: A100 (163 KiB) and H100 (227 KiB) run them; sm_86 (99 KiB) not.
                assert_eq!(KernelId::flash_bwd(e, d).unwrap()[1].variant().dynamic_smem_bytes(), 128 * 1024);
                assert_eq!(main(e, d, 163 * 1024), Some(format!("flash_bwd_{x}_d{d}")).as_deref());
                assert_eq!(main(e, d, 128 * 1024), Some(format!("flash_bwd_{x}_d{d}")).as_deref());
                assert_eq!(main(e, d, 128 * 1024 - 1), Some(format!("flash_bwd_{x}_d{d}_compact")).as_deref());
                assert_eq!(main(e, d, 99 * 1024), Some(format!("flash_bwd_{x}_d{d}_compact")).as_deref());
            }
            assert_eq!(main(e, 32, 99 * 1024), Some(format!("flash_bwd_{x}_d32")).as_deref());
            // d96 runs on d128 (padded), its compact row where the big one does not fit.
            assert_eq!(main(e, 96, u32::MAX), Some(format!("flash_bwd_{x}_d128")).as_deref());
            assert_eq!(main(e, 96, 99 * 1024), Some(format!("flash_bwd_{x}_d128_compact")).as_deref());
            assert_eq!(main(e, 192, u32::MAX), None);
            assert_eq!(KernelId::flash_bwd_head_dims(e), vec![32, 64, 128]);
        }
        assert_eq!(main(Elem::F32, 64, 0), Some("flash_bwd_f32_d64"));
    }

    pub fn lookups_find_exactly_the_table_rows() {
        assert_eq!(KernelId::flash(Elem::F32, 64), Some(KernelId::FlashFwdF32D64));
        assert_eq!(KernelId::flash(Elem::F32, 128), Some(KernelId::FlashFwdF32D128));
        assert_eq!(KernelId::flash(Elem::Bf16, 64), Some(KernelId::FlashFwdBf16D64));
        assert_eq!(KernelId::flash(Elem::F16, 128), Some(KernelId::FlashFwdF16D128));
        assert_eq!(KernelId::flash(Elem::Bf16, 96), Some(KernelId::FlashFwdBf16D96));
        assert_eq!(KernelId::flash(Elem::F16, 256), Some(KernelId::FlashFwdF16D256));
        assert_eq!(KernelId::flash(Elem::F32, 32), Some(KernelId::FlashFwdF32D32));
        // A multiple of 8 without a row runs on the next row's head dim; others are refused.
        assert_eq!(KernelId::flash(Elem::Bf16, 80), Some(KernelId::FlashFwdBf16D96));
        assert_eq!(KernelId::flash(Elem::F32, 40), Some(KernelId::FlashFwdF32D64));
        assert_eq!(KernelId::flash(Elem::F16, 8), Some(KernelId::FlashFwdF16D32));
        assert_eq!(KernelId::flash(Elem::F16, 200), Some(KernelId::FlashFwdF16D256));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 120, (60, 0)), Some(KernelId::FlashFwdBf16D128Window));
        assert_eq!(KernelId::flash(Elem::Bf16, 84), None);
        assert_eq!(KernelId::flash(Elem::F32, 264), None);
        assert_eq!(KernelId::flash(Elem::F32, 512), None);
        assert_eq!(KernelId::flash(Elem::F32, 0), None);
        assert_eq!(KernelId::flash_sm90(Elem::Bf16, 120), None);
        // Decode: the next head dim of either family (the tensor-core one where it has it).
        assert_eq!(KernelId::decode(Elem::Bf16, 40).map(|k| k[0]), Some(KernelId::DecodeMmaBf16D64));
        assert_eq!(KernelId::decode(Elem::Bf16, 80).map(|k| k[0]), Some(KernelId::DecodeFwdBf16D96));
        assert_eq!(KernelId::decode(Elem::F32, 160).map(|k| k[0]), Some(KernelId::DecodeFwdF32D192));
        assert_eq!(
            KernelId::decode_with(Family::DecodeMma, Elem::F16, 80).map(|k| k[0]),
            Some(KernelId::DecodeMmaF16D128)
        );
        // Backward: bf16/f16 have nothing past 128.
        assert_eq!(KernelId::flash_bwd(Elem::Bf16, 120).map(|k| k[1]), Some(KernelId::FlashBwdBf16D128));
        assert_eq!(KernelId::flash_bwd(Elem::F32, 200).map(|k| k[1]), Some(KernelId::FlashBwdF32D256));
        assert_eq!(KernelId::flash_bwd(Elem::F16, 160), None);
        assert_eq!(
            KernelId::naive(Elem::Bf16),
            Some([KernelId::NaiveScoresBf16, KernelId::NaiveSoftmaxF32, KernelId::NaivePvBf16])
        );
        for e in [Elem::F32, Elem::Bf16, Elem::F16] {
            assert_eq!(KernelId::flash_head_dims(e), vec![32, 64, 96, 128, 192, 256], "{e:?}");
        }
        for k in KernelId::ALL {
            assert_eq!(KernelId::from_name(k.name()), Some(k));
            assert_eq!(k.variant().id, k);
        }
        assert_eq!(KernelId::from_name("flash_fwd_f32_d80"), None);
    }

    pub fn fp8_decode_rows_pair_an_fp8_forward_and_append_with_the_bf16_combine() {
        assert_eq!(
            KernelId::decode(Elem::Fp8E4m3, 128),
            Some([KernelId::DecodeMmaFp8E4m3D128, KernelId::MergeStatesBf16, KernelId::DecodeAppendFp8E4m3])
        );
        assert_eq!(
            KernelId::decode_with(Family::DecodeFwd, Elem::Fp8E5m2, 64),
            Some([KernelId::DecodeFwdFp8E5m2D64, KernelId::MergeStatesBf16, KernelId::DecodeAppendFp8E5m2])
        );
        assert_eq!(KernelId::decode(Elem::Fp8E5m2, 96), None);
        // An FP8 cache keeps its own head dims: no padding.
        assert_eq!(KernelId::decode(Elem::Fp8E4m3, 40), None);
        assert_eq!(KernelId::decode_head_dims(Elem::Fp8E4m3), vec![64, 128]);
        assert_eq!((Elem::Fp8E4m3.qo(), Elem::F16.qo()), (Elem::Bf16, Elem::F16));
        assert!(KernelId::DecodeMmaFp8E4m3D64.variant().tensor_cores());
        // On sm_90 the e4m3 tensor-core decode is the sm_90a module's row, the same tile; the
        // other decode forwards stay.
        for (k, d) in [(KernelId::DecodeMmaFp8E4m3D64, 64), (KernelId::DecodeMmaFp8E4m3D128, 128)] {
            let h = KernelId::decode_on_sm90(k);
            assert_eq!(h.name(), format!("decode_mma_fp8_e4m3_sm90_d{d}"));
            assert_eq!(h.variant().module(), PtxModule::Sm90a);
            assert_eq!(h.variant().tile, k.variant().tile);
            assert_eq!(h.variant().param_bytes(), k.variant().param_bytes());
        }
        for k in [KernelId::DecodeMmaFp8E5m2D128, KernelId::DecodeMmaBf16D128, KernelId::DecodeFwdFp8E4m3D128] {
            assert_eq!(KernelId::decode_on_sm90(k), k);
        }
        assert_eq!(KernelId::DecodeMmaFp8E4m3D64.variant().param_bytes(), 264);
    }

    pub fn backward_rows_and_their_geometry() {
        assert_eq!(
            KernelId::flash_bwd(Elem::F32, 64),
            Some([KernelId::BwdPreF32, KernelId::FlashBwdF32D64, KernelId::BwdConvertF32])
        );
        assert_eq!(KernelId::flash_bwd(Elem::F32, 128).map(|k| k[1]), Some(KernelId::FlashBwdF32D128));
        assert_eq!(KernelId::flash_bwd(Elem::F32, 96).map(|k| k[1]), Some(KernelId::FlashBwdF32D96));
        assert_eq!(KernelId::flash_bwd(Elem::F32, 80).map(|k| k[1]), Some(KernelId::FlashBwdF32D96));
        assert_eq!(KernelId::flash_bwd(Elem::F32, 84), None);
        assert_eq!(
            KernelId::flash_bwd(Elem::Bf16, 64),
            Some([KernelId::BwdPreBf16, KernelId::FlashBwdBf16D64, KernelId::BwdConvertBf16])
        );
        assert_eq!(KernelId::flash_bwd(Elem::F16, 128).map(|k| k[1]), Some(KernelId::FlashBwdF16D128));
        assert_eq!(KernelId::flash_bwd(Elem::Bf16, 96).map(|k| k[1]), Some(KernelId::FlashBwdBf16D128));
        assert_eq!(KernelId::flash_bwd(Elem::Bf16, 192), None);
        assert_eq!(KernelId::flash_bwd_head_dims(Elem::Bf16), vec![32, 64, 128]);
        assert_eq!(KernelId::flash_bwd_head_dims(Elem::F32), vec![32, 64, 96, 128, 192, 256]);
        let m = KernelId::FlashBwdF32D128.variant();
        assert_eq!((m.threads(), m.block_rows(), m.block_cols(), m.param_bytes()), (256, 16, 32, 456));
        assert_eq!(m.dynamic_smem_bytes(), (32 * 128 + 2 * 16 * 128 + 16 * 32 + 32) * 4);
        assert_eq!(FLASH_BWD_F32_D64.launch(2, 3, 65).grid, [3, 3, 2]);
        assert_eq!(BWD_ROWS.launch(2, 5, 9), LaunchDims { grid: [3, 5, 2], block: [128, 1, 1], dynamic_smem_bytes: 0 });
        assert_eq!(m.launch(LaunchShape { batch: 1, heads: 1, seq_q: 1, seq_kv: 1 }), None);
    }

    pub fn naive_backward_rows_and_their_geometry() {
        assert_eq!(
            KernelId::naive_bwd(Elem::F32),
            Some([KernelId::NaiveBwdPF32, KernelId::NaiveBwdDsF32, KernelId::NaiveBwdDqF32, KernelId::NaiveBwdDkvF32])
        );
        assert_eq!(KernelId::naive_bwd(Elem::Bf16), None);
        let s = LaunchShape { batch: 2, heads: 3, seq_q: 130, seq_kv: 300 };
        let dims = |k: KernelId| k.variant().launch(s).map(|l| (l.grid, l.block));
        assert_eq!(dims(KernelId::NaiveBwdPF32), Some(([130, 3, 6], [128, 1, 1])));
        assert_eq!(dims(KernelId::NaiveBwdDsF32), Some(([33, 1, 6], [128, 1, 1])));
        assert_eq!(dims(KernelId::NaiveBwdDqF32), Some(([130, 1, 6], [64, 1, 1])));
        assert_eq!(dims(KernelId::NaiveBwdDkvF32), None);
        assert_eq!(NAIVE_BWD_DKV.launch(2, 1, 300).grid, [300, 1, 2]);
        for k in KernelId::naive_bwd(Elem::F32).unwrap() {
            assert_eq!(k.variant().param_bytes(), crate::abi::NAIVE_BWD_PARAMS_BYTES);
            assert_eq!(k.variant().dynamic_smem_bytes(), 0);
        }
    }

    pub fn window_rules_choose_rows_and_fall_back_to_the_default() {
        // d64 has no narrow row: every window runs the default.
        assert_eq!(KernelId::flash_for(Elem::Bf16, 64, (255, 0)), Some(KernelId::FlashFwdBf16D64));
        assert_eq!(KernelId::flash_for(Elem::F16, 64, (0, 0)), Some(KernelId::FlashFwdF16D64));
        // At most `keys` keys, both sides bounded: d32 and d128 96, d96 192, d192 320, d256 192.
        assert_eq!(KernelId::flash_for(Elem::Bf16, 128, (63, 0)), Some(KernelId::FlashFwdBf16D128Window));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 128, (40, 55)), Some(KernelId::FlashFwdBf16D128Window));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 128, (40, 56)), Some(KernelId::FlashFwdBf16D128));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 128, (63, -1)), Some(KernelId::FlashFwdBf16D128));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 128, (-1, 0)), Some(KernelId::FlashFwdBf16D128));
        assert_eq!(KernelId::flash_for(Elem::F32, 128, (63, 0)), Some(KernelId::FlashFwdF32D128));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 96, (191, 0)), Some(KernelId::FlashFwdBf16D96Window));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 96, (192, 0)), Some(KernelId::FlashFwdBf16D96));
        assert_eq!(KernelId::flash_for(Elem::F16, 32, (0, 95)), Some(KernelId::FlashFwdF16D32Window));
        assert_eq!(KernelId::flash_for(Elem::F16, 32, (0, 96)), Some(KernelId::FlashFwdF16D32));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 192, (319, 0)), Some(KernelId::FlashFwdBf16D192Window));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 192, (320, 0)), Some(KernelId::FlashFwdBf16D192));
        assert_eq!(KernelId::flash_for(Elem::F16, 256, (191, 0)), Some(KernelId::FlashFwdF16D256Window));
        assert_eq!(KernelId::flash_for(Elem::F16, 256, (255, 0)), Some(KernelId::FlashFwdF16D256));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 80, (255, 0)), Some(KernelId::FlashFwdBf16D96));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 80, (95, 0)), Some(KernelId::FlashFwdBf16D96Window));
        assert_eq!(KernelId::flash_for(Elem::Bf16, 81, (255, 0)), None);
        // `flash` and `find` give the default rows only.
        assert_eq!(KernelId::flash(Elem::F16, 128), Some(KernelId::FlashFwdF16D128));
        assert!(WindowRule::Any.admits(-1, -1));
        let r = WindowRule::Narrow { keys: 512 };
        assert!(r.admits(511, 0) && r.admits(0, 511) && r.admits(0, 0));
        assert!(!r.admits(512, 0) && !r.admits(-1, 0) && !r.admits(0, -1) && !r.admits(i32::MAX, i32::MAX));
        let w = KernelId::FlashFwdBf16D128Window.variant();
        assert_eq!(
            (w.block_rows(), w.block_cols(), w.head_dim(), w.dynamic_smem_bytes()),
            (64, 32, Some(128), 32 * 1024)
        );
        assert!(w.tensor_cores());
        assert_eq!(KernelId::flash_head_dims(Elem::Bf16), vec![32, 64, 96, 128, 192, 256]);
    }

    pub fn launch_geometry_derives_from_the_tile() {
        let s = LaunchShape { batch: 2, heads: 3, seq_q: 130, seq_kv: 300 };
        let l = KernelId::FlashFwdBf16D128.variant().launch(s).unwrap();
        assert_eq!((l.grid, l.block, l.dynamic_smem_bytes), ([3, 3, 2], [128, 1, 1], 48 * 1024));
        let l = KernelId::FlashFwdF32D64.variant().launch(s).unwrap();
        assert_eq!((l.grid, l.block, l.dynamic_smem_bytes), ([5, 3, 2], [128, 1, 1], 32 * 1024));
        let l = KernelId::NaiveScoresF16.variant().launch(s).unwrap();
        assert_eq!((l.grid, l.block), ([130, 3, 6], [128, 1, 1]));
        let l = KernelId::NaiveSoftmaxF32.variant().launch(s).unwrap();
        assert_eq!((l.grid, l.block), ([33, 1, 6], [128, 1, 1]));
        let l = KernelId::NaivePvF32.variant().launch(s).unwrap();
        assert_eq!((l.grid, l.block), ([130, 1, 6], [64, 1, 1]));
        assert_eq!(KernelId::Saxpy.variant().launch(s), None);
        // batch * heads past u32 saturates instead of wrapping to a small grid.
        let huge = LaunchShape { batch: 1 << 20, heads: 1 << 20, seq_q: 1, seq_kv: 1 };
        assert_eq!(KernelId::NaivePvF32.variant().launch(huge).unwrap().grid[2], u32::MAX);
        assert!(KernelId::FlashFwdF16D64.variant().tensor_cores());
        assert!(!KernelId::FlashFwdF32D64.variant().tensor_cores());
        assert_eq!(
            KernelId::FlashFwdF32D128.variant().tile_record(),
            TileRecord { threads: 128, block_rows: 16, block_cols: 32, dynamic_smem_bytes: 32 * 1024, head_dim: 128 }
        );
    }
}
