//! Which kernel a call runs, decided in one place for every device and every entry point: the
//! GPU generation a device is ([`Arch`], from its compute capability), the committed table of
//! measured choices between the `sm_80` and `sm_90a` modules (`choice/kernel-choice.tsv`), and
//! the `MEMATTN_HOPPER` override ([`HopperPolicy`]). A [`Target`] carries the first and the last;
//! the planning of the forward ([`crate::problem::Problem::launches_on`]) and of the KV-cache
//! calls ([`crate::decode::DecodeProblem::kernels_on`]) ask it, whether the device is the VM, the
//! command's measuring device or a caller's CUDA context.
//!
//! | `MEMATTN_HOPPER` | on a compute capability 9.0 GPU (or the VM / VM-backed driver modelling sm_90) |
//! | --- | --- |
//! | unset or empty | the measured table: the `sm_90a` kernel where it measured faster (or tied), the `sm_80` one elsewhere |
//! | `1` | the `sm_90a` kernel wherever there is one (the Hopper forward at every head dim it has) |
//! | `0` | the `sm_80` module only |
//!
//! Any other value is refused where a device is opened, naming the variable. On every other GPU
//! the `sm_80` module runs whatever the variable says (the `sm_90a` module loads on compute
//! capability 9.0 only).

use kernels_gpu::{Elem, KernelId};
use std::fmt;
use std::sync::OnceLock;

/// The environment variable of the Hopper override ([`HopperPolicy::from_env`]).
pub const HOPPER_ENV: &str = "MEMATTN_HOPPER";

/// The committed table of measured choices (`memattn/src/choice/kernel-choice.tsv`).
pub const TABLE_TSV: &str = include_str!("choice/kernel-choice.tsv");

/// Which GPU generation's kernels a launch plan may use. `Sm90` (Hopper, compute capability
/// 9.0 exactly: the `sm_90a` module's features are not forward compatible) adds the `sm_90a`
/// module's rows — the Hopper forward ([`kernels_gpu::Family::FlashSm90`]) and the e4m3 decode —
/// where [`Target`] picks them; everything else runs the `sm_80` module's kernels on every GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Arch {
    /// The `sm_80` module's kernels only (every GPU but compute capability 9.0; the default).
    #[default]
    Sm80,
    /// Hopper (compute capability 9.0): the `sm_90a` module's kernels too, where [`Target`] picks them.
    Sm90,
}

impl Arch {
    /// `sm_80` or `sm_90`, as `Display` writes it and the table names it.
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }

    /// The generation of a GPU of compute capability `major.minor`: `Sm90` for 9.0 exactly (the
    /// `sm_90a` module runs nowhere else), `Sm80` for every other.
    pub const fn of_compute_capability(major: i32, minor: i32) -> Arch {
        if major == 9 && minor == 0 {
            Arch::Sm90
        } else {
            Arch::Sm80
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether an sm_90 device runs the `sm_90a` module's kernels (`MEMATTN_HOPPER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum HopperPolicy {
    /// The measured table decides ([`measured_runs_sm90`]): the default.
    #[default]
    Measured,
    /// Every `sm_90a` kernel there is (`MEMATTN_HOPPER=1`).
    Always,
    /// The `sm_80` module only (`MEMATTN_HOPPER=0`).
    Never,
}

impl HopperPolicy {
    /// `MEMATTN_HOPPER`: unset or empty is [`HopperPolicy::Measured`], `1` [`HopperPolicy::Always`],
    /// `0` [`HopperPolicy::Never`]; anything else an error naming the variable and its values.
    pub fn from_env() -> Result<HopperPolicy, String> {
        match std::env::var_os(HOPPER_ENV) {
            None => Ok(HopperPolicy::Measured),
            Some(v) => HopperPolicy::parse(&v.to_string_lossy()),
        }
    }

    /// The policy a value of `MEMATTN_HOPPER` names.
    pub fn parse(v: &str) -> Result<HopperPolicy, String> {
        match v.trim() {
            "" => Ok(HopperPolicy::Measured),
            "1" => Ok(HopperPolicy::Always),
            "0" => Ok(HopperPolicy::Never),
            other => Err(format!(
                "{HOPPER_ENV}={other:?}: use 1 (the sm_90a kernels wherever there is one), 0 (the sm_80 module only), or leave it unset (the measured choice, docs in memattn::choice)"
            )),
        }
    }

    /// `measured`, `always` or `never`.
    pub const fn name(self) -> &'static str {
        match self {
            HopperPolicy::Measured => "measured",
            HopperPolicy::Always => "always",
            HopperPolicy::Never => "never",
        }
    }
}

/// The kernels a device runs: its generation and the Hopper policy. Every plan takes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Target {
    /// The device's GPU generation.
    pub arch: Arch,
    /// Whether an sm_90 device runs the `sm_90a` kernels (ignored on `Sm80`).
    pub hopper: HopperPolicy,
}

impl From<Arch> for Target {
    /// `arch` with the measured choices.
    fn from(arch: Arch) -> Target {
        Target { arch, hopper: HopperPolicy::Measured }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.arch, self.hopper) {
            (Arch::Sm90, HopperPolicy::Measured) => f.write_str("sm_90 (measured kernel choice)"),
            (Arch::Sm90, HopperPolicy::Always) => write!(f, "sm_90 ({HOPPER_ENV}=1: every sm_90a kernel)"),
            (Arch::Sm90, HopperPolicy::Never) => write!(f, "sm_90 ({HOPPER_ENV}=0: the sm_80 module only)"),
            (arch, _) => write!(f, "{arch}"),
        }
    }
}

impl Target {
    /// The target of `arch` under `hopper`.
    pub const fn new(arch: Arch, hopper: HopperPolicy) -> Target {
        Target { arch, hopper }
    }

    /// Whether this target runs the `sm_90a` row `k` of `call` (an `sm_90a` kernel for `elem` at
    /// `head_dim`).
    fn runs(&self, call: Call, elem: Elem, head_dim: u32) -> bool {
        self.arch == Arch::Sm90
            && match self.hopper {
                HopperPolicy::Never => false,
                HopperPolicy::Always => true,
                HopperPolicy::Measured => measured_runs_sm90(call, elem, head_dim),
            }
    }

    /// The forward kernel: `sm90` (the Hopper row the problem could run, if any) when this target
    /// runs it, else `None` (the `sm_80` module's row).
    pub fn forward(&self, sm90: Option<KernelId>, elem: Elem, head_dim: u32) -> Option<KernelId> {
        sm90.filter(|_| self.runs(Call::Forward, elem, head_dim))
    }

    /// The decode kernel: `fwd` (an `sm_80` row), or its `sm_90a` twin when this target runs it.
    pub fn decode(&self, fwd: KernelId) -> KernelId {
        let sm90 = KernelId::decode_on_sm90(fwd);
        let v = fwd.variant();
        match v.head_dim() {
            Some(d) if sm90 != fwd && self.runs(Call::Decode, v.elem, d) => sm90,
            _ => fwd,
        }
    }
}

/// The two calls with a choice between modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Call {
    /// The dense and varlen forward (`flash_fwd_*`).
    Forward,
    /// The KV-cache decode's main kernel (`decode_mma_*`).
    Decode,
}

impl Call {
    /// `forward` or `decode`, as the table names it.
    pub const fn name(self) -> &'static str {
        match self {
            Call::Forward => "forward",
            Call::Decode => "decode",
        }
    }
}

/// One row of the measured table.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The GPU generation the row is for.
    pub arch: Arch,
    /// The call the row chooses for.
    pub call: Call,
    /// The element type.
    pub elem: Elem,
    /// The head dim.
    pub head_dim: u32,
    /// The `sm_80` and `sm_90a` kernels' median times (ms) in the run the row cites; `None`
    /// where the row carries another's choice.
    pub sm80_ms: Option<f64>,
    /// The `sm_90a` kernel's median time (ms), as `sm80_ms`.
    pub sm90_ms: Option<f64>,
    /// Whether the `sm_90a` kernel runs by default.
    pub runs_sm90: bool,
    /// Where the figures come from, or why there are none.
    pub note: String,
}

/// The rows of [`TABLE_TSV`], parsed once.
pub fn table() -> &'static [Choice] {
    static TABLE: OnceLock<Vec<Choice>> = OnceLock::new();
    // The table is compiled in; a unit test parses it, so an error here cannot reach a user.
    TABLE.get_or_init(|| parse_table(TABLE_TSV).unwrap_or_else(|e| panic!("memattn's kernel-choice table: {e}")))
}

/// Whether the measured table runs the `sm_90a` kernel of `call` for `elem` at `head_dim` on an
/// sm_90 device (a pair without a row runs the `sm_80` kernel).
pub fn measured_runs_sm90(call: Call, elem: Elem, head_dim: u32) -> bool {
    table()
        .iter()
        .any(|c| c.arch == Arch::Sm90 && c.call == call && c.elem == elem && c.head_dim == head_dim && c.runs_sm90)
}

/// Parses the table's text: `#` lines are comments; each row has eight tab-separated fields
/// (`arch call elem head_dim sm80_ms sm90_ms run note`, `-` for a time not measured).
pub fn parse_table(text: &str) -> Result<Vec<Choice>, String> {
    let mut rows: Vec<Choice> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 8 {
            return Err(format!("line {n}: {} fields, 8 expected (tab-separated)", f.len()));
        }
        let arch = match f[0] {
            "sm_90" => Arch::Sm90,
            "sm_80" => Arch::Sm80,
            other => return Err(format!("line {n}: arch {other:?} (sm_80 or sm_90)")),
        };
        let call = match f[1] {
            "forward" => Call::Forward,
            "decode" => Call::Decode,
            other => return Err(format!("line {n}: call {other:?} (forward or decode)")),
        };
        let elem = match f[2] {
            "bf16" => Elem::Bf16,
            "f16" => Elem::F16,
            "f32" => Elem::F32,
            "fp8_e4m3" => Elem::Fp8E4m3,
            "fp8_e5m2" => Elem::Fp8E5m2,
            other => return Err(format!("line {n}: elem {other:?}")),
        };
        let head_dim: u32 = f[3].parse().map_err(|_| format!("line {n}: head_dim {:?}", f[3]))?;
        let ms = |s: &str| -> Result<Option<f64>, String> {
            match s {
                "-" => Ok(None),
                s => s.parse::<f64>().map(Some).map_err(|_| format!("line {n}: time {s:?} (ms, or -)")),
            }
        };
        let runs_sm90 = match f[6] {
            "sm_90" => true,
            "sm_80" => false,
            other => return Err(format!("line {n}: run {other:?} (sm_80 or sm_90)")),
        };
        let row = Choice {
            arch,
            call,
            elem,
            head_dim,
            sm80_ms: ms(f[4])?,
            sm90_ms: ms(f[5])?,
            runs_sm90,
            note: f[7].to_string(),
        };
        if rows.iter().any(|r| (r.arch, r.call, r.elem, r.head_dim) == (arch, call, elem, head_dim)) {
            return Err(format!("line {n}: a second row for {} {} {} d{head_dim}", f[0], f[1], f[2]));
        }
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(feature = "unit-tests")]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// Every row names a pair that has an `sm_90a` kernel, a timed row picks the faster kernel
    /// (the `sm_90a` one on a tie), and every cited time is in docs/gpu-h200.md.
    pub fn the_table_parses_and_each_timed_row_picks_the_faster_kernel() {
        let rows = parse_table(TABLE_TSV).unwrap();
        assert!(rows.len() >= 6, "{rows:?}");
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/gpu-h200.md")).unwrap();
        for r in &rows {
            let sm90 = match r.call {
                Call::Forward => KernelId::flash_sm90(r.elem, r.head_dim),
                Call::Decode => KernelId::decode(r.elem, r.head_dim).map(|k| KernelId::decode_on_sm90(k[0])),
            };
            let sm90 = sm90.unwrap_or_else(|| panic!("no sm_90a kernel for {r:?}"));
            assert_eq!(sm90.variant().module(), kernels_gpu::variants::PtxModule::Sm90a, "{r:?}");
            if let (Some(a), Some(b)) = (r.sm80_ms, r.sm90_ms) {
                assert_eq!(r.runs_sm90, b <= a, "{r:?}: the faster kernel runs");
                for t in [a, b] {
                    assert!(doc.contains(&format!("{t}")), "{t} ms is not in docs/gpu-h200.md ({r:?})");
                }
            }
        }
        // The H200 run's verdicts: the Hopper forward at d128 and d256, the sm_80 kernel at d64.
        assert!(measured_runs_sm90(Call::Forward, Elem::Bf16, 128));
        assert!(measured_runs_sm90(Call::Forward, Elem::Bf16, 256));
        assert!(!measured_runs_sm90(Call::Forward, Elem::Bf16, 64));
        assert!(!measured_runs_sm90(Call::Forward, Elem::Bf16, 96), "no row: the sm_80 kernel");
    }

    /// Malformed rows are named with their line.
    pub fn malformed_rows_are_refused_with_their_line() {
        let e = parse_table("# c\nsm_90\tforward\tbf16\t64\t1\t2\tsm_80\n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("7 fields"), "{e}");
        let e = parse_table("sm_90\tforward\tbf16\t64\tx\t2\tsm_80\tn\n").unwrap_err();
        assert!(e.contains("line 1") && e.contains("\"x\""), "{e}");
        let two = "sm_90\tforward\tbf16\t64\t-\t-\tsm_80\tn\n";
        let e = parse_table(&format!("{two}{two}")).unwrap_err();
        assert!(e.contains("a second row"), "{e}");
    }

    /// The policy: the table by default, the override both ways, and sm_80 devices never.
    pub fn the_policy_picks_by_table_and_override() {
        let bf16_64 = KernelId::flash_sm90(Elem::Bf16, 64);
        let bf16_128 = KernelId::flash_sm90(Elem::Bf16, 128);
        let t = Target::from(Arch::Sm90);
        assert_eq!(t.forward(bf16_64, Elem::Bf16, 64), None);
        assert_eq!(t.forward(bf16_128, Elem::Bf16, 128), bf16_128);
        let always = Target::new(Arch::Sm90, HopperPolicy::Always);
        assert_eq!(always.forward(bf16_64, Elem::Bf16, 64), bf16_64);
        let never = Target::new(Arch::Sm90, HopperPolicy::Never);
        assert_eq!(never.forward(bf16_128, Elem::Bf16, 128), None);
        let sm80 = Target::new(Arch::Sm80, HopperPolicy::Always);
        assert_eq!(sm80.forward(bf16_128, Elem::Bf16, 128), None);
        let fp8 = KernelId::decode(Elem::Fp8E4m3, 128).unwrap()[0];
        assert_eq!(t.decode(fp8), KernelId::decode_on_sm90(fp8));
        assert_ne!(t.decode(fp8), fp8);
        assert_eq!(never.decode(fp8), fp8);
        assert_eq!(sm80.decode(fp8), fp8);
        assert_eq!(HopperPolicy::parse("1"), Ok(HopperPolicy::Always));
        assert_eq!(HopperPolicy::parse("0"), Ok(HopperPolicy::Never));
        assert_eq!(HopperPolicy::parse(""), Ok(HopperPolicy::Measured));
        let e = HopperPolicy::parse("yes").unwrap_err();
        assert!(e.contains("MEMATTN_HOPPER=\"yes\"") && e.contains("use 1"), "{e}");
        assert_eq!(Arch::of_compute_capability(9, 0), Arch::Sm90);
        assert_eq!(Arch::of_compute_capability(10, 0), Arch::Sm80);
        assert_eq!(Arch::of_compute_capability(8, 9), Arch::Sm80);
    }
}
