//! What the two unit-test runners share (`ptx-vm/tests/unit.rs` and, through `#[path]`,
//! `tests/tests/unit.rs` of memattn-tests): the macro that turns a list of a library's unit
//! tests into `#[test]`s, and the reader that finds the unit tests in the library's sources, so
//! that a test the list lacks fails the runner instead of never running.
//!
//! A library's unit-test modules are `pub mod NAME {` behind a `#[cfg(...)]` that names the
//! feature `unit-tests` (other attributes may follow it), with their tests as `pub fn` at one
//! level of indentation, and re-exported from its `unit_tests` module as the path of the file,
//! `_`-joined, plus `_NAME` unless NAME is `tests` (`verify/grad.rs`'s `tests` is `verify_grad`).

use std::path::{Path, PathBuf};

/// `unit_tests!(crate_name; module: [test, #[ignore = "why"] test, ...], ...)`: a `mod` of
/// `#[test]`s per module calling `crate_name::unit_tests::module::test`, and `LISTED`, every
/// module with its tests.
macro_rules! unit_tests {
    ($krate:ident; $($module:ident: [$($(#[$attr:meta])* $name:ident),* $(,)?]),* $(,)?) => {
        $(mod $module {
            $(#[test] $(#[$attr])* fn $name() { $krate::unit_tests::$module::$name() })*
        })*
        /// Every test named above, by module.
        const LISTED: &[(&str, &[&str])] = &[$((stringify!($module), &[$(stringify!($name)),*])),*];
    };
}

/// The unit tests of the sources under `src`, as (module as re-exported, test), in file order.
pub fn in_sources(src: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for file in walk(src) {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut parts: Vec<String> = file
            .strip_prefix(src)
            .unwrap()
            .with_extension("")
            .iter()
            .map(|p| p.to_string_lossy().to_string())
            .collect();
        if parts.last().is_some_and(|p| p == "lib" || p == "mod") {
            parts.pop();
        }
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if !(line.starts_with("#[cfg(") && line.contains("\"unit-tests\"")) {
                continue;
            }
            while lines.peek().is_some_and(|l| l.starts_with("#[")) {
                lines.next();
            }
            let Some(module) = lines.peek().and_then(|l| l.strip_prefix("pub mod ")).and_then(|l| l.strip_suffix(" {"))
            else {
                continue;
            };
            let mut alias = parts.clone();
            if module != "tests" || alias.is_empty() {
                alias.push(module.to_string());
            }
            let alias = alias.join("_");
            for l in lines.by_ref().skip(1).take_while(|l| *l != "}") {
                if let Some(rest) = l.strip_prefix("    pub fn ") {
                    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    found.push((alias.clone(), name));
                }
            }
        }
    }
    found
}

/// Fails naming every test of the sources under `src` that `listed` lacks, and every listed
/// test the sources do not have; and when fewer than `at_least` are found (a reader that stopped
/// finding them).
pub fn check_listed(src: &Path, listed: &[(&str, &[&str])], at_least: usize) {
    let found = in_sources(src);
    assert!(found.len() >= at_least, "only {} unit tests found in {}", found.len(), src.display());
    let is_listed = |m: &str, n: &str| listed.iter().any(|(lm, names)| *lm == m && names.contains(&n));
    let missing: Vec<_> = found.iter().filter(|(m, n)| !is_listed(m, n)).collect();
    assert!(missing.is_empty(), "unit tests in {} that the runner does not list: {missing:?}", src.display());
    let count: usize = listed.iter().map(|(_, n)| n.len()).sum();
    assert_eq!(count, found.len(), "the runner lists tests that {} does not have", src.display());
}

pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}
