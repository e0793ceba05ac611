//! `memattn`: run, verify and measure memattn's attention kernels (see `memattn --help`).

mod cli;

use clap::Parser;
use memattn_cli::error::exit;

fn main() {
    // A closed stdout (`memattn ... | head -1`) ends the process the conventional Unix way, by
    // SIGPIPE, quietly, as `cat` or `grep` do: the shell sees status 141, never 0. Rust ignores
    // SIGPIPE by default, which would turn every later print into an error.
    // SAFETY: restoring the default disposition of one signal before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Under a file-size limit (`ulimit -f`) SIGXFSZ would kill the process half-way through a
    // write, with no message and the temporary file left behind. Ignored, the write fails with
    // EFBIG and is reported as a resource error naming the file and the limit (exit 3).
    // SAFETY: setting the disposition of one signal before any thread is started.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // SIGINT, SIGTERM and SIGHUP remove a temporary file being written before the process ends.
    memattn_cli::files::install_signal_cleanup();
    let parsed = cli::args::Cli::try_parse();
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            // --help and --version exit 0; usage errors exit 2 (clap's convention and ours).
            let _ = e.print();
            let code = if e.use_stderr() { exit::BAD_INPUT } else { exit::SUCCESS };
            if e.use_stderr() {
                // A command line clap refuses is evidence too, when it asked for --save.
                cli::evidence::record_refused_command_line(&e.render().to_string());
            }
            // With --json a usage error is also one JSON object on stdout, like every other error.
            if code != exit::SUCCESS && json_requested() {
                let message = e.kind().as_str().map(str::to_string).unwrap_or_else(|| {
                    e.to_string().lines().next().unwrap_or("usage error").trim_start_matches("error: ").to_string()
                });
                let detail = e.to_string().lines().next().unwrap_or("").trim_start_matches("error: ").to_string();
                println!("{}", serde_json::json!({ "error": detail, "kind": message, "exit_code": code }));
            }
            std::process::exit(code);
        }
    };
    let json = cli.json;
    // A panic is reported once, below, as an internal error with exit code 3.
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cli::dispatch(&cli)));
    let code = match outcome {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            let err = anyhow::Error::new(e);
            let code = err.downcast_ref::<memattn_cli::Error>().map(|e| e.exit_code()).unwrap_or(exit::DEVICE);
            report_error(json, &format!("{err}"), code);
            code
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            report_error(json, &format!("internal error: {msg}"), exit::DEVICE);
            exit::DEVICE
        }
    };
    std::process::exit(code);
}

fn report_error(json: bool, message: &str, code: i32) {
    eprintln!("error: {message}");
    if json {
        println!("{}", serde_json::json!({ "error": message, "exit_code": code }));
    }
}

/// Whether `--json` is among the arguments (before a `--`), for errors found before parsing ends.
fn json_requested() -> bool {
    std::env::args_os().skip(1).take_while(|a| a != "--").any(|a| a == "--json")
}
