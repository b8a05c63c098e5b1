//! `tine bench` with tiny counts: every scenario runs and reports numbers
//! (a check that it works, not of how fast: no timing is asserted).
//!
//! Needs what the server's end-to-end tests need (root, the guest
//! artifacts, the E2B Python SDK venv of `tests/e2e/setup.sh`);
//! `scripts/test.sh` prepares them and runs this as its `bench` step
//! (`cargo test --workspace --test bench_smoke -- --ignored`). Its data dir is
//! `$TINE_DATA_DIR/bench-smoke` (kept, so its template snapshot is built
//! once), with `current` linked to the real artifacts.

use std::path::PathBuf;
use std::process::Command;

#[test]
#[ignore = "minutes long: scripts/test.sh runs it as its own step (`test.sh bench`)"]
fn every_scenario_runs_with_tiny_counts() {
    let real =
        PathBuf::from(std::env::var("TINE_DATA_DIR").unwrap_or_else(|_| "/var/lib/tine".into()));
    assert!(
        real.join("current/vmlinuz").exists(),
        "no guest artifacts in {}: run scripts/setup-host.sh",
        real.display()
    );
    let python = real.join("venv/bin/python");
    assert!(
        python.exists(),
        "no E2B SDK venv at {}: run tests/e2e/setup.sh",
        python.display()
    );
    let base = real.join("bench-smoke");
    std::fs::create_dir_all(&base).unwrap();
    let link = base.join("current");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(real.join("current"), &link).unwrap();
    let json = base.join("smoke.json");
    let _ = std::fs::remove_file(&json);

    let out = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args([
            "bench",
            // P12's and P15's fixed counts at their smallest too.
            "--smoke",
            "--iterations",
            "1",
            "--concurrency",
            "2",
            "--sequential",
            "1",
            "--fork-count",
            "2",
            "--episodes",
            "1",
            "--branches",
            "2",
        ])
        .args([
            "--write-mib",
            "8",
            "--snapshot-memory-mb",
            "256",
            "--idle-count",
            "2",
            "--volume-mib",
            "4",
            "--volume-files",
            "20",
            // P15's density fills a capacity of 4, not the host's
            // default (hundreds of creates): the same refusal at capacity.
            "--density-capacity",
            "4",
            "--json",
        ])
        .arg(&json)
        .env("TINE_DATA_DIR", &base)
        .env("TINE_SHM_DIR", "/dev/shm/tine-bench-smoke")
        .env("TINE_BENCH_PYTHON", &python)
        .env_remove("TINE_BENCH_API_KEY")
        .output()
        .expect("running tine bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "tine bench failed ({}):\n{stdout}\n{stderr}",
        out.status
    );

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().expect("rows");
    for id in [
        "P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9", "P10", "P11", "P12", "P13", "P14",
    ] {
        let mine: Vec<_> = rows.iter().filter(|r| r["scenario"] == id).collect();
        assert!(!mine.is_empty(), "no row for {id}:\n{stdout}");
        for r in &mine {
            assert!(r["error"].is_null(), "{id} {}: {}", r["what"], r["error"]);
            assert!(
                r["summary"]["p50"].as_f64().is_some_and(|v| v > 0.0),
                "{id} {} has no numbers",
                r["what"]
            );
        }
        assert!(
            mine.iter().any(|r| r["floor"]["p50"].as_f64().is_some()),
            "{id} measured no floor"
        );
        assert!(
            stdout.contains(&format!("| {id} |")),
            "{id} is not in the table"
        );
    }

    // Nothing left behind: no QEMU of the run, no namespace of a hand VM.
    let ps = Command::new("pgrep")
        .args(["-f", &format!("qemu-system.*{}", base.display())])
        .output()
        .unwrap();
    assert!(
        ps.stdout.is_empty(),
        "QEMU processes left: {}",
        String::from_utf8_lossy(&ps.stdout)
    );
    let left: Vec<String> = tine_vmm::netns::list_ours()
        .into_iter()
        .filter(|n| n.starts_with("tine-bench-"))
        .collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");
}
