//! A sandbox as the server records it, and its lifecycle.
//!
//! ```text
//!  Starting ──▶ Running ◀──▶ Paused        (pause/resume: issue "Templates…")
//!     │            │            │
//!     ▼            ▼            ▼
//!   Failed       Killed       Killed
//! ```
//! Only `Running` and `Paused` are visible through the E2B API (the SDK
//! accepts no other `state`); `Killed` and `Failed` rows stay in the
//! database as history.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Milliseconds since the epoch as RFC 3339 (UTC), as the E2B API writes
/// times.
pub fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Starting,
    Running,
    Paused,
    Killed,
    Failed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Killed => "killed",
            SandboxState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "starting" => SandboxState::Starting,
            "running" => SandboxState::Running,
            "paused" => SandboxState::Paused,
            "killed" => SandboxState::Killed,
            "failed" => SandboxState::Failed,
            _ => return None,
        })
    }

    /// The state as the E2B API names it, for sandboxes the API shows.
    pub fn e2b(self) -> Option<&'static str> {
        match self {
            SandboxState::Running => Some("running"),
            SandboxState::Paused => Some("paused"),
            _ => None,
        }
    }

    /// Whether the lifecycle allows going from `self` to `to`.
    pub fn can_become(self, to: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, to),
            (Starting, Running | Failed | Killed)
                | (Running, Paused | Killed)
                | (Paused, Running | Killed)
        )
    }
}

/// What happens around a pause (E2B's `lifecycle`), stored as JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Lifecycle {
    /// Traffic to the paused sandbox (an envd call or `get_host`) resumes
    /// it (`autoResume.enabled`).
    pub auto_resume: bool,
    /// The pause at timeout keeps only the disk (`autoPauseMemory: false`).
    pub auto_pause_disk_only: bool,
    /// The sandbox is paused with only its disk: the next resume
    /// cold-boots it.
    pub paused_disk_only: bool,
}

/// One sandbox row (serialized as it travels with a durable pause's
/// capture between nodes of a cluster).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub template_id: String,
    pub alias: Option<String>,
    pub client_id: String,
    pub state: SandboxState,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub envd_version: String,
    pub envd_access_token: String,
    /// Unix milliseconds.
    pub started_at_ms: i64,
    pub end_at_ms: i64,
    pub auto_pause: bool,
    /// Why it failed or was killed by the server, if it was.
    pub error: Option<String>,
    /// What it may reach, and who may reach its ports.
    pub network: crate::network::NetworkPolicy,
    /// Required by `get_host` traffic when the policy closes public traffic.
    pub traffic_token: Option<String>,
    pub lifecycle: Lifecycle,
    /// The team of the API key that made it (or of its fork source).
    pub team: String,
    /// Volumes mounted into it (children of a fork and sandboxes from its
    /// snapshots keep them: their guests have them mounted).
    pub volume_mounts: Vec<crate::volumes::VolumeMount>,
    /// Workload identity tokens it may use (`iam.tokens`).
    pub iam: crate::identity::Iam,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_transitions() {
        use SandboxState::*;
        assert!(Starting.can_become(Running));
        assert!(Running.can_become(Killed));
        assert!(Paused.can_become(Running));
        assert!(!Killed.can_become(Running), "a killed sandbox stays dead");
        assert!(!Failed.can_become(Running));
        assert!(!Running.can_become(Starting));
        for s in [Starting, Running, Paused, Killed, Failed] {
            assert_eq!(SandboxState::parse(s.as_str()), Some(s));
        }
        assert_eq!(Running.e2b(), Some("running"));
        assert_eq!(Starting.e2b(), None);
    }
}

/// Whether one of a snapshot's names is `wanted` (`name` also matches
/// `name:tag`).
pub fn has_name(names: &[String], wanted: &str) -> bool {
    names.iter().any(|n| {
        n == wanted
            || (!wanted.contains(':') && n.split_once(':').is_some_and(|(base, _)| base == wanted))
    })
}

#[cfg(test)]
mod name_tests {
    use super::has_name;

    #[test]
    fn snapshot_names_match_with_or_without_their_tag() {
        let names = vec!["snap:v1".to_string(), "other".to_string()];
        assert!(has_name(&names, "snap"));
        assert!(has_name(&names, "snap:v1"));
        assert!(!has_name(&names, "snap:v2"));
        assert!(has_name(&names, "other"));
        assert!(!has_name(&names, "sna"));
    }
}
