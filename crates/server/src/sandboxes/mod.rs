//! Sandbox lifecycle.
pub mod model;
