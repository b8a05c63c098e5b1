//! One network namespace per VM, holding the VM's tap device.
//!
//! Every guest uses the same address ([`GUEST_IP`]); namespaces keep them
//! apart, so a clone needs no re-addressing. The host reaches a guest port by
//! creating the socket inside the namespace ([`Netns::connect`]): a
//! short-lived thread enters the namespace with `setns`, creates the socket
//! and exits; a socket keeps the namespace it was created in. No veth, no
//! NAT, no per-VM host ports, no collisions.
//!
//! Creation uses iproute2 (`ip netns add` sets up the `/run/netns` bind
//! mount that other tools such as `ip netns exec` understand, and one
//! `ip -batch` configures the rest): two process spawns, a few ms, and the
//! operator can inspect everything with the usual tools.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Stdio;

use nix::sched::{setns, CloneFlags};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};

/// Address of every guest.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 11, 0, 2);
/// Address of the tap device (the guest's gateway) inside each namespace.
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 11, 0, 1);
pub const PREFIX_LEN: u8 = 24;
/// Name of the tap device inside each namespace.
pub const TAP_NAME: &str = "tap0";
/// Namespaces we create are named with this prefix (cleanup finds them).
pub const NAME_PREFIX: &str = "tine-";

#[derive(Debug)]
pub struct Netns {
    name: String,
    file: File,
}

fn netns_err(name: &str, detail: impl Into<String>) -> Error {
    Error::Netns {
        name: name.to_string(),
        detail: detail.into(),
    }
}

async fn ip(name: &str, args: &[&str], stdin: Option<&str>) -> Result<()> {
    let mut cmd = tokio::process::Command::new("ip");
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| netns_err(name, format!("running ip: {e}")))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .await
            .map_err(|e| netns_err(name, e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| netns_err(name, e.to_string()))?;
    if !out.status.success() {
        return Err(netns_err(
            name,
            format!(
                "ip {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(())
}

impl Netns {
    /// Create namespace `tine-<vm_id>` with `lo` up and a tap device that
    /// has the gateway address.
    pub async fn create(vm_id: &str) -> Result<Self> {
        let name = format!("{NAME_PREFIX}{vm_id}");
        ip(&name, &["netns", "add", &name], None).await?;
        let batch = format!(
            "link set lo up\n\
             tuntap add dev {TAP_NAME} mode tap\n\
             addr add {HOST_IP}/{PREFIX_LEN} dev {TAP_NAME}\n\
             link set {TAP_NAME} up\n"
        );
        if let Err(e) = ip(&name, &["-n", &name, "-batch", "-"], Some(&batch)).await {
            let _ = ip(&name, &["netns", "delete", &name], None).await;
            return Err(e);
        }
        Self::open(&name)
    }

    /// Open an existing namespace by name (e.g. when adopting a VM).
    pub fn open(name: &str) -> Result<Self> {
        let file = File::open(Self::path_of(name))
            .map_err(|e| netns_err(name, format!("opening: {e}")))?;
        Ok(Self {
            name: name.to_string(),
            file,
        })
    }

    fn path_of(name: &str) -> PathBuf {
        PathBuf::from("/run/netns").join(name)
    }

    /// A second handle on the same namespace (for connecting to the guest
    /// without holding the VM).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Self {
            name: self.name.clone(),
            file: self.file.try_clone()?,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file; a child process can `setns` into it.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Open a TCP connection to `port` of the guest in this namespace.
    pub async fn connect(&self, port: u16) -> std::io::Result<tokio::net::TcpStream> {
        let ns = self.file.try_clone()?;
        let socket = std::thread::spawn(move || -> std::io::Result<socket2::Socket> {
            // This thread exists only to create the socket, so it never has
            // to switch back to the host namespace.
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
            let s =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM.cloexec(), None)?;
            s.set_nonblocking(true)?;
            s.set_tcp_nodelay(true)?;
            Ok(s)
        })
        .join()
        .map_err(|_| std::io::Error::other("netns socket thread panicked"))??;
        let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(socket));
        socket.connect(SocketAddr::from((GUEST_IP, port))).await
    }
}

/// Delete namespace `name`; a namespace that is already gone is fine.
pub async fn delete_by_name(name: &str) -> Result<()> {
    if !Netns::path_of(name).exists() {
        return Ok(());
    }
    ip(name, &["netns", "delete", name], None).await
}

/// Names of all namespaces tine created (for cleanup and leak checks).
pub fn list_ours() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(NAME_PREFIX))
                .collect()
        })
        .unwrap_or_default()
}

impl crate::driver::GuestNet for Netns {
    fn connect(
        &self,
        port: u16,
    ) -> crate::driver::BoxFuture<'_, std::io::Result<tokio::net::TcpStream>> {
        Box::pin(Netns::connect(self, port))
    }
}
