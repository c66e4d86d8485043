//! wgpu on OpenGL: the adapter a machine with Mesa's OpenGL libraries and
//! no Vulkan driver offers (llvmpipe through EGL), as many desktop and CI
//! images do. Its shaders have no f16, so `--precision f16` there must be
//! refused by name at start, not panic in a kernel launch or hang on a
//! shader that does not compile; f32 runs.
//!
//! `WGPU_BACKEND=gl` pins wgpu to OpenGL in the child process, so these
//! run the GL path even where a Vulkan driver is installed. Where there is
//! no GL adapter either they skip, saying why, unless `BAPO_REQUIRE_WGPU`
//! is `1` or `f32`.

use std::{
    path::PathBuf,
    process::{Command, Output},
    time::{Duration, Instant},
};

/// Long enough for a debug build to compile its shaders on two cores;
/// a run past it is a hang, and is killed.
const HANG: Duration = Duration::from_secs(300);

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("policy/tests/fixtures/llama")
}

/// `bapo eval` of the tiny Llama fixture on wgpu over OpenGL, killed if
/// it outlives [`HANG`]; the output and how long it took. The output goes
/// to files, not pipes: a child whose pipe is full would block on it and
/// look hung.
fn eval_on_gl(precision: &str, env: &[(&str, &str)]) -> (Output, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| std::fs::File::create(dir.path().join(name)).unwrap();
    let t0 = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args([
            "eval",
            "--problems",
            "2",
            "--k",
            "1",
            "--max-new-tokens",
            "4",
        ])
        .args(["--device", "wgpu", "--precision", precision, "--checkpoint"])
        .arg(fixture())
        .env("WGPU_BACKEND", "gl")
        .envs(env.iter().copied())
        .stdout(file("out"))
        .stderr(file("err"))
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > HANG {
            child.kill().unwrap();
            child.wait().unwrap();
            let err = std::fs::read_to_string(dir.path().join("err")).unwrap();
            panic!("bapo eval --precision {precision} on GL hung (killed after {HANG:?}):\n{err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    let out = Output {
        status,
        stdout: read("out"),
        stderr: read("err"),
    };
    (out, t0.elapsed())
}

/// Whether the machine has a GL adapter for wgpu; `false` (the test then
/// skips) only where it has none and `BAPO_REQUIRE_WGPU` requires none.
fn has_gl(test: &str, out: &Output) -> bool {
    let err = String::from_utf8_lossy(&out.stderr);
    if !err.contains("no usable adapter") {
        return true;
    }
    assert!(
        !matches!(
            std::env::var("BAPO_REQUIRE_WGPU").as_deref(),
            Ok("1" | "f32")
        ),
        "{test}: BAPO_REQUIRE_WGPU is set but wgpu found no OpenGL adapter:\n{err}"
    );
    eprintln!("{test}: skipped: wgpu found no OpenGL adapter:\n{err}");
    false
}

#[test]
fn f16_on_an_adapter_without_it_is_refused_by_name() {
    let (out, took) = eval_on_gl("f16", &[]);
    if !has_gl("f16 on GL", &out) {
        return;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("refused in {took:?}");
    assert!(!out.status.success(), "f16 on GL was accepted:\n{err}");
    assert!(
        err.contains("precision f16 on wgpu: the adapter") && err.contains("Gl"),
        "not refused by name, with the adapter and its API:\n{err}"
    );
    assert!(
        !err.contains("panicked"),
        "refused by a panic, not a check:\n{err}"
    );
}

#[test]
fn f32_runs_on_gl() {
    let (out, took) = eval_on_gl("f32", &[]);
    if !has_gl("f32 on GL", &out) {
        return;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "f32 on GL failed:\n{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(r["greedy_accuracy"].as_f64().is_some(), "{r}");
    eprintln!("f32 on GL: {r} in {took:?}");
}

#[test]
fn an_unknown_graphics_api_is_refused_by_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["eval", "--device", "wgpu", "--checkpoint"])
        .arg(fixture())
        .env("WGPU_BACKEND", "glide")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "wgpu") {
        assert!(!out.status.success());
        assert!(err.contains("WGPU_BACKEND = \"glide\""), "{err}");
    }
}

/// The failure the check prevents, provoked by skipping the check: f16
/// kernels on an adapter without f16 fail inside the backend. The process
/// ends by name with the GPU-failure exit code, within [`HANG`], never
/// hangs.
#[test]
fn a_gpu_backend_failure_ends_the_process_by_name() {
    let skip = [(bapo_policy::device::SKIP_DTYPE_CHECK, "1")];
    let (out, took) = eval_on_gl("f16", &skip);
    if !has_gl("GPU failure on GL", &out) {
        return;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("ended in {took:?} with {:?}", out.status.code());
    assert_eq!(out.status.code(), Some(70), "{err}");
    assert!(err.contains("bapo: fatal: the GPU backend failed"), "{err}");
}
