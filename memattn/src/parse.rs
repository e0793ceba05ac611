//! Errors of parsing option values (kernel, layout, dtype, backend names). A leaf module.

/// An option value that is not one of the names it may take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{got}` (expected one of: {expected})")]
pub struct ParseEnumError {
    /// What was parsed (e.g. `backend`).
    pub what: &'static str,
    /// The string given.
    pub got: String,
    /// The accepted names, comma-separated.
    pub expected: &'static str,
}
