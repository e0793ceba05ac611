// The library names itself `libcuda.so` (ELF soname): once a program has loaded it by its path,
// the dynamic loader hands it out for `dlopen("libcuda.so")`, the first name cudarc tries.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so");
    }
}
