//! `memattn`: run, verify and measure memattn's attention kernels (see `memattn --help`).

mod cli;

use clap::Parser;
use memattn::error::exit;

fn main() {
    let parsed = cli::args::Cli::try_parse();
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            // --help and --version exit 0; usage errors exit 2 (clap's convention and ours).
            let _ = e.print();
            if e.use_stderr() {
                // A command line clap refuses is evidence too, when it asked for --save.
                cli::evidence::record_refused_command_line(&e.render().to_string());
            }
            std::process::exit(if e.use_stderr() { exit::BAD_INPUT } else { exit::SUCCESS });
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
            let code = err.downcast_ref::<memattn::Error>().map(|e| e.exit_code()).unwrap_or(exit::DEVICE);
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
