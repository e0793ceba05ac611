//! Calling code that may panic (a driver library that is missing or incomplete, a parser given
//! garbage) without printing a panic message. A leaf module.

/// Runs `f`, turning a panic into an error message without printing the panic.
pub fn quietly<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = HOOK_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(previous);
    r.map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic without message".into())
    })
}
