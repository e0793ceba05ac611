//! Arbitrary bytes into the PTX loader: it must return Ok or a LoadError, never panic or hang.
//! Modules that load are also launched once (one block of 32 threads, tiny budget) when their
//! first kernel takes no parameters, to fuzz the executor's error paths.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(module) = ptx_vm::Module::load(text) else { return };
    let Some(k) = module.kernels().into_iter().find(|k| k.param_bytes == 0) else { return };
    let mut vm = ptx_vm::Vm::with_workers(1);
    let mut lim = vm.limits();
    lim.max_instructions_per_thread = 10_000;
    lim.memory_bytes = 1 << 20;
    vm.set_limits(lim);
    let _ = vm.launch(&module, &k.name, &ptx_vm::LaunchConfig::new([1, 1, 1], [32, 1, 1], 0), &[]);
});
