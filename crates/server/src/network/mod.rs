//! Sandbox networking: what each sandbox may reach (its E2B network
//! policy, enforced by its namespace's firewall and, for rules by name, an
//! egress proxy), and the operator's settings every policy sits on.
//!
//! - `policy`: the E2B policy, its checks, and what it compiles to;
//! - `transform`: `network.rules`, header transforms with secret
//!   placeholders;
//! - `egress`: the per-sandbox proxy that matches domains by SNI / Host;
//! - `inject`: the part of it that terminates HTTP(S) to apply transforms;
//! - `ca`: the host's egress CA, which guests trust, for `inject`;
//! - `sniff`: reading names from a connection's first bytes.
//!
//! The firewall itself is `tine_vmm::firewall`; this module decides what
//! goes in it. A VM's namespace is closed until [`Network::apply`] runs.

pub mod ca;
mod dns;
mod egress;
mod inject;
pub mod policy;
pub mod site;
mod sniff;
pub mod suffix;
pub mod transform;
pub mod tunnel;

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use serde::Deserialize;
use tine_vmm::{Guest, Net4};

pub use policy::{Compiled, NetworkPolicy};
pub use site::Site;

use egress::EgressProxy;
use inject::Injector;

/// Where the injecting proxy reads secrets, and notes what it refused.
#[async_trait::async_trait]
pub trait Vault: Send + Sync {
    /// The current value of `team`'s secret `name` (`None`: no such secret).
    async fn reveal(&self, team: &str, name: &str) -> Result<Option<String>, String>;
    /// Record `detail` as an event of sandbox `sandbox`.
    fn note(&self, sandbox: &str, detail: &str);
    /// A workload identity token for `sandbox` of `team`, for `audience`.
    fn mint(&self, team: &str, sandbox: &str, audience: &str) -> Result<String, String>;
}

/// The vault of a server: its secrets, and its database for events.
struct ServerVault {
    secrets: Arc<crate::secrets::Secrets>,
    identity: Arc<crate::identity::Identity>,
    db: Arc<crate::db::Db>,
}

#[async_trait::async_trait]
impl Vault for ServerVault {
    async fn reveal(&self, team: &str, name: &str) -> Result<Option<String>, String> {
        self.secrets
            .reveal(team, name)
            .await
            .map_err(|e| e.to_string())
    }
    fn note(&self, sandbox: &str, detail: &str) {
        tracing::warn!(sandbox, "{detail}");
        if let Err(e) = self.db.add_event(sandbox, "egress_refused", detail) {
            tracing::warn!(sandbox, "recording an egress event: {e}");
        }
    }
    fn mint(&self, team: &str, sandbox: &str, audience: &str) -> Result<String, String> {
        self.identity
            .mint(team, sandbox, audience)
            .map_err(|e| e.to_string())
    }
}

/// One sandbox's egress: who it is and what it may reach.
pub struct Egress {
    pub sandbox: String,
    pub team: String,
    /// Its workload identity tokens, by name.
    pub iam: crate::identity::Iam,
    pub guest: Guest,
    pub site: Arc<Site>,
    pub policy: Compiled,
    /// The SOCKS5 proxy its TCP goes through (`network.egress_proxy`).
    pub tunnel: Option<tunnel::Tunnel>,
    /// Refusals recorded as events so far (a guest could make millions).
    pub notes: std::sync::atomic::AtomicU32,
}

/// Refusals of one egress proxy recorded as events; later ones are only
/// logged at debug level.
const MAX_NOTES: u32 = 100;

impl Egress {
    /// Record a refusal on the sandbox (the first [`MAX_NOTES`]).
    pub fn note(&self, vault: &dyn Vault, detail: &str) {
        use std::sync::atomic::Ordering;
        if self.notes.fetch_add(1, Ordering::Relaxed) < MAX_NOTES {
            vault.note(&self.sandbox, detail);
        } else {
            tracing::debug!(sandbox = %self.sandbox, "{detail}");
        }
    }

    /// Where a connection that the policy lets out only for the `name` it
    /// sent (SNI or Host) goes: `dst` when the sandboxes' resolver gives
    /// that address for the name, else the first address it gives that the
    /// policy allows. A guest cannot send an allowed name to an address of
    /// its own choosing.
    pub async fn named_destination(
        &self,
        dst: std::net::SocketAddrV4,
        name: &str,
    ) -> Result<std::net::SocketAddrV4, String> {
        let resolver = self
            .site
            .resolver
            .ok_or_else(|| format!("no resolver is configured to find {name} (network.dns)"))?;
        let addrs = dns::resolve_a(std::net::SocketAddrV4::new(resolver, 53), name)
            .await
            .map_err(|e| format!("resolving {name}: {e}"))?;
        if addrs.contains(dst.ip()) {
            return Ok(dst);
        }
        addrs
            .into_iter()
            .find(|ip| self.policy.allows(&self.site, *ip, Some(name)))
            .map(|ip| std::net::SocketAddrV4::new(ip, dst.port()))
            .ok_or_else(|| format!("{name} resolves to no address the sandbox's policy allows"))
    }

    /// A stream to `dst`: from the sandbox's namespace, through its
    /// egress proxy when it has one.
    pub async fn dial(&self, dst: std::net::SocketAddrV4) -> std::io::Result<tunnel::Stream> {
        match &self.tunnel {
            Some(t) => t.dial(&self.guest, &self.site, dst).await,
            None => Ok(Box::pin(self.guest.connect_out(dst).await?)),
        }
    }
}

/// The `[network]` section of the server's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Ranges that are not the internet (private, link-local…) which
    /// sandboxes may reach anyway, e.g. a package mirror on the LAN.
    pub allow_private: Vec<String>,
    /// The resolver sandboxes' DNS goes to (default: the host's first IPv4
    /// nameserver that is not on loopback).
    pub dns: Option<String>,
    /// Addresses for the veth pairs between the host and each sandbox (a
    /// /31 per sandbox); must not overlap a network the host uses.
    pub veth_pool: String,
    /// CA certificates (PEM) trusted for destinations of header
    /// transforms besides the host's trust store.
    pub upstream_ca_file: Option<PathBuf>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            allow_private: Vec::new(),
            dns: None,
            veth_pool: tine_vmm::netns::DEFAULT_POOL.to_string(),
            upstream_ca_file: None,
        }
    }
}

impl NetworkConfig {
    pub fn validate(&self) -> Result<(), String> {
        self.site().map(|_| ())?;
        self.pool().map(|_| ())
    }

    pub fn pool(&self) -> Result<Net4, String> {
        Net4::parse(&self.veth_pool)
            .filter(|n| n.prefix <= 30)
            .ok_or_else(|| {
                format!(
                    "network.veth_pool {:?} is not an IPv4 CIDR of /30 or wider",
                    self.veth_pool
                )
            })
    }

    fn site(&self) -> Result<Site, String> {
        let opened = self
            .allow_private
            .iter()
            .map(|s| {
                Net4::parse(s)
                    .ok_or_else(|| format!("network.allow_private: {s:?} is not an IPv4 CIDR"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let resolver = match &self.dns {
            Some(s) => Some(
                s.parse::<Ipv4Addr>()
                    .map_err(|_| format!("network.dns: {s:?} is not an IPv4 address"))?,
            ),
            None => host_resolver(),
        };
        Ok(Site { opened, resolver })
    }
}

/// The host's first IPv4 nameserver off loopback (systemd-resolved's
/// upstream list when `/etc/resolv.conf` names only its stub).
fn host_resolver() -> Option<Ipv4Addr> {
    ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.trim().strip_prefix("nameserver"))
                .filter_map(|v| v.trim().parse::<Ipv4Addr>().ok())
                .collect::<Vec<_>>()
        })
        .find(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("{0}")]
    Invalid(String),
    #[error("setting the sandbox's firewall: {0}")]
    Firewall(#[from] tine_vmm::Error),
    #[error("starting the sandbox's egress proxy: {0}")]
    Proxy(std::io::Error),
}

/// Applies policies to sandboxes' namespaces and runs their egress proxies.
pub struct Network {
    site: Arc<Site>,
    proxies: Mutex<HashMap<String, EgressProxy>>,
    /// The host's egress CA (`None` in unit tests without a data dir).
    ca: Option<Arc<ca::EgressCa>>,
    upstream: Option<tokio_rustls::TlsConnector>,
    /// The host's trust store (and `upstream_ca_file`).
    roots: Arc<tokio_rustls::rustls::RootCertStore>,
    inject: OnceLock<Arc<Injector>>,
}

impl Network {
    /// With the egress CA kept in `<data_dir>/egress-ca`.
    pub fn with_ca(config: &NetworkConfig, data_dir: &Path) -> Result<Self, String> {
        let mut n = Self::new(config)?;
        let ca =
            ca::EgressCa::load_or_create(&data_dir.join("egress-ca")).map_err(|e| e.to_string())?;
        n.ca = Some(Arc::new(ca));
        n.roots = Arc::new(Injector::host_roots(config.upstream_ca_file.as_deref())?);
        n.upstream = Some(Injector::upstream_connector(n.roots.clone())?);
        Ok(n)
    }

    /// Whether `proxy` can be used: checked, resolving to the internet.
    pub async fn check_proxy(&self, proxy: &tunnel::EgressProxyConfig) -> Result<(), String> {
        let t = tunnel::Tunnel::new(proxy, &self.roots)?;
        t.resolve(&self.site)
            .await
            .map(|_| ())
            .map_err(|e| format!("network.egress_proxy: {e}"))
    }

    /// Where secrets come from; header transforms work from then on.
    pub fn set_vault(
        &self,
        secrets: Arc<crate::secrets::Secrets>,
        identity: Arc<crate::identity::Identity>,
        db: Arc<crate::db::Db>,
    ) {
        let (Some(ca), Some(upstream)) = (&self.ca, &self.upstream) else {
            return;
        };
        let _ = self.inject.set(Arc::new(Injector {
            ca: ca.clone(),
            upstream: upstream.clone(),
            vault: Arc::new(ServerVault {
                secrets,
                identity,
                db,
            }),
        }));
    }

    /// The certificate a guest with `policy` must trust (PEM): the egress
    /// CA when the policy transforms requests (others are spared the
    /// install at every start).
    pub fn trust_for(&self, policy: &NetworkPolicy) -> Option<&str> {
        let transforms = policy.compile().is_ok_and(|c| !c.transforms.is_empty());
        self.ca.as_ref().filter(|_| transforms).map(|c| c.pem())
    }

    pub fn new(config: &NetworkConfig) -> Result<Self, String> {
        let site = config.site()?;
        if site.resolver.is_none() {
            tracing::warn!(
                "no IPv4 nameserver off loopback in /etc/resolv.conf: sandboxes get no DNS \
                 (set network.dns)"
            );
        }
        tine_vmm::netns::set_pool(config.pool()?);
        Ok(Self {
            site: Arc::new(site),
            proxies: Mutex::new(HashMap::new()),
            ca: None,
            upstream: None,
            roots: Arc::new(tokio_rustls::rustls::RootCertStore::empty()),
            inject: OnceLock::new(),
        })
    }

    /// Give sandbox `rec` (its VM's network is `guest`) the firewall of
    /// `policy`, with an egress proxy when the policy names domains or
    /// transforms requests. Replaces whatever it had.
    pub async fn apply(
        &self,
        rec: &crate::model::SandboxRecord,
        guest: &Guest,
        policy: &NetworkPolicy,
    ) -> Result<(), NetworkError> {
        let id = rec.id.as_str();
        let t = std::time::Instant::now();
        let compiled = policy.compile().map_err(NetworkError::Invalid)?;
        if !compiled.transforms.is_empty() && self.inject.get().is_none() {
            return Err(NetworkError::Invalid(
                "network.rules: header transforms need the egress CA and secrets, \
                 which this server has not set up"
                    .into(),
            ));
        }
        let rules = compiled.rules(&self.site);
        let old = self.take(id);
        if let Some(old) = old {
            old.stop().await;
        }
        if compiled.by_name() {
            // Listening before the redirect exists, so no connection is refused.
            let listener = guest
                .listen(policy::PROXY_PORT)
                .map_err(NetworkError::Proxy)?;
            let tunnel = match &compiled.egress_proxy {
                Some(p) => {
                    Some(tunnel::Tunnel::new(p, &self.roots).map_err(NetworkError::Invalid)?)
                }
                None => None,
            };
            let egress = Arc::new(Egress {
                sandbox: id.to_string(),
                team: rec.team.clone(),
                iam: rec.iam.clone(),
                guest: guest.clone(),
                site: self.site.clone(),
                policy: compiled,
                tunnel,
                notes: Default::default(),
            });
            let proxy = EgressProxy::start(listener, egress, self.inject.get().cloned());
            self.proxies
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.to_string(), proxy);
        }
        guest.set_egress(&rules, true).await?;
        tracing::debug!(
            sandbox = id,
            apply_ms = t.elapsed().as_secs_f64() * 1e3,
            "network policy"
        );
        Ok(())
    }

    /// The default policy, for VMs that belong to no sandbox (build VMs),
    /// or (with `open` false) loaded ahead for a pooled VM, which then
    /// costs its sandbox no `nft` run if it keeps the default.
    pub async fn apply_default(&self, guest: &Guest, open: bool) -> Result<(), NetworkError> {
        let compiled = NetworkPolicy::default()
            .compile()
            .map_err(NetworkError::Invalid)?;
        guest.set_egress(&compiled.rules(&self.site), open).await?;
        Ok(())
    }

    fn take(&self, id: &str) -> Option<EgressProxy> {
        self.proxies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
    }

    /// Sandbox `id`'s VM is gone: stop its egress proxy.
    pub fn release(&self, id: &str) {
        drop(self.take(id));
    }
}
