//! Cluster mode: many `tine serve` nodes behind `tine gateway` replicas,
//! with PostgreSQL as the shared catalog (docs/cluster.md).
//!
//! - [`catalog`]: the PostgreSQL schema and every query on it.
//! - [`node`]: what a node does in a cluster: heartbeats with its capacity,
//!   publishes its sandboxes, and takes API calls only from gateways
//!   ([`gateway_team`]).
//!
//! A node stays authoritative for its VMs (its SQLite, crash recovery);
//! the catalog is a published view that heals itself from the nodes' full
//! lists.

pub mod captures;
pub mod catalog;
pub mod node;
pub mod secrets;
pub mod spread;
pub mod trash;
pub mod volumes;

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The header that carries the cluster secret from a gateway to a node.
pub use crate::proxy::CLUSTER_SECRET_HEADER as SECRET_HEADER;
/// The header in which a gateway names the caller's team to a node.
pub const TEAM_HEADER: &str = "x-tine-team";
/// On a gateway's `connect`: the sandbox's own node is down or full;
/// adopt it from its pushed pause capture if this node lacks it.
pub const ADOPT_HEADER: &str = "x-tine-adopt";
/// On a gateway's fork: start what fits here, push the capture for the
/// rest ([`spread::fork_here`]).
pub const SPREAD_HEADER: &str = "x-tine-spread";
/// On a gateway's fork: start the children from this fork capture, which
/// another node pushed ([`spread::fork_elsewhere`]).
pub const FORK_FROM_HEADER: &str = "x-tine-fork-from";

/// `[cluster]` of a node's config; cluster mode is on when `postgres_url`
/// is set.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// The catalog: a libpq URL (`postgresql://user@host:port/db`) or
    /// key=value string (`host=/run/postgresql dbname=tine`).
    pub postgres_url: Option<String>,
    /// This node's name in the catalog (default: the host name and the
    /// listen port).
    pub node_id: Option<String>,
    /// Where gateways reach this node (default: `http://<listen>`).
    pub advertise_url: Option<String>,
    /// A file holding the secret gateways send; the node refuses API calls
    /// without it, a user's key included.
    pub secret_file: Option<PathBuf>,
    /// Seconds between heartbeats (default 2).
    pub heartbeat_secs: Option<u64>,
    /// Seconds between full lists of its sandboxes (default 60; a list
    /// also goes whenever one of them changes).
    pub publish_secs: Option<u64>,
    /// Where captures travel between nodes: a repository in an OCI
    /// registry (`host:port/path`, reached as `[registries]` says).
    /// Persistent snapshots are pushed there and pulled by any node that
    /// is asked for one it lacks, templates built here likewise. Unset:
    /// captures stay on their node.
    pub registry: Option<String>,
    /// With `registry`: push the capture of each sandbox paused with its
    /// memory too, so that its `connect` resumes it on another node when
    /// this one is down or full (default true).
    pub durable_pause: Option<bool>,
    /// With `registry`: a node restoring a capture it lacks reads its RAM
    /// and disk lazily, chunk by chunk as the VM touches them, through
    /// the image daemon's FUSE mount (default true; false, or a host
    /// without FUSE: it fetches the whole capture first).
    pub lazy_pull: Option<bool>,
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        self.postgres_url.is_some()
    }

    /// This node's name: `node_id`, or the host name and `listen`'s port.
    pub fn node_id_for(&self, listen: std::net::SocketAddr) -> String {
        self.node_id.clone().unwrap_or_else(|| {
            let host = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "node".into());
            format!("{host}-{}", listen.port())
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("reading the cluster secret {0}: {1}")]
    Read(PathBuf, std::io::Error),
    #[error("the cluster secret in {0} is shorter than 16 characters")]
    Short(PathBuf),
    #[error("the cluster secret file {0} is readable by others: chmod 0600 it")]
    Open(PathBuf),
}

/// The shared secret from `path` (trimmed; at least 16 characters; the
/// file must not be readable by group or others).
pub fn read_secret(path: &Path) -> Result<String, SecretError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| SecretError::Read(path.into(), e))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(SecretError::Open(path.into()));
    }
    let s = std::fs::read_to_string(path).map_err(|e| SecretError::Read(path.into(), e))?;
    let s = s.trim().to_string();
    if s.len() < 16 {
        return Err(SecretError::Short(path.into()));
    }
    Ok(s)
}

pub use crate::proxy::secret_matches;

/// Why a node refuses a call in cluster mode.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No cluster secret: a client called the node instead of a gateway.
    NotFromGateway,
    /// A cluster secret that is not this cluster's.
    WrongSecret,
    /// A gateway's call without a valid team.
    NoTeam,
}

/// The team a gateway's call is made for, from its headers; `secret` is the
/// cluster's.
pub fn gateway_team(secret: &str, headers: &http::HeaderMap) -> Result<String, Refusal> {
    let given = headers
        .get(SECRET_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or(Refusal::NotFromGateway)?;
    if !secret_matches(secret, given) {
        return Err(Refusal::WrongSecret);
    }
    headers
        .get(TEAM_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|t| crate::db::valid_team(t))
        .map(str::to_string)
        .ok_or(Refusal::NoTeam)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_takes_calls_only_with_the_clusters_secret_and_a_team() {
        let secret = "0123456789abcdef-secret";
        let mut h = http::HeaderMap::new();
        assert_eq!(gateway_team(secret, &h), Err(Refusal::NotFromGateway));
        h.insert(SECRET_HEADER, "0123456789abcdef-wrong".parse().unwrap());
        assert_eq!(gateway_team(secret, &h), Err(Refusal::WrongSecret));
        h.insert(SECRET_HEADER, secret.parse().unwrap());
        assert_eq!(gateway_team(secret, &h), Err(Refusal::NoTeam));
        h.insert(TEAM_HEADER, "../etc".parse().unwrap());
        assert_eq!(gateway_team(secret, &h), Err(Refusal::NoTeam));
        h.insert(TEAM_HEADER, "team-a".parse().unwrap());
        assert_eq!(gateway_team(secret, &h), Ok("team-a".into()));
    }

    #[test]
    fn a_secret_file_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, "short\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(read_secret(&p), Err(SecretError::Short(_))));
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        assert_eq!(read_secret(&p).unwrap(), "0123456789abcdef0123");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(read_secret(&p), Err(SecretError::Open(_))));
        assert!(matches!(
            read_secret(&dir.path().join("none")),
            Err(SecretError::Read(..))
        ));
    }
}
