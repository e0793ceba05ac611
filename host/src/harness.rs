//! The measured run every command shares: `run` ([`crate::runner`]), `run --backward`
//! ([`crate::backward_run`]) and `decode` ([`crate::decode_run`]) each say what to allocate,
//! what to poison and what to launch; the harness does the rest in one order for all of them, so
//! a new kind of attention is measured the same way by being wired here once.
//!
//! Order of events ([`measure`]):
//! 1. the repetitions, resolved against the device's defaults and [`MAX_LAUNCHES`]
//!    ([`Repetitions::resolve`], before anything is allocated);
//! 2. the memory bracket opens ([`Device::memory_begin`]; on CUDA the NVML sampler starts, on the
//!    VM the allocator's peak resets) and, for a sampled launch, the block subset is set;
//! 3. the device is lent to the library ([`Kernels::scoped`]) and the run kind's body allocates
//!    and uploads, marks the allocation ([`allocated`]) and hands its steps to [`repeat`]: for
//!    each warm-up and measured repetition poison the outputs, synchronise, start the clock,
//!    launch, stop the clock, keep the sample (measured repetitions) and the launches (the last
//!    one), then the kind's untimed check; the body downloads its outputs;
//! 4. every buffer is freed when the scope returns (also after an error), the block subset is
//!    cleared, the memory bracket closes ([`Device::memory_end`]);
//! 5. the samples become a [`Timing`] (median, min, max).
//!
//! Verification against the f64 reference and the report are the kind's: they differ in what is
//! compared (O and LSE; the gradients; O, LSE and the cache after the append).

use crate::error::Error;
use crate::timing::Timing;
use memattn::attn::{AttnError, Kernels};
use memattn::device::{BlockSubset, DevPtr, Device, DeviceError};
use memattn::memory::MeasuredMemory;
use serde::Serialize;

/// NaN bit pattern the f32 outputs are filled with before every launch.
pub const POISON: u32 = 0x7FC0_0000;
/// Two 16-bit NaNs (0x7FC0 is a quiet NaN both as bf16 and as f16): the poison of a bf16/f16 O.
pub const POISON_16: u32 = 0x7FC0_7FC0;

/// Most warm-up launches, and most timed repetitions, of one run (each keeps a timing sample).
pub const MAX_LAUNCHES: u32 = 1_000_000;

/// Fills `bytes` bytes at `ptr` with the poison of `dtype` (whole words with `fill_u32`, a
/// trailing half word with one upload).
pub fn poison<D: Device + ?Sized>(
    dev: &mut D,
    ptr: DevPtr,
    bytes: u64,
    dtype: crate::Dtype,
) -> Result<(), DeviceError> {
    let word = if dtype.is_16bit() { POISON_16 } else { POISON };
    dev.fill_u32(ptr, bytes / 4, word)?;
    if !bytes.is_multiple_of(4) {
        let tail = &word.to_le_bytes()[..(bytes % 4) as usize];
        dev.upload_bytes(ptr + bytes / 4 * 4, tail)?;
    }
    Ok(())
}

/// One kernel launch of a run: what `--json` reports of it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LaunchRecord {
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_smem_bytes: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_instructions: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_bytes_read: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global_bytes_written: Option<u64>,
    /// VM with `--vm-bank-conflicts`: the launch's shared-memory wavefronts per source line.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bank_conflicts: Vec<BankLine>,
    /// VM with `--vm-sectors`: the launch's global-memory sectors per source line.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sectors: Vec<SectorLine>,
}

/// The 32-byte global-memory sectors of the instructions of one source line in one launch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SectorLine {
    /// `file:line` of the source (the PTX line when the module has no `.loc`).
    pub at: String,
    /// Warp-wide executions.
    pub executions: u64,
    /// The distinct bytes the lanes asked for.
    pub useful_bytes: u64,
    pub sectors: u64,
}

impl SectorLine {
    /// Useful bytes / (32 x sectors).
    pub fn efficiency(&self) -> f64 {
        self.useful_bytes as f64 / (32 * self.sectors).max(1) as f64
    }
}

/// [`SectorLine`]s of a launch's per-PTX-line counts, merged by source line, in first-seen order.
pub fn sector_lines(counts: &[ptx_vm::Sectors]) -> Vec<SectorLine> {
    ptx_vm::Sectors::by_source(counts)
        .into_iter()
        .map(|(at, s)| SectorLine { at, executions: s.executions, useful_bytes: s.useful_bytes, sectors: s.sectors })
        .collect()
}

/// The lines of a sector report: the launch's total efficiency, then the least efficient source
/// lines (at most `worst`), one line each: `at: U useful bytes in S sectors (E %), X warp-wide
/// executions`. Shared by `run` and `launch`.
pub fn sector_report(kernel: &str, lines: &[SectorLine], worst: usize) -> Vec<String> {
    let (u, s) = lines.iter().fold((0, 0), |(u, s), l| (u + l.useful_bytes, s + l.sectors));
    let mut out = vec![format!(
        "sectors      {kernel}: {} useful bytes in {s} sectors of 32 B ({:.1} % efficiency)",
        u,
        100.0 * u as f64 / (32 * s).max(1) as f64
    )];
    let mut by: Vec<&SectorLine> = lines.iter().filter(|l| l.sectors > 0).collect();
    by.sort_by(|a, b| a.efficiency().total_cmp(&b.efficiency()).then(b.sectors.cmp(&a.sectors)));
    for l in by.into_iter().take(worst) {
        out.push(format!(
            "               {}: {} useful bytes in {} sectors ({:.1} %), {} warp-wide executions",
            l.at,
            l.useful_bytes,
            l.sectors,
            100.0 * l.efficiency(),
            l.executions
        ));
    }
    out
}

/// The shared-memory wavefronts of the instructions of one source line in one launch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BankLine {
    /// `file:line` of the source (the PTX line when the module has no `.loc`).
    pub at: String,
    /// Warp-wide executions.
    pub executions: u64,
    pub wavefronts: u64,
    /// The minimum, one wavefront per phase.
    pub ideal: u64,
}

/// [`BankLine`]s of a launch's per-PTX-line counts, merged by source line, in first-seen order.
pub fn bank_lines(counts: &[ptx_vm::BankConflicts]) -> Vec<BankLine> {
    ptx_vm::BankConflicts::by_source(counts)
        .into_iter()
        .map(|(at, b)| BankLine { at, executions: b.executions, wavefronts: b.wavefronts, ideal: b.ideal })
        .collect()
}

impl From<&memattn::attn::Launched> for LaunchRecord {
    /// The record of a launch the library made ([`Kernels::take_launches`]).
    fn from(l: &memattn::attn::Launched) -> Self {
        LaunchRecord {
            kernel: l.kernel.name().to_string(),
            grid: l.dims.grid,
            block: l.dims.block,
            dynamic_smem_bytes: l.dims.dynamic_smem_bytes,
            thread_instructions: l.info.thread_instructions,
            global_bytes_read: l.info.global_bytes_read,
            global_bytes_written: l.info.global_bytes_written,
            bank_conflicts: bank_lines(&l.info.bank_conflicts),
            sectors: sector_lines(&l.info.sectors),
        }
    }
}

/// How many times a run launches: `warmup` untimed repetitions, then `repeats` timed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repetitions {
    pub warmup: u32,
    /// At least 1.
    pub repeats: u32,
}

impl Repetitions {
    /// The requested counts, or the device's defaults where `None`; repeats at least 1, each at
    /// most [`MAX_LAUNCHES`] (a usage error past it).
    pub fn resolve(dev: &dyn Device, warmup: Option<u32>, repeats: Option<u32>) -> Result<Self, Error> {
        let (def_warmup, def_repeats) = dev.default_warmup_repeats();
        let warmup = warmup.unwrap_or(def_warmup);
        let repeats = repeats.unwrap_or(def_repeats).max(1);
        if warmup > MAX_LAUNCHES || repeats > MAX_LAUNCHES {
            return Err(Error::Usage(format!(
                "warm-up {warmup} and repeats {repeats}: each must be at most {MAX_LAUNCHES}"
            )));
        }
        Ok(Repetitions { warmup, repeats })
    }

    /// Warm-up and measured repetitions together.
    pub fn total(&self) -> u64 {
        self.warmup as u64 + self.repeats as u64
    }
}

/// What [`repeat`] kept: the measured repetitions' times, the last repetition's launches and
/// the VM's instruction trace (the last non-empty one).
#[derive(Debug, Default)]
pub struct Repeated {
    pub samples_ms: Vec<f64>,
    pub launches: Vec<LaunchRecord>,
    pub trace: Vec<ptx_vm::TraceEntry>,
}

/// What a run kind's body returns to [`measure`]: what [`repeat`] kept and the body's outputs.
pub type Body<T> = Result<(Repeated, T), AttnError>;

/// Everything a measured run brought back: the body's outputs, the timing of its repetitions,
/// the last repetition's launches, the trace and the device memory the run added.
#[derive(Debug)]
pub struct Measured<T> {
    pub out: T,
    pub timing: Timing,
    pub launches: Vec<LaunchRecord>,
    pub trace: Vec<ptx_vm::TraceEntry>,
    pub memory: MeasuredMemory,
}

impl<T> Measured<T> {
    /// VM only: instructions executed (per thread) by the last repetition's launches.
    pub fn vm_thread_instructions(&self) -> Option<u64> {
        self.launches.iter().map(|r| r.thread_instructions).sum()
    }

    /// VM only: bytes the last repetition's threads read from global memory.
    pub fn vm_global_bytes_read(&self) -> Option<u64> {
        self.launches.iter().map(|r| r.global_bytes_read).sum()
    }

    /// VM only: bytes the last repetition's threads wrote to global memory.
    pub fn vm_global_bytes_written(&self) -> Option<u64> {
        self.launches.iter().map(|r| r.global_bytes_written).sum()
    }
}

/// Marks the end of a run's allocations ([`Device::memory_mark_allocated`]): what the body has
/// allocated so far is the run's, before the launches add their own.
pub fn allocated(k: &Kernels) -> Result<(), AttnError> {
    k.with_device(|d| d.memory_mark_allocated())
}

/// One timed launch: `poison` (untimed), synchronise, start the clock, `launch`, stop it.
/// Returns the milliseconds of the device's clock.
pub fn time_once(
    k: &Kernels,
    poison: impl FnOnce(&Kernels) -> Result<(), AttnError>,
    launch: impl FnOnce() -> Result<(), AttnError>,
) -> Result<f64, AttnError> {
    poison(k)?;
    k.with_device(|dev| {
        dev.synchronize()?;
        dev.timer_start()
    })?;
    launch()?;
    k.with_device(|dev| dev.timer_stop())
}

/// The repetitions of a run on `k`, launches recorded: each one [`time_once`] with `poison` and
/// `launch`, then `after` outside the timed region (the backward compares the gradients' bits
/// there). Keeps the samples of the measured repetitions and the launches of the last one.
pub fn repeat(
    k: &Kernels,
    reps: Repetitions,
    mut poison: impl FnMut(&Kernels) -> Result<(), AttnError>,
    mut launch: impl FnMut() -> Result<(), AttnError>,
    mut after: impl FnMut(&Kernels) -> Result<(), AttnError>,
) -> Result<Repeated, AttnError> {
    k.record_launches(true)?;
    let mut r = Repeated::default();
    for rep in 0..reps.total() {
        let ms = time_once(k, &mut poison, &mut launch)?;
        if rep >= reps.warmup as u64 {
            r.samples_ms.push(ms);
        }
        r.launches = k
            .take_launches()?
            .into_iter()
            .map(|l| {
                let record = LaunchRecord::from(&l);
                if !l.info.trace.is_empty() {
                    r.trace = l.info.trace;
                }
                record
            })
            .collect();
        after(k)?;
    }
    Ok(r)
}

/// One measured run on `dev`: opens the memory bracket, sets `subset` (a sampled launch's
/// blocks) for the run's launches only, lends the device to `body` ([`Kernels::scoped`]), then
/// clears the subset and closes the bracket, whether `body` succeeded or not. `body` allocates,
/// calls [`allocated`] and [`repeat`] (or [`time_once`]), downloads, and returns what
/// [`repeat`] kept with its outputs. An error of `body` comes before one of the bracket.
pub fn measure<T>(
    dev: &mut dyn Device,
    reps: Repetitions,
    subset: Option<BlockSubset>,
    body: impl FnOnce(&Kernels) -> Body<T>,
) -> Result<Measured<T>, Error> {
    dev.memory_begin()?;
    // The subset holds for this run's launches only: set right before them, cleared right after
    // (also when they failed), so a later run on the device is whole again.
    let sampled = subset.is_some();
    let ran = match subset.map(|s| dev.set_block_subset(Some(s))).transpose() {
        Ok(_) => Kernels::scoped(dev, body),
        Err(e) => Err(e.into()),
    };
    if sampled {
        dev.set_block_subset(None)?;
    }
    // Every buffer was freed when the scope returned, also after an error.
    let memory = dev.memory_end();
    let (repeated, out) = ran?;
    Ok(Measured {
        out,
        timing: Timing::new(reps.warmup, dev.clock_name(), repeated.samples_ms),
        launches: repeated.launches,
        trace: repeated.trace,
        memory: memory?,
    })
}

#[cfg(feature = "unit-tests")]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use memattn::device::vm::VmDevice;
    use memattn::device::{BackendChoice, DeviceOptions};
    use memattn::ptx::PtxSource;
    use std::cell::RefCell;

    fn vm() -> VmDevice {
        let mut o = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
        o.vm_workers = Some(1);
        VmDevice::new(&o).unwrap()
    }

    pub fn repetitions_take_the_device_defaults_and_refuse_past_the_limit() {
        let dev = vm();
        let (w, r) = dev.default_warmup_repeats();
        assert_eq!(Repetitions::resolve(&dev, None, None).unwrap(), Repetitions { warmup: w, repeats: r.max(1) });
        // Zero repeats would leave no sample: one is measured.
        assert_eq!(Repetitions::resolve(&dev, Some(2), Some(0)).unwrap(), Repetitions { warmup: 2, repeats: 1 });
        assert_eq!(Repetitions { warmup: 2, repeats: 3 }.total(), 5);
        for (w, r) in [(Some(MAX_LAUNCHES + 1), None), (None, Some(MAX_LAUNCHES + 1))] {
            let e = Repetitions::resolve(&dev, w, r).unwrap_err();
            assert!(matches!(e, Error::Usage(_)) && e.to_string().contains("at most 1000000"), "{e}");
        }
    }

    pub fn every_repetition_is_poisoned_then_launched_and_the_measured_ones_timed() {
        // The steps a run kind hands the harness, logged in order: each launch must see the
        // poison its repetition wrote, every buffer is freed by the end, the bracket saw it.
        let mut dev = vm();
        let reps = Repetitions { warmup: 2, repeats: 3 };
        let log = RefCell::new(Vec::new());
        let m = measure(&mut dev, reps, None, |k| {
            let out = k.alloc(64)?;
            allocated(k)?;
            let poisoned = |k: &Kernels| {
                log.borrow_mut().push("poison");
                k.with_device(|dev| poison(dev, out.ptr(), 6, memattn::Dtype::Bf16))
            };
            let launch = || {
                let bytes = out.read_bytes(6)?;
                assert_eq!(bytes, [0xC0, 0x7F, 0xC0, 0x7F, 0xC0, 0x7F], "a launch sees its repetition's poison");
                log.borrow_mut().push("launch");
                out.write_bytes(&[0; 6])
            };
            let after = |_: &Kernels| {
                log.borrow_mut().push("after");
                Ok(())
            };
            let repeated = repeat(k, reps, poisoned, launch, after)?;
            Ok((repeated, out.read_bytes(6)?))
        })
        .unwrap();
        assert_eq!(log.into_inner(), ["poison", "launch", "after"].repeat(5));
        assert_eq!(m.out, [0; 6]);
        assert_eq!((m.timing.warmup, m.timing.repeats, m.timing.samples_ms.len()), (2, 3, 3));
        assert!(m.launches.is_empty() && m.trace.is_empty(), "no kernel ran");
        assert!(m.memory.peak_delta_bytes >= 64, "{:?}", m.memory);
        assert_eq!(m.memory.after_bytes, m.memory.before_bytes, "the run's buffers are freed");
    }

    pub fn a_failing_body_still_closes_the_bracket_and_frees_its_buffers() {
        let mut dev = vm();
        let reps = Repetitions { warmup: 0, repeats: 1 };
        let failed = measure(&mut dev, reps, None, |k| -> Body<()> {
            let _held = k.alloc(1 << 20)?;
            // A launch that fails: more memory than the VM has.
            repeat(k, reps, |_| Ok(()), || k.alloc(u64::MAX).map(drop), |_| Ok(()))?;
            unreachable!("the launch failed")
        });
        assert!(failed.is_err());
        // The device is whole again: the next run measures from the same start.
        let m =
            measure(&mut dev, reps, None, |k| Ok((repeat(k, reps, |_| Ok(()), || Ok(()), |_| Ok(()))?, ()))).unwrap();
        assert_eq!((m.memory.before_bytes, m.memory.peak_delta_bytes), (m.memory.after_bytes, 0), "{:?}", m.memory);
    }
}
