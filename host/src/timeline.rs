//! `memattn run --timeline FILE`: a timeline of every warp of the forward.
//!
//! The run launches its forward from the timeline module (`memattn_kernels_timeline.ptx`, see
//! [`kernels_gpu::timeline`]), whose kernels stamp a clock per warp at every phase boundary
//! into a buffer: [`TimelineDevice`] wraps the run's device, allocates the buffer, sets the
//! module's variable to its address before each launch and reads it back after the run. The
//! stamps become a Chrome trace ([`Timeline::chrome_trace`]: one process per block, one thread
//! per warp, a complete event per phase; it opens in Perfetto or `chrome://tracing`) and a
//! picture ([`crate::charts::timeline_chart`]).
//!
//! The clock is `%globaltimer` on a GPU (nanoseconds; the trace's `ts`/`dur` are microseconds)
//! and the warp's count of executed instructions in the VM (the trace's `ts`/`dur` are then
//! instructions); the trace's `otherData` says which.

use kernels_gpu::tiles::LaunchDims;
use kernels_gpu::timeline::{decode, Phase, EVENTS_PER_WARP, GLOBAL_NAME, TIMELINE_KERNELS, WARP_WORDS};
use kernels_gpu::KernelId;
use memattn::device::{Backend, BlockSubset, DevPtr, Device, DeviceCaps, DeviceError, LaunchInfo};
use memattn::memory::MeasuredMemory;
use memattn::problem::Arch;
use memattn::ptx::PtxSource;
use memattn::tma::TensorMapDesc;

/// The timeline module, borrowed from the binary.
pub fn ptx_source() -> PtxSource {
    PtxSource::embedded_timeline()
}

/// What `--timeline` supports, for the messages that refuse the rest.
pub fn supported() -> String {
    let names: Vec<&str> = TIMELINE_KERNELS.iter().map(|k| k.variant().name).collect();
    format!(
        "--timeline runs the flash forward from the timeline modules, whose kernels are {} \
         (bf16 or f16 at head_dim 128, no narrow window)",
        names.join(", ")
    )
}

/// The run's device with the timeline buffer of one kernel's launches.
pub struct TimelineDevice<'a> {
    inner: &'a mut dyn Device,
    kernel: KernelId,
    dims: LaunchDims,
    buf: DevPtr,
    words: u64,
    launched: bool,
}

impl<'a> TimelineDevice<'a> {
    /// Allocates the buffer of `kernel`'s launches of `dims` on `inner` (before the run, so the
    /// run's measured memory does not include it).
    pub fn new(inner: &'a mut dyn Device, kernel: KernelId, dims: LaunchDims) -> Result<Self, DeviceError> {
        let warps = warps_of(&dims);
        let words = warps * WARP_WORDS as u64;
        let buf = inner.alloc(words * 8)?;
        Ok(TimelineDevice { inner, kernel, dims, buf, words, launched: false })
    }

    /// Reads the stamps of the last launch back and frees the buffer.
    pub fn finish(self, backend: Backend) -> Result<Timeline, DeviceError> {
        let mut bytes = vec![0u8; (self.words * 8) as usize];
        let read = if self.launched { self.inner.download_bytes(self.buf, &mut bytes) } else { Ok(()) };
        self.inner.free(self.buf)?;
        read?;
        if !self.launched {
            return Err(DeviceError::Unavailable(format!("the run did not launch `{}`", self.kernel.variant().name)));
        }
        let words: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        Ok(Timeline::from_words(self.kernel, &self.dims, &words, backend))
    }
}

fn warps_of(dims: &LaunchDims) -> u64 {
    let blocks = dims.grid.iter().map(|&g| g.max(1) as u64).product::<u64>();
    blocks * (dims.block[0] as u64).div_ceil(32) * dims.block[1].max(1) as u64 * dims.block[2].max(1) as u64
}

impl Device for TimelineDevice<'_> {
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn name(&self) -> String {
        self.inner.name()
    }
    fn ptx(&self) -> &PtxSource {
        self.inner.ptx()
    }
    fn ptx_sm90(&self) -> Option<&PtxSource> {
        self.inner.ptx_sm90()
    }
    fn caps(&mut self) -> Result<DeviceCaps, DeviceError> {
        self.inner.caps()
    }
    fn multiprocessor_count(&mut self) -> Result<Option<u32>, DeviceError> {
        self.inner.multiprocessor_count()
    }
    fn alloc(&mut self, bytes: u64) -> Result<DevPtr, DeviceError> {
        self.inner.alloc(bytes)
    }
    fn free(&mut self, ptr: DevPtr) -> Result<(), DeviceError> {
        self.inner.free(ptr)
    }
    fn upload_bytes(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.upload_bytes(ptr, data)
    }
    fn download_bytes(&mut self, ptr: DevPtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.download_bytes(ptr, out)
    }
    fn fill_u32(&mut self, ptr: DevPtr, count: u64, value: u32) -> Result<(), DeviceError> {
        self.inner.fill_u32(ptr, count, value)
    }
    fn set_module_global(&mut self, kernel: &str, name: &str, value: &[u8]) -> Result<(), DeviceError> {
        self.inner.set_module_global(kernel, name, value)
    }
    fn launch(&mut self, kernel: &str, dims: &LaunchDims, params: &[&[u8]]) -> Result<LaunchInfo, DeviceError> {
        if kernel == self.kernel.variant().name {
            if dims.grid != self.dims.grid || dims.block != self.dims.block {
                return Err(DeviceError::Unavailable(format!(
                    "`{kernel}` launched with grid {:?} and block {:?}, the timeline buffer was planned for {:?} and {:?}",
                    dims.grid, dims.block, self.dims.grid, self.dims.block
                )));
            }
            // Every launch starts from empty records: the trace shows the last one.
            self.inner.fill_u32(self.buf, 2 * self.words, 0)?;
            self.inner.set_module_global(kernel, GLOBAL_NAME, &self.buf.to_le_bytes())?;
            self.launched = true;
        }
        self.inner.launch(kernel, dims, params)
    }
    fn arch(&mut self) -> Result<Arch, DeviceError> {
        self.inner.arch()
    }
    fn target(&mut self) -> Result<memattn::choice::Target, DeviceError> {
        self.inner.target()
    }
    fn encode_tensor_map(&mut self, desc: &TensorMapDesc) -> Result<[u8; 128], DeviceError> {
        self.inner.encode_tensor_map(desc)
    }
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.inner.synchronize()
    }
    fn timer_start(&mut self) -> Result<(), DeviceError> {
        self.inner.timer_start()
    }
    fn timer_stop(&mut self) -> Result<f64, DeviceError> {
        self.inner.timer_stop()
    }
    fn clock_name(&self) -> &'static str {
        self.inner.clock_name()
    }
    fn memory_begin(&mut self) -> Result<(), DeviceError> {
        self.inner.memory_begin()
    }
    fn memory_mark_allocated(&mut self) -> Result<(), DeviceError> {
        self.inner.memory_mark_allocated()
    }
    fn memory_end(&mut self) -> Result<MeasuredMemory, DeviceError> {
        self.inner.memory_end()
    }
    fn default_warmup_repeats(&self) -> (u32, u32) {
        self.inner.default_warmup_repeats()
    }
    fn set_block_subset(&mut self, subset: Option<BlockSubset>) -> Result<(), DeviceError> {
        self.inner.set_block_subset(subset)
    }
}

/// One phase of one warp: `[start, end)` on the warp's clock.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub phase: Phase,
    pub start: u64,
    pub end: u64,
}

/// One warp's phases.
#[derive(Clone, Debug, PartialEq)]
pub struct WarpTrack {
    /// Linear block index (`(z * grid.y + y) * grid.x + x`) and its `[x, y, z]`.
    pub block: u64,
    pub block_xyz: [u32; 3],
    pub warp: u32,
    pub spans: Vec<Span>,
    /// Stamps the warp made past [`EVENTS_PER_WARP`] (not recorded).
    pub dropped: u64,
}

/// The stamps of one launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub kernel: KernelId,
    pub grid: [u32; 3],
    pub warps_per_block: u32,
    /// `true`: the clock is `%globaltimer` in nanoseconds; `false`: VM instructions.
    pub nanoseconds: bool,
    pub warps: Vec<WarpTrack>,
}

impl Timeline {
    /// Reads the buffer of a launch of `dims` (see [`kernels_gpu::timeline`] for its layout).
    pub fn from_words(kernel: KernelId, dims: &LaunchDims, words: &[u64], backend: Backend) -> Timeline {
        let warps_per_block = dims.block[0].div_ceil(32);
        let [gx, gy, _] = dims.grid.map(|g| g.max(1));
        let mut warps = Vec::new();
        for (i, rec) in words.chunks_exact(WARP_WORDS).enumerate() {
            let n = rec[0];
            if n == 0 {
                // A block that ran no stamp (past the problem's end, or sampled out).
                continue;
            }
            let kept = (n as usize).min(EVENTS_PER_WARP);
            let stamps: Vec<(Option<Phase>, u64)> = rec[1..=kept].iter().map(|&w| decode(w)).collect();
            let spans = stamps
                .windows(2)
                .filter_map(|w| match (w[0].0, w[1].0) {
                    (Some(p), Some(_)) if p != Phase::End => {
                        Some(Span { phase: p, start: w[0].1, end: w[1].1.max(w[0].1) })
                    }
                    _ => None,
                })
                .collect();
            let block = (i / warps_per_block as usize) as u64;
            let (x, yz) = ((block % gx as u64) as u32, block / gx as u64);
            let (y, z) = ((yz % gy as u64) as u32, (yz / gy as u64) as u32);
            warps.push(WarpTrack {
                block,
                block_xyz: [x, y, z],
                warp: (i % warps_per_block as usize) as u32,
                spans,
                dropped: n.saturating_sub(EVENTS_PER_WARP as u64),
            });
        }
        Timeline { kernel, grid: dims.grid, warps_per_block, nanoseconds: backend != Backend::Vm, warps }
    }

    /// The clock's origin: the earliest stamp (a GPU's `%globaltimer` is absolute).
    fn origin(&self) -> u64 {
        if !self.nanoseconds {
            return 0;
        }
        self.warps.iter().filter_map(|w| w.spans.first().map(|s| s.start)).min().unwrap_or(0)
    }

    /// A clock value in the trace's units (µs on a GPU, instructions in the VM).
    pub fn units(&self, clock: u64) -> f64 {
        let c = clock.saturating_sub(self.origin()) as f64;
        if self.nanoseconds {
            c / 1000.0
        } else {
            c
        }
    }

    /// What the trace's `ts` and `dur` count.
    pub fn unit_name(&self) -> &'static str {
        if self.nanoseconds {
            "microseconds (%globaltimer)"
        } else {
            "instructions executed by the warp (ptx-vm), not microseconds"
        }
    }

    /// Stamps dropped over all warps.
    pub fn dropped(&self) -> u64 {
        self.warps.iter().map(|w| w.dropped).sum()
    }

    /// The Chrome trace (`{"traceEvents": [...]}`): pid = linear block, tid = warp.
    pub fn chrome_trace(&self) -> serde_json::Value {
        use serde_json::json;
        let mut events = Vec::new();
        let origin = self.origin();
        let units = |c: u64| {
            let c = c.saturating_sub(origin) as f64;
            if self.nanoseconds {
                c / 1000.0
            } else {
                c
            }
        };
        let mut last_block = None;
        for w in &self.warps {
            if last_block != Some(w.block) {
                let [x, y, z] = w.block_xyz;
                events.push(json!({"name": "process_name", "ph": "M", "pid": w.block,
                    "args": {"name": format!("block ({x},{y},{z})")}}));
                events.push(json!({"name": "process_sort_index", "ph": "M", "pid": w.block,
                    "args": {"sort_index": w.block}}));
                last_block = Some(w.block);
            }
            events.push(json!({"name": "thread_name", "ph": "M", "pid": w.block, "tid": w.warp,
                "args": {"name": format!("warp {}", w.warp)}}));
            events.push(json!({"name": "thread_sort_index", "ph": "M", "pid": w.block, "tid": w.warp,
                "args": {"sort_index": w.warp}}));
            for s in &w.spans {
                events.push(json!({"name": s.phase.name(), "cat": "phase", "ph": "X", "pid": w.block, "tid": w.warp,
                    "ts": units(s.start), "dur": units(s.end) - units(s.start)}));
            }
        }
        json!({
            "traceEvents": events,
            "displayTimeUnit": if self.nanoseconds { "ns" } else { "ms" },
            "otherData": {
                "kernel": self.kernel.variant().name,
                "grid": self.grid,
                "warps_per_block": self.warps_per_block,
                "clock": if self.nanoseconds { "%globaltimer (ns)" } else { "ptx-vm: instructions executed by the warp" },
                "ts_unit": self.unit_name(),
                "events_per_warp": EVENTS_PER_WARP,
                "dropped_stamps": self.dropped(),
            },
        })
    }
}

/// The picture's file next to the trace: `FILE` with the extension `.svg`.
pub fn picture_path(trace: &std::path::Path) -> std::path::PathBuf {
    trace.with_extension("svg")
}

/// The colours of the phases in the picture, in [`Phase`] order (`End`'s is not drawn).
pub const PHASE_COLOURS: [(u8, u8, u8); 10] = [
    (150, 150, 150), // prologue
    (255, 127, 14),  // wait K/V
    (214, 39, 40),   // barrier
    (188, 189, 34),  // load K/V
    (31, 119, 180),  // QK^T
    (44, 160, 44),   // softmax
    (148, 103, 189), // PV
    (140, 86, 75),   // epilogue
    (0, 0, 0),       // end
    (23, 190, 207),  // wait slot
];

/// Warps the picture draws at most (the trace has them all): the first blocks' warps.
pub const PICTURE_MAX_WARPS: usize = 256;

/// Draws the picture of `t` (one row per warp of the first blocks, up to
/// [`PICTURE_MAX_WARPS`]) to `path` (`.svg` or `.png`).
pub fn draw(t: &Timeline, path: &std::path::Path, title: &str) -> Result<(), crate::charts::ChartError> {
    let per_block = t.warps_per_block.max(1) as usize;
    let take = (PICTURE_MAX_WARPS / per_block).max(1) * per_block;
    let rows: Vec<crate::charts::TimelineRow> = t
        .warps
        .iter()
        .take(take)
        .map(|w| crate::charts::TimelineRow {
            label: format!("block {} warp {}", w.block, w.warp),
            bars: w.spans.iter().map(|s| (t.units(s.start), t.units(s.end), s.phase as usize)).collect(),
        })
        .collect();
    // Every phase keeps its colour index; the legend names those the launch has (not `End`).
    let seen: std::collections::BTreeSet<usize> =
        t.warps.iter().flat_map(|w| w.spans.iter().map(|s| s.phase as usize)).collect();
    let legend: Vec<(&str, (u8, u8, u8))> = Phase::ALL
        .iter()
        .zip(PHASE_COLOURS)
        .map(|(p, c)| (if seen.contains(&(*p as usize)) { p.name() } else { "" }, c))
        .collect();
    let x_label = if t.nanoseconds { "time (µs, %globaltimer)" } else { "instructions executed by the warp (ptx-vm)" };
    crate::charts::timeline_chart(path, title, x_label, &rows, &legend)
}

#[cfg(feature = "unit-tests")]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use kernels_gpu::timeline::CLOCK_BITS;

    fn word(p: Phase, clock: u64) -> u64 {
        ((p as u64) << CLOCK_BITS) | clock
    }

    /// Spans between consecutive stamps (`End` closes the last), warps without stamps left out,
    /// block coordinates from the linear index, stamps past the capacity counted as dropped.
    pub fn stamps_become_spans_and_overflow_is_counted() {
        let dims = LaunchDims { grid: [2, 2, 1], block: [64, 1, 1], dynamic_smem_bytes: 0 };
        let mut words = vec![0u64; 8 * WARP_WORDS];
        // Block 3 = (1, 1, 0), warp 1: prologue 5..9, QK^T 9..20, end at 20.
        let w = (3 * 2 + 1) * WARP_WORDS;
        words[w] = 3;
        words[w + 1..w + 4].copy_from_slice(&[word(Phase::Prologue, 5), word(Phase::Qk, 9), word(Phase::End, 20)]);
        // Block 0, warp 0: more stamps than it keeps.
        words[0] = EVENTS_PER_WARP as u64 + 7;
        for i in 0..EVENTS_PER_WARP {
            words[1 + i] = word(Phase::WaitKv, i as u64);
        }
        let t = Timeline::from_words(KernelId::FlashFwdBf16D128, &dims, &words, Backend::Vm);
        assert_eq!(t.warps.len(), 2, "warps without stamps are left out");
        assert_eq!(t.warps_per_block, 2);
        assert_eq!(t.dropped(), 7);
        assert_eq!(t.warps[0].spans.len(), EVENTS_PER_WARP - 1);
        let last = &t.warps[1];
        assert_eq!((last.block, last.block_xyz, last.warp), (3, [1, 1, 0], 1));
        assert_eq!(
            last.spans,
            vec![Span { phase: Phase::Prologue, start: 5, end: 9 }, Span { phase: Phase::Qk, start: 9, end: 20 }]
        );
        assert!(!t.nanoseconds && t.units(20) == 20.0, "VM: instructions, no origin");
        let trace = t.chrome_trace();
        let x: Vec<_> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), EVENTS_PER_WARP - 1 + 2);
        assert_eq!(trace["otherData"]["dropped_stamps"], 7);
        // On a GPU the clock is nanoseconds from the earliest stamp, shown in microseconds.
        let g = Timeline::from_words(KernelId::FlashFwdBf16D128, &dims, &words, Backend::Cuda);
        assert!(g.nanoseconds);
        assert_eq!(g.units(1000), 1.0);
    }
}
