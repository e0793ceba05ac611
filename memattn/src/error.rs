//! The error of the library's lower layers: the decode plan and the device calls under
//! [`crate::attn`] (whose own calls return [`crate::attn::AttnError`]).

use crate::device::DeviceError;
use crate::problem::ProblemError;

/// Why a plan or a device call was refused or failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Shape, dtype, head dim or launch limits of a problem.
    #[error("invalid problem: {0}")]
    Problem(#[from] ProblemError),
    /// A rule of the call (named in the message) that the inputs break.
    #[error("{0}")]
    Usage(String),
    /// The device or the VM failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A rule of a KV-cache call (see [`crate::decode::KvCacheRule`]).
    #[error(transparent)]
    KvCache(#[from] crate::decode::KvCacheRule),
}
