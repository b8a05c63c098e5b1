//! The manager's lifecycle, fork fan-out, garbage collection of capture
//! chains and recovery, against the in-memory fake driver (`fake.rs`) and a
//! real SQLite file. The real-QEMU paths are tested in `crates/vmm/tests`
//! and end to end with the SDKs.

mod fake;

use std::sync::Arc;

use fake::FakeDriver;
use tine_vmm::Artifacts;

use super::{CreateRequest, Manager, SandboxError};
use crate::config::Config;
use crate::db::Db;
use crate::model::SandboxState;
use crate::templates::Templates;

struct Setup {
    manager: Manager,
    driver: FakeDriver,
    db: Arc<Db>,
    _dir: tempfile::TempDir,
}

fn config() -> Config {
    Config {
        pool_size: 0,
        resume_ahead: 0,
        default_cpu_count: 1,
        default_memory_mb: 256,
        ..Config::default()
    }
}

fn network() -> Arc<crate::network::Network> {
    Arc::new(crate::network::Network::new(&Default::default()).unwrap())
}

fn manager_over(driver: &FakeDriver, db: &Arc<Db>) -> Manager {
    manager_with(driver, db, config())
}

fn manager_with(driver: &FakeDriver, db: &Arc<Db>, config: Config) -> Manager {
    let artifacts = Artifacts {
        kernel: "/fake/kernel".into(),
        initramfs: "/fake/initramfs".into(),
        rootfs: "/fake/rootfs".into(),
    };
    let driver: Arc<dyn tine_vmm::Driver> = Arc::new(driver.clone());
    let templates = Templates::new(driver.clone(), artifacts, db.clone())
        .with_max_base_shapes(config.max_base_shapes);
    let volumes = Arc::new(crate::volumes::Volumes::with_limit(
        db.clone(),
        std::path::Path::new("/nonexistent/tine-test"),
        1 << 20,
    ));
    let exports = Arc::new(crate::volumes::Exports::new(volumes));
    Manager::new(
        config,
        db.clone(),
        driver,
        templates.into(),
        network(),
        exports,
    )
}

async fn setup() -> Setup {
    setup_with(config()).await
}

/// A manager with `config` over the fake driver and a fresh database.
async fn setup_with(config: Config) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(Db::open(&dir.path().join("tine.db")).unwrap());
    let driver = FakeDriver::start().await;
    Setup {
        manager: manager_with(&driver, &db, config),
        driver,
        db,
        _dir: dir,
    }
}

/// Until the warm pool holds a VM (10 s at most).
async fn wait_for_the_pool(manager: &Manager) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while manager.pool.ids().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool never filled"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

fn base() -> CreateRequest {
    CreateRequest {
        template_id: "base".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn create_builds_the_template_once_and_hands_each_guest_its_identity() {
    let s = setup().await;
    let a = s.manager.create(base()).await.unwrap();
    let b = s.manager.create(base()).await.unwrap();
    assert_eq!(
        s.driver.calls("boot").len(),
        1,
        "one cold boot for the template"
    );
    assert_eq!(s.driver.calls("capture_and_kill").len(), 1);
    assert_eq!(s.driver.calls("restore ").len(), 2);
    let inits = s.driver.inits();
    assert_eq!(inits.len(), 2);
    for (rec, init) in [(&a, &inits[0]), (&b, &inits[1])] {
        assert_eq!(init.body["hostname"], rec.id.as_str());
        assert_eq!(init.body["accessToken"], rec.envd_access_token.as_str());
        assert_eq!(init.body["envVars"]["E2B_SANDBOX_ID"], rec.id.as_str());
        assert_eq!(init.token, None, "a template's guest has no token yet");
    }
    assert_ne!(inits[0].body["entropy"], inits[1].body["entropy"]);
    assert_eq!(s.manager.live_count(), 2);
    assert_eq!(a.state, SandboxState::Running);
}

#[tokio::test]
async fn a_failed_restore_keeps_its_kind_and_leaves_a_failed_row() {
    let s = setup().await;
    s.manager.create(base()).await.unwrap(); // builds the template
    s.driver.fail("restore", 1);
    let err = s.manager.create(base()).await.unwrap_err();
    let SandboxError::Vm { ref id, source, .. } = err else {
        panic!("expected a driver error, got {err}");
    };
    assert!(source.to_string().contains("failed on demand"), "{source}");
    let row = s.db.get_sandbox(id).unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Failed);
    assert_eq!(s.manager.live_count(), 1);
    // Bad input never reaches the driver.
    let calls = s.driver.calls("").len();
    let bad = CreateRequest {
        timeout_secs: Some(-5),
        ..base()
    };
    assert!(matches!(
        s.manager.create(bad).await,
        Err(SandboxError::InvalidArgument(_))
    ));
    assert_eq!(s.driver.calls("").len(), calls);
}

#[tokio::test]
async fn a_pause_that_fails_before_the_vm_exits_keeps_the_sandbox() {
    let s = setup().await;
    let sb = s.manager.create(base()).await.unwrap();
    let from = s.db.sandbox_snapshot(&sb.id).unwrap();
    s.driver.fail("capture", 1);
    let err = s.manager.pause(&sb.id).await.unwrap_err();
    assert!(err.to_string().contains("keeps running"), "{err}");
    assert_eq!(s.manager.get(&sb.id).unwrap().state, SandboxState::Running);
    assert_eq!(s.manager.live_count(), 1, "its VM is back in place");
    assert_eq!(
        s.db.sandbox_snapshot(&sb.id).unwrap(),
        from,
        "no pause recorded"
    );
    // It pauses normally afterwards: state, capture row, pointer and
    // event together.
    s.manager.pause(&sb.id).await.unwrap();
    assert_eq!(s.manager.get(&sb.id).unwrap().state, SandboxState::Paused);
    let capture = s.db.sandbox_snapshot(&sb.id).unwrap().unwrap();
    assert!(capture.starts_with("p-"), "{capture}");
    assert!(s.db.get_snapshot(&capture).unwrap().is_some());
    let kinds: Vec<String> =
        s.db.events(&sb.id)
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect();
    assert!(
        kinds.ends_with(&["pause_failed".into(), "paused".into()]),
        "{kinds:?}"
    );
    // A change the lifecycle does not have is refused loudly, and changes
    // nothing.
    let err =
        s.db.set_state(
            &sb.id,
            &[SandboxState::Paused],
            SandboxState::Failed,
            None,
            ("x", ""),
        )
        .unwrap_err();
    assert!(err.to_string().contains("paused -> failed"), "{err}");
    assert_eq!(s.manager.get(&sb.id).unwrap().state, SandboxState::Paused);

    // A failure after the VM's QEMU exited loses the VM: the sandbox is
    // killed, with the reason.
    let other = s.manager.create(base()).await.unwrap();
    s.driver.fail("capture_exit", 1);
    let err = s.manager.pause(&other.id).await.unwrap_err();
    assert!(err.to_string().contains("the VM is gone"), "{err}");
    let row = s.db.get_sandbox(&other.id).unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Killed);
}

#[tokio::test]
async fn concurrent_creates_get_exactly_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(Db::open(&dir.path().join("tine.db")).unwrap());
    let driver = FakeDriver::start().await;
    let mut cfg = config();
    cfg.max_sandboxes = 3;
    cfg.teams.insert(
        "small".into(),
        crate::config::TeamLimits {
            max_sandboxes: Some(2),
            ..Default::default()
        },
    );
    let manager = manager_with(&driver, &db, cfg);
    // The template is built first, so every create below only restores.
    let first = manager.create(base()).await.unwrap();
    manager.kill(&first.id, "test").await.unwrap();

    let small = || CreateRequest {
        team: "small".into(),
        ..base()
    };
    let results = futures::future::join_all((0..5).map(|_| manager.create(small()))).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, 2, "the team's limit, exactly");
    assert!(results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .all(|e| matches!(e, SandboxError::TeamLimit(_))));

    let results = futures::future::join_all((0..5).map(|_| manager.create(base()))).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, 1, "the server's limit (3, two in use), exactly");
    assert!(results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .all(|e| matches!(e, SandboxError::Capacity(_))));
    assert_eq!(manager.live_count(), 3);
}

#[tokio::test]
async fn shapes_of_base_are_rounded_and_bounded() {
    let mut cfg = config();
    cfg.max_base_shapes = 2;
    let s = setup_with(cfg).await;
    let shape = |cpus: u32, mem: u32| CreateRequest {
        cpu_count: Some(cpus),
        memory_mb: Some(mem),
        ..base()
    };
    let a = s.manager.create(shape(1, 256)).await.unwrap();
    // 129 MiB is given 192: a second shape.
    let b = s.manager.create(shape(1, 129)).await.unwrap();
    assert_eq!(s.manager.get(&b.id).unwrap().memory_mb, 192);
    // 150 MiB is 192 too: no third shape.
    s.manager.create(shape(1, 150)).await.unwrap();
    let err = s.manager.create(shape(2, 256)).await.unwrap_err();
    assert!(
        matches!(
            &err,
            SandboxError::Template(crate::templates::TemplateError::TooManyShapes(_))
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("max_base_shapes = 2") && msg.contains("1c-192m") && msg.contains("1c-256m"),
        "{msg}"
    );
    s.manager.kill(&a.id, "test").await.unwrap();
}

#[tokio::test]
async fn fork_captures_once_and_each_child_fails_alone() {
    let s = setup().await;
    let src = s.manager.create(base()).await.unwrap();
    s.driver.fail("restore", 1);
    let results = s.manager.fork(&src.id, 3, None).await.unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 2);
    let captures = s.driver.calls("capture ");
    assert_eq!(captures.len(), 1, "{captures:?}");
    let fork_id = captures[0].rsplit(' ').next().unwrap().to_string();
    // Three children and more share a materialized RAM file; the capture is
    // opened again once, after that, and not before.
    assert_eq!(s.driver.calls("materialize").len(), 1);
    assert_eq!(s.driver.calls(&format!("open_snapshot {fork_id}")).len(), 1);
    // The source was reseeded with its own token after the capture.
    let reseed = s
        .driver
        .inits()
        .into_iter()
        .find(|i| i.body["hostname"] == src.id.as_str() && i.token.is_some())
        .expect("the source's reseed");
    assert_eq!(
        reseed.token.as_deref(),
        Some(src.envd_access_token.as_str())
    );
    assert_eq!(s.manager.live_count(), 3, "the source and two children");
    // Bad counts are refused before anything is captured.
    for bad in [0, -1, 10_000] {
        assert!(matches!(
            s.manager.fork(&src.id, bad, None).await,
            Err(SandboxError::InvalidArgument(_))
        ));
    }
    assert_eq!(s.driver.calls("capture ").len(), 1);
}

#[tokio::test]
async fn captures_nothing_uses_are_collected() {
    let s = setup().await;
    let src = s.manager.create(base()).await.unwrap();
    let children: Vec<_> = s
        .manager
        .fork(&src.id, 2, None)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let fork_capture = s
        .driver
        .snapshot_ids()
        .into_iter()
        .find(|id| id.starts_with("f-"))
        .unwrap();
    s.manager.kill(&children[0].id, "test").await.unwrap();
    assert!(
        s.driver.has_snapshot(&fork_capture),
        "a child still uses it"
    );
    s.manager.kill(&children[1].id, "test").await.unwrap();
    s.manager.kill(&src.id, "test").await.unwrap();
    assert!(!s.driver.has_snapshot(&fork_capture), "nothing uses it now");
    let template: Vec<_> = s.driver.snapshot_ids();
    assert_eq!(template.len(), 1, "the template stays: {template:?}");
}

#[tokio::test]
async fn pause_then_connect_restores_from_the_pause_capture() {
    let s = setup().await;
    let sb = s.manager.create(base()).await.unwrap();
    s.manager.pause(&sb.id).await.unwrap();
    assert_eq!(s.manager.get(&sb.id).unwrap().state, SandboxState::Paused);
    assert_eq!(s.manager.live_count(), 0);
    assert!(matches!(
        s.manager.pause(&sb.id).await,
        Err(SandboxError::Conflict(_))
    ));
    let (rec, resumed) = s.manager.connect(&sb.id, Some(60), true).await.unwrap();
    assert!(resumed);
    assert_eq!(rec.state, SandboxState::Running);
    let restore = s.driver.calls(&format!("restore {}", sb.id));
    assert_eq!(restore.len(), 2, "{restore:?}");
    assert!(
        restore[1].contains(&format!(" p-{}-", sb.id)),
        "{restore:?}"
    );
    let last = s.driver.inits().pop().unwrap();
    assert_eq!(last.token.as_deref(), Some(sb.envd_access_token.as_str()));
    let (_, again) = s.manager.connect(&sb.id, None, true).await.unwrap();
    assert!(!again, "a running sandbox is not resumed twice");
}

/// Sandbox `id` has a VM (the fake's view) and the calls so far that
/// restored one paused for it.
fn restored_ahead(s: &Setup, id: &str) -> (bool, Vec<String>) {
    let has = s.driver.state.lock().unwrap().vms.contains(id);
    (has, s.driver.calls(&format!("restore_paused {id}")))
}

#[tokio::test]
async fn a_pause_restores_ahead_for_that_sandbox_s_resume_only() {
    let s = setup_with(Config {
        resume_ahead: 1,
        ..config()
    })
    .await;
    let a = s.manager.create(base()).await.unwrap();
    let b = s.manager.create(base()).await.unwrap();
    s.manager.pause(&a.id).await.unwrap();
    // The restore ahead holds the sandbox's lock: whatever comes next for
    // it (here a refused second pause) sees it done.
    assert!(s.manager.pause(&a.id).await.is_err());
    let (has, calls) = restored_ahead(&s, &a.id);
    assert!(has, "a paused sandbox's capture is loaded ahead");
    assert_eq!(calls.len(), 1);
    assert!(calls[0].contains(&format!(" p-{}-", a.id)), "{calls:?}");
    assert_eq!(s.manager.live_count(), 1, "it is not live: only b is");
    // At most `resume_ahead` are held.
    s.manager.pause(&b.id).await.unwrap();
    s.manager.connect(&b.id, None, true).await.unwrap(); // waits for b's lock
    assert!(restored_ahead(&s, &b.id).1.is_empty());
    // A create never takes it: another id, its own restore.
    let c = s.manager.create(base()).await.unwrap();
    assert_ne!(c.id, a.id);
    // The resume takes it: no restore of its own, its own token.
    let (rec, resumed) = s.manager.connect(&a.id, Some(60), true).await.unwrap();
    assert!(resumed && rec.state == SandboxState::Running);
    assert_eq!(s.driver.calls(&format!("restore {}", a.id)).len(), 1);
    let last = s.driver.inits().pop().unwrap();
    assert_eq!(last.token.as_deref(), Some(a.envd_access_token.as_str()));
    assert!(!s.manager.pool.ids().contains(&a.id), "taken once");
    // Paused again: a new one, for the new capture; a kill ends it.
    s.manager.pause(&a.id).await.unwrap();
    s.manager.kill(&a.id, "test").await.unwrap();
    let (has, calls) = restored_ahead(&s, &a.id);
    assert!(!has, "a kill ends it");
    assert_eq!(calls.len(), 2);
    // A resume that reboots from the disk does not use it, and it is gone
    // before that boot takes the id.
    s.manager.pause(&c.id).await.unwrap();
    assert!(s.manager.pause(&c.id).await.is_err()); // after the restore ahead
    assert!(restored_ahead(&s, &c.id).0);
    s.manager.connect(&c.id, None, false).await.unwrap();
    assert_eq!(s.driver.calls(&format!("boot_from_disk {}", c.id)).len(), 1);
    assert!(!s.manager.pool.ids().contains(&c.id));
    let reused = s.driver.state.lock().unwrap().reused.clone();
    assert!(reused.is_empty(), "one VM per id at a time: {reused:?}");
}

#[tokio::test]
async fn recovery_adopts_what_runs_and_cleans_up_the_rest() {
    let s = setup().await;
    let kept = s.manager.create(base()).await.unwrap();
    let lost = s.manager.create(base()).await.unwrap();
    // The second VM died while no server ran; a stray VM is left over.
    s.driver.state.lock().unwrap().vms.remove(&lost.id);
    s.driver.state.lock().unwrap().vms.insert("stray".into());
    let next = manager_over(&s.driver, &s.db);
    next.recover().await.unwrap();
    assert_eq!(next.live_count(), 1);
    assert!(next.live(&kept.id).is_some());
    let row = s.db.get_sandbox(&lost.id).unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Killed);
    assert!(row.error.unwrap().contains("lost across a server restart"));
    assert_eq!(s.driver.calls("cleanup stray").len(), 1);
    assert!(s.driver.calls(&format!("cleanup {}", kept.id)).is_empty());
}

#[tokio::test]
async fn recovery_finishes_or_undoes_a_pause_the_crash_cut_short() {
    let s = setup().await;
    // Cut short after its capture was on disk and its VM gone: paused.
    let done = s.manager.create(base()).await.unwrap();
    s.driver.state.lock().unwrap().vms.remove(&done.id);
    s.driver
        .add_snapshot("p-done", tine_vmm::Machine::default(), None);
    s.db.set_intent(&done.id, Some("pause p-done memory"))
        .unwrap();
    // Cut short before its QEMU exited: it runs on; a half-written
    // capture goes.
    let running = s.manager.create(base()).await.unwrap();
    s.driver
        .add_snapshot("p-half", tine_vmm::Machine::default(), None);
    s.db.set_intent(&running.id, Some("pause p-half disk"))
        .unwrap();
    // Cut short with its VM gone and no whole capture: lost, and said so.
    let lost = s.manager.create(base()).await.unwrap();
    s.driver.state.lock().unwrap().vms.remove(&lost.id);
    s.db.set_intent(&lost.id, Some("pause p-lost memory"))
        .unwrap();

    let next = manager_over(&s.driver, &s.db);
    next.recover().await.unwrap();

    let row = s.db.get_sandbox(&done.id).unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Paused);
    assert_eq!(
        s.db.sandbox_snapshot(&done.id).unwrap().as_deref(),
        Some("p-done")
    );
    assert!(s.db.get_snapshot("p-done").unwrap().is_some());
    assert_eq!(s.db.intent(&done.id).unwrap(), None);
    // It resumes from that capture.
    let (_, resumed) = next.connect(&done.id, None, true).await.unwrap();
    assert!(resumed);

    assert!(next.live(&running.id).is_some());
    assert_eq!(
        s.db.get_sandbox(&running.id).unwrap().unwrap().state,
        SandboxState::Running
    );
    assert!(!s.driver.has_snapshot("p-half"));
    assert_eq!(s.db.intent(&running.id).unwrap(), None);
    assert_eq!(
        s.driver
            .calls(&format!("ensure_running {}", running.id))
            .len(),
        1
    );

    assert_eq!(
        s.db.get_sandbox(&lost.id).unwrap().unwrap().state,
        SandboxState::Killed
    );
}

#[tokio::test]
async fn the_warm_pool_lets_go_of_a_template_that_is_gone() {
    let config = Config {
        pool_size: 1,
        ..config()
    };
    let s = setup_with(config).await;
    let sandbox = s.manager.create(base()).await.unwrap();
    let snapshot = s.db.sandbox_snapshot(&sandbox.id).unwrap().unwrap();
    wait_for_the_pool(&s.manager).await;
    let pooled: Vec<String> = s.manager.pool.ids().into_iter().collect();
    // While the template lives, its pooled VM stays.
    s.manager.sweep().await;
    assert_eq!(s.manager.pool.ids().len(), 1);
    // Rebuilt (its row hidden): the pooled VM is killed.
    s.db.hide_snapshot(&snapshot).unwrap();
    s.manager.sweep().await;
    assert!(s.manager.pool.ids().is_empty());
    assert!(s
        .driver
        .calls("kill")
        .contains(&format!("kill {}", pooled[0])));
}

#[tokio::test]
async fn recovery_keeps_whole_captures_and_resumes_from_them() {
    let s = setup().await;
    let capture = |id: &str, kind: &str| {
        super::intent::Intent::Capture {
            capture: id.into(),
            kind: kind.into(),
            names: vec!["named".into()],
        }
        .to_string()
    };
    // Its VM outlived the crash and the capture is whole: the snapshot is
    // kept (named as asked), the guest reseeded.
    let kept = s.manager.create(base()).await.unwrap();
    s.driver
        .add_snapshot("snap-kept", tine_vmm::Machine::default(), None);
    s.db.set_intent(&kept.id, Some(&capture("snap-kept", "snapshot")))
        .unwrap();
    // Its VM was lost (a booted VM continues as a new QEMU after its
    // capture) but the fork's capture is whole: it runs again from it.
    let moved = s.manager.create(base()).await.unwrap();
    s.driver.state.lock().unwrap().vms.remove(&moved.id);
    s.driver
        .add_snapshot("f-moved", tine_vmm::Machine::default(), None);
    s.db.set_intent(&moved.id, Some(&capture("f-moved", "fork")))
        .unwrap();
    // A capture that is not whole, VM alive: dropped; the sandbox runs on.
    let half = s.manager.create(base()).await.unwrap();
    s.db.set_intent(&half.id, Some(&capture("snap-half", "snapshot")))
        .unwrap();
    let inits_before = s.driver.inits().len();

    let next = manager_over(&s.driver, &s.db);
    next.recover().await.unwrap();

    let row = s.db.get_snapshot("snap-kept").unwrap().unwrap();
    assert_eq!(row.names, vec!["named".to_string()]);
    assert_eq!(
        s.db.sandbox_snapshot(&kept.id).unwrap().as_deref(),
        Some("snap-kept")
    );
    assert_eq!(s.db.intent(&kept.id).unwrap(), None);
    assert!(next.live(&kept.id).is_some());

    let moved_row = s.db.get_sandbox(&moved.id).unwrap().unwrap();
    assert_eq!(
        moved_row.state,
        SandboxState::Running,
        "resumed from its capture"
    );
    assert!(next.live(&moved.id).is_some());
    let restores = s.driver.calls(&format!("restore {}", moved.id));
    assert!(restores.last().unwrap().contains("f-moved"), "{restores:?}");

    assert!(next.live(&half.id).is_some());
    assert_eq!(s.db.intent(&half.id).unwrap(), None);
    assert!(s.db.get_snapshot("snap-half").unwrap().is_none());
    // Both adopted VMs were reseeded, and the resumed one was started with
    // its own token.
    assert!(s.driver.inits().len() >= inits_before + 3);
}

#[tokio::test]
async fn reclaim_deletes_only_what_nothing_needs() {
    let s = setup().await;
    let sb = s.manager.create(base()).await.unwrap();
    s.manager.pause(&sb.id).await.unwrap();
    let paused_at = s.db.sandbox_snapshot(&sb.id).unwrap().unwrap();
    // Left by a crash: no row, no intent.
    s.driver
        .add_snapshot("snap-orphan", tine_vmm::Machine::default(), None);
    // Named by an operation in flight on another sandbox.
    let busy = s.manager.create(base()).await.unwrap();
    s.driver
        .add_snapshot("snap-busy", tine_vmm::Machine::default(), None);
    s.db.set_intent(
        &busy.id,
        Some(
            &super::intent::Intent::Capture {
                capture: "snap-busy".into(),
                kind: "snapshot".into(),
                names: vec![],
            }
            .to_string(),
        ),
    )
    .unwrap();
    let n = s.manager.reclaim_snapshots(std::time::Duration::ZERO).await;
    assert_eq!(n, 1);
    assert!(!s.driver.has_snapshot("snap-orphan"));
    assert!(s.driver.has_snapshot("snap-busy"));
    assert!(s.driver.has_snapshot(&paused_at));
    let (_, resumed) = s.manager.connect(&sb.id, None, true).await.unwrap();
    assert!(resumed);
}

#[tokio::test]
async fn starts_are_refused_when_the_host_lacks_memory() {
    let config = Config {
        // More than any host has available.
        min_free_memory_mb: 1 << 40,
        ..config()
    };
    let s = setup_with(config).await;
    let err = s.manager.create(base()).await.unwrap_err();
    assert!(matches!(err, SandboxError::HostMemory(_)), "{err}");
    assert!(err.to_string().contains("min_free_memory_mb"), "{err}");
    assert!(s.driver.calls("restore").is_empty(), "no VM was started");
}

#[tokio::test]
async fn pooled_vms_count_but_make_room_for_sandboxes() {
    let config = Config {
        pool_size: 2,
        max_sandboxes: 2,
        ..config()
    };
    let s = setup_with(config).await;
    let first = s.manager.create(base()).await.unwrap();
    // The pool fills up to what the limit leaves (one slot).
    wait_for_the_pool(&s.manager).await;
    // A second sandbox still fits: it takes (or evicts) the pooled VM.
    let second = s.manager.create(base()).await.unwrap();
    assert_ne!(first.id, second.id);
    assert_eq!(s.manager.live_count(), 2);
    let err = s.manager.create(base()).await.unwrap_err();
    assert!(
        matches!(&err, SandboxError::Capacity(c) if c.used == 2),
        "{err}"
    );
    // Never more VMs than the limit plus the pool's own warm-ups in flight.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        s.manager.pool.ids().is_empty(),
        "{:?}",
        s.manager.pool.ids()
    );
}

#[tokio::test]
async fn a_capture_that_cannot_be_finished_at_restart_keeps_everything() {
    let s = setup().await;
    let sb = s.manager.create(base()).await.unwrap();
    s.driver.state.lock().unwrap().vms.remove(&sb.id);
    s.db.set_intent(&sb.id, Some("pause p-stuck memory"))
        .unwrap();
    // Finishing it fails (a full disk at restart, say).
    s.driver.fail("salvage_capture", 1);
    let next = manager_over(&s.driver, &s.db);
    next.recover().await.unwrap();
    let row = s.db.get_sandbox(&sb.id).unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Running, "not declared dead");
    assert!(
        s.db.intent(&sb.id).unwrap().is_some(),
        "the next start retries"
    );
    assert!(
        s.driver.calls(&format!("cleanup {}", sb.id)).is_empty(),
        "its VM's files are kept"
    );
    assert!(s
        .db
        .events(&sb.id)
        .unwrap()
        .iter()
        .any(|e| e.kind == "recovery_deferred"));
    // The next start gets further: here, no whole capture, so it is dead.
    let again = manager_over(&s.driver, &s.db);
    again.recover().await.unwrap();
    let row = s.db.get_sandbox(&sb.id).unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Killed);
}
