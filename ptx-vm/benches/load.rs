//! Cost of loading the committed PTX module (5.5 MB, every kernel of the project): parsing it,
//! decoding its entries, and what `Module::shared` costs once the process has it.
//!
//! Run: `cargo bench -p memattn-ptx-vm --bench load` (add `-- <runs>` to change the number of runs).
//! Prints medians (and minima) of: `Module::load` (parse + decode every entry), `Module::load_lazy` (parse
//! only), `check_all` on a lazy module (decode every entry, one worker per core), the first
//! `kernel()` of a small and of a large entry, and a `Module::shared` call that hits the cache
//! (hashing the text).

use std::time::{Duration, Instant};

use memattn_ptx_vm::Module;

use kernels_gpu::artifacts::PTX;

fn median(runs: usize, mut f: impl FnMut() -> Duration) -> String {
    let mut v: Vec<Duration> = (0..runs).map(|_| f()).collect();
    v.sort();
    format!("{:8.1} ms (min {:.1})", v[v.len() / 2].as_secs_f64() * 1e3, v[0].as_secs_f64() * 1e3)
}

fn time<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let t = Instant::now();
    let r = f();
    (t.elapsed(), r)
}

fn main() {
    let runs: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(7);
    let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
    println!("committed PTX: {} bytes, {} entries; medians of {runs}, {cores} cores", PTX.len(), {
        Module::load_lazy(PTX).unwrap().kernel_names().len()
    });
    println!("Module::load (parse + decode all)   {}", median(runs, || time(|| Module::load(PTX).unwrap()).0));
    println!("Module::load_lazy (parse only)      {}", median(runs, || time(|| Module::load_lazy(PTX).unwrap()).0));
    println!(
        "check_all on a lazy module          {}",
        median(runs, || {
            let m = Module::load_lazy(PTX).unwrap();
            time(|| m.check_all().unwrap()).0
        })
    );
    for entry in ["saxpy_f32", "flash_fwd_f32_d64", "flash_fwd_bf16_d128"] {
        println!(
            "first kernel(\"{entry}\"){:w$}{}",
            "",
            median(runs, || {
                let m = Module::load_lazy(PTX).unwrap();
                time(|| m.kernel(entry).expect("entry exists")).0
            }),
            w = 18usize.saturating_sub(entry.len())
        );
    }
    let keep = Module::shared(PTX).unwrap();
    println!("Module::shared, cached (SHA-256)    {}", median(runs, || time(|| Module::shared(PTX).unwrap()).0));
    drop(keep);
}
