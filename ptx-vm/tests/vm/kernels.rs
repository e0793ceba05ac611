//! The project's committed PTX in the VM: every kernel of the variant table loads with the
//! parameter layout the ABI promises, and the smoke kernel computes bit-exact results.
//!
//! Kernel-versus-reference tests of the attention kernels live once, generic over the device, in
//! `tests/tests/all/attention.rs` (they use the host's f64 reference and verification).

use kernels_gpu::tiles;
use kernels_gpu::{Family, VARIANTS};
use ptx_vm::{LaunchConfig, Module, Vm};

use crate::util;
use util::{module, Rng};

fn upload(vm: &mut Vm, v: &[f32]) -> u64 {
    let p = vm.alloc((v.len() * 4) as u64).unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    vm.write(p, &bytes).unwrap();
    p
}
fn download(vm: &Vm, p: u64, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    vm.read(p, &mut b).unwrap();
    b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The parameter bytes of `saxpy_f32(n, a, x, y)`.
fn saxpy_params(n: u32, a: f32, px: u64, py: u64) -> Vec<u8> {
    [&n.to_le_bytes()[..], &a.to_le_bytes(), &px.to_le_bytes(), &py.to_le_bytes()].concat()
}

#[test]
fn all_kernels_load() {
    use kernels_gpu::variants::PtxModule;
    let m = module();
    let m90 = Module::shared(kernels_gpu::artifacts::PTX_SM90).unwrap_or_else(|e| panic!("{e}"));
    m90.check_all().unwrap_or_else(|e| panic!("{e}"));
    // Each row is in its module, with the parameter struct the table says.
    for v in VARIANTS {
        let (mm, file) = match v.module() {
            PtxModule::Sm80 => (&m, "memattn_kernels.ptx"),
            PtxModule::Sm90a => (&m90, "memattn_kernels_sm90.ptx"),
        };
        let names: Vec<String> = mm.kernels().into_iter().map(|k| k.name).collect();
        assert!(
            names.iter().any(|n| n == v.name),
            "`{}` is a row of kernels-gpu/src/variants.rs but not in the committed {file}; fix: cargo xtask build-ptx",
            v.name
        );
        if v.family != Family::Smoke {
            let k = mm.kernel(v.name).unwrap();
            assert_eq!((k.params.len(), k.param_bytes), (1, v.param_bytes()), "{}", v.name);
        }
    }
    for (mm, module) in [(&m, PtxModule::Sm80), (&m90, PtxModule::Sm90a)] {
        let names: Vec<String> = mm.kernels().into_iter().map(|k| k.name).collect();
        assert_eq!(
            names.len(),
            VARIANTS.iter().filter(|v| v.module() == module).count(),
            "the {module:?} PTX has entries that are not rows of the variant table (kernels-gpu/src/variants.rs): {names:?}"
        );
    }
    assert_eq!(m90.version_and_target(), ("8.3".to_string(), "sm_90a".to_string()));
    assert_eq!(m.version_and_target(), ("7.4".to_string(), "sm_80".to_string()));
    let s = m.kernel("saxpy_f32").unwrap();
    assert_eq!(s.param_bytes, 24);
    assert_eq!(s.params[2].offset, 8);
    assert_eq!(s.params[2].align, 8);
    let f = m.kernel("flash_fwd_f32_d64").unwrap();
    assert_eq!(f.param_bytes, 264);
    assert_eq!(f.params[0].align, 8);
}

#[test]
fn saxpy() {
    let m = module();
    let mut vm = Vm::with_workers(1);
    let mut lim = vm.limits();
    lim.max_instructions_per_thread = 10000;
    vm.set_limits(lim);
    let n = 1000u32;
    let mut rng = Rng(7);
    let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let (px, py) = (upload(&mut vm, &x), upload(&mut vm, &y));
    let a = 1.5f32;
    let params = saxpy_params(n, a, px, py);
    let d = tiles::saxpy_launch(n);
    let st = vm.launch(&m, "saxpy_f32", &LaunchConfig::new(d.grid, d.block, 0), &params).unwrap();
    let out = download(&vm, py, n as usize);
    for i in 0..n as usize {
        assert_eq!(out[i].to_bits(), (a * x[i] + y[i]).to_bits());
    }
    assert_eq!(st.blocks, 4);
    assert!(st.thread_instructions > 0 && st.warp_instructions * 32 >= st.thread_instructions);
    // Each of the n threads in bounds reads x[i] and y[i] and writes y[i]; the 24 threads past
    // the end of the last block read nothing.
    assert_eq!((st.global_bytes_read, st.global_bytes_written), (8 * n as u64, 4 * n as u64));
}

/// A sampled launch (`LaunchConfig::blocks`): only the listed blocks run (a duplicate once), the
/// others' elements keep what was there, the stats count the blocks that ran, and a block
/// outside the grid is refused before anything runs.
#[test]
fn saxpy_on_a_subset_of_blocks() {
    let m = module();
    let mut vm = Vm::with_workers(2);
    let n = 1000u32; // 4 blocks of 256, the last partial
    let mut rng = Rng(11);
    let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let (px, py) = (upload(&mut vm, &x), upload(&mut vm, &y));
    let a = -2.5f32;
    let params = saxpy_params(n, a, px, py);
    let d = tiles::saxpy_launch(n);
    assert_eq!(d.grid, [4, 1, 1]);
    let mut config = LaunchConfig::new(d.grid, d.block, 0);
    config.blocks = Some(vec![[3, 0, 0], [1, 0, 0], [3, 0, 0]]);
    let st = vm.launch(&m, "saxpy_f32", &config, &params).unwrap();
    assert_eq!(st.blocks, 2);
    let out = download(&vm, py, n as usize);
    for i in 0..n as usize {
        let ran = (256..512).contains(&i) || i >= 768;
        let want = if ran { a * x[i] + y[i] } else { y[i] };
        assert_eq!(out[i].to_bits(), want.to_bits(), "element {i}");
    }
    // Blocks 1 and 3: 256 + 232 threads in bounds.
    assert_eq!(st.global_bytes_written, 4 * (256 + 232));
    config.blocks = Some(vec![[0, 0, 0], [4, 0, 0]]);
    let e = vm.launch(&m, "saxpy_f32", &config, &params).unwrap_err().to_string();
    assert!(e.contains("block (4,0,0)") && e.contains("outside the grid (4,1,1)"), "{e}");
    assert_eq!(download(&vm, py, n as usize)[0].to_bits(), y[0].to_bits(), "nothing ran");
}
