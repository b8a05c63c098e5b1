//! Operations in flight on a sandbox, as recorded in its row before they
//! start (`Db::set_intent`), so a restart after a crash knows what was
//! cut short and can finish or undo it (`recover.rs`). Stored as JSON.

use serde::{Deserialize, Serialize};

use crate::db::SnapshotKind;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub(super) enum Intent {
    /// A pause into capture `capture`; with `keep_memory` false the next
    /// resume cold-boots from its disk.
    Pause { capture: String, keep_memory: bool },
    /// A capture of a running sandbox that goes on running: a user
    /// snapshot (with its names) or the capture a fork starts from.
    Capture {
        capture: String,
        kind: String,
        #[serde(default)]
        names: Vec<String>,
    },
}

impl Intent {
    pub fn capture(&self) -> &str {
        match self {
            Intent::Pause { capture, .. } | Intent::Capture { capture, .. } => capture,
        }
    }

    /// The kind of snapshot row the capture becomes.
    pub fn kind(&self) -> SnapshotKind {
        match self {
            Intent::Pause { .. } => SnapshotKind::Pause,
            Intent::Capture { kind, .. } => {
                SnapshotKind::parse(kind).unwrap_or(SnapshotKind::Snapshot)
            }
        }
    }
}

impl std::fmt::Display for Intent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
    }
}

impl std::str::FromStr for Intent {
    type Err = ();
    /// JSON, or the form of the first release that recorded pauses:
    /// `pause <capture> memory|disk`.
    fn from_str(s: &str) -> Result<Self, ()> {
        if let Ok(intent) = serde_json::from_str(s) {
            return Ok(intent);
        }
        match s.split(' ').collect::<Vec<_>>()[..] {
            ["pause", capture, what] if !capture.is_empty() => Ok(Intent::Pause {
                capture: capture.to_string(),
                keep_memory: match what {
                    "memory" => true,
                    "disk" => false,
                    _ => return Err(()),
                },
            }),
            _ => Err(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_reads_the_old_form() {
        let intents = [
            Intent::Pause {
                capture: "p-1".into(),
                keep_memory: false,
            },
            Intent::Capture {
                capture: "snap-1".into(),
                kind: "snapshot".into(),
                names: vec!["a name with spaces".into()],
            },
        ];
        for i in intents {
            assert_eq!(i.to_string().parse::<Intent>(), Ok(i));
        }
        assert_eq!(
            "pause p-2 memory".parse::<Intent>(),
            Ok(Intent::Pause {
                capture: "p-2".into(),
                keep_memory: true
            })
        );
        assert!("pause p-2 sideways".parse::<Intent>().is_err());
        assert!("{\"op\":\"explode\"}".parse::<Intent>().is_err());
    }
}
