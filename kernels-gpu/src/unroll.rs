//! `unroll!`: compile-time loop unrolling shared by the kernels.
//!
//! LLVM does not fully unroll loops over per-thread arrays, and an array indexed by a loop
//! variable then lives in local memory (a stack frame, 100x slower than a register). `unroll!`
//! spells the loop out with the index a literal, so every fragment and score stays a register.

/// Repeats a block for `$i = 0..$n` (`$n <= 16`, a constant after monomorphisation) with `$i` a
/// literal `usize`; iterations `>= $n` are removed at compile time.
#[allow(unused_macros)]
macro_rules! unroll {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 16, "unroll! spells out 16 indices") };
        unroll!(@ $i ($n) $body 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@ $i:ident ($n:expr) $body:block $($k:literal)*) => {
        $(if $k < $n {
            let $i: usize = $k;
            $body
        })*
    };
}

/// `unroll!` for short loops (`$n <= 4`): spells out 4 indices instead of 16, so nesting it
/// inside `unroll!` does not multiply the code the compiler has to fold away.
#[allow(unused_macros)]
macro_rules! unroll4 {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 4, "unroll4! spells out 4 indices") };
        unroll!(@ $i ($n) $body 0 1 2 3)
    };
}
