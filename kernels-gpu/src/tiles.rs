//! Tile configurations, one item per kernel variant (rows of [`crate::variants`] name them).
//!
//! The kernels are instantiated from these constants and the host derives grid, block and
//! dynamic shared memory from the same items (through [`crate::variants::Variant::launch`]), so a
//! tile change cannot desynchronise the two.

/// Launch geometry of one kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes (the `.extern .shared` window).
    pub dynamic_smem_bytes: u32,
}

/// Tile of the f32 SIMT flash-forward kernel for one head dim.
///
/// A block owns `br` query rows; each row is served by `threads_per_row` consecutive lanes of one
/// warp, each lane owning `dims_per_thread = head_dim / threads_per_row` interleaved dimensions
/// (lane `l` owns dims `l, l + tpr, l + 2 tpr, ...`) of the query row and of the output
/// accumulator. K and V tiles of `bc` rows each are staged in dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashF32Tile {
    pub head_dim: u32,
    pub br: u32,
    pub bc: u32,
    pub threads_per_row: u32,
}

impl FlashF32Tile {
    pub const fn dims_per_thread(&self) -> u32 {
        self.head_dim / self.threads_per_row
    }
    pub const fn threads(&self) -> u32 {
        self.br * self.threads_per_row
    }
    /// K tile + V tile, f32: `2 * bc * head_dim * 4` bytes.
    pub const fn smem_bytes(&self) -> u32 {
        2 * self.bc * self.head_dim * 4
    }
    /// Grid `(ceil(seq_q / br), heads, batch)`, block `(threads, 1, 1)`.
    pub const fn launch(&self, batch: u32, heads: u32, seq_q: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_q.div_ceil(self.br), heads, batch],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        assert!(self.head_dim.is_multiple_of(self.threads_per_row));
        assert!(32u32.is_multiple_of(self.threads_per_row), "a row's lanes must sit in one warp");
        assert!(self.threads().is_multiple_of(32), "whole warps only");
        assert!((self.bc * self.head_dim).is_multiple_of(self.threads()), "even cooperative tile load");
    }
}

/// d=64: 4 lanes per row x 16 dims each; 32 rows x 4 = 128 threads. Bc = 64 keys keeps the K and V
/// tiles at 2 x 64 x 64 x 4 B = 32 KiB, under the 48 KiB available without opt-in. Scores are
/// computed 8 keys at a time, so a thread holds q and acc (16 + 16 registers) and 8 scores: ptxas
/// gives 72 registers at sm_80 (`ptxas-report.json`).
pub const FLASH_F32_D64: FlashF32Tile = FlashF32Tile { head_dim: 64, br: 32, bc: 64, threads_per_row: 4 };
/// d=128: 8 lanes per row x 16 dims; 16 rows x 8 = 128 threads. Bc = 32 keeps smem at 32 KiB;
/// per thread the same 16 + 16 + 8 live values as d=64.
pub const FLASH_F32_D128: FlashF32Tile = FlashF32Tile { head_dim: 128, br: 16, bc: 32, threads_per_row: 8 };

/// Tile of the tensor-core (`mma.sync` m16n8k16) flash-forward kernels for one head dim; bf16 and
/// f16 share it (both 2-byte elements).
///
/// A block of `warps` warps owns `br = rows_per_warp * warps` query rows and walks the keys in
/// tiles of `bc`. A warp owns `rows_per_warp` rows: 16 (one `mma` M tile) or 32 (two M tiles that
/// share every K and V fragment loaded from shared memory, so each `ldmatrix` feeds twice the
/// `mma`s). `q_reg_ksteps`: the first k-steps (16 head dims each) of Q whose A fragments stay in
/// registers for the whole key loop (`head_dim / 16`: all of Q); the others are reloaded from
/// shared memory in every k-step (fewer registers, more `ldmatrix`).
/// `keys_backward`: the key tiles are walked from the last to the first, as FlashAttention-2 does;
/// the one tile that can reach past the last key is then loaded before the loop, so the loop's
/// `cp.async` copies carry no row checks (false at d = 96 and 128, where the extra loop state
/// spills at 255 registers; those check rows only in the tile that needs it). Shared
/// memory holds the block's Q tile (`br x head_dim`), one K tile and one V tile (`bc x head_dim`
/// each), 2-byte elements, rows of `head_dim * 2` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashMmaTile {
    pub head_dim: u32,
    pub br: u32,
    pub bc: u32,
    pub warps: u32,
    pub rows_per_warp: u32,
    pub q_reg_ksteps: u32,
    pub keys_backward: bool,
    /// Blocks per SM the tile is built for (0: as many as its registers allow). Its PTX entry
    /// gets the launch bounds `.maxntid threads, 1, 1` and `.minnctapersm min_blocks_per_sm`
    /// (rustc has no attribute for them; `cargo xtask build-ptx` adds them), so ptxas, and the
    /// driver's JIT on the GPU alike, keep the registers at `65536 / (threads x blocks)`, rounded
    /// down to 8, or spill (`cargo xtask ptxas --check` refuses spills). A test checks that the
    /// sm_90 registers in `ptxas-report.json` fit this many blocks. d96 (168 registers, three
    /// blocks; 221 without the bounds) uses it; d128 does not need it at sm_90 (168 unbounded) and
    /// spills 48 bytes there with it.
    pub min_blocks_per_sm: u32,
}

/// Tile of the Hopper forward ([`crate::flash_fwd_sm90`], the `sm_90a` module): 384 threads
/// (a producer and two consumer warpgroups), 128 query rows, key tiles of `bc`, two K/V stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashSm90Tile {
    pub head_dim: u32,
    pub bc: u32,
}

impl FlashSm90Tile {
    pub const BR: u32 = 128;
    pub const THREADS: u32 = 384;
    /// 1024 bytes of alignment slack, Q (`128 x D`), two K and two V stages (`bc x D`), 2-byte
    /// elements, and the eight 8-byte barriers.
    pub const fn smem_bytes(&self) -> u32 {
        1024 + Self::BR * self.head_dim * 2 + 4 * self.bc * self.head_dim * 2 + 64
    }
    /// Grid `(ceil(seq_q / 128), heads, batch)`, block `(384, 1, 1)`.
    pub const fn launch(&self, batch: u32, heads: u32, seq_q: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_q.div_ceil(Self::BR), heads, batch],
            block: [Self::THREADS, 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
}

/// d64: key tiles of 128: 1 + 16 + 64 KiB shared memory.
pub const FLASH_SM90_D64: FlashSm90Tile = FlashSm90Tile { head_dim: 64, bc: 128 };
/// d128: key tiles of 128 (FlashAttention-3 uses 128 to 176): 1 + 32 + 128 KiB.
pub const FLASH_SM90_D128: FlashSm90Tile = FlashSm90Tile { head_dim: 128, bc: 128 };
/// d256: key tiles of 64 (FlashAttention-3: 80): 1 + 64 + 128 KiB, within sm_90's 227 KiB.
pub const FLASH_SM90_D256: FlashSm90Tile = FlashSm90Tile { head_dim: 256, bc: 64 };

/// Shared memory a block may use on sm_80 with the opt-in
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`): 163 KiB (sm_90: 227 KiB). Without the
/// opt-in a block gets 48 KiB; the hosts opt in per kernel when a launch needs more.
pub const SMEM_OPT_IN_SM80: u32 = 163 * 1024;
/// The same on sm_90 (H100, H200): 227 KiB.
pub const SMEM_OPT_IN_SM90: u32 = 227 * 1024;

impl FlashMmaTile {
    pub const fn threads(&self) -> u32 {
        32 * self.warps
    }
    /// 16-row `mma` M tiles per warp (1 or 2).
    pub const fn m_tiles(&self) -> u32 {
        self.rows_per_warp / 16
    }
    /// Q tile + K tile + V tile, 2-byte elements: `(br + 2 * bc) * head_dim * 2` bytes.
    pub const fn smem_bytes(&self) -> u32 {
        (self.br + 2 * self.bc) * self.head_dim * 2
    }
    /// 16-byte chunks per row of a staged tile (the unit of `cp.async`, `ldmatrix` and swizzle).
    pub const fn chunks_per_row(&self) -> u32 {
        self.head_dim / 8
    }
    /// Grid `(ceil(seq_q / br), heads, batch)`, block `(threads, 1, 1)`.
    pub const fn launch(&self, batch: u32, heads: u32, seq_q: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_q.div_ceil(self.br), heads, batch],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        assert!(self.rows_per_warp == 16 || self.rows_per_warp == 32, "one or two 16-row mma tiles per warp");
        assert!(self.q_reg_ksteps <= self.head_dim / 16, "at most every k-step of Q in registers");
        assert!(self.br == self.rows_per_warp * self.warps, "a warp owns rows_per_warp rows");
        assert!(self.head_dim.is_multiple_of(16) && self.bc.is_multiple_of(16), "whole k16 steps of both mmas");
        assert!(self.head_dim / 16 <= 16 && self.bc / 8 <= 16, "fragment loops unroll up to 16");
        assert!(self.head_dim / 8 <= 32, "the O accumulator's loops unroll up to 32");
        assert!(self.head_dim.is_multiple_of(32), "the XOR swizzle permutes aligned groups of 4 or 8 chunks");
        // The copy plan (`swizzle::copy_phases`): whole groups of rows per tile, and with several
        // phases (d 96 and 192 at 128 threads) groups of whole swizzle periods.
        let (phases, group) = (
            crate::swizzle::copy_phases(self.head_dim as usize, self.threads() as usize) as u32,
            crate::swizzle::copy_group_rows(self.head_dim as usize, self.threads() as usize) as u32,
        );
        assert!(group.is_multiple_of(4), "a thread's rows take one or two swizzles");
        assert!(phases == 1 || group.is_multiple_of(8), "one swizzle per copy phase");
        assert!(phases <= 4, "copy phases unroll up to 4");
        assert!(self.br.is_multiple_of(group), "even Q tile load");
        assert!(self.bc.is_multiple_of(group), "even K/V tile load");
        assert!(self.smem_bytes() <= SMEM_OPT_IN_SM80, "fits sm_80's opt-in shared memory");
        assert!(
            self.min_blocks_per_sm * self.smem_bytes() <= SMEM_OPT_IN_SM80,
            "min_blocks_per_sm blocks fit sm_80's shared memory"
        );
    }
}

/// d=64: 32 rows per warp (Br 128), Bc = 64 keys per step: smem (128 + 2 x 64) x 64 x 2 B =
/// 32 KiB. Per thread Q fragments 32 registers, O accumulator 64, scores 64 (Bc = 128 spills).
pub const FLASH_MMA_D64: FlashMmaTile = FlashMmaTile {
    head_dim: 64,
    br: 128,
    bc: 64,
    warps: 4,
    rows_per_warp: 32,
    q_reg_ksteps: 4,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
/// d=128: 4 warps of 16 rows (Br 64), Bc = 64: smem (64 + 2 x 64) x 128 x 2 B = 48 KiB (no
/// opt-in). Per thread O accumulator 64 registers, scores 32; the first 2 of Q's 8 k-steps stay
/// in registers (8), the other 6 are reloaded from shared memory per key tile. ptxas gives 168
/// registers at sm_90 (three blocks per SM on an H100/H200) and 192 at sm_80 (two), so while one
/// block waits for its K/V tile the others' warps run. The 8-warp block of 32-row warps (Br 256,
/// Bc 32, 255 registers, one block per SM) that ran before left that wait exposed:
/// `scripts/perf_model.py` puts it at 0.83-0.87x FA2 on the H200, where it measured 0.81-0.86x,
/// and this block at 1.01-1.12x (`docs/perf/README.md`); 4 warps of 32 rows (Br 128, Bc 32: 255
/// registers, two blocks per SM) at 1.02x. 16-row warps read K and V twice as often per unit of
/// work as 32-row ones (more `ldmatrix`), which three blocks per SM more than pay for in the model.
pub const FLASH_MMA_D128: FlashMmaTile = FlashMmaTile {
    head_dim: 128,
    br: 64,
    bc: 64,
    warps: 4,
    rows_per_warp: 16,
    q_reg_ksteps: 2,
    keys_backward: false,
    min_blocks_per_sm: 0,
};

// The other head dims (d = 32, 96, 192, 256). Tiles above 48 KiB
// (d = 192, 256) need the shared-memory opt-in, which the hosts request per kernel. Registers are
// ptxas's at sm_80 / sm_90 (`ptxas-report.json`), 0 spills and 0 stack for each; the tile shapes
// were chosen with `scripts/sass-compare.sh` (its pipe model against FA2's kernels).

/// d=32 (rows of 64 bytes, the 4-chunk swizzle): 32 rows per warp (Br 128), Bc = 64: smem
/// (128 + 2 x 64) x 32 x 2 B = 16 KiB. Per thread Q fragments 16 registers, O 32, scores 64.
pub const FLASH_MMA_D32: FlashMmaTile = FlashMmaTile {
    head_dim: 32,
    br: 128,
    bc: 64,
    warps: 4,
    rows_per_warp: 32,
    q_reg_ksteps: 2,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
/// d=96 (12 chunks a row, the 4-chunk swizzle): 4 warps of 16 rows (Br 64), Bc = 64: smem
/// (64 + 2 x 64) x 96 x 2 B = 36 KiB. Per thread O 48 registers, scores 32; the first 4 of Q's 6
/// k-steps stay in registers (16), the other 2 are reloaded from shared memory per key tile.
/// Built for three blocks per SM (168 registers at sm_80 and sm_90, 0 spills). 128 threads do not
/// copy whole rows of 12 chunks per pass: the copies run in 3 phases over groups of 32 rows
/// (`swizzle::copy_phases`). The 6-warp block of 32-row warps (Br 192, Bc 32, 255 registers: one
/// block per SM) that ran on the H200 measured 0.65-0.69x FA2; `scripts/perf_model.py` puts it at
/// 0.59-0.64x and this block at 1.10-1.12x (`docs/perf/README.md`): more blocks per SM hide each
/// key tile's wait, and 4 warps keep the 4 SMSPs even.
pub const FLASH_MMA_D96: FlashMmaTile = FlashMmaTile {
    head_dim: 96,
    br: 64,
    bc: 64,
    warps: 4,
    rows_per_warp: 16,
    q_reg_ksteps: 4,
    keys_backward: false,
    min_blocks_per_sm: 3,
};
/// d=192 (24 chunks a row): 4 warps of 16 rows (Br 64), Bc = 64: smem (64 + 2 x 64) x 192 x 2 B
/// = 72 KiB (opt-in; two blocks per SM). Per thread Q fragments 48 registers (all of Q), O 96,
/// scores 32. The copies run in 3 phases over groups of 16 rows. The 6-warp block (Br 96) that
/// ran on the H200 measured 0.83-0.86x FA2 (model 0.77-0.83x; this block 1.29-1.30x).
pub const FLASH_MMA_D192: FlashMmaTile = FlashMmaTile {
    head_dim: 192,
    br: 64,
    bc: 64,
    warps: 4,
    rows_per_warp: 16,
    q_reg_ksteps: 12,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
/// d=256 (Gemma's; 32 chunks a row): FlashAttention-2's tile, 8 warps of 16 rows (Br 128), 8 rows
/// per copy pass, Bc = 64: smem (128 + 2 x 64) x 256 x 2 B = 128 KiB (opt-in; one block per SM).
/// Per thread O 128 registers, scores 32; of Q's 16 k-steps (64 registers of fragments) the
/// first 2 stay in registers (252 registers at sm_90) and the others are reloaded from shared
/// memory per key tile (all of Q in registers spills).
pub const FLASH_MMA_D256: FlashMmaTile = FlashMmaTile {
    head_dim: 256,
    br: 128,
    bc: 64,
    warps: 8,
    rows_per_warp: 16,
    q_reg_ksteps: 2,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
// Narrow-window tiles: the default row's warp (rows per warp and the k-steps of Q kept in
// registers unchanged, so the same registers) in fewer warps (d32, d96), or with key tiles of 32
// (d192, d256); d128's is the warp of its earlier default (32 rows, Bc 32) in 2 warps. Each warp skips the key tiles outside its own rows' windows, so these win
// only for narrow windows; the measured crossovers are the rules in variants.rs
// (`NARROW_WINDOW_D32` ...). d64 has none: its default row is the cheaper one at every window.

/// d=32 for narrow windows: 2 warps of 32 rows (Br 64), Bc = 64: smem (64 + 2 x 64) x 32 x 2 B =
/// 12 KiB.
pub const FLASH_MMA_D32_WINDOW: FlashMmaTile = FlashMmaTile {
    head_dim: 32,
    br: 64,
    bc: 64,
    warps: 2,
    rows_per_warp: 32,
    q_reg_ksteps: 2,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
/// d=96 for narrow windows: 3 warps of 32 rows (Br 96), Bc = 32: smem (96 + 2 x 32) x 96 x 2 B =
/// 30 KiB. (3 warps of 16 rows, Br 48, cost more: 29.2 M against 25.8 M thread-instructions at
/// seq 4096, window (255, 0); two 16-row mma tiles per warp share each K and V fragment.)
pub const FLASH_MMA_D96_WINDOW: FlashMmaTile = FlashMmaTile {
    head_dim: 96,
    br: 96,
    bc: 32,
    warps: 3,
    rows_per_warp: 32,
    q_reg_ksteps: 6,
    keys_backward: false,
    min_blocks_per_sm: 0,
};
/// d=128 for narrow windows: 2 warps of 32 rows (Br 64), Bc = 32: smem (64 + 2 x 32) x 128 x 2 B
/// = 32 KiB. Its rule (`NARROW_WINDOW_D128`, windows of at most 96 keys) was measured against the
/// earlier default (Br 256, 8 warps of 32 rows, Bc 32), not against today's.
pub const FLASH_MMA_D128_WINDOW: FlashMmaTile = FlashMmaTile {
    head_dim: 128,
    br: 64,
    bc: 32,
    warps: 2,
    rows_per_warp: 32,
    q_reg_ksteps: 2,
    keys_backward: false,
    min_blocks_per_sm: 0,
};
/// d=192 for narrow windows: the default 6 warps of 16 rows (Br 96) with Bc = 32 (8 rows per copy
/// pass): smem (96 + 2 x 32) x 192 x 2 B = 60 KiB (opt-in). (3 warps, Br 48, cost 5 % more at
/// window (255, 0), 37.9 M against 36.1 M: fewer rows share each K/V tile.)
pub const FLASH_MMA_D192_WINDOW: FlashMmaTile = FlashMmaTile {
    head_dim: 192,
    br: 96,
    bc: 32,
    warps: 6,
    rows_per_warp: 16,
    q_reg_ksteps: 12,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
/// d=256 for narrow windows: the default 8 warps of 16 rows (Br 128) with Bc = 32 (8 rows per
/// copy pass): smem (128 + 2 x 32) x 256 x 2 B = 96 KiB (opt-in).
pub const FLASH_MMA_D256_WINDOW: FlashMmaTile = FlashMmaTile {
    head_dim: 256,
    br: 128,
    bc: 32,
    warps: 8,
    rows_per_warp: 16,
    q_reg_ksteps: 2,
    keys_backward: true,
    min_blocks_per_sm: 0,
};
/// f32 d=32: 4 lanes per row x 8 dims; 32 rows; smem 2 x 64 x 32 x 4 B = 16 KiB.
pub const FLASH_F32_D32: FlashF32Tile = FlashF32Tile { head_dim: 32, br: 32, bc: 64, threads_per_row: 4 };
/// f32 d=96: 8 lanes per row x 12 dims; 16 rows; smem 2 x 32 x 96 x 4 B = 24 KiB.
pub const FLASH_F32_D96: FlashF32Tile = FlashF32Tile { head_dim: 96, br: 16, bc: 32, threads_per_row: 8 };
/// f32 d=192: 16 lanes per row x 12 dims; 8 rows; smem 2 x 32 x 192 x 4 B = 48 KiB.
pub const FLASH_F32_D192: FlashF32Tile = FlashF32Tile { head_dim: 192, br: 8, bc: 32, threads_per_row: 16 };
/// f32 d=256: 16 lanes per row x 16 dims (as d=128, so the same live values); 8 rows; smem 2 x 16
/// x 256 x 4 B = 32 KiB.
pub const FLASH_F32_D256: FlashF32Tile = FlashF32Tile { head_dim: 256, br: 8, bc: 16, threads_per_row: 16 };

/// Largest head dim the naive kernels accept (they loop over it at run time).
pub const NAIVE_MAX_HEAD_DIM: u32 = 256;

/// Tile of the naive score kernel: one thread per score, a block covers `threads` keys of one
/// query row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NaiveScoresTile {
    pub threads: u32,
}
/// Tile of the naive softmax: one warp per row, `rows` rows per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NaiveSoftmaxTile {
    pub rows: u32,
}
impl NaiveSoftmaxTile {
    pub const fn threads(&self) -> u32 {
        32 * self.rows
    }
}
/// Tile of the naive P·V kernel: a block owns one output row, `threads` threads stride over d.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NaivePvTile {
    pub threads: u32,
}
/// Tile of the smoke kernel: one thread per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmokeTile {
    pub threads: u32,
}

pub const NAIVE_SCORES: NaiveScoresTile = NaiveScoresTile { threads: 128 };
pub const NAIVE_SOFTMAX: NaiveSoftmaxTile = NaiveSoftmaxTile { rows: 4 };
pub const NAIVE_PV: NaivePvTile = NaivePvTile { threads: 64 };
pub const SAXPY: SmokeTile = SmokeTile { threads: 256 };
/// `tensor_maps_store`: one thread writes the 48 words (a store of 384 bytes needs no more).
pub const TENSOR_MAPS_STORE: SmokeTile = SmokeTile { threads: 1 };

/// The launch of `tensor_maps_store`: one block of [`TENSOR_MAPS_STORE`]'s threads.
pub const fn tensor_maps_store_launch() -> LaunchDims {
    LaunchDims { grid: [1, 1, 1], block: [TENSOR_MAPS_STORE.threads, 1, 1], dynamic_smem_bytes: 0 }
}

/// Tile of the naive backward's `dK, dV` kernel (`naive_bwd.rs`): a block owns key row `j` of
/// one K/V head, `threads` threads stride over d (as [`NAIVE_PV`] over a query row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NaiveBwdKvTile {
    pub threads: u32,
}

impl NaiveBwdKvTile {
    /// Grid `(seq_kv, 1, batch * heads_kv)`, block `(threads, 1, 1)`, no shared memory.
    pub const fn launch(&self, batch: u32, heads_kv: u32, seq_kv: u32) -> LaunchDims {
        let bh = batch as u64 * heads_kv as u64;
        LaunchDims {
            grid: [seq_kv, 1, if bh > u32::MAX as u64 { u32::MAX } else { bh as u32 }],
            block: [self.threads, 1, 1],
            dynamic_smem_bytes: 0,
        }
    }
}

/// Naive backward step 1, P recomputed from the forward's LSE: one thread per element of P, as
/// the forward's scores ([`NAIVE_SCORES`]).
pub const NAIVE_BWD_P: NaiveScoresTile = NaiveScoresTile { threads: 128 };
/// Naive backward step 2, dS: one warp per row, lanes striding over the keys, 4 rows per block,
/// as the forward's softmax ([`NAIVE_SOFTMAX`]).
pub const NAIVE_BWD_DS: NaiveSoftmaxTile = NaiveSoftmaxTile { rows: 4 };
/// Naive backward step 3, `dQ = dS K`: one query row per block, 64 threads over d (as
/// [`NAIVE_PV`]: d up to 256 is 4 dims per thread).
pub const NAIVE_BWD_DQ: NaivePvTile = NaivePvTile { threads: 64 };
/// Naive backward step 4, `dK = dSᵀ Q`, `dV = Pᵀ dO`: one key row per block, 64 threads over d.
pub const NAIVE_BWD_DKV: NaiveBwdKvTile = NaiveBwdKvTile { threads: 64 };

/// Largest grid y/z extent.
pub const MAX_GRID_YZ: u32 = 65_535;

/// Launch geometry of the smoke kernel for `n` elements.
pub const fn saxpy_launch(n: u32) -> LaunchDims {
    LaunchDims { grid: [n.div_ceil(SAXPY.threads), 1, 1], block: [SAXPY.threads, 1, 1], dynamic_smem_bytes: 0 }
}

/// Tile of the split-KV decode kernel (`decode_fwd.rs`) for one head dim.
///
/// 128 threads; each packed query row (a `(token, query head)` pair of one KV head's group) is
/// served by `threads_per_row` consecutive lanes owning interleaved dims, as in [`FlashF32Tile`].
/// Decode has few rows (`seq_q * heads / heads_kv`, often 4-8), so the tile gives a row more lanes
/// and has fewer rows than the prefill kernel. K and V tiles of `bc` keys are staged in dynamic
/// shared memory as f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeTile {
    pub head_dim: u32,
    pub bc: u32,
    pub threads_per_row: u32,
}

impl DecodeTile {
    pub const THREADS: u32 = 128;
    pub const fn threads(&self) -> u32 {
        Self::THREADS
    }
    /// Packed query rows per block.
    pub const fn br(&self) -> u32 {
        Self::THREADS / self.threads_per_row
    }
    pub const fn dims_per_thread(&self) -> u32 {
        self.head_dim / self.threads_per_row
    }
    /// K tile + V tile, f32: `2 * bc * head_dim * 4` bytes.
    pub const fn smem_bytes(&self) -> u32 {
        2 * self.bc * self.head_dim * 4
    }
    /// Grid `(num_splits, ceil(seq_q * group / br), heads_kv * batch)`, block `(128, 1, 1)`.
    /// Extents are computed in 64 bits and saturate at `u32::MAX`.
    pub const fn launch(&self, num_splits: u32, seq_q: u32, group: u32, heads_kv: u32, batch: u32) -> LaunchDims {
        let rows = seq_q as u64 * group as u64;
        let tiles = rows.div_ceil(self.br() as u64);
        let z = heads_kv as u64 * batch as u64;
        LaunchDims {
            grid: [num_splits, sat(tiles), sat(z)],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        assert!(self.head_dim.is_multiple_of(self.threads_per_row));
        assert!(32u32.is_multiple_of(self.threads_per_row), "a row's lanes must sit in one warp");
        assert!(self.bc.is_multiple_of(8), "scores are computed 8 keys at a time");
        assert!((self.bc * self.head_dim).is_multiple_of(Self::THREADS), "even cooperative tile load");
        assert!(self.smem_bytes() <= 48 * 1024, "fits without the shared-memory opt-in");
    }
}

const fn sat(x: u64) -> u32 {
    if x > u32::MAX as u64 {
        u32::MAX
    } else {
        x as u32
    }
}

/// d=64: 8 lanes per row x 8 dims, 16 rows (a group of 8 heads for 2 tokens, or 16 heads of one
/// token); Bc = 32: smem 2 x 32 x 64 x 4 B = 16 KiB. Per thread q and acc are 8 + 8 registers.
pub const DECODE_D64: DecodeTile = DecodeTile { head_dim: 64, bc: 32, threads_per_row: 8 };
/// d=128: 16 lanes per row x 8 dims, 8 rows (one token of a GQA group of 8); Bc = 32: smem 2 x 32
/// x 128 x 4 B = 32 KiB.
pub const DECODE_D128: DecodeTile = DecodeTile { head_dim: 128, bc: 32, threads_per_row: 16 };
/// d=32: 4 lanes per row x 8 dims, 32 rows; Bc = 32: smem 2 x 32 x 32 x 4 B = 8 KiB.
pub const DECODE_D32: DecodeTile = DecodeTile { head_dim: 32, bc: 32, threads_per_row: 4 };
/// d=96: 16 lanes per row x 6 dims, 8 rows; Bc = 32: smem 2 x 32 x 96 x 4 B = 24 KiB.
pub const DECODE_D96: DecodeTile = DecodeTile { head_dim: 96, bc: 32, threads_per_row: 16 };
/// d=192: 16 lanes per row x 12 dims, 8 rows; Bc = 32: smem 2 x 32 x 192 x 4 B = 48 KiB.
pub const DECODE_D192: DecodeTile = DecodeTile { head_dim: 192, bc: 32, threads_per_row: 16 };
/// d=256: 16 lanes per row x 16 dims, 8 rows; Bc = 16 (48 KiB without the opt-in): smem 2 x 16 x
/// 256 x 4 B = 32 KiB.
pub const DECODE_D256: DecodeTile = DecodeTile { head_dim: 256, bc: 16, threads_per_row: 16 };

/// Tile of `merge_states`: one warp per output row, `rows` rows per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeTile {
    pub rows: u32,
}
impl MergeTile {
    pub const fn threads(&self) -> u32 {
        32 * self.rows
    }
    /// Grid `(ceil(rows / tile rows), 1, 1)` for `rows = batch * heads * seq_q` output rows.
    pub const fn launch(&self, rows: u64) -> LaunchDims {
        LaunchDims {
            grid: [sat(rows.div_ceil(self.rows as u64)), 1, 1],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: 0,
        }
    }
}
pub const MERGE: MergeTile = MergeTile { rows: 4 };

/// Tile of the cache append: one block per new token of one sequence, `threads` threads stride
/// over its `heads_kv * head_dim` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendTile {
    pub threads: u32,
}
impl AppendTile {
    /// Grid `(seq_new, batch, 1)`.
    pub const fn launch(&self, seq_new: u32, batch: u32) -> LaunchDims {
        LaunchDims { grid: [seq_new, batch, 1], block: [self.threads, 1, 1], dynamic_smem_bytes: 0 }
    }
}
pub const APPEND: AppendTile = AppendTile { threads: 128 };

/// Tile of the tensor-core split-KV decode kernel (`decode_mma.rs`) for one head dim.
///
/// One block owns one 16-row `mma` m-tile of packed query rows (the `heads / heads_kv` query
/// heads of one KV head for each query token) and `warps` warps that share it: per step of `bc`
/// keys each warp scores and accumulates its own `bc / warps` keys with its own online-softmax
/// state, and the warps' states are merged once at the end (FlashDecoding's split of the keys
/// over the warps of a block). Q, K and V are staged as 16-bit swizzled tiles, as in
/// [`FlashMmaTile`], K and V each in a ring of `stages` buffers (the copies of the next
/// `stages - 1` tiles are in flight while one is computed); after the key loop the K and V area
/// holds the warps' f32 accumulators for the merge: `warps * 16 * head_dim * 4` bytes, no more
/// than the `2 * stages * bc * head_dim * 2` of the K and V buffers when `bc >= 16 * warps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeMmaTile {
    pub head_dim: u32,
    pub bc: u32,
    pub warps: u32,
    /// K and V buffers each (1: one tile's copy in flight at a time, 2: double buffering).
    pub stages: u32,
}

impl DecodeMmaTile {
    /// Packed query rows per block: one m16 tile.
    pub const ROWS: u32 = 16;
    pub const fn threads(&self) -> u32 {
        32 * self.warps
    }
    pub const fn br(&self) -> u32 {
        Self::ROWS
    }
    /// Keys one warp scores per step.
    pub const fn keys_per_warp(&self) -> u32 {
        self.bc / self.warps
    }
    /// Q tile + `stages` K tiles + `stages` V tiles, 2-byte elements (an FP8 cache uses half of
    /// each): `(16 + 2 * stages * bc) * head_dim * 2` bytes.
    pub const fn smem_bytes(&self) -> u32 {
        (Self::ROWS + 2 * self.stages * self.bc) * self.head_dim * 2
    }
    /// Bytes of one K (or V) buffer: `bc * head_dim * 2`.
    pub const fn kv_tile_bytes(&self) -> u32 {
        self.bc * self.head_dim * 2
    }
    /// Grid `(num_splits, ceil(seq_q * group / 16), heads_kv * batch)`, block `(threads, 1, 1)`.
    /// Extents are computed in 64 bits and saturate at `u32::MAX`.
    pub const fn launch(&self, num_splits: u32, seq_q: u32, group: u32, heads_kv: u32, batch: u32) -> LaunchDims {
        let rows = seq_q as u64 * group as u64;
        LaunchDims {
            grid: [num_splits, sat(rows.div_ceil(Self::ROWS as u64)), sat(heads_kv as u64 * batch as u64)],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        let cpr = self.head_dim / 8;
        assert!(self.head_dim.is_multiple_of(16), "whole k16 steps of Q Kᵀ");
        assert!(self.keys_per_warp() * self.warps == self.bc && self.keys_per_warp().is_multiple_of(16));
        assert!(cpr <= 16 && self.keys_per_warp() / 8 <= 16, "fragment loops unroll up to 16");
        assert!(cpr.is_multiple_of(8), "the XOR swizzle permutes groups of 8 chunks");
        assert!(self.threads().is_multiple_of(cpr) && (self.threads() / cpr).is_multiple_of(8));
        assert!((Self::ROWS * cpr).is_multiple_of(self.threads()), "even Q tile load");
        assert!((self.bc * cpr).is_multiple_of(self.threads()), "even K/V tile load");
        assert!(
            self.threads().is_multiple_of(Self::ROWS)
                && self.head_dim.is_multiple_of(2 * (self.threads() / Self::ROWS))
        );
        assert!(self.stages >= 1 && self.stages <= 4, "a ring of 1 to 4 K and V buffers");
        assert!(
            self.warps * Self::ROWS * self.head_dim * 4 <= 2 * self.stages * self.kv_tile_bytes(),
            "the merge fits in K and V"
        );
        // Two blocks per SM on an A100 (164 KiB per SM, 1 KiB of it reserved per block), so the
        // split plan's two resident blocks hold from sm_80 on.
        assert!(2 * (self.smem_bytes() + 1024) <= 164 * 1024, "two blocks per SM on sm_80");
        assert!(self.smem_bytes() <= SMEM_OPT_IN_SM80, "fits sm_80's opt-in shared memory");
    }
}

/// d=64: 4 warps of 16 keys, Bc = 64, 2 stages: smem (16 + 2 x 2 x 64) x 64 x 2 B = 34 KiB. Per
/// thread Q fragments 16 registers, O accumulator 32, scores 8.
pub const DECODE_MMA_D64: DecodeMmaTile = DecodeMmaTile { head_dim: 64, bc: 64, warps: 4, stages: 2 };
/// d=128: 4 warps of 16 keys, Bc = 64, 2 stages: smem (16 + 2 x 2 x 64) x 128 x 2 B = 68 KiB
/// (opt-in; 2 blocks per SM on sm_80 and 3 on sm_90 by shared memory; 1 on the 100 KiB SMs of
/// sm_86/sm_89). Per thread Q fragments 32 registers, O accumulator 64, scores 8.
pub const DECODE_MMA_D128: DecodeMmaTile = DecodeMmaTile { head_dim: 128, bc: 64, warps: 4, stages: 2 };

/// Tile of the f32 SIMT backward main kernel (`flash_bwd_f32.rs`) for one head dim.
///
/// A block owns `bc` keys of one K/V head and walks the query tiles of `br` rows of every query
/// head that reads it (GQA: dK and dV are summed over the group in registers, no atomics). Each
/// key is served by `threads_per_key` consecutive lanes of one warp, each lane owning
/// `head_dim / threads_per_key` interleaved dims of k, v, dK and dV. Shared memory holds the K
/// tile (for dQ), the Q and dO tiles, the `br x bc` dS tile and the rows' LSE and D.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashBwdF32Tile {
    pub head_dim: u32,
    pub br: u32,
    pub bc: u32,
    pub threads_per_key: u32,
}

impl FlashBwdF32Tile {
    pub const fn dims_per_thread(&self) -> u32 {
        self.head_dim / self.threads_per_key
    }
    pub const fn threads(&self) -> u32 {
        self.bc * self.threads_per_key
    }
    /// K `bc x d`, Q and dO `br x d` each, dS `br x bc`, LSE and D `br` each, f32.
    pub const fn smem_bytes(&self) -> u32 {
        (self.bc * self.head_dim + 2 * self.br * self.head_dim + self.br * self.bc + 2 * self.br) * 4
    }
    /// Grid `(ceil(seq_kv / bc), heads_kv, batch)`, block `(threads, 1, 1)`.
    pub const fn launch(&self, batch: u32, heads_kv: u32, seq_kv: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_kv.div_ceil(self.bc), heads_kv, batch],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        assert!(self.head_dim.is_multiple_of(self.threads_per_key));
        assert!(32u32.is_multiple_of(self.threads_per_key), "a key's lanes must sit in one warp");
        assert!(self.threads().is_multiple_of(32), "whole warps only");
        assert!(self.smem_bytes() <= 48 * 1024, "fits without the shared-memory opt-in");
    }
}

/// d=32: 2 lanes per key x 16 dims (64 live values per thread, as at every head dim); 32 keys
/// x 2 = 64 threads. Shared memory (32 x 32 + 2 x 32 x 32 + 32 x 32 + 64) x 4 B = 16.25 KiB.
pub const FLASH_BWD_F32_D32: FlashBwdF32Tile = FlashBwdF32Tile { head_dim: 32, br: 32, bc: 32, threads_per_key: 2 };
/// d=64: 4 lanes per key x 16 dims; 32 keys x 4 = 128 threads. A thread keeps k, v, dK and dV
/// (4 x 16 registers). Shared memory (32 x 64 + 2 x 32 x 64 + 32 x 32 + 64) x 4 B = 28.25 KiB.
pub const FLASH_BWD_F32_D64: FlashBwdF32Tile = FlashBwdF32Tile { head_dim: 64, br: 32, bc: 32, threads_per_key: 4 };
/// d=128: 8 lanes per key x 16 dims (the same 64 live values per thread as d=64); 32 keys x 8 =
/// 256 threads; Br = 16 keeps shared memory at (32 x 128 + 2 x 16 x 128 + 16 x 32 + 32) x 4 B =
/// 34.1 KiB, under 48 KiB.
pub const FLASH_BWD_F32_D128: FlashBwdF32Tile = FlashBwdF32Tile { head_dim: 128, br: 16, bc: 32, threads_per_key: 8 };
/// d=96: 8 lanes per key x 12 dims; 32 keys x 8 = 256 threads; shared memory (32 x 96 + 2 x 16
/// x 96 + 16 x 32 + 32) x 4 B = 26.1 KiB.
pub const FLASH_BWD_F32_D96: FlashBwdF32Tile = FlashBwdF32Tile { head_dim: 96, br: 16, bc: 32, threads_per_key: 8 };
/// d=192: 16 lanes per key x 12 dims; Bc = 16 keys x 16 = 256 threads (32 keys would be 512
/// threads, over the register file at this kernel's ~170 registers); shared memory (16 x 192 +
/// 2 x 16 x 192 + 16 x 16 + 32) x 4 B = 37.1 KiB.
pub const FLASH_BWD_F32_D192: FlashBwdF32Tile = FlashBwdF32Tile { head_dim: 192, br: 16, bc: 16, threads_per_key: 16 };
/// d=256: 16 lanes per key x 16 dims; Bc = 16 keys x 16 = 256 threads; Br = 8 keeps shared
/// memory at (16 x 256 + 2 x 8 x 256 + 8 x 16 + 16) x 4 B = 32.6 KiB (Br = 16 would need 49.1
/// KiB, over 48 KiB).
pub const FLASH_BWD_F32_D256: FlashBwdF32Tile = FlashBwdF32Tile { head_dim: 256, br: 8, bc: 16, threads_per_key: 16 };

/// Tile of the compact tensor-core backward main kernel (`flash_bwd_mma.rs`, bf16/f16) for one
/// head dim: d32's kernel, and at d64 and d128 the fallback of GPUs whose blocks may not opt in
/// to the 128 KiB of [`FlashBwdTcTile`].
///
/// A block of `warps` warps owns `bc = 16 · warps` keys of one K/V head (warp `w` keys
/// `16w..16w + 16`, their dK and dV accumulators in registers) and walks the query tiles of `br`
/// rows of every query head that reads it. Per query tile each warp computes `Sᵀ = K Qᵀ` and
/// `dPᵀ = V dOᵀ` for its 16 keys on tensor cores, then `dV += Pᵀ dO` and `dK += dSᵀ Q` with P and
/// dS as A operands straight from the accumulators; dSᵀ goes to shared memory in 16 bits and
/// `dQ += dS K` is split over the warps: `br / 16` m-tiles times [`FlashBwdMmaTile::dq_parts`]
/// parts of the head dim. Shared memory: K and V `[bc][d]`, Q and dO `[br][d]`, dSᵀ `[bc][br]`,
/// 16-bit and swizzled; LSE and D `[br]`, f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashBwdMmaTile {
    pub head_dim: u32,
    pub br: u32,
    pub warps: u32,
    /// Warps that share one 16-key row group, each owning `head_dim / kv_splits` columns of its
    /// dK and dV (and each computing the group's Sᵀ and dPᵀ): 1, or 2 where a warp's dK and dV
    /// of the whole head dim would not fit in registers (d128).
    pub kv_splits: u32,
}

impl FlashBwdMmaTile {
    /// Keys per block: 16 per group of `kv_splits` warps.
    pub const fn bc(&self) -> u32 {
        16 * self.warps / self.kv_splits
    }
    /// 8-column tiles of dK and dV per warp.
    pub const fn dkv_dtiles(&self) -> u32 {
        self.head_dim / 8 / self.kv_splits
    }
    pub const fn threads(&self) -> u32 {
        32 * self.warps
    }
    /// Parts of the head dim the `dQ += dS K` step splits each 16-row m-tile into (one warp each).
    pub const fn dq_parts(&self) -> u32 {
        self.warps / (self.br / 16)
    }
    /// 8-column tiles of dQ per warp.
    pub const fn dq_dtiles(&self) -> u32 {
        self.head_dim / 8 / self.dq_parts()
    }
    /// K, V `bc x d`, Q, dO `br x d`, dSᵀ `bc x br` (2 B each), LSE and D `br` (4 B each).
    pub const fn smem_bytes(&self) -> u32 {
        (2 * self.bc() * self.head_dim + 2 * self.br * self.head_dim + self.bc() * self.br) * 2 + 2 * self.br * 4
    }
    /// Grid `(ceil(seq_kv / bc), heads_kv, batch)`, block `(threads, 1, 1)`.
    pub const fn launch(&self, batch: u32, heads_kv: u32, seq_kv: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_kv.div_ceil(self.bc()), heads_kv, batch],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        let cpr = self.head_dim / 8; // 16-byte chunks per row
        assert!(self.head_dim.is_multiple_of(32), "rows of whole swizzle groups");
        assert!(self.br == 32 || self.br == 64, "dSᵀ rows of 64 or 128 bytes (one swizzle)");
        assert!(self.bc() / 16 <= 4, "unroll4! over the key block's 16-key steps");
        assert!(self.warps.is_multiple_of(self.kv_splits) && (self.head_dim / 8).is_multiple_of(self.kv_splits));
        assert!(
            self.kv_splits == 1 || (self.head_dim.is_multiple_of(64) && self.dkv_dtiles().is_power_of_two()),
            "a dK/dV part's first chunk XORs cleanly with its lane's chunk steps"
        );
        assert!(self.warps.is_multiple_of(self.br / 16), "whole dQ m-tiles per warp group");
        assert!((self.head_dim / 8).is_multiple_of(self.dq_parts()) && self.dq_dtiles().is_multiple_of(2));
        assert!(
            self.dq_parts() == 1 || (self.head_dim.is_multiple_of(64) && self.dq_dtiles().is_power_of_two()),
            "a dQ part's first chunk XORs cleanly with its lane's chunk steps"
        );
        assert!(self.threads().is_multiple_of(cpr) && (self.threads() / cpr).is_multiple_of(4), "whole copy passes");
        assert!(self.br.is_multiple_of(self.threads() / cpr) && self.bc().is_multiple_of(self.threads() / cpr));
        assert!(self.br / (self.threads() / cpr) <= 8 && self.bc() / (self.threads() / cpr) <= 8);
        assert!(self.smem_bytes() <= 99 * 1024, "fits an sm_86 block with the opt-in");
    }
}

/// d=32: 4 warps of 16 keys (Bc 64), Br 64. Per thread dK, dV 16 registers each, Sᵀ and dPᵀ
/// 32 each. Shared memory (2 x 64 x 32 + 2 x 64 x 32 + 64 x 64) x 2 + 512 B = 24.5 KiB.
pub const FLASH_BWD_MMA_D32: FlashBwdMmaTile = FlashBwdMmaTile { head_dim: 32, br: 64, warps: 4, kv_splits: 1 };
/// d=64: 4 warps of 16 keys (Bc 64), Br 32 (Br 64, with Sᵀ and dPᵀ 32 registers each instead
/// of 16, spilled). dK, dV 32 registers each; dQ: 2 m-tiles x 2 halves of the head dim. Shared
/// memory (2 x 64 x 64 + 2 x 32 x 64 + 64 x 32) x 2 + 256 B = 28.3 KiB.
pub const FLASH_BWD_MMA_D64: FlashBwdMmaTile = FlashBwdMmaTile { head_dim: 64, br: 32, warps: 4, kv_splits: 1 };
/// d=128: 8 warps, two per 16-key row group (Bc 64), each owning half of the head dim of its
/// keys' dK and dV (32 registers each; one warp for all 128 columns, 64 each, spilled), both
/// computing the group's Sᵀ and dPᵀ (16 registers each); Br 32. dQ: 2 m-tiles x 4 quarters of
/// the head dim. Shared memory (2 x 64 x 128 + 2 x 32 x 128 + 64 x 32) x 2 + 256 B = 52.3 KiB
/// (opt-in).
pub const FLASH_BWD_MMA_D128: FlashBwdMmaTile = FlashBwdMmaTile { head_dim: 128, br: 32, warps: 8, kv_splits: 2 };

/// Tile of the tensor-core backward main kernel with FlashAttention-2's two-dimensional warp
/// layout (`flash_bwd_tc.rs`, bf16/f16) for one head dim: 8 warps, `br = 128` query rows per
/// tile, `bc` keys per block. Per query tile: `S` and `dP` (warp tiles of 32 rows x `bc / 2`
/// keys, in passes of 32), P and dS through shared memory, `dV += Pᵀ dO` and `dK += dSᵀ Q`
/// (warp tiles of 32 keys x `head_dim / (8 / (bc / 32))` columns, accumulated in registers for
/// the whole block), `dQ += dS K` (32 rows x `head_dim / 2`). Shared memory: K, V `[bc][d]`, Q,
/// dO `[br][d]`, P, dS `[br][bc]`, 16-bit and swizzled: more than the 99 KiB an sm_86 block may
/// opt in to, so GPUs with less use the compact rows ([`FlashBwdMmaTile`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashBwdTcTile {
    pub head_dim: u32,
    pub bc: u32,
}

impl FlashBwdTcTile {
    /// Query rows per tile.
    pub const BR: u32 = 128;
    /// 8 warps.
    pub const fn threads(&self) -> u32 {
        256
    }
    /// Warps over the keys of dK and dV (32 keys each).
    pub const fn dkv_key_warps(&self) -> u32 {
        self.bc / 32
    }
    /// 8-column tiles of dK and dV per warp.
    pub const fn dkv_dtiles(&self) -> u32 {
        self.head_dim / 8 / (8 / self.dkv_key_warps())
    }
    /// K, V `bc x d`, Q, dO `128 x d`, P, dS `128 x bc`, 2 B each.
    pub const fn smem_bytes(&self) -> u32 {
        (2 * self.bc * self.head_dim + 2 * Self::BR * self.head_dim + 2 * Self::BR * self.bc) * 2
    }
    /// Grid `(ceil(seq_kv / bc), heads_kv, batch)`, block `(256, 1, 1)`.
    pub const fn launch(&self, batch: u32, heads_kv: u32, seq_kv: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_kv.div_ceil(self.bc), heads_kv, batch],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: self.smem_bytes(),
        }
    }
    /// Compile-time consistency of the tile.
    pub const fn check(&self) {
        assert!(self.head_dim.is_multiple_of(64), "rows of whole 128-byte lines (the XOR swizzle)");
        assert!(self.bc == 64 || self.bc == 128, "passes of 32 keys, two warps over the keys of S");
        assert!(self.dkv_dtiles() >= 2 && self.dkv_dtiles().is_power_of_two(), "dK/dV parts start on XOR-clean chunks");
        assert!((self.head_dim / 16).is_power_of_two(), "dQ parts start on XOR-clean chunks");
        assert!(self.smem_bytes() <= 163 * 1024, "fits an sm_80 block with the opt-in");
    }
}

/// d=64: Bc 128. dK, dV: 4 warps over keys x 2 over the head dim, 32 registers each; S and dP
/// in two passes of 32 x 32 (32 registers each); dQ 32 x 32. Shared memory 128 KiB (opt-in).
pub const FLASH_BWD_TC_D64: FlashBwdTcTile = FlashBwdTcTile { head_dim: 64, bc: 128 };
/// d=128: Bc 64. dK, dV: 2 warps over keys x 4 over the head dim, 32 registers each; S and dP
/// in one pass of 32 x 32; dQ 32 x 64 (64 registers). Shared memory 128 KiB (opt-in).
pub const FLASH_BWD_TC_D128: FlashBwdTcTile = FlashBwdTcTile { head_dim: 128, bc: 64 };

/// Tile of the backward's row kernels (preprocess: `D = rowsum(dO ∘ O)` and zeroing the dQ
/// accumulator; convert: dQ accumulator to dQ): one warp per query row, `rows` rows per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdRowsTile {
    pub rows: u32,
}

impl BwdRowsTile {
    pub const fn threads(&self) -> u32 {
        32 * self.rows
    }
    /// Grid `(ceil(seq_q / rows), heads, batch)`, block `(threads, 1, 1)`, no shared memory.
    pub const fn launch(&self, batch: u32, heads: u32, seq_q: u32) -> LaunchDims {
        LaunchDims {
            grid: [seq_q.div_ceil(self.rows), heads, batch],
            block: [self.threads(), 1, 1],
            dynamic_smem_bytes: 0,
        }
    }
}

/// 4 rows (warps) per block: 128 threads.
pub const BWD_ROWS: BwdRowsTile = BwdRowsTile { rows: 4 };
