//! Helpers: the committed module, a deterministic RNG, and wrapping a PTX body in a kernel taking
//! one output pointer, running it and reading the output back.
#![allow(dead_code)]

use std::sync::Arc;

use ptx_vm::{LaunchConfig, Module, Vm, VmError};

pub const HEADER: &str = ".version 7.0\n.target sm_80\n.address_size 64\n";

pub fn kernel(decls: &str, body: &str) -> String {
    format!(
        "{HEADER}{decls}\n.visible .entry t(\n\t.param .u64 t_param_0\n)\n{{\n\t.reg .pred %p<16>;\n\t.reg .b16 %h<16>;\n\t\
         .reg .b32 %r<64>;\n\t.reg .b64 %rd<64>;\n\t.reg .f32 %f<32>;\n\t.reg .f64 %fd<32>;\n\tld.param.u64 %rd0, [t_param_0];\n\
         {body}\n\tret;\n}}\n"
    )
}

/// Runs `body` with `threads` threads x `blocks` blocks; returns the `out_bytes` output buffer.
pub fn run(decls: &str, body: &str, blocks: u32, threads: u32, out_bytes: usize) -> Result<Vec<u8>, VmError> {
    run_with(decls, body, blocks, threads, out_bytes, true)
}

/// As [`run`], with shared-memory initcheck on or off (off: fresh shared memory reads as poison).
pub fn run_with(
    decls: &str,
    body: &str,
    blocks: u32,
    threads: u32,
    out_bytes: usize,
    initcheck: bool,
) -> Result<Vec<u8>, VmError> {
    run_src(&kernel(decls, body), blocks, threads, out_bytes, initcheck)
}

/// As [`run`], for a module declaring `.target {target}` (instructions newer than sm_80).
pub fn run_on(target: &str, body: &str, blocks: u32, threads: u32, out_bytes: usize) -> Result<Vec<u8>, VmError> {
    let src = kernel("", body).replace(".target sm_80", &format!(".target {target}"));
    run_src(&src, blocks, threads, out_bytes, true)
}

fn run_src(src: &str, blocks: u32, threads: u32, out_bytes: usize, initcheck: bool) -> Result<Vec<u8>, VmError> {
    let src = src.to_string();
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(2);
    vm.set_initcheck(initcheck);
    let out = vm.alloc(out_bytes as u64)?;
    vm.launch(&m, "t", &LaunchConfig::new([blocks, 1, 1], [threads, 1, 1], 0), &out.to_le_bytes())?;
    let mut b = vec![0u8; out_bytes];
    vm.read(out, &mut b)?;
    Ok(b)
}

/// Single-thread run; returns the output as u32 words.
pub fn run1(body: &str, words: usize) -> Vec<u32> {
    let b = run("", body, 1, 1, words * 4).unwrap_or_else(|e| panic!("{e}"));
    b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub fn words(b: &[u8]) -> Vec<u32> {
    b.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// 1-based line of the first line of `src` containing `marker`.
pub fn line_of(src: &str, marker: &str) -> usize {
    src.lines().position(|l| l.contains(marker)).expect("marker") + 1
}

/// The project's committed PTX module.
pub const PTX: &str = include_str!("../../../kernels-gpu/ptx/memattn_kernels.ptx");

/// The committed module, loaded once per test process ([`Module::shared`]), every entry decoded.
pub fn module() -> Arc<Module> {
    let m = Module::shared(PTX).unwrap_or_else(|e| panic!("{e}"));
    m.check_all().unwrap_or_else(|e| panic!("{e}"));
    m
}

/// Small deterministic RNG (xorshift64*), so test inputs need no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
