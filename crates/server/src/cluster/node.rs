//! A node in a cluster: heartbeats with its capacity every few seconds and
//! publishes its full list of sandboxes when one of them changes (made,
//! paused, killed, timed out, its end time moved; changes in a burst go as
//! one list) and every `publish_secs` anyway, so the catalog heals itself
//! after any lost write (a gateway also writes what it changed through the
//! node at once). PostgreSQL being down costs nothing but staleness: the loop
//! logs and tries again.

use std::sync::Arc;
use std::time::Duration;

use super::catalog::{Catalog, CatalogError, NodeStatus, SandboxRow};
use super::ClusterConfig;
use crate::db::ListFilter;
use crate::model::SandboxState;
use crate::sandboxes::Manager;

/// How long a node gathers sandbox changes before it publishes them.
const CHANGES_GATHERED: Duration = Duration::from_millis(200);

/// A node's link to its cluster.
pub struct NodeLink {
    pub id: String,
    /// What gateways must send ([`super::gateway_team`]).
    pub secret: String,
    address: String,
    catalog: Catalog,
    heartbeat: Duration,
    publish: Duration,
    data_dir: std::path::PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("[cluster] secret_file is required in cluster mode")]
    NoSecret,
    #[error(transparent)]
    Secret(#[from] super::SecretError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

impl NodeLink {
    /// Join the cluster of `cfg`: read the secret, reach PostgreSQL (fails
    /// now if it cannot), and register with a first heartbeat.
    pub async fn join(
        cfg: &ClusterConfig,
        listen: std::net::SocketAddr,
        data_dir: &std::path::Path,
    ) -> Result<Self, JoinError> {
        let secret = super::read_secret(cfg.secret_file.as_deref().ok_or(JoinError::NoSecret)?)?;
        let url = cfg.postgres_url.as_deref().unwrap_or_default();
        let catalog = Catalog::connect(url).await?;
        let id = cfg.node_id_for(listen);
        let address = cfg
            .advertise_url
            .clone()
            .unwrap_or_else(|| format!("http://{listen}"));
        Ok(NodeLink {
            id,
            secret,
            address: address.trim_end_matches('/').to_string(),
            catalog,
            heartbeat: Duration::from_secs(cfg.heartbeat_secs.unwrap_or(2).max(1)),
            publish: Duration::from_secs(cfg.publish_secs.unwrap_or(60).max(1)),
            data_dir: data_dir.to_path_buf(),
        })
    }

    fn status(&self, manager: &Manager) -> NodeStatus {
        let (cap, admitted, _) = manager.capacity();
        let mut templates = vec!["base".to_string()];
        // Templates and persistent snapshots: both can be created from.
        let rows = manager.db().list_templates().into_iter().flatten();
        let snapshots = manager.list_snapshots(None).into_iter().flatten();
        for r in rows.chain(snapshots) {
            templates.extend(r.names.iter().cloned());
            templates.push(r.id.clone());
        }
        templates.sort();
        templates.dedup();
        let disk_free_mb =
            crate::sandboxes::limits::disk_free_bytes(&self.data_dir).unwrap_or(0) >> 20;
        NodeStatus {
            address: self.address.clone(),
            cores: cap.cores,
            capacity: cap.sandboxes,
            live: admitted,
            memory_free_mb: crate::sandboxes::limits::mem_available_mb().unwrap_or(0),
            disk_free_mb,
            templates,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// Every running or paused sandbox of this node, as the catalog keeps it.
    fn sandboxes(manager: &Manager) -> Vec<SandboxRow> {
        let f = ListFilter {
            states: vec![SandboxState::Running, SandboxState::Paused],
            limit: usize::MAX >> 1,
            ..Default::default()
        };
        manager
            .list(&f)
            .unwrap_or_default()
            .into_iter()
            .map(row_of)
            .collect()
    }

    /// The catalog this node publishes to.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// One heartbeat and, when due, a full list.
    async fn beat(&self, manager: &Manager, full: bool) -> Result<(), CatalogError> {
        self.catalog
            .heartbeat(&self.id, &self.status(manager))
            .await?;
        // Every beat: a gateway may still route a moved sandbox here
        // until this node no longer has it.
        self.drop_moved(manager).await?;
        if full {
            // The list is read after PostgreSQL's "now": a gateway's write
            // after that instant wins over it.
            let at = self.catalog.now_ms().await?;
            let rows = Self::sandboxes(manager);
            self.catalog.publish(&self.id, at, &rows).await?;
        }
        Ok(())
    }

    /// Drop the paused sandboxes another node resumed from their pushed
    /// captures while this one was down or full: they live there now.
    async fn drop_moved(&self, manager: &Manager) -> Result<(), CatalogError> {
        for (id, to) in self.catalog.moved_away(&self.id).await? {
            let paused_here = manager
                .get(&id)
                .is_ok_and(|r| r.state == SandboxState::Paused);
            if !paused_here {
                continue;
            }
            let why = format!("resumed on node {to} from its pushed capture");
            match manager.kill(&id, &why).await {
                Ok(()) => tracing::info!(sandbox = %id, "dropped: {why}"),
                Err(e) => tracing::warn!(sandbox = %id, "dropping a sandbox that moved: {e}"),
            }
        }
        Ok(())
    }

    /// Heartbeat and publish forever.
    pub async fn run(self: Arc<Self>, manager: Arc<Manager>) {
        let mut last_full: Option<std::time::Instant> = None;
        let mut failing = false;
        let mut changed = false;
        let mut changes = manager.db().subscribe();
        loop {
            let full = changed || last_full.is_none_or(|t| t.elapsed() >= self.publish);
            match self.beat(&manager, full).await {
                Ok(()) => {
                    if failing {
                        tracing::info!(node = %self.id, "the cluster catalog is reachable again");
                    }
                    failing = false;
                    if full {
                        last_full = Some(std::time::Instant::now());
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(node = %self.id, "heartbeat to the cluster catalog failed: {e}");
                    }
                    failing = true;
                    last_full = None;
                }
            }
            changed = tokio::select! {
                _ = tokio::time::sleep(self.heartbeat) => false,
                _ = changes.changed() => {
                    tokio::time::sleep(CHANGES_GATHERED).await;
                    true
                }
            };
        }
    }
}

/// A sandbox record as the catalog keeps it.
pub fn row_of(r: crate::model::SandboxRecord) -> SandboxRow {
    SandboxRow {
        id: r.id.clone(),
        team: r.team.clone(),
        state: r.state.e2b().unwrap_or("running").to_string(),
        template_id: r.template_id.clone(),
        started_ms: r.started_at_ms,
        metadata: r.metadata.clone(),
        detail: crate::api::listed(r),
    }
}
