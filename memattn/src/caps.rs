//! What a device can do: the limits a problem is validated against. A leaf module, so the
//! problem and the memory plan can be checked against a device without depending on the device
//! backends.

/// Limits a problem is validated against before anything is allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DeviceCaps {
    /// Largest dynamic shared memory one block may use (with opt-in where the device has it).
    pub max_dynamic_smem_bytes: u32,
    /// Most threads one block may have.
    pub max_threads_per_block: u32,
    /// Most blocks of a grid on each axis, `[x, y, z]`.
    pub max_grid: [u32; 3],
    /// Device memory in all, in bytes.
    pub total_memory_bytes: u64,
    /// Free device memory now.
    pub free_memory_bytes: u64,
}
