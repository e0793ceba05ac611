//! `tensor_maps_store`: writes the Hopper forward's three tensor maps, given by value as the
//! kernel's parameter, to the global slot the forward launch that follows reads them from.
//!
//! Why a kernel: TMA reads a tensor map from global, constant or parameter memory, and rustc
//! cannot declare the 64-byte aligned by-value parameter a map needs (see
//! `shared/TOOLCHAIN-FACTS.md`), so the forward takes the maps' global address
//! ([`crate::abi::Sm90Params::tensor_maps`]). Writing them with a launch on the caller's stream,
//! instead of a host copy, keeps a forward call free of allocations, host copies and
//! synchronisation: the two launches are ordered by the stream, and a CUDA graph captures the
//! maps by value with this launch's parameters. The forward's `fence.proxy.tensormap` acquire
//! orders the generic-proxy stores made here before its TMA reads.
//!
//! Launch: one block of one thread ([`crate::tiles::TENSOR_MAPS_STORE`]); 48 stores of 8 bytes.
//!
//! # Safety
//! `dst` must be a 128-byte aligned global address of at least 384 writable bytes that no
//! launch running at the same time reads.

#[cfg(all(target_arch = "nvptx64", memattn_sm90))]
#[no_mangle]
pub unsafe extern "ptx-kernel" fn tensor_maps_store(p: crate::abi::TensorMapsParams) {
    let dst = p.dst as *mut u64;
    // Literal indices (unrolled, 16 words a map): the parameter words are read in place, never
    // copied to a local array.
    unroll!(i in 0..16 => {
        unsafe {
            core::ptr::write_volatile(dst.add(i), p.maps[i]);
            core::ptr::write_volatile(dst.add(16 + i), p.maps[16 + i]);
            core::ptr::write_volatile(dst.add(32 + i), p.maps[32 + i]);
        }
    });
}
