//! `unroll!`: compile-time loop unrolling shared by the kernels.
//!
//! LLVM does not fully unroll loops over per-thread arrays, and an array indexed by a loop
//! variable then lives in local memory (a stack frame, 100x slower than a register). `unroll!`
//! spells the loop out with the index a literal, so every fragment and score stays a register.

/// Repeats a block for `$i = 0..$n` (`$n <= 32`, a constant after monomorphisation) with `$i` a
/// literal `usize`; iterations `>= $n` are removed at compile time. 32 covers the O accumulator of
/// the widest tensor-core head dim (256 / 8 column tiles).
#[allow(unused_macros)]
macro_rules! unroll {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 32, "unroll! spells out 32 indices") };
        unroll!(@ $i ($n) $body 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15
            16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@ $i:ident ($n:expr) $body:block $($k:literal)*) => {
        $(if $k < $n {
            let $i: usize = $k;
            $body
        })*
    };
}
