//! tine's server (work in progress).
pub mod config;
pub mod db;
pub mod ids;
pub mod sandboxes;
pub mod templates;
