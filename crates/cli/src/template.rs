//! `tine template build | list | delete`.

use std::time::Duration;

use anyhow::bail;
use clap::Subcommand;
use tine_server::db::Db;
use tine_server::templates;
use tine_vmm::{Machine, Paths};

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Build a template with the one build engine (the SDK's builds run on it too): from
    /// `base` (or an OCI image), run commands as root, start a process, wait until ready,
    /// capture; every step cached. Sandboxes created from it restore that state.
    #[command(after_help = "With -f: tine template build -f Dockerfile [CONTEXT] NAME")]
    Build {
        /// NAME, or CONTEXT NAME with -f (a-z, 0-9, '-', '_'); replaces an
        /// older template of that name.
        #[arg(num_args = 1..=2, required = true, value_names = ["CONTEXT", "NAME"])]
        names: Vec<String>,
        /// Build this Dockerfile (FROM, RUN, COPY, ADD of local files, ENV,
        /// ARG, WORKDIR, USER, CMD, ENTRYPOINT); every step is cached.
        #[arg(short = 'f', long = "file")]
        file: Option<std::path::PathBuf>,
        /// Rebuild every step.
        #[arg(long)]
        no_cache: bool,
        /// A command to run as root (repeatable, in order; each must exit 0).
        #[arg(long = "run")]
        run: Vec<String>,
        /// A command started in the background before the capture, so it
        /// runs in every sandbox of the template.
        #[arg(long)]
        start: Option<String>,
        /// A command polled until it exits 0 before the capture.
        #[arg(long)]
        ready: Option<String>,
        #[arg(long, default_value_t = 300)]
        ready_timeout_secs: u64,
        #[arg(long, default_value_t = 2)]
        vcpus: u32,
        #[arg(long, default_value_t = 512)]
        memory_mib: u32,
        /// Run on this OCI image's root disk instead of `base` (pulled if
        /// it is not in the local store).
        #[arg(long)]
        from_image: Option<String>,
        #[command(flatten)]
        registry: crate::image::RegistryArgs,
    },
    /// List templates (one line per template and machine shape).
    List,
    /// Delete a template; its files go once no sandbox uses them.
    Delete { name: String },
}

pub async fn run(cmd: TemplateCommand) -> anyhow::Result<i32> {
    let paths = Paths::from_env();
    let db = Db::open(&paths.data_dir.join("tine.db"))?;
    match cmd {
        TemplateCommand::Build {
            names,
            file,
            no_cache,
            run,
            start,
            ready,
            ready_timeout_secs,
            vcpus,
            memory_mib,
            from_image,
            registry,
        } => {
            let machine = Machine {
                vcpus,
                memory_mib,
                ..Machine::default()
            };
            if let Some(file) = file {
                if !run.is_empty() || start.is_some() || from_image.is_some() {
                    bail!("-f takes its steps from the Dockerfile: drop --run, --start and --from-image");
                }
                let (context, name) = match names.as_slice() {
                    [c, n] => (Some(c.into()), n.clone()),
                    [n] => (None, n.clone()),
                    _ => bail!("give NAME, or CONTEXT NAME"),
                };
                let args = crate::dockerfile::Args {
                    file,
                    context,
                    name,
                    machine,
                    ready,
                    ready_timeout: Duration::from_secs(ready_timeout_secs),
                    no_cache,
                    registry,
                };
                crate::dockerfile::build(&paths, std::sync::Arc::new(db), args).await?;
                return Ok(0);
            }
            let [name] = names.as_slice() else {
                bail!("CONTEXT is for -f builds: give only NAME");
            };
            let files = std::sync::Arc::new(tine_server::builds::files::ContextStore::new(
                &paths.data_dir,
                u64::MAX,
            ));
            let request = crate::local_build::Request {
                name: name.clone(),
                machine,
                base: match from_image {
                    Some(r) => crate::local_build::From::Image(r),
                    None => crate::local_build::From::Template,
                },
                steps: crate::local_build::root_steps(&run),
                start,
                ready,
                ready_timeout: Duration::from_secs(ready_timeout_secs),
                no_cache,
                registry,
                files,
                quiet: false,
            };
            crate::local_build::build(&paths, std::sync::Arc::new(db), request).await?;
            return Ok(0);
        }
        TemplateCommand::List => {
            for t in db.list_templates()? {
                println!(
                    "{}\t{}\t{} vCPU\t{} MiB",
                    t.names.first().map_or("?", String::as_str),
                    t.id,
                    t.cpu_count,
                    t.memory_mb
                );
            }
        }
        TemplateCommand::Delete { name } => {
            if !templates::delete(&db, &name)? {
                bail!("no template {name}");
            }
            eprintln!("deleted template {name}");
        }
    }
    Ok(0)
}
