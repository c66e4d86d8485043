//! A controlled study killed with SIGKILL after some of its runs finished,
//! then started again with the same flags: the finished runs come back
//! from disk untouched (neither redone nor lost), the rest are made, and
//! the results hold every run. And `--gate-only`, which makes no run.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A study small enough for a test: a few SFT steps, two tiny arms, two
/// seeds, three batches each.
const CONFIG: &str = r#"
[run]
eval_problems = 8
pass_k = 1

[model]
preset = "tiny"
seed = 0

[task]
name = "countdown-trace"
difficulty = 1
seed = 0

[sft]
steps = 20
batch = 8
lr = 3e-3
warmup_steps = 2
check_every = 100
check_problems = 8

[learner]
algo = "bapo"
batch_groups = 2
lr = 1e-4
warmup_steps = 0
decay = "constant"
temperature = 1.0
steps = 3
eval_problems = 8
eval_max_new_tokens = 24

[actor]
group_size = 4

[actor.sampling]
temperature = 1.0
max_new_tokens = 24
"#;

fn start(dir: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["study", "--reuse", "2", "--arms", "a,p2", "--seeds", "0,1"])
        .args([
            "--probe-every",
            "3",
            "--probe-prompts",
            "4",
            "--probe-samples",
            "2",
        ])
        .args(["--gate-groups", "0", "--jobs", "1"])
        .arg("--config")
        .arg(dir.join("config.toml"))
        .arg("--out")
        .arg(dir.join("study"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running bapo study")
}

fn finished_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("study/finished"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.ends_with(".json.gz"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The text of a gzip'd artefact, as a reader's `zcat` gives it.
fn gunzip(path: &Path) -> String {
    use std::io::Read;
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .expect("gzip");
    text
}

#[test]
fn a_killed_study_keeps_its_finished_runs_and_makes_the_rest() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("config.toml"), CONFIG).expect("config");

    let mut first = start(dir.path());
    let deadline = Instant::now() + Duration::from_secs(600);
    while finished_files(dir.path()).is_empty() {
        assert!(
            first.try_wait().expect("waiting").is_none(),
            "the study ended before any run finished"
        );
        assert!(Instant::now() < deadline, "no run finished in 10 minutes");
        std::thread::sleep(Duration::from_millis(100));
    }
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    let kept = finished_files(dir.path());
    assert!(kept.len() < 4, "killed before the end: {kept:?}");
    let before: Vec<Vec<u8>> = kept
        .iter()
        .map(|n| std::fs::read(dir.path().join("study/finished").join(n)).expect("read"))
        .collect();

    let second = start(dir.path()).wait_with_output().expect("rerun");
    let log = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{log}");
    assert_eq!(
        log.matches("(finished before, reused)").count(),
        kept.len(),
        "{log}"
    );
    // The warm start's own row was measured before the first run and is
    // not measured again.
    assert!(
        log.contains("warm-row of warm start 0 kept from an earlier start"),
        "{log}"
    );
    for (name, bytes) in kept.iter().zip(&before) {
        let now = std::fs::read(dir.path().join("study/finished").join(name)).expect("read");
        assert_eq!(&now, bytes, "{name} was made again");
    }
    assert_eq!(finished_files(dir.path()).len(), 4);
    let study: serde_json::Value =
        serde_json::from_str(&gunzip(&dir.path().join("study/study.json.gz"))).expect("json");
    // study.json.gz lists the runs; each is in its own file, once.
    let runs = study["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 4);
    for name in runs {
        let name = name.as_str().expect("a file name");
        let stored: serde_json::Value =
            serde_json::from_str(&gunzip(&dir.path().join("study").join(name))).expect("json");
        let run = &stored["run"];
        let own = format!(
            "finished/{}-w{}-s{}.json.gz",
            run["arm"].as_str().expect("arm"),
            run["warm"],
            run["seed"]
        );
        assert_eq!(name, own, "the listed file holds another run");
        assert!(run["steps"].as_array().is_some_and(|s| !s.is_empty()));
    }
}

#[test]
fn gate_only_measures_gate0_per_mini_batch_and_makes_no_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A target never met: the warm start runs to its cap, checking twice.
    let config = CONFIG.replace(
        "check_every = 100",
        "check_every = 10\ntarget_accuracy = 0.99",
    );
    std::fs::write(dir.path().join("config.toml"), config).expect("config");
    let out = dir.path().join("gate");
    let run = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["study", "--reuse", "2", "--gate-only", "--gate-groups", "6"])
        .args(["--model-seeds", "7"])
        .arg("--config")
        .arg(dir.path().join("config.toml"))
        .arg("--out")
        .arg(&out)
        .output()
        .expect("running bapo study");
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{log}");
    let gate: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("gate0.json")).expect("gate0.json"))
            .expect("json");
    let g = &gate["gate0"][0];
    assert_eq!(g["groups"], 6, "{gate}");
    // 2 groups per batch over min(E, 4) = 2 mini-batches: one group each.
    assert_eq!(g["minibatch_groups"], 1, "{gate}");
    let below = g["minibatch_below_rho0"].as_f64().expect("a fraction");
    assert!((0.0..=1.0).contains(&below), "{gate}");
    assert!(
        gate["command"]
            .as_str()
            .is_some_and(|c| c.contains(" --gate-only"))
    );
    assert!(!out.join("finished").exists() && !out.join("study.json.gz").exists());
    assert!(log.contains("per mini-batch of 1 groups"), "{log}");
    // The log shows how far the warm start got at each check.
    let line = log
        .lines()
        .find(|l| l.contains("greedy training accuracy at each check (target 0.99)"))
        .unwrap_or_else(|| panic!("no SFT checks in the log: {log}"));
    let checks: Vec<&str> = line.rsplit(": ").next().unwrap_or("").split(' ').collect();
    assert_eq!(checks.len(), 2, "{line}");
    assert!(
        checks[0].ends_with("@10") && checks[1].ends_with("@20"),
        "{line}"
    );
    // A screen of model seed 7: the warm start says which seed it is (in
    // the directory a study of several named seeds gives its first), and
    // the setting records it.
    let seed = std::fs::read_to_string(out.join("warm-start-0/model-seed.txt")).expect("seed");
    assert_eq!(seed.trim(), "7");
    assert_eq!(gate["setting"]["model_seeds"], serde_json::json!([7]));
    assert!(
        gate["command"]
            .as_str()
            .is_some_and(|c| c.contains(" --model-seeds 7")),
        "{gate}"
    );
}
