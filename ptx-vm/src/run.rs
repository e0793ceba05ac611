//! Launch any entry point of a PTX module by name, with named buffers and typed scalar
//! arguments, without packing parameter bytes by hand.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use memattn_ptx_vm::run::{Arg, Launcher};
//! # let ptx = r#"
//! # .version 7.0
//! # .target sm_80
//! # .address_size 64
//! # .visible .entry twice(.param .u32 n, .param .u64 .ptr .align 1 x, .param .u64 .ptr .align 1 y)
//! # {
//! #   .reg .pred %p<2>; .reg .b32 %r<4>; .reg .f32 %f<3>; .reg .b64 %rd<6>;
//! #   ld.param.b32 %r1, [n]; ld.param.b64 %rd1, [x]; ld.param.b64 %rd2, [y];
//! #   mov.u32 %r2, %tid.x; setp.ge.u32 %p1, %r2, %r1; @%p1 bra END;
//! #   mul.wide.u32 %rd3, %r2, 4; add.s64 %rd4, %rd1, %rd3; add.s64 %rd5, %rd2, %rd3;
//! #   ld.global.f32 %f1, [%rd4]; add.f32 %f2, %f1, %f1; st.global.f32 [%rd5], %f2;
//! # END:
//! #   ret;
//! # }"#;
//! let module = memattn_ptx_vm::Module::load(ptx)?;
//! let mut l = Launcher::new(&module);
//! l.input_f32("x", &[1.0, 2.0, 3.0])?;
//! l.output_f32("y", 3)?; // filled with OUTPUT_POISON: unwritten elements are visible
//! l.launch("twice", [1, 1, 1], [32, 1, 1], 0, &[Arg::U32(3), Arg::buf("x"), Arg::buf("y")])?;
//! assert_eq!(l.read_f32("y")?, vec![2.0, 4.0, 6.0]);
//! # Ok(()) }
//! ```
//!
//! Arguments are matched to the entry's `.param` declarations in order and by size (4-byte
//! scalars, 8-byte pointers and `u64`, raw bytes for structs); a mismatch is an
//! [`VmError::InvalidLaunch`] naming the parameter. Buffers are labelled with their names, so a
//! memcheck finding says which buffer an access belongs to ([`crate::Finding::buffer`]).

use crate::{DevPtr, LaunchConfig, LaunchStats, Module, Vm, VmError};

/// The f32 bit pattern [`Launcher::output_f32`] fills outputs with: a quiet NaN with a
/// recognisable payload, so an element the kernel never wrote is told apart from a computed NaN.
pub const OUTPUT_POISON: u32 = 0x7FF0_0BAD;

/// One kernel argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    U32(u32),
    I32(i32),
    F32(f32),
    U64(u64),
    /// The device address of the named buffer.
    Buf(String),
    /// Raw bytes (a `#[repr(C)]` struct passed by value).
    Bytes(Vec<u8>),
}

impl Arg {
    pub fn buf(name: &str) -> Arg {
        Arg::Buf(name.to_string())
    }
    fn describe(&self) -> String {
        match self {
            Arg::U32(v) => format!("u32 {v} (4 bytes)"),
            Arg::I32(v) => format!("i32 {v} (4 bytes)"),
            Arg::F32(v) => format!("f32 {v} (4 bytes)"),
            Arg::U64(v) => format!("u64 {v} (8 bytes)"),
            Arg::Buf(n) => format!("buffer `{n}` (an 8-byte pointer)"),
            Arg::Bytes(b) => format!("{} raw bytes", b.len()),
        }
    }
}

/// A named device buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub name: String,
    pub ptr: DevPtr,
    pub bytes: u64,
}

/// A VM, one module, and named buffers.
pub struct Launcher<'m> {
    vm: Vm,
    module: &'m Module,
    buffers: Vec<Buffer>,
}

impl<'m> Launcher<'m> {
    /// A fresh VM (one worker per core, all checks on) for `module`.
    pub fn new(module: &'m Module) -> Self {
        Launcher::with_vm(Vm::new(), module)
    }
    pub fn with_vm(vm: Vm, module: &'m Module) -> Self {
        Launcher { vm, module, buffers: Vec::new() }
    }
    /// The VM, e.g. to change its limits or checks.
    pub fn vm(&mut self) -> &mut Vm {
        &mut self.vm
    }
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }
    pub fn buffer(&self, name: &str) -> Result<&Buffer, VmError> {
        self.buffers.iter().find(|b| b.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.buffers.iter().map(|b| b.name.as_str()).collect();
            VmError::InvalidPointer(format!("no buffer named `{name}` (buffers: {known:?})"))
        })
    }
    /// Allocates a named buffer holding `data`.
    pub fn input_bytes(&mut self, name: &str, data: &[u8]) -> Result<DevPtr, VmError> {
        if self.buffers.iter().any(|b| b.name == name) {
            return Err(VmError::InvalidPointer(format!("a buffer named `{name}` exists already")));
        }
        let ptr = self.vm.alloc(data.len() as u64)?;
        self.vm.write(ptr, data)?;
        self.vm.set_label(ptr, name);
        self.buffers.push(Buffer { name: name.to_string(), ptr, bytes: data.len() as u64 });
        Ok(ptr)
    }
    pub fn input_f32(&mut self, name: &str, data: &[f32]) -> Result<DevPtr, VmError> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.input_bytes(name, &bytes)
    }
    /// Allocates a named f32 output of `len` elements filled with [`OUTPUT_POISON`].
    pub fn output_f32(&mut self, name: &str, len: usize) -> Result<DevPtr, VmError> {
        let bytes: Vec<u8> = (0..len).flat_map(|_| OUTPUT_POISON.to_le_bytes()).collect();
        self.input_bytes(name, &bytes)
    }
    pub fn read_bytes(&self, name: &str) -> Result<Vec<u8>, VmError> {
        let b = self.buffer(name)?;
        let mut out = vec![0u8; b.bytes as usize];
        self.vm.read(b.ptr, &mut out)?;
        Ok(out)
    }
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, VmError> {
        let raw = self.read_bytes(name)?;
        Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    /// Packs `args` for `kernel` (checked against its `.param` declarations).
    pub fn pack(&self, kernel: &str, args: &[Arg]) -> Result<Vec<u8>, VmError> {
        let info = self.module.kernel_info(kernel)?;
        if info.params.len() != args.len() {
            let decl: Vec<String> = info.params.iter().map(|p| format!("{} {}", p.name, p.ty)).collect();
            return Err(VmError::InvalidLaunch(format!(
                "kernel `{kernel}` takes {} parameters ({}), {} arguments given",
                info.params.len(),
                decl.join(", "),
                args.len()
            )));
        }
        let mut packed = vec![0u8; info.param_bytes];
        for (i, (p, a)) in info.params.iter().zip(args).enumerate() {
            let bytes: Vec<u8> = match a {
                Arg::U32(v) => v.to_le_bytes().to_vec(),
                Arg::I32(v) => v.to_le_bytes().to_vec(),
                Arg::F32(v) => v.to_le_bytes().to_vec(),
                Arg::U64(v) => v.to_le_bytes().to_vec(),
                Arg::Buf(n) => self.buffer(n)?.ptr.to_le_bytes().to_vec(),
                Arg::Bytes(b) => b.clone(),
            };
            if bytes.len() != p.size {
                return Err(VmError::InvalidLaunch(format!(
                    "parameter {i} of `{kernel}`, `{}`, is `{}` ({} bytes) but the argument is {}",
                    p.name,
                    p.ty,
                    p.size,
                    a.describe()
                )));
            }
            packed[p.offset..p.offset + p.size].copy_from_slice(&bytes);
        }
        Ok(packed)
    }
    /// Launches `kernel` with grid, block and dynamic shared bytes.
    pub fn launch(
        &mut self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        dynamic_shared_bytes: u32,
        args: &[Arg],
    ) -> Result<LaunchStats, VmError> {
        self.launch_with(kernel, &LaunchConfig::new(grid, block, dynamic_shared_bytes), args)
    }
    /// As [`Launcher::launch`], with a full configuration (e.g. a [`crate::TraceRequest`]; the
    /// trace is kept also when the launch stops at a finding: [`Vm::take_trace`]).
    pub fn launch_with(&mut self, kernel: &str, config: &LaunchConfig, args: &[Arg]) -> Result<LaunchStats, VmError> {
        let packed = self.pack(kernel, args)?;
        self.vm.launch(self.module, kernel, config, &packed)
    }
}
