//! Determinism across worker counts, the instruction trace, and a deterministic mutation fuzz of
//! the loader (always run; the coverage-guided fuzzer lives in `ptx-vm/fuzz`).

use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::tiles::FLASH_F32_D64;
use ptx_vm::{LaunchConfig, Module, TraceRequest, Vm, VmError};

use crate::util;
use util::{Rng, PTX};

fn flash_output(workers: usize) -> Vec<u8> {
    let m = Module::load(PTX).unwrap();
    let mut vm = Vm::with_workers(workers);
    let (b, h, s, d) = (1u32, 2u32, 70u32, 64u32);
    let n = (b * h * s * d) as usize;
    let mut x = 12345u64;
    let mut bufs = Vec::new();
    for _ in 0..4 {
        let data: Vec<u8> = (0..n)
            .flat_map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (((x >> 40) as f32) / (1u64 << 24) as f32 - 0.5).to_le_bytes()
            })
            .collect();
        let p = vm.alloc(data.len() as u64).unwrap();
        vm.write(p, &data).unwrap();
        bufs.push(p);
    }
    let lse = vm.alloc((b * h * s * 4) as u64).unwrap();
    let st = Strides::bshd(s as u64, h as u64, d as u64);
    let p = AttnParams {
        q: bufs[0],
        k: bufs[1],
        v: bufs[2],
        o: bufs[3],
        lse,
        scores: 0,
        q_strides: st,
        k_strides: st,
        v_strides: st,
        o_strides: st,
        batch: b,
        heads: h,
        seq_q: s,
        seq_kv: s,
        head_dim: d,
        causal: 1,
        softmax_scale: 0.125,
        ..AttnParams::default()
    };
    let dims = FLASH_F32_D64.launch(b, h, s);
    vm.launch(
        &m,
        "flash_fwd_f32_d64",
        &LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes),
        &p.to_bytes(),
    )
    .unwrap();
    let mut out = vec![0u8; n * 4 + (b * h * s * 4) as usize];
    vm.read(bufs[3], &mut out[..n * 4]).unwrap();
    vm.read(lse, &mut out[n * 4..]).unwrap();
    out
}

#[test]
fn bit_identical_with_one_and_two_workers() {
    let a = flash_output(1);
    let b = flash_output(2);
    let c = flash_output(3);
    assert!(a == b && b == c);
}

#[test]
fn trace_of_one_thread() {
    let src = ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry t(.param .u64 o)\n{\n.reg .pred %p<2>;\n\
        .reg .b32 %r<4>;\n.reg .b64 %rd<4>;\nld.param.u64 %rd1, [o];\nmov.u32 %r1, %tid.x;\nsetp.eq.u32 %p1, %r1, 0;\n\
        @%p1 mov.b32 %r2, 0f3F800000;\nret;\n}\n";
    let m = Module::load(src).unwrap();
    let mut vm = Vm::new();
    let mut cfg = LaunchConfig::new([2, 1, 1], [4, 1, 1], 0);
    cfg.trace = Some(TraceRequest { block: [1, 0, 0], thread: [2, 0, 0], max_entries: 100 });
    let st = vm.launch(&m, "t", &cfg, &0u64.to_le_bytes()).unwrap();
    assert_eq!(st.trace.len(), 5);
    assert_eq!(st.trace[1].text, "mov.u32 %r1, %tid.x;");
    assert_eq!(st.trace[1].line, 10);
    assert_eq!(st.trace[1].writes, vec![("%r1".to_string(), 2)]);
    assert!(!st.trace[3].executed, "guard false for thread 2");
    assert_eq!(st.thread_instructions, 2 * 4 * 5, "predicated-off instructions count as issued");
    assert_eq!(st.warp_instructions, 2 * 5);
}

// 3000 mutated modules in three tests of their own (each its own seed) that run side by side:
// as one test it was the last 2.5 s of this executable on one core.
#[test]
fn mutated_modules_never_panic_1() {
    mutated_modules_never_panic(0x5EED, 1000);
}

#[test]
fn mutated_modules_never_panic_2() {
    mutated_modules_never_panic(0x5EED_0002, 1000);
}

#[test]
fn mutated_modules_never_panic_3() {
    mutated_modules_never_panic(0x5EED_0003, 1000);
}

/// Loads `count` mutations of the committed module (truncations, flipped bits, swapped and
/// deleted lines, inserted tokens and chunks) drawn from `seed`: each loads or is a load error
/// naming a line, never a panic.
fn mutated_modules_never_panic(seed: u64, count: usize) {
    // The saxpy + naive part of the module keeps each load cheap; truncations cover the rest.
    let lines: Vec<&str> = PTX.lines().collect();
    let start = lines.iter().position(|l| l.contains(".entry naive_pv_f32")).unwrap_or(0).saturating_sub(1);
    // Everything before the first entry: directives and the module's globals (tile records,
    // constants the kernels reference).
    let first_entry = lines.iter().position(|l| l.contains(".entry ")).unwrap_or(8);
    let header = lines[..first_entry].join("\n");
    let small = format!("{header}\n{}", lines[start..].join("\n"));
    let mut rng = Rng(seed);
    let tokens = [
        "{",
        "}",
        ";",
        "[",
        "]",
        "%r1",
        "%p1",
        "@",
        "!",
        ".reg",
        ".b32",
        "0f3F800000",
        "-",
        "+",
        ",",
        "ld.shared.v4.f32",
        "$L__BB2_3",
        "call.uni",
        "(",
        ")",
        ".param",
        "bra",
        "99999999999999999999",
        "0d",
        ".align 3",
        "<",
        ">",
        "\"",
        "/*",
        "shfl.sync.idx.b32",
        "mov.b64 {",
        "ret;",
        ".extern .shared .b8 x[];",
        "\u{0}",
        "é",
    ];
    let mut loaded = 0;
    for i in 0..count {
        let mut s = small.clone().into_bytes();
        match i % 6 {
            0 => {
                // Truncations: of the whole module one time in ten (it is megabytes, and the
                // loader reads a prefix in time linear in its length), else of the small one.
                let src = if i % 60 == 0 { PTX.as_bytes() } else { small.as_bytes() };
                let at = rng.below(src.len());
                s = src[..at].to_vec();
            }
            1 => {
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(s.len());
                    s[at] ^= 1 << rng.below(8);
                }
            }
            2 => {
                let mut ls: Vec<&str> = small.lines().collect();
                let (a, b) = (rng.below(ls.len()), rng.below(ls.len()));
                ls.swap(a, b);
                if rng.below(2) == 0 {
                    let k = rng.below(ls.len());
                    ls.remove(k);
                }
                s = ls.join("\n").into_bytes();
            }
            3 => {
                let at = rng.below(s.len());
                let t = tokens[rng.below(tokens.len())];
                s.splice(at..at, t.bytes());
            }
            4 => {
                let at = rng.below(s.len());
                let len = rng.below(40).min(s.len() - at);
                s.drain(at..at + len);
            }
            _ => {
                let a = rng.below(s.len());
                let b = rng.below(s.len());
                let (a, b) = (a.min(b), a.max(b));
                let chunk = s[a..b.min(a + 200)].to_vec();
                let at = rng.below(s.len());
                s.splice(at..at, chunk);
            }
        }
        let text = String::from_utf8_lossy(&s).into_owned();
        let r = std::panic::catch_unwind(|| Module::load(&text).map(|m| m.kernels().len()));
        match r {
            Ok(Ok(_)) => loaded += 1,
            Ok(Err(e)) => assert!(e.line >= 1, "load errors name a line"),
            Err(_) => panic!("Module::load panicked on mutation {i}:\n{text}"),
        }
    }
    assert!(loaded > 0);
}

/// PTX a GPU driver would reject is rejected by the loader too, naming the line.
#[test]
fn loader_rejects_what_a_driver_rejects() {
    let ok = util::kernel("", "");
    Module::load(&ok).unwrap();
    let cases: [(String, usize, &str); 6] = [
        (ok.replace(".version 7.0", ".version 99.9"), 1, "unsupported .version 99.9"),
        (ok.replace(".version 7.0", ".version 7.10"), 1, "unsupported .version 7.10"),
        (ok.replace(".target sm_80", ".target sm_200"), 2, "unsupported .target sm_200"),
        (ok.replace(".target sm_80", ".target sm_80, texmode_bogus"), 2, "texmode_bogus"),
        (
            format!("{ok}{}", ok.trim_start_matches(util::HEADER)),
            20,
            "duplicate definition of `t` (first defined at PTX line 5)",
        ),
        (
            ok.replace("\t.reg .b16 %h<16>;", "\t.reg .b16 %h<16>;\n\t.reg .b32 %h3;"),
            11,
            "duplicate declaration of register `%h3`",
        ),
    ];
    for (src, line, needle) in cases {
        let e = Module::load(&src).map(|_| ()).unwrap_err();
        assert!(e.message.contains(needle), "{needle}: {e}");
        assert_eq!(e.line, line, "{needle}: {e}\n{src}");
    }
    // What drivers accept still loads: newer ISA versions, feature-suffixed targets, and a
    // declaration followed by its definition.
    for src in [
        ok.replace(".version 7.0", ".version 8.8"),
        ok.replace(".target sm_80", ".target sm_90a"),
        ok.replace(".target sm_80", ".target sm_100f, debug"),
        format!(
            "{}.visible .entry t(\n\t.param .u64 t_param_0\n);\n{}",
            util::HEADER,
            ok.trim_start_matches(util::HEADER)
        ),
    ] {
        Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    }
}

/// A simulated device larger than the host: an allocation the host cannot back is an error
/// naming the bytes, not an abort of the process in the allocator.
#[test]
fn an_allocation_the_host_cannot_back_is_an_error() {
    let mut vm = Vm::new();
    let mut limits = vm.limits();
    limits.memory_bytes = 1 << 46;
    vm.set_limits(limits);
    let bytes = 1u64 << 45; // 32 TiB
    match vm.alloc(bytes) {
        Err(ptx_vm::VmError::HostMemory { requested }) => assert_eq!(requested, bytes),
        Ok(p) => {
            // Only with `vm.overcommit_memory = 1` does the kernel hand out 32 TiB of address space.
            let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
            assert_eq!(mode.trim(), "1", "a 32 TiB allocation succeeded without unlimited overcommit");
            eprintln!("skipped: this host overcommits without limit (vm.overcommit_memory = 1)");
            vm.free(p).unwrap();
        }
        Err(e) => panic!("{e}"),
    }
    // The heap is unchanged and still works.
    assert_eq!(vm.memory().current_bytes, 0);
    let p = vm.alloc(64).unwrap();
    vm.free(p).unwrap();
}

/// A module whose second entry uses an opcode the VM lacks, plus a global the first one bumps.
const LAZY: &str = ".version 7.0\n.target sm_80\n.address_size 64\n\
    .global .align 4 .u32 counter = 40;\n\
    .visible .entry good(.param .u64 o)\n{\n.reg .b32 %r<4>;\n.reg .b64 %rd<4>;\n\
    ld.param.u64 %rd1, [o];\nld.global.u32 %r1, [counter];\nadd.s32 %r1, %r1, 1;\n\
    st.global.u32 [counter], %r1;\nst.global.u32 [%rd1], %r1;\nret;\n}\n\
    .visible .entry bad(.param .u64 o)\n{\n.reg .b32 %r<4>;\nfrobnicate.f32 %r1;\nret;\n}\n";

fn bump(vm: &mut Vm, m: &Module) -> Result<u32, VmError> {
    let out = vm.alloc(4)?;
    vm.launch(m, "good", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &out.to_le_bytes())?;
    let mut b = [0u8; 4];
    vm.read(out, &mut b)?;
    Ok(u32::from_le_bytes(b))
}

#[test]
fn lazy_modules_report_an_undecodable_entry_before_it_runs() {
    // Loading everything at once finds it at load, naming the line.
    let e = Module::load(LAZY).map(|_| ()).unwrap_err();
    assert_eq!(e.line, util::line_of(LAZY, "frobnicate"), "{e}");
    // Lazily, the module loads; the good entry runs, the bad one fails before any thread runs.
    let m = Module::load_lazy(LAZY).unwrap();
    assert_eq!(m.kernel_names(), ["good", "bad"]);
    let mut vm = Vm::with_workers(1);
    assert_eq!(bump(&mut vm, &m).unwrap(), 41);
    assert!(m.kernel("bad").is_none());
    assert!(matches!(m.kernel_info("bad"), Err(VmError::Load(ref l)) if *l == e));
    assert!(matches!(m.kernel_info("missing"), Err(VmError::UnknownKernel(_))));
    let out = vm.alloc(8).unwrap();
    let r = vm.launch(&m, "bad", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &out.to_le_bytes());
    assert_eq!(r.unwrap_err(), VmError::Load(e.clone()));
    assert!(VmError::Load(e.clone()).to_string().contains("frobnicate"));
    assert_eq!(m.check_all().unwrap_err(), e);
    assert_eq!(m.kernels().len(), 1, "kernels() lists the entries that decode");
}

/// A body with braces in comments and a string-like `.file` path at the top, a nested block,
/// and (in `broken`) a syntax error: bodies are found by matching braces and parsed on first use.
const BODIES: &str = ".version 7.0\n.target sm_80\n.address_size 64\n\
    .file 1 \"/src/{weird}.rs\"\n\
    .visible .entry fine(.param .u64 o)\n.maxntid 32, 1, 1\n{\n.reg .b32 %r<4>;\n.reg .b64 %rd<4>;\n\
    // a comment with a } brace\n/* and { another\n } */\n{\n.reg .b32 %t;\nmov.u32 %t, 5;\nmov.u32 %r1, %t;\n}\n\
    ld.param.u64 %rd1, [o];\nst.global.u32 [%rd1], %r1;\nret;\n}\n\
    .visible .entry broken(.param .u64 o)\n{\n.reg .b32 %r<4>;\nadd.u32 %r1, , %r2; // SYNTAX\nret;\n}\n";

#[test]
fn function_bodies_are_parsed_on_first_use_with_their_lines() {
    // Loading everything at once still finds the syntax error, naming its line.
    let e = Module::load(BODIES).map(|_| ()).unwrap_err();
    assert_eq!(e.line, util::line_of(BODIES, "// SYNTAX"), "{e}");
    // Lazily the module loads; the good entry (braces in comments, a nested block) runs and
    // the broken one reports the same error at first use, every time.
    let m = Module::load_lazy(BODIES).unwrap();
    assert_eq!(m.kernel_names(), ["fine", "broken"]);
    let mut vm = Vm::with_workers(1);
    let out = vm.alloc(4).unwrap();
    vm.launch(&m, "fine", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &out.to_le_bytes()).unwrap();
    let mut b = [0u8; 4];
    vm.read(out, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 5);
    for _ in 0..2 {
        assert!(matches!(m.kernel_info("broken"), Err(VmError::Load(ref l)) if *l == e), "{e}");
    }
    assert_eq!(m.check_all().unwrap_err(), e);
    // A body that never closes is an error of the load itself, at the line of its `{`.
    let open = BODIES.rsplit_once('}').unwrap().0;
    let e = Module::load_lazy(open).map(|_| ()).unwrap_err();
    assert_eq!(e.line, util::line_of(BODIES, "// SYNTAX") - 2, "{e}");
    assert!(e.message.contains("unterminated function body"), "{e}");
}

#[test]
fn vms_sharing_a_module_have_their_own_globals() {
    let m = std::sync::Arc::new(Module::load_lazy(LAZY).unwrap());
    let (mut a, mut b) = (Vm::with_workers(1), Vm::with_workers(1));
    assert_eq!(bump(&mut a, &m).unwrap(), 41);
    assert_eq!(bump(&mut a, &m).unwrap(), 42);
    assert_eq!(bump(&mut b, &m).unwrap(), 41, "another VM starts from the initialiser");
    assert_eq!(a.global_address(&m, "counter"), b.global_address(&m, "counter"));
    // Releasing A's instance resets it; B keeps counting.
    a.release_globals(&m);
    assert_eq!(bump(&mut a, &m).unwrap(), 41);
    assert_eq!(bump(&mut b, &m).unwrap(), 42);
}

/// An instruction its `.target` does not have is refused, naming both, as ptxas and a driver's
/// JIT refuse it: `mma.sync` under `.target sm_30` ran (and verified) before.
#[test]
fn instructions_newer_than_the_modules_target_are_refused() {
    let mma = "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f0, %f1, %f2, %f3}, {%r0, %r1, %r2, %r3}, \
               {%r4, %r5}, {%f4, %f5, %f6, %f7};";
    let ok = util::kernel("", mma);
    let check = |src: &str| Module::load(src).and_then(|m| m.check_all().map(|_| ()));
    check(&ok).unwrap_or_else(|e| panic!("{e}\n{ok}"));
    check(&ok.replace(".target sm_80", ".target sm_90a")).unwrap();
    for old in ["sm_30", "sm_75"] {
        let e = check(&ok.replace(".target sm_80", &format!(".target {old}"))).unwrap_err();
        assert!(e.message.contains("needs .target sm_80 or newer") && e.message.contains(old), "{e}");
    }
    let cvt = util::kernel("", "\tcvt.rn.f16x2.e4m3x2 %r1, %h1;");
    let e = check(&cvt).unwrap_err();
    assert!(e.message.contains("sm_89 or newer"), "{e}");
    check(&cvt.replace(".target sm_80", ".target sm_89")).unwrap_or_else(|e| panic!("{e}"));
}
