//! What every request handler shares: the sandbox manager, metrics, the
//! domain sandboxes are addressed under, and the proxy's pooled client.
//! Below both `api` and `proxy`, so neither imports the other.

use std::sync::Arc;

use crate::guest_client::GuestClient;
use crate::metrics::Metrics;
use crate::sandboxes::Manager;

pub struct AppState {
    pub manager: Arc<Manager>,
    pub metrics: Arc<Metrics>,
    pub domain: String,
    /// Pooled connections into sandboxes, for the proxy.
    pub client: GuestClient,
    /// Where the image daemon writes its cache statistics.
    pub data_dir: std::path::PathBuf,
    /// Template builds (the Template API).
    pub builds: Arc<crate::builds::Builds>,
    /// Creates already made under an `Idempotency-Key`.
    pub idempotency: crate::api::idempotency::Idempotency,
    /// In cluster mode, the secret gateways send: API calls come only
    /// from them ([`crate::cluster::gateway_team`]).
    pub cluster_secret: Option<String>,
    /// In cluster mode with `[cluster] registry`: snapshots pushed to and
    /// pulled from the registry.
    pub captures: Option<Arc<crate::cluster::captures::Captures>>,
    /// Volumes and their content API.
    pub volumes: Arc<crate::volumes::Volumes>,
    /// Secrets (written here, read only by egress proxies).
    pub secrets: Arc<crate::secrets::Secrets>,
    /// Workload identity: its keys are published at `/.well-known/`.
    pub identity: Arc<crate::identity::Identity>,
}
