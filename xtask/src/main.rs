//! `cargo xtask <task>`: the kernel build pipeline.
//!
//! - `build-ptx [--check]`: compile `kernels-gpu` for nvptx64 with the pinned nightly and write the
//!   committed PTX (`--check`: rebuild and fail if the committed file is stale).
//! - `ptxas [--check]`: assemble the committed PTX with ptxas for sm_80 and sm_90 and write the
//!   committed resource report (`--check`: fail if stale, on any spill, or on any ptxas error).
//! - `lesson N [--solution]`, `lesson check`: build a lesson's kernel, run and check it in the VM;
//!   `lesson new NAME`, `lesson build NAME`: a scratch kernel of your own; `lesson check-scratch
//!   NAME [--reference FILE]`: it checked against a reference (a Rust function or safetensors).
//! - `book --check`: every page of the book (`docs/`) is a chapter of `docs/SUMMARY.md` and every
//!   link and anchor resolves.

mod book;
mod build_ptx;
mod lesson;
mod paths;
mod ptxas;
mod scratch;
mod scratch_check;
mod toolchain;

use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <task> [--check]   (tasks: build-ptx, ptxas, book)
       cargo xtask lesson N [--solution] | list | check | new NAME | build NAME
                          | check-scratch NAME [--reference FILE] [--tol T]

tasks:
  build-ptx   compile kernels-gpu to PTX with the pinned nightly toolchain and write
              kernels-gpu/ptx/memattn_kernels.ptx and build-info.json
  ptxas       assemble the committed PTX for sm_80 and sm_90 with ptxas -v and write
              kernels-gpu/ptx/ptxas-report.json (ptxas from $CUDA_HOME, $PATH, or the
              pinned PyPI wheel nvidia-cuda-nvcc, cached under target/)
  book        check the book (docs/, an mdBook: `mdbook build docs/book`): every page is
              a chapter of docs/SUMMARY.md, every link and anchor resolves
  lesson      build lessons/NN-*/kernel.rs to PTX, run it in the VM and say what is wrong
              (`cargo xtask lesson list`; see docs/guide/en/05-your-own-kernel.md)

options:
  --sm90      build-ptx / ptxas: only the sm_90a module (memattn_kernels_sm90.ptx)
  --timeline  build-ptx: only the timeline module (memattn_kernels_timeline.ptx: the d128
              sm_80 forwards with a clock stamp per warp at every phase, for run --timeline)
  --check     regenerate into a temporary location and fail if the committed files differ
              (ptxas --check also fails on any spill or ptxas error)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("lesson") {
        return ExitCode::from(lesson::main(&args[1..]) as u8);
    }
    let check = args.iter().any(|a| a == "--check");
    // `--sm90`: build or assemble only the sm_90a module (while working on the Hopper kernels).
    let only_sm90 = args.iter().any(|a| a == "--sm90");
    // `--timeline`: build-ptx builds the timeline module (memattn_kernels_timeline.ptx) instead.
    let timeline = args.iter().any(|a| a == "--timeline");
    let unknown: Vec<&String> =
        args.iter().skip(1).filter(|a| *a != "--check" && *a != "--sm90" && *a != "--timeline").collect();
    if !unknown.is_empty() {
        eprintln!("error: unknown option(s) {unknown:?}\n\n{USAGE}");
        return ExitCode::from(2);
    }
    let result = match args.first().map(String::as_str) {
        Some("build-ptx") if timeline => build_ptx::run_timeline(check),
        Some("build-ptx") => build_ptx::run(check, only_sm90),
        Some("ptxas") => ptxas::run(check, only_sm90),
        Some("book") => book::run(&paths::root()),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown task `{other}`\n\n{USAGE}")),
        None => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
