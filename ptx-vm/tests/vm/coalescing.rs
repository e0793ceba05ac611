//! Global-memory sectors (`Vm::set_sectors`): a warp's access is counted in the 32-byte sectors
//! its lanes' bytes lie in, and the efficiency is useful bytes / (32 · sectors). Checked against
//! the arithmetic on a read of one f32 per lane at a stride of `s` elements.

use crate::util::HEADER;
use ptx_vm::run::{Arg, Launcher};
use ptx_vm::{Module, Vm};

/// `y[tid] = x[tid * stride]`, one warp; the load is on PTX line `LOAD`.
fn strided_read() -> String {
    format!(
        "{HEADER}.visible .entry strided(\n\t.param .u64 x,\n\t.param .u64 y,\n\t.param .u32 stride\n)\n{{\n\
         \t.reg .b32 %r<8>;\n\t.reg .b64 %rd<8>;\n\
         \tld.param.u64 %rd1, [x];\n\tld.param.u64 %rd2, [y];\n\tld.param.u32 %r1, [stride];\n\
         \tcvta.to.global.u64 %rd1, %rd1;\n\tcvta.to.global.u64 %rd2, %rd2;\n\
         \tmov.u32 %r2, %tid.x;\n\tmul.lo.s32 %r3, %r2, %r1;\n\
         \tmul.wide.u32 %rd3, %r3, 4;\n\tadd.s64 %rd4, %rd1, %rd3;\n\
         \tld.global.f32 %r4, [%rd4]; // LOAD\n\
         \tmul.wide.u32 %rd5, %r2, 4;\n\tadd.s64 %rd6, %rd2, %rd5;\n\
         \tst.global.f32 [%rd6], %r4; // STORE\n\tret;\n}}\n"
    )
}

fn line_of(src: &str, marker: &str) -> usize {
    src.lines().position(|l| l.contains(marker)).expect("marker") + 1
}

/// The sector counts of the load and the store of one launch at `stride`, and the output.
fn run(stride: u32, sectors_on: bool) -> (Vec<ptx_vm::Sectors>, Vec<f32>) {
    let src = strided_read();
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    vm.set_sectors(sectors_on);
    let mut l = Launcher::with_vm(vm, &m);
    let x: Vec<f32> = (0..32 * 32).map(|i| i as f32).collect();
    l.input_f32("x", &x).unwrap();
    l.output_f32("y", 32).unwrap();
    let stats =
        l.launch("strided", [1, 1, 1], [32, 1, 1], 0, &[Arg::buf("x"), Arg::buf("y"), Arg::U32(stride)]).unwrap();
    (stats.sectors, l.read_f32("y").unwrap())
}

#[test]
fn a_stride_of_32_f32_takes_a_sector_per_lane_and_unit_stride_four() {
    let src = strided_read();
    let (load, store) = (line_of(&src, "// LOAD"), line_of(&src, "// STORE"));
    // Stride 32 elements = 128 bytes: each lane its own sector, 32 sectors (1024 bytes moved)
    // for 128 useful bytes, 12.5 %.
    let (s, y) = run(32, true);
    assert_eq!(y, (0..32).map(|i| (32 * i) as f32).collect::<Vec<_>>());
    let ld = s.iter().find(|c| c.line == load).expect("the load is counted");
    assert_eq!((ld.executions, ld.useful_bytes, ld.sectors), (1, 128, 32));
    assert_eq!(ld.efficiency(), 0.125);
    // The store is unit stride either way: 4 sectors, 100 %.
    let st = s.iter().find(|c| c.line == store).expect("the store is counted");
    assert_eq!((st.executions, st.useful_bytes, st.sectors, st.efficiency()), (1, 128, 4, 1.0));
    // Unit stride: 128 consecutive bytes in 4 sectors, 100 %.
    let (s, _) = run(1, true);
    let ld = s.iter().find(|c| c.line == load).unwrap();
    assert_eq!((ld.useful_bytes, ld.sectors, ld.efficiency()), (128, 4, 1.0));
    // Stride 2: 256 bytes span 8 sectors, half of each used.
    let (s, _) = run(2, true);
    let ld = s.iter().find(|c| c.line == load).unwrap();
    assert_eq!((ld.useful_bytes, ld.sectors, ld.efficiency()), (128, 8, 0.5));
    // Only global accesses are lines of the report: the two, in line order.
    assert_eq!(s.iter().map(|c| c.line).collect::<Vec<_>>(), vec![load, store]);
    // Off by default: nothing counted, the same result.
    let (s, y) = run(32, false);
    assert!(s.is_empty());
    assert_eq!(y[1], 32.0);
}
