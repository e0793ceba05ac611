//! Embeds the kernel build metadata written by `cargo xtask build-ptx` / `cargo xtask ptxas` when
//! present. A missing file becomes `None` instead of a build failure.

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let ptx_dir = manifest.join("..").join("kernels-gpu").join("ptx");
    println!("cargo:rerun-if-changed={}", ptx_dir.display());
    let mut out = String::new();
    for (konst, file) in [("BUILD_INFO_JSON", "build-info.json"), ("PTXAS_REPORT_JSON", "ptxas-report.json")] {
        let path = ptx_dir.join(file);
        if path.is_file() {
            println!("cargo:rerun-if-changed={}", path.display());
            out.push_str(&format!(
                "pub const {konst}: Option<&str> = Some(include_str!({:?}));\n",
                path.display().to_string()
            ));
        } else {
            out.push_str(&format!("pub const {konst}: Option<&str> = None;\n"));
        }
    }
    let dest = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("embedded_meta.rs");
    fs::write(dest, out).expect("write embedded_meta.rs");
}
