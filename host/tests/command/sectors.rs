//! `--vm-sectors`: the VM counts each warp's global accesses in 32-byte sectors and `launch`
//! and `run` report the efficiency, useful bytes / (32 x sectors), per source line.

use crate::common;
use common::*;

/// `y[tid] = x[tid * stride]`: one f32 per lane, read at a stride of `stride` elements.
const STRIDED: &str = ".version 7.0\n.target sm_80\n.address_size 64\n\
.visible .entry strided(\n\t.param .u64 x,\n\t.param .u64 y,\n\t.param .u32 stride\n)\n{\n\
\t.reg .b32 %r<8>;\n\t.reg .b64 %rd<8>;\n\
\tld.param.u64 %rd1, [x];\n\tld.param.u64 %rd2, [y];\n\tld.param.u32 %r1, [stride];\n\
\tcvta.to.global.u64 %rd1, %rd1;\n\tcvta.to.global.u64 %rd2, %rd2;\n\
\tmov.u32 %r2, %tid.x;\n\tmul.lo.s32 %r3, %r2, %r1;\n\
\tmul.wide.u32 %rd3, %r3, 4;\n\tadd.s64 %rd4, %rd1, %rd3;\n\
\tld.global.f32 %r4, [%rd4];\n\
\tmul.wide.u32 %rd5, %r2, 4;\n\tadd.s64 %rd6, %rd2, %rd5;\n\
\tst.global.f32 [%rd6], %r4;\n\tret;\n}\n";

fn launch_strided(stride: u32, json: bool) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!("memattn-sectors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ptx = dir.join("strided.ptx");
    std::fs::write(&ptx, STRIDED).unwrap();
    let stride = format!("u32={stride}");
    let mut args = vec!["--backend", "vm", "--vm-sectors", "--ptx", ptx.to_str().unwrap()];
    if json {
        args.push("--json");
    }
    args.extend([
        "launch",
        "strided",
        "--grid",
        "1",
        "--block",
        "32",
        "--buf",
        "x=f32:1024:iota",
        "--buf",
        "y=f32:32",
        "--arg",
        "buf=x",
        "--arg",
        "buf=y",
        "--arg",
        &stride,
        "--show",
        "y",
        "--count",
        "2",
    ]);
    memattn(&args)
}

#[test]
fn a_strided_read_wastes_seven_eighths_of_its_sectors_and_a_unit_stride_read_none() {
    // Stride 32 f32 = 128 bytes: each lane its own sector, 32 sectors for 128 useful bytes
    // (12.5 %); the store (unit stride) is 4 sectors for 128 bytes (100 %). The PTX has no
    // line table, so the report names PTX lines.
    let line = |op: &str| STRIDED.lines().position(|l| l.contains(op)).unwrap() + 1;
    let (load, store) = (format!("PTX line {}", line("ld.global")), format!("PTX line {}", line("st.global")));
    let o = launch_strided(32, false);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("sectors      strided: 256 useful bytes in 36 sectors of 32 B (22.2 % efficiency)"), "{out}");
    assert!(out.contains(&format!("{load}: 128 useful bytes in 32 sectors (12.5 %), 1 warp-wide executions")), "{out}");
    assert!(
        out.contains(&format!("{store}: 128 useful bytes in 4 sectors (100.0 %), 1 warp-wide executions")),
        "{out}"
    );
    assert!(out.find(&load).unwrap() < out.find(&store).unwrap(), "least efficient first:\n{out}");
    assert!(out.contains("y[0..2] = [0, 32]"), "{out}");
    // Unit stride: 4 sectors for the load too.
    let o = launch_strided(1, true);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let lines = v["sectors"].as_array().expect("sectors in the JSON");
    assert_eq!(lines.len(), 2, "{v}");
    for l in lines {
        assert_eq!((l["useful_bytes"].as_u64(), l["sectors"].as_u64()), (Some(128), Some(4)), "{l}");
    }
}

#[test]
fn run_reports_the_sectors_of_the_flash_kernel_by_rust_line() {
    let o = memattn(&["--backend", "vm", "--vm-sectors", "run", "--kernel", "flash", "--seq", "64", "--heads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    let head =
        out.lines().find(|l| l.starts_with("sectors      flash_fwd_f32_d64: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(head.ends_with("% efficiency)"), "{head}");
    assert!(out.contains("kernels-gpu/src/"), "source lines named:\n{out}");
    // Off by default.
    let o = memattn(&["--backend", "vm", "run", "--kernel", "flash", "--seq", "64", "--heads", "1"]);
    assert!(!stdout(&o).contains("sectors  "), "{}", stdout(&o));
}
