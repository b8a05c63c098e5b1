//! `tine vm ...` and `tine run`.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Args, Subcommand};
use tine_agent_client::{ExecOutput, AGENT_PORT};
use tine_vmm::{Driver, Guest, Machine, Paths, QemuDriver, VmHandle};

#[derive(Subcommand)]
pub enum VmCommand {
    /// Cold-boot a VM from the base template and leave it running.
    Boot(BootArgs),
    /// Run a shell command in a VM; exits with the command's exit code.
    Exec {
        id: String,
        #[arg(long, default_value = "root")]
        user: String,
        #[arg(long, default_value_t = 60)]
        timeout_secs: u64,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Capture a VM as a snapshot (a RAM and disk layer if it was restored), and let it continue.
    Snapshot { id: String, snapshot: String },
    /// Start clones of a snapshot.
    Clone {
        snapshot: String,
        /// How many clones.
        #[arg(short = 'n', long, default_value_t = 1)]
        count: usize,
    },
    /// List VMs.
    List,
    /// Print a VM's serial console log.
    Logs { id: String },
    /// Kill VMs and remove their files.
    Kill {
        ids: Vec<String>,
        /// Kill every VM.
        #[arg(long)]
        all: bool,
    },
    /// Delete a snapshot's files.
    DeleteSnapshot { snapshot: String },
}

#[derive(Args)]
pub struct BootArgs {
    /// VM id (default: random).
    #[arg(long)]
    id: Option<String>,
    #[arg(long, default_value_t = 512)]
    memory_mib: u32,
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    boot: BootArgs,
    #[arg(long, default_value = "user")]
    user: String,
    /// The command (run with `bash -l -c`).
    #[arg(trailing_var_arg = true, default_values_t = vec!["uname -a && id && python3 --version".to_string()])]
    command: Vec<String>,
}

/// A random id such as `vm-3fa9c21b`.
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 4];
    let _ = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b));
    format!(
        "{prefix}-{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

fn machine(a: &BootArgs) -> Machine {
    Machine {
        vcpus: a.vcpus,
        memory_mib: a.memory_mib,
        ..Machine::default()
    }
}

async fn boot(driver: &QemuDriver, a: &BootArgs) -> anyhow::Result<Box<dyn VmHandle>> {
    let id = a.id.clone().unwrap_or_else(|| new_id("vm"));
    let m = machine(a);
    let t = Instant::now();
    let artifacts = driver.paths().current_artifacts();
    let vm = driver.boot(&id, m, &artifacts).await?;
    eprintln!(
        "booted {id} ({} vCPU, {} MiB, {}) in {} ms",
        m.vcpus,
        m.memory_mib,
        m.accel.as_str(),
        t.elapsed().as_millis()
    );
    Ok(vm)
}

fn print_output(out: &ExecOutput) {
    let _ = std::io::stdout().write_all(&out.stdout);
    let _ = std::io::stderr().write_all(&out.stderr);
}

/// Run `cmd` as `user` through the agent of a guest.
async fn exec(
    guest: &Guest,
    user: &str,
    cmd: &str,
    timeout: Duration,
) -> anyhow::Result<ExecOutput> {
    let conn = guest.connect(AGENT_PORT);
    Ok(tine_agent_client::process::exec(conn, user, cmd, None, timeout).await?)
}

pub async fn run_once(a: RunArgs) -> anyhow::Result<i32> {
    let driver = crate::driver(&Paths::from_env());
    let vm = boot(&driver, &a.boot).await?;
    let t = Instant::now();
    let result = exec(
        &vm.guest(),
        &a.user,
        &a.command.join(" "),
        Duration::from_secs(300),
    )
    .await;
    let elapsed = t.elapsed();
    vm.kill().await?;
    let out = result?;
    print_output(&out);
    eprintln!(
        "exit code {} after {} ms",
        out.exit_code,
        elapsed.as_millis()
    );
    Ok(out.exit_code)
}

pub async fn run(cmd: VmCommand) -> anyhow::Result<i32> {
    let paths = Paths::from_env();
    let driver = crate::driver(&paths);
    match cmd {
        VmCommand::Boot(a) => {
            let vm = boot(&driver, &a).await?;
            println!("{}", vm.id());
        }
        VmCommand::Exec {
            id,
            user,
            timeout_secs,
            command,
        } => {
            let guest = driver.guest_of(&id)?;
            let timeout = Duration::from_secs(timeout_secs);
            let out = exec(&guest, &user, &command.join(" "), timeout).await?;
            print_output(&out);
            return Ok(out.exit_code);
        }
        VmCommand::Snapshot { id, snapshot } => {
            let mut vm = driver.adopt(&id).await?;
            let t = Instant::now();
            vm.capture(&snapshot).await?;
            eprintln!(
                "snapshot {snapshot} of {id} taken; {id} continues ({} ms)",
                t.elapsed().as_millis()
            );
        }
        VmCommand::Clone { snapshot, count } => clone(&driver, &snapshot, count).await?,
        VmCommand::List => list(&driver).await,
        VmCommand::Logs { id } => {
            if !paths.vm_dir(&id).exists() {
                bail!("no VM {id}");
            }
            std::io::stdout().write_all(driver.console_log(&id).as_bytes())?;
        }
        VmCommand::Kill { ids, all } => {
            let ids = if all { driver.vm_ids() } else { ids };
            if ids.is_empty() && !all {
                bail!("name VMs to kill, or --all");
            }
            for id in ids {
                match driver.adopt(&id).await {
                    Ok(vm) => vm.kill().await?,
                    Err(_) => driver.cleanup(&id).await,
                }
                eprintln!("killed {id}");
            }
        }
        VmCommand::DeleteSnapshot { snapshot } => driver.snapshots().delete_snapshot(&snapshot)?,
    }
    Ok(0)
}

async fn clone(driver: &QemuDriver, snapshot: &str, count: usize) -> anyhow::Result<()> {
    let snap = driver.snapshots().open_snapshot(snapshot)?;
    for _ in 0..count {
        let id = new_id("vm");
        let t = Instant::now();
        let vm = driver.restore(&id, &snap).await?;
        eprintln!(
            "restored {id} from {snapshot} in {} ms",
            t.elapsed().as_millis()
        );
        println!("{}", vm.id());
    }
    Ok(())
}

async fn list(driver: &QemuDriver) {
    for id in driver.vm_ids() {
        match driver.adopt(&id).await {
            Ok(vm) => println!("{id}\trunning or paused\tpid {}", vm.process_id()),
            Err(e) => println!("{id}\tdead\t{e}"),
        }
    }
}
