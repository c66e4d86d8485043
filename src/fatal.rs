//! A GPU backend that fails ends the process, by name, at once.
//!
//! Burn's GPU backends report some failures by panicking: a kernel launch
//! the adapter cannot run, wgpu's handler of an uncaptured device error (a
//! shader that does not compile, a lost device), on whichever thread met
//! it. On the main thread that is an unnamed exit 101; on a runtime or
//! worker thread the thread dies while the rest of the process waits for
//! an answer that never comes: a hang. The hook below turns every panic
//! raised inside a GPU backend into one named line and exit code
//! [`GPU_FAILED`], whatever thread it is on; other panics keep Rust's
//! default behaviour.

use bapo_policy::device::is_gpu_backend_file;

/// The exit code of a process whose GPU backend failed.
pub const GPU_FAILED: i32 = 70;

pub fn exit_on_gpu_backend_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let Some(at) = info.location() else { return };
        if !is_gpu_backend_file(at.file()) {
            return;
        }
        let what = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("(no message)");
        eprintln!(
            "bapo: fatal: the GPU backend failed ({what}) at {}:{}; exiting with code \
             {GPU_FAILED} rather than wait on a device that will not answer",
            at.file(),
            at.line()
        );
        // `_exit`, not `exit`: the graphics driver's exit handlers can
        // wait on locks the failing thread holds (seen with Mesa's GL).
        // SAFETY: ends the process; nothing runs after it.
        unsafe { libc::_exit(GPU_FAILED) }
    }));
}
