//! Every driver function cudarc 0.19 may resolve (feature `cuda-12080`, as memattn builds it) is
//! exported by the library, so resolving one never panics.

use std::path::PathBuf;

/// cudarc's generated bindings in the cargo registry, at the version `Cargo.lock` pins.
fn cudarc_bindings() -> String {
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock")).unwrap();
    let at = lock.find("name = \"cudarc\"").expect("cudarc in Cargo.lock");
    let version = lock[at..].lines().nth(1).unwrap().trim_start_matches("version = ").trim_matches('"').to_string();
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    for index in std::fs::read_dir(home.join("registry/src")).unwrap() {
        let p = index.unwrap().path().join(format!("cudarc-{version}/src/driver/sys/mod.rs"));
        if p.exists() {
            return std::fs::read_to_string(p).unwrap();
        }
    }
    panic!("cudarc {version} sources not found under {}/registry/src", home.display());
}

/// The `cu*` functions of the bindings available with `cuda-12080`.
fn cudarc_functions() -> Vec<String> {
    let src = cudarc_bindings();
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.strip_prefix("pub unsafe fn cu") else { continue };
        let name = format!("cu{}", rest.split('(').next().unwrap());
        if name == "culib" {
            continue;
        }
        let cfg = lines[i - 1];
        if !cfg.starts_with("#[cfg") || cfg.contains("\"cuda-12080\"") {
            out.push(name);
        }
    }
    out
}

#[test]
fn every_function_cudarc_resolves_is_exported() {
    let names = cudarc_functions();
    assert!(names.len() > 400, "parsed only {} functions", names.len());
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libvm_cuda.so");
    let lib = unsafe { libloading::Library::new(&lib) }.unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    let missing: Vec<&String> =
        names.iter().filter(|n| unsafe { lib.get::<*const ()>(n.as_bytes()) }.is_err()).collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");
    // Each is either implemented or a NOT_SUPPORTED stub, never both.
    let (implemented, stubbed) = (vm_cuda::implemented_functions(), vm_cuda::stubbed_functions());
    for n in &names {
        let (i, s) = (implemented.contains(&n.as_str()), stubbed.contains(&n.as_str()));
        assert!(i != s, "{n}: implemented {i}, stubbed {s}");
    }
    assert_eq!(implemented.len() + stubbed.len(), names.len());
    println!(
        "{} functions: {} implemented, {} return CUDA_ERROR_NOT_SUPPORTED",
        names.len(),
        implemented.len(),
        stubbed.len()
    );
}
