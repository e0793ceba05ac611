//! Findings and traces name the Rust line (from the committed PTX's line tables) and the buffer;
//! the `run::Launcher` packs arguments by the kernel's declarations.

use ptx_vm::run::{Arg, Launcher, OUTPUT_POISON};
use ptx_vm::{LaunchConfig, Module, TraceRequest, Vm, VmError};

const PTX: &str = include_str!("../../../kernels-gpu/ptx/memattn_kernels.ptx");
const SMOKE_RS: &str = include_str!("../../../kernels-gpu/src/smoke.rs");

/// The 1-based line of `kernels-gpu/src/smoke.rs` that loads and stores `y`, found by its text.
fn saxpy_line() -> u32 {
    let i = SMOKE_RS.lines().position(|l| l.contains("*yi = a *")).expect("the saxpy statement");
    i as u32 + 1
}

fn launcher(module: &Module) -> Launcher<'_> {
    Launcher::with_vm(Vm::with_workers(2), module)
}

#[test]
fn a_finding_names_the_rust_line_and_the_buffer() {
    let m = Module::load(PTX).expect("committed PTX loads");
    assert!(m.has_line_info(), "the committed PTX carries .file/.loc line tables");
    let mut l = launcher(&m);
    let x: Vec<f32> = (0..300).map(|i| i as f32 * 0.5).collect();
    l.input_f32("x", &x).unwrap();
    l.input_f32("y", &[1.0; 256]).unwrap(); // 44 elements short of n = 300
    let e = l
        .launch("saxpy_f32", [3, 1, 1], [128, 1, 1], 0, &[Arg::U32(300), Arg::F32(2.0), Arg::buf("x"), Arg::buf("y")])
        .unwrap_err();
    let VmError::Memcheck(f) = e else { panic!("expected a memcheck finding, got {e}") };
    assert_eq!(f.buffer.as_deref(), Some("y"), "{f}");
    let src = f.source.clone().expect("the finding has a source line");
    assert_eq!(src.file, "kernels-gpu/src/smoke.rs", "{f}");
    assert_eq!(src.line, saxpy_line(), "{f}");
    assert_eq!((f.block, f.thread), ([2, 0, 0], [0, 0, 0]), "element 256 is the first out of bounds: {f}");
    let text = f.to_string();
    assert!(text.contains(&format!("kernels-gpu/src/smoke.rs:{}", saxpy_line())), "{text}");
    assert!(text.contains("buffer `y`") && text.contains("allocation `y`"), "{text}");
}

#[test]
fn the_trace_is_kept_up_to_the_instruction_that_made_the_finding() {
    let m = Module::load(PTX).unwrap();
    let mut l = launcher(&m);
    l.input_f32("x", &[3.0; 300]).unwrap();
    l.input_f32("y", &[1.0; 256]).unwrap();
    let mut cfg = LaunchConfig::new([3, 1, 1], [128, 1, 1], 0);
    cfg.trace = Some(TraceRequest { block: [2, 0, 0], thread: [0, 0, 0], max_entries: 1000 });
    let args = [Arg::U32(300), Arg::F32(2.0), Arg::buf("x"), Arg::buf("y")];
    assert!(l.launch_with("saxpy_f32", &cfg, &args).is_err());
    let trace = l.vm().take_trace();
    let last = trace.last().expect("trace kept");
    assert_eq!(last.finding.as_deref(), Some("out-of-bounds global load"), "{last:?}");
    assert!(last.text.starts_with("ld."), "{last:?}");
    assert_eq!(last.source.as_ref().map(|s| s.line), Some(saxpy_line()));
    assert!(trace.len() > 3 && trace[..trace.len() - 1].iter().all(|t| t.finding.is_none()));
    assert!(trace.iter().filter(|t| t.source.is_some()).count() >= trace.len() / 2, "most entries have a line");
}

#[test]
fn the_launcher_checks_arguments_against_the_declarations_and_poisons_outputs() {
    let m = Module::load(PTX).unwrap();
    let mut l = launcher(&m);
    l.input_f32("x", &[1.0, 2.0, 3.0]).unwrap();
    l.output_f32("y", 4).unwrap();
    // A pointer where the kernel wants an f32: named in the error, nothing launched.
    let e =
        l.launch("saxpy_f32", [1, 1, 1], [32, 1, 1], 0, &[Arg::U32(3), Arg::buf("x"), Arg::buf("x"), Arg::buf("y")]);
    let msg = e.unwrap_err().to_string();
    assert!(msg.contains("parameter 1") && msg.contains("buffer `x`") && msg.contains(".f32"), "{msg}");
    let e = l.launch("saxpy_f32", [1, 1, 1], [32, 1, 1], 0, &[Arg::U32(3)]).unwrap_err().to_string();
    assert!(e.contains("takes 4 parameters"), "{e}");
    // y = 2 x + y on 3 of 4 elements: y[3] keeps the poison; y[0..3] = 2x + poison = NaN.
    l.launch("saxpy_f32", [1, 1, 1], [32, 1, 1], 0, &[Arg::U32(3), Arg::F32(2.0), Arg::buf("x"), Arg::buf("y")])
        .unwrap();
    let y = l.read_f32("y").unwrap();
    assert_eq!(y[3].to_bits(), OUTPUT_POISON);
    assert!(y[..3].iter().all(|v| v.is_nan()));
    // With y initialised: the exact answer.
    l.input_f32("y0", &[10.0, 20.0, 30.0]).unwrap();
    l.launch("saxpy_f32", [1, 1, 1], [32, 1, 1], 0, &[Arg::U32(3), Arg::F32(2.0), Arg::buf("x"), Arg::buf("y0")])
        .unwrap();
    assert_eq!(l.read_f32("y0").unwrap(), vec![12.0, 24.0, 36.0]);
    assert!(l.read_f32("nope").is_err());
}
