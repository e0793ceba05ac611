//! `unroll!`: compile-time loop unrolling shared by the kernels.
//!
//! LLVM does not fully unroll loops over per-thread arrays, and an array indexed by a loop
//! variable then lives in local memory (a stack frame, 100x slower than a register). `unroll!`
//! spells the loop out with the index a literal, so every fragment and score stays a register.

/// Repeats a block for `$i = 0..$n` (`$n <= 16`, a constant after monomorphisation) with `$i` a
/// literal `usize`; iterations `>= $n` are removed at compile time.
///
/// `unroll!(i in 0..n, max 32 => { .. })` spells out 32 indices, for the O accumulator of the
/// widest tensor-core head dim (256 / 8 column tiles). It is kept to the loops that need it:
/// every copy is generated for every instantiation before the unused ones are removed, so nested
/// 32-index loops would multiply the kernel build time (making every loop 32 wide took the build
/// of the 28 kernels of the time from 13 s to 134 s).
#[allow(unused_macros)]
macro_rules! unroll {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 16, "unroll! spells out 16 indices (`, max 32` for up to 32)") };
        unroll!(@ $i ($n) $body 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    ($i:ident in 0..$n:expr, max 32 => $body:block) => {
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

/// `unroll!` for short loops (`$n <= 4`): spells out 4 indices instead of 16, so nesting it
/// inside `unroll!` does not multiply the code the compiler has to fold away.
#[allow(unused_macros)]
macro_rules! unroll4 {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 4, "unroll4! spells out 4 indices") };
        unroll!(@ $i ($n) $body 0 1 2 3)
    };
}

/// `unroll!` for the two-iteration loops (the two rows `g` and `g + 8` of a fragment, the two
/// elements of a pair): nested inside other unrolled loops, 16 spelled-out copies of each would
/// multiply the code the compiler type-checks and then removes (a kernel body's type checking
/// took most of the kernel build before these loops spelled out only what they run).
#[allow(unused_macros)]
macro_rules! unroll2 {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 2, "unroll2! spells out 2 indices") };
        unroll!(@ $i ($n) $body 0 1)
    };
}

/// `unroll!` for loops of at most 8 (`$n <= 8`): the key-tile loops of the tensor-core kernels
/// (`BC / 8 <= 8` column tiles of S), where 16 spelled-out copies inside other unrolled loops
/// only add code for the compiler to remove.
#[allow(unused_macros)]
macro_rules! unroll8 {
    ($i:ident in 0..$n:expr => $body:block) => {
        const { assert!($n <= 8, "unroll8! spells out 8 indices") };
        unroll!(@ $i ($n) $body 0 1 2 3 4 5 6 7)
    };
}
