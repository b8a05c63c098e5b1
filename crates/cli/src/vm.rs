//! `tine vm ...` and `tine run`.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tine_vmm::{Machine, Paths, Snapshot, StartOptions, Vm};

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

async fn boot(paths: &Paths, a: &BootArgs) -> anyhow::Result<Vm> {
    let id = a.id.clone().unwrap_or_else(|| new_id("vm"));
    let m = machine(a);
    let t = Instant::now();
    let vm = Vm::boot(
        paths,
        &id,
        m,
        &paths.current_artifacts(),
        StartOptions::default(),
    )
    .await?;
    eprintln!(
        "booted {id} ({} vCPU, {} MiB, {}) in {} ms",
        m.vcpus,
        m.memory_mib,
        m.accel.as_str(),
        t.elapsed().as_millis()
    );
    Ok(vm)
}

fn print_output(out: &tine_vmm::guest::ExecOutput) {
    let _ = std::io::stdout().write_all(&out.stdout);
    let _ = std::io::stderr().write_all(&out.stderr);
}

pub async fn run_once(a: RunArgs) -> anyhow::Result<i32> {
    let paths = Paths::from_env();
    let vm = boot(&paths, &a.boot).await?;
    let t = Instant::now();
    let result = vm
        .exec(&a.user, &a.command.join(" "), Duration::from_secs(300))
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
    match cmd {
        VmCommand::Boot(a) => {
            let vm = boot(&paths, &a).await?;
            println!("{}", vm.id());
        }
        VmCommand::Exec {
            id,
            user,
            timeout_secs,
            command,
        } => {
            let vm = Vm::adopt(&paths, &id).await?;
            let out = vm
                .exec(&user, &command.join(" "), Duration::from_secs(timeout_secs))
                .await?;
            print_output(&out);
            return Ok(out.exit_code);
        }
        VmCommand::Snapshot { id, snapshot } => {
            let mut vm = Vm::adopt(&paths, &id).await?;
            let t = Instant::now();
            vm.snapshot(&snapshot).await?;
            eprintln!(
                "snapshot {snapshot} of {id} taken; {id} continues ({} ms)",
                t.elapsed().as_millis()
            );
        }
        VmCommand::Clone { snapshot, count } => {
            let snap = Snapshot::open(&paths, &snapshot)?;
            for _ in 0..count {
                let id = new_id("vm");
                let t = Instant::now();
                let vm = Vm::restore(&paths, &id, &snap, StartOptions::default()).await?;
                eprintln!(
                    "restored {id} from {snapshot} in {} ms",
                    t.elapsed().as_millis()
                );
                println!("{}", vm.id());
            }
        }
        VmCommand::List => {
            for id in tine_vmm::vm::list(&paths) {
                match Vm::adopt(&paths, &id).await {
                    Ok(vm) => println!("{id}\t{}\tpid {}", vm.state().as_str(), vm.pid()),
                    Err(e) => println!("{id}\tdead\t{e}"),
                }
            }
        }
        VmCommand::Logs { id } => {
            let path = paths.vm_dir(&id).join("console.log");
            let log =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            std::io::stdout().write_all(&log)?;
        }
        VmCommand::Kill { ids, all } => {
            let ids = if all { tine_vmm::vm::list(&paths) } else { ids };
            if ids.is_empty() && !all {
                bail!("name VMs to kill, or --all");
            }
            for id in ids {
                match Vm::adopt(&paths, &id).await {
                    Ok(vm) => vm.kill().await?,
                    Err(_) => tine_vmm::vm::cleanup(&paths, &id).await,
                }
                eprintln!("killed {id}");
            }
        }
        VmCommand::DeleteSnapshot { snapshot } => Snapshot::delete(&paths, &snapshot)?,
    }
    Ok(0)
}
