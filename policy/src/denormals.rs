//! Flush-to-zero for subnormal floats, process-wide.
//!
//! Training drives the probabilities of unused tokens towards zero; their
//! softmax outputs and gradients then fall into the subnormal range and flow
//! through the LM head's matmuls. On Intel cores every FMA with a subnormal
//! operand takes a microcode assist (~100 cycles): a tiny-model SFT run fell
//! from 18 to 6 steps/s within 1,000 steps. XLA and PyTorch's CPU backends
//! flush subnormals for the same reason, so this also keeps `bapo bench
//! model` comparing like with like. AMD cores pay little for subnormals,
//! which is why the slowdown can hide on one machine and not another.
//!
//! The mode bits are per thread and inherited by threads created afterwards,
//! so the binary sets them first thing in `main`, before Tokio or Rayon start
//! their workers.

/// Sets flush-to-zero (and, on x86, denormals-are-zero) on the calling
/// thread and every thread it creates from now on. Returns whether the
/// architecture has such a mode (x86_64 and aarch64 do).
pub fn flush_denormals_to_zero() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        /// MXCSR bit 15: results that would be subnormal become zero.
        const FTZ: u32 = 1 << 15;
        /// MXCSR bit 6: subnormal inputs are read as zero.
        const DAZ: u32 = 1 << 6;
        let mut csr: u32 = 0;
        // SAFETY: stmxcsr/ldmxcsr read and write the SSE control register of
        // this thread through a valid pointer to a local; only the two
        // rounding-to-zero bits change, no exception is unmasked. (Rust
        // treats a non-default float environment as outside its model: the
        // compiler may still constant-fold with subnormals, which only makes
        // such folded values more precise than the runtime ones.)
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack));
            csr |= FTZ | DAZ;
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, readonly));
        }
        true
    }
    #[cfg(target_arch = "aarch64")]
    {
        /// FPCR bit 24 (FZ): subnormal inputs and results are zero.
        const FZ: u64 = 1 << 24;
        let mut fpcr: u64;
        // SAFETY: reads and writes this thread's floating-point control
        // register; only the flush-to-zero bit changes.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack));
            fpcr |= FZ;
            std::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nomem, nostack));
        }
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::hint::black_box;

    use super::*;

    /// The smallest normal float halved is subnormal without the mode and
    /// zero with it, on this thread and on a thread started afterwards.
    #[test]
    fn subnormal_results_become_zero_here_and_in_new_threads() {
        // A fresh thread: the test harness's own threads keep their mode.
        std::thread::spawn(|| {
            let half = || black_box(f32::MIN_POSITIVE) * black_box(0.5f32);
            assert!(half() > 0.0, "subnormals are kept by default");
            if !flush_denormals_to_zero() {
                return;
            }
            assert_eq!(half(), 0.0);
            let child = std::thread::spawn(half).join().expect("child thread");
            assert_eq!(child, 0.0, "threads created afterwards inherit the mode");
        })
        .join()
        .expect("test thread");
    }
}
