//! The `memattn` command's error type and the exit codes it maps to.

use crate::device::DeviceError;
use crate::files::FileError;
use crate::problem::ProblemError;
use crate::safetensors_io::InputError;

/// Exit codes of the `memattn` binary.
pub mod exit {
    pub const SUCCESS: i32 = 0;
    /// A result did not match the reference.
    pub const VERIFICATION_FAILED: i32 = 1;
    /// Bad usage or bad input: options, files, shapes, dtypes.
    pub const BAD_INPUT: i32 = 2;
    /// Device, kernel or host-resource error: CUDA error, VM memcheck finding, PTX that does not
    /// load, memory that cannot be had, a write cut short by the file-size limit or a full disk.
    pub const DEVICE: i32 = 3;
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid problem: {p}{h}", p = .0, h = problem_hint(.0))]
    Problem(#[from] ProblemError),
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("{0}")]
    Usage(String),
    #[error("{d}{h}", d = .0, h = device_hint(.0))]
    Device(#[from] DeviceError),
    /// Files: unreadable or unwritable paths are bad input (2); host memory that cannot be
    /// allocated for a problem-sized buffer, and a write cut short by the file-size limit, a full
    /// disk or a quota, are resource errors (3).
    #[error(transparent)]
    File(#[from] FileError),
    /// A call whose buffers need more device memory than is free, refused before anything is
    /// allocated (as the forward's [`ProblemError::OutOfDeviceMemory`]): bad input for this
    /// device (2), and a case `check` reports as not run.
    #[error("the {what} needs {needed} bytes ({}) of device memory, {free} bytes ({}) are free", crate::units::human_bytes(*.needed), crate::units::human_bytes(*.free))]
    DeviceMemory { what: &'static str, needed: u64, free: u64 },
}

/// The command's words for a library error that names a setting: the library speaks of its own API
/// (the BSHD layout, the simulated memory size), the command of the flag that sets it.
fn problem_hint(e: &ProblemError) -> &'static str {
    match e {
        ProblemError::VarlenLayout => " (use --layout bshd with --seqlens-q/--seqlens-kv)",
        _ => "",
    }
}

/// As [`problem_hint`], for device errors.
fn device_hint(e: &DeviceError) -> &'static str {
    match e {
        DeviceError::UnknownKernel(_) => " (`memattn kernels` lists what it has; --ptx FILE loads another module)",
        DeviceError::HostMemory { what, .. } if what.starts_with("a simulated device allocation") => {
            " (--vm-memory-mib sets the simulated memory)"
        }
        _ => "",
    }
}

impl Error {
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Input(InputError::File(FileError::HostMemory { .. } | FileError::Resource { .. })) => exit::DEVICE,
            Error::File(FileError::HostMemory { .. } | FileError::Resource { .. }) => exit::DEVICE,
            Error::Problem(_) | Error::Input(_) | Error::Usage(_) | Error::File(_) | Error::DeviceMemory { .. } => {
                exit::BAD_INPUT
            }
            // A setting the user wrote wrong (MEMATTN_HOPPER=yes): bad input, not the device.
            Error::Device(DeviceError::Setting(_)) => exit::BAD_INPUT,
            Error::Device(_) => exit::DEVICE,
        }
    }
}

impl Error {
    /// Whether the error says a resource ran out (device or host memory, the file-size limit, the
    /// disk) rather than that the input or the result was wrong: what ran into it could not run.
    pub fn is_resource(&self) -> bool {
        matches!(
            self,
            Error::Problem(ProblemError::OutOfDeviceMemory { .. })
                | Error::DeviceMemory { .. }
                | Error::Device(DeviceError::OutOfMemory { .. })
                | Error::File(FileError::HostMemory { .. } | FileError::Resource { .. })
                | Error::Input(InputError::File(FileError::HostMemory { .. } | FileError::Resource { .. }))
        )
    }
}

impl From<memattn::error::Error> for Error {
    fn from(e: memattn::error::Error) -> Self {
        match e {
            memattn::error::Error::Problem(p) => Error::Problem(p),
            memattn::error::Error::Device(d) => Error::Device(d),
            other => Error::Usage(other.to_string()), // Usage and KvCache rules: bad input
        }
    }
}

impl From<memattn::attn::AttnError> for Error {
    fn from(e: memattn::attn::AttnError) -> Self {
        match e {
            memattn::attn::AttnError::Problem(p) => Error::Problem(p),
            memattn::attn::AttnError::Device(d) => Error::Device(d),
            other => Error::Usage(other.to_string()),
        }
    }
}

impl From<memattn::decode::KvCacheRule> for Error {
    fn from(e: memattn::decode::KvCacheRule) -> Self {
        Error::Usage(e.to_string())
    }
}
