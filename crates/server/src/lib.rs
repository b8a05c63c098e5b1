//! tine's server: one process per host that speaks the E2B REST API,
//! proxies SDK traffic into sandboxes, runs their lifecycle and keeps its
//! state in SQLite.
//!
//! Where a request goes: [`app`] composes [`proxy`] (sandbox traffic,
//! chosen by headers or Host) in front of [`api`] (REST routes); both are
//! thin over [`sandboxes::Manager`] (lifecycle), which drives VMs through
//! `tine_vmm::Driver`; [`network`] decides what each sandbox may reach;
//! [`console`] serves the web console, a client of those same routes.
//! The import arrows run one way:
//! `app` → `api`/`proxy` → [`state`] → [`guest_client`] → [`sandboxes`] →
//! [`templates`] → [`db`] → [`model`] → `tine_vmm`.

pub mod api;
pub mod app;
pub mod builds;
pub mod cluster;
pub mod config;
pub mod console;
pub mod crypto;
pub mod db;
pub mod gateway;
pub use tine_vmm::failpoint;
pub mod guest_client;
mod guest_tls;
pub mod identity;
pub mod ids;
pub mod metrics;
pub mod model;
pub mod network;
pub mod proxy;
pub mod sandboxes;
pub mod secrets;
pub mod state;
pub mod templates;
pub mod tls;
pub mod uri;
pub mod volumes;

pub use app::serve;
pub use config::Config;
