//! Server configuration: a TOML file (all keys optional), then flags.
//!
//! ```toml
//! listen = "127.0.0.1:3000"
//! domain = "localhost:3000"       # for get_host(): <port>-<id>.<domain>
//! default_timeout_secs = 300
//! max_timeout_secs = 86400
//! default_cpu_count = 2
//! default_memory_mb = 512
//! max_cpu_count = 8
//! max_memory_mb = 8192
//! max_sandboxes = 256
//! max_sandboxes_per_core = 100    # capacity by CPU: at most this many per host core (0: no bound)
//! max_base_shapes = 16            # (vCPUs, memory) shapes of `base` kept as snapshots (429 beyond; 0: no bound)
//! max_body_bytes = 1048576
//! max_fork_count = 32
//! min_free_memory_mb = 256        # refuse starts (429) below this MemAvailable
//! min_free_disk_mb = 1024         # refuse starts (507) below this free in the data dir
//! pool_size = 2                   # warm pool per template shape
//! resume_ahead = 2                # paused sandboxes restored ahead of their resume
//! max_concurrent_starts = 4       # VM starts at once (default 2 per core)
//! compact_after_layers = 3        # fold longer capture chains (0: never)
//! fork_shared_ram_from = 2        # forks this big share one RAM file (0: never)
//! volume_max_bytes = 1073741824   # file contents each new volume may hold (507 beyond)
//! secrets_key_file = "/var/lib/tine/secrets.key"  # AES-256 key of secrets at rest (0600; made if missing)
//!
//! [network]                       # see docs/networking.md
//! allow_private = ["10.99.1.0/24"]  # not-internet ranges sandboxes may reach
//! dns = "10.0.0.2"                 # the resolver guests use (default: the host's)
//! veth_pool = "10.233.0.0/16"      # host<->sandbox links, a /31 each
//!
//! require_kvm = false             # refuse to start under TCG
//!
//! [jail]                          # see docs/security.md
//! enabled = true
//! uid_base = 900000               # VMs run as uids uid_base..uid_base+uid_count
//! uid_count = 65536
//! vmm_overhead_mib = 256          # memory.max = guest memory + this
//! pids_max = 512
//! console_max_bytes = 1048576     # console.log, then one rotated file
//!
//! [teams.default]                 # per-team limits (429 beyond them)
//! max_sandboxes = 100
//! max_vcpus = 200
//! max_memory_mb = 102400
//! max_snapshot_bytes = 107374182400
//! max_volume_bytes = 1073741824   # each of its volumes, at most (≤ volume_max_bytes)
//!
//! [registries]                    # where OCI images come from
//! insecure = ["registry.lan:5000"]            # plain HTTP (loopback always is)
//! mirrors = { "docker.io" = ["registry.lan:5000"] }   # tried first, in order
//! credentials = { "ghcr.io" = { username = "me", password = "token" } }
//! ```

use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    /// Returned as `domain` so the SDK's `get_host(port)` names
    /// `<port>-<id>.<domain>`; `None` means `localhost:<listen port>`.
    pub domain: Option<String>,
    /// Domain mode over HTTPS (`[tls]`).
    pub tls: crate::tls::TlsConfig,
    /// Serve the web console under `/console` (on by default).
    pub console: bool,
    pub default_timeout_secs: u64,
    pub max_timeout_secs: u64,
    pub default_cpu_count: u32,
    pub max_cpu_count: u32,
    pub default_memory_mb: u32,
    pub min_memory_mb: u32,
    pub max_memory_mb: u32,
    /// Sandboxes alive at once; creates beyond it get 429.
    pub max_sandboxes: usize,
    /// Capacity by CPU: sandboxes (live, starting, pooled, restored ahead)
    /// per host core, so a host refuses creates (429) before its live
    /// sandboxes stop answering. An idle TCG sandbox costs about 0.2 % of
    /// a core (docs/benchmarks.md, P15), so the bound is the CPU left for
    /// the ones that work. 0: no bound beyond `max_sandboxes`.
    pub max_sandboxes_per_core: f64,
    /// (vCPUs, memory) shapes of `base` kept as template snapshots, at
    /// most: each is a cold boot and a RAM file on disk, so a create for
    /// one more gets 429 naming those there are (memory is rounded to a
    /// few sizes first). 0: no bound.
    pub max_base_shapes: usize,
    /// A VM start (create, resume, fork) is refused with 429 while the
    /// host's `MemAvailable` is below this (0: never).
    pub min_free_memory_mb: u64,
    /// A VM start is refused with 507 while the data directory's file
    /// system has less free than this (0: never).
    pub min_free_disk_mb: u64,
    /// Largest REST request body.
    pub max_body_bytes: usize,
    /// Most children one fork call may ask for.
    pub max_fork_count: usize,
    /// VMs restored ahead of time per template shape in use (0: none).
    pub pool_size: usize,
    /// Paused sandboxes, at most, whose capture is loaded into a stopped
    /// QEMU right after the pause, so their resume skips QEMU's start and
    /// the load (0: none). First come: a pause finding them all held gets
    /// none; a resume, a kill or a start that needs the room frees one.
    /// Each holds a slot of `max_sandboxes` and its QEMU's memory.
    pub resume_ahead: usize,
    /// VM starts (create, resume, fork children) running at once; more wait.
    pub max_concurrent_starts: usize,
    /// A capture with more RAM/disk layers above its template than this is
    /// compacted in the background (0: never).
    pub compact_after_layers: usize,
    /// A fork of at least this many children first gives its capture its
    /// whole RAM as a file, which the children then share instead of each
    /// holding private copies of the source's changed pages (0: never),
    /// when those copies would hold at least as much as the file.
    pub fork_shared_ram_from: usize,
    /// What sandboxes may reach, beyond their own policies.
    pub network: crate::network::NetworkConfig,
    /// How OCI registries are reached.
    pub registries: tine_image::RegistryOptions,
    /// Bound of the local cache of image chunks that can be fetched again
    /// (chunks of images converted here and pushed nowhere are kept
    /// outside it).
    pub image_cache_max_bytes: u64,
    /// Bytes of file contents each new volume may hold.
    pub volume_max_bytes: u64,
    /// The key secrets are sealed with (default `<data dir>/secrets.key`,
    /// made on first start, mode 0600).
    pub secrets_key_file: Option<std::path::PathBuf>,
    /// Template builds that may run at once (more wait, status `waiting`).
    pub max_concurrent_builds: usize,
    /// Largest build-context archive an upload may send.
    pub build_context_max_bytes: u64,
    /// How long a template's ready command may keep failing.
    pub build_ready_timeout_secs: u64,
    /// How long one build step may run.
    pub build_step_timeout_secs: u64,
    /// Build layers no build made or reused for this long are deleted
    /// (0: kept forever).
    pub build_layer_ttl_secs: u64,
    /// How each QEMU is confined (`[jail]`, see docs/security.md).
    pub jail: tine_vmm::JailConfig,
    /// Refuse to start without KVM: under TCG, QEMU's own security policy
    /// does not count the guest/host boundary as one.
    pub require_kvm: bool,
    /// Per-team limits (`[teams.<name>]`); a team not named gets
    /// `[teams.default]`'s, or none.
    pub teams: std::collections::BTreeMap<String, TeamLimits>,
    /// Cluster mode (`[cluster]`): this server is a node behind gateways
    /// (docs/cluster.md).
    pub cluster: crate::cluster::ClusterConfig,
    /// Workload identity tokens (`[identity]`, see docs/security.md).
    pub identity: crate::identity::IdentityConfig,
}

/// What one team may hold at once; a create, resume, fork or snapshot
/// beyond it gets 429.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TeamLimits {
    /// Sandboxes running (paused ones hold no VM and do not count).
    pub max_sandboxes: Option<usize>,
    /// vCPUs of its running sandboxes together.
    pub max_vcpus: Option<u64>,
    /// Memory of its running sandboxes together, in MiB.
    pub max_memory_mb: Option<u64>,
    /// Bytes of its snapshots and pause captures on disk.
    pub max_snapshot_bytes: Option<u64>,
    /// What each of its volumes may hold, when less than
    /// `volume_max_bytes` (set when the volume is made).
    pub max_volume_bytes: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: ([127, 0, 0, 1], 3000).into(),
            domain: None,
            tls: Default::default(),
            console: true,
            default_timeout_secs: 300,
            max_timeout_secs: 24 * 3600,
            default_cpu_count: 2,
            max_cpu_count: 8,
            default_memory_mb: 512,
            min_memory_mb: 128,
            max_memory_mb: 8192,
            max_sandboxes: 256,
            max_sandboxes_per_core: 100.0,
            max_base_shapes: 16,
            min_free_memory_mb: 256,
            min_free_disk_mb: 1024,
            max_body_bytes: 1 << 20,
            max_fork_count: 32,
            pool_size: 2,
            resume_ahead: 2,
            max_concurrent_starts: 2 * std::thread::available_parallelism().map_or(2, |n| n.get()),
            compact_after_layers: 3,
            fork_shared_ram_from: 2,
            network: Default::default(),
            registries: Default::default(),
            image_cache_max_bytes: tine_image::nbd::daemon::DEFAULT_CACHE_MAX_BYTES,
            volume_max_bytes: 1 << 30,
            secrets_key_file: None,
            max_concurrent_builds: 2,
            build_context_max_bytes: 1 << 30,
            build_ready_timeout_secs: 300,
            build_step_timeout_secs: 3600,
            build_layer_ttl_secs: 7 * 24 * 3600,
            jail: Default::default(),
            require_kvm: false,
            teams: Default::default(),
            cluster: Default::default(),
            identity: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: toml::de::Error,
    },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// How many sandboxes this host holds: `max_sandboxes`, and
    /// `max_sandboxes_per_core` times its cores (at least one sandbox).
    pub fn capacity(&self) -> Capacity {
        self.capacity_for(host_cores())
    }

    /// [`Config::capacity`] on a host of `cores` cores.
    pub fn capacity_for(&self, cores: usize) -> Capacity {
        let by_cpu = (self.max_sandboxes_per_core > 0.0)
            .then(|| ((self.max_sandboxes_per_core * cores as f64).floor() as usize).max(1));
        Capacity {
            sandboxes: by_cpu.map_or(self.max_sandboxes, |c| c.min(self.max_sandboxes)),
            by_cpu,
            cores,
        }
    }

    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let cfg: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_string()));
        if self.default_cpu_count == 0 || self.default_cpu_count > self.max_cpu_count {
            return bad("default_cpu_count must be between 1 and max_cpu_count");
        }
        if self.default_memory_mb < self.min_memory_mb
            || self.default_memory_mb > self.max_memory_mb
        {
            return bad("default_memory_mb must be between min_memory_mb and max_memory_mb");
        }
        if self.max_concurrent_builds == 0 {
            return bad("max_concurrent_builds must be at least 1");
        }
        self.identity.validate().map_err(ConfigError::Invalid)?;
        if !(self.max_sandboxes_per_core >= 0.0 && self.max_sandboxes_per_core.is_finite()) {
            return bad("max_sandboxes_per_core must be a number, at least 0 (0: no bound)");
        }
        if self.default_timeout_secs == 0 || self.default_timeout_secs > self.max_timeout_secs {
            return bad("default_timeout_secs must be between 1 and max_timeout_secs");
        }
        self.jail.validate().map_err(ConfigError::Invalid)?;
        for name in self.teams.keys() {
            if !crate::db::valid_team(name) {
                return bad(&format!(
                    "[teams.{name}]: a team name is 1 to 64 letters, digits, '-' or '_'"
                ));
            }
        }
        self.network.validate().map_err(ConfigError::Invalid)
    }

    /// The limits of team `team`.
    pub fn team_limits(&self, team: &str) -> TeamLimits {
        self.teams
            .get(team)
            .or_else(|| self.teams.get("default"))
            .cloned()
            .unwrap_or_default()
    }

    /// What the image daemon is told.
    pub fn image_daemon(&self) -> tine_image::nbd::daemon::Settings {
        tine_image::nbd::daemon::Settings {
            cache_max_bytes: self.image_cache_max_bytes,
            registries: self.registries.clone(),
        }
    }

    pub fn domain(&self) -> String {
        self.domain
            .clone()
            .unwrap_or_else(|| format!("localhost:{}", self.listen.port()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_smaller_of_max_sandboxes_and_the_cpu_bound() {
        let mut c = Config::default();
        assert_eq!(c.capacity_for(2).sandboxes, 200);
        assert_eq!(c.capacity_for(2).by_cpu, Some(200));
        assert_eq!(c.capacity_for(4).sandboxes, 256, "max_sandboxes bounds it");
        c.max_sandboxes_per_core = 1.25;
        assert_eq!(c.capacity_for(2).sandboxes, 2);
        c.max_sandboxes_per_core = 0.1;
        assert_eq!(c.capacity_for(2).sandboxes, 1, "at least one");
        c.max_sandboxes_per_core = 0.0;
        assert_eq!(
            c.capacity_for(2),
            Capacity {
                sandboxes: 256,
                by_cpu: None,
                cores: 2
            }
        );
        c.max_sandboxes_per_core = -1.0;
        assert!(c.validate().is_err());
        c.max_sandboxes_per_core = f64::NAN;
        assert!(c.validate().is_err());
    }

    #[test]
    fn jail_and_team_settings_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tine.toml");
        std::fs::write(
            &p,
            "[jail]\nconsole_max_bytes = 4096\n[teams.a]\nmax_sandboxes = 2\n[teams.default]\nmax_vcpus = 8\n",
        )
        .unwrap();
        let c = Config::load(Some(&p)).unwrap();
        assert!(c.jail.enabled, "the jail is on unless turned off");
        assert_eq!(c.jail.console_max_bytes, 4096);
        assert_eq!(c.team_limits("a").max_sandboxes, Some(2));
        assert_eq!(
            c.team_limits("other").max_vcpus,
            Some(8),
            "[teams.default] applies"
        );
        for bad in [
            "[jail]\nuid_base = 0\n",
            "[jail]\nuid_base = 4294967000\nuid_count = 65536\n",
            "[jail]\ncgroup_parent = \"../x\"\n",
            "[teams.\"a b\"]\nmax_sandboxes = 1\n",
            "[jail]\nno_such_key = 1\n",
        ] {
            std::fs::write(&p, bad).unwrap();
            assert!(Config::load(Some(&p)).is_err(), "{bad}");
        }
    }

    #[test]
    fn file_overrides_defaults_and_rejects_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tine.toml");
        std::fs::write(&p, "listen = \"127.0.0.1:4000\"\nmax_sandboxes = 3\n").unwrap();
        let c = Config::load(Some(&p)).unwrap();
        assert_eq!(c.listen.port(), 4000);
        assert_eq!(c.max_sandboxes, 3);
        assert_eq!(c.default_timeout_secs, 300);
        assert_eq!(c.domain(), "localhost:4000");

        std::fs::write(
            &p,
            "[registries]\ninsecure = [\"r.lan:5000\"]\nmirrors = { \"docker.io\" = [\"127.0.0.1:5000\"] }\n\
             credentials = { \"ghcr.io\" = { username = \"me\", password = \"pw\" } }\n",
        )
        .unwrap();
        let c = Config::load(Some(&p)).unwrap();
        assert_eq!(c.registries.insecure, ["r.lan:5000"]);
        assert_eq!(c.registries.mirrors["docker.io"], ["127.0.0.1:5000"]);
        assert_eq!(c.registries.credentials["ghcr.io"].username, "me");

        std::fs::write(&p, "listne = \"x\"\n").unwrap();
        assert!(Config::load(Some(&p))
            .unwrap_err()
            .to_string()
            .contains("listne"));
        std::fs::write(&p, "default_cpu_count = 99\n").unwrap();
        assert!(matches!(
            Config::load(Some(&p)),
            Err(ConfigError::Invalid(_))
        ));
    }
}

/// The host's capacity for sandboxes (see [`Config::capacity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Sandboxes at most: the smaller bound.
    pub sandboxes: usize,
    /// The CPU bound, when there is one.
    pub by_cpu: Option<usize>,
    /// Host cores it was computed from.
    pub cores: usize,
}

/// Cores this process may run on (the cgroup's and affinity's view).
pub fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
