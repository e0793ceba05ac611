//! `Module::shared`: the committed module is parsed once per process, and one `Arc<Module>` serves
//! several VMs, also launching at the same time from different threads.
//!
//! One test only: `Module::parses()` counts for the whole process, so no other test of this
//! binary may parse while it runs.

use std::sync::Arc;

use kernels_gpu::tiles;
use ptx_vm::{LaunchConfig, Module, Vm};

mod util;
use util::{Rng, PTX};

fn saxpy(vm: &mut Vm, m: &Module, seed: u64) {
    let n = 1000u32;
    let mut rng = Rng(seed);
    let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let upload = |vm: &mut Vm, v: &[f32]| {
        let p = vm.alloc((v.len() * 4) as u64).unwrap();
        vm.write(p, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        p
    };
    let (px, py) = (upload(vm, &x), upload(vm, &y));
    let a = 0.5 + seed as f32;
    let mut params = Vec::new();
    params.extend_from_slice(&n.to_le_bytes());
    params.extend_from_slice(&a.to_le_bytes());
    params.extend_from_slice(&px.to_le_bytes());
    params.extend_from_slice(&py.to_le_bytes());
    let d = tiles::saxpy_launch(n);
    vm.launch(m, "saxpy_f32", &LaunchConfig::new(d.grid, d.block, 0), &params).unwrap();
    let mut b = vec![0u8; n as usize * 4];
    vm.read(py, &mut b).unwrap();
    for (i, c) in b.chunks(4).enumerate() {
        let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        assert_eq!(got.to_bits(), (a * x[i] + y[i]).to_bits(), "seed {seed}, element {i}");
    }
}

#[test]
fn committed_module_parses_once_and_serves_two_vms() {
    let before = Module::parses();
    let a = Module::shared(PTX).unwrap();
    let b = Module::shared(PTX).unwrap();
    assert!(Arc::ptr_eq(&a, &b), "the same text gives the same module");
    assert_eq!(Module::parses() - before, 1, "two shared loads of one text parse it once");
    drop((a, b));
    // Nobody holds it now; the cache still does.
    let m = Module::shared(PTX).unwrap();
    assert_eq!(Module::parses() - before, 1, "a dropped shared module stays cached");

    // Two VMs, each on its own thread, launch the same entry of the same module at once (its
    // first use decodes it, so both race for that too).
    std::thread::scope(|s| {
        for seed in [1u64, 2] {
            let m = Arc::clone(&m);
            s.spawn(move || {
                let mut vm = Vm::with_workers(2);
                for _ in 0..3 {
                    saxpy(&mut vm, &m, seed);
                }
            });
        }
    });
    // And one after the other in this thread.
    let (mut v1, mut v2) = (Vm::with_workers(1), Vm::with_workers(1));
    saxpy(&mut v1, &m, 3);
    saxpy(&mut v2, &m, 4);
    saxpy(&mut v1, &m, 5);
    assert_eq!(Module::parses() - before, 1);
}
