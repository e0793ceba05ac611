//! SHA-256 of the loaded PTX, compared with `build-info.json` to tell which build it is.

use sha2::{Digest, Sha256};

/// Lower-case hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_ptx_hash_matches_build_info() {
        // xtask writes build-info.json with the hash of the PTX it built; the host must agree.
        let info = include_str!("../../kernels-gpu/ptx/build-info.json");
        let ptx = include_str!("../../kernels-gpu/ptx/memattn_kernels.ptx");
        assert!(info.contains(&format!("\"ptx_sha256\": \"{}\"", sha256_hex(ptx.as_bytes()))));
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
