//! One network namespace per VM, holding the VM's tap device and its way
//! out.
//!
//! ```text
//!  guest eth0 10.11.0.2 ── tap0 10.11.0.1 ─┐ namespace tine-<vm>  (table inet tine)
//!                                           veth0 <pool>+2i+1/31
//!                                             │
//!  host ─────────────────────────────────── tnv<i> <pool>+2i/31   (table inet tine_host)
//! ```
//!
//! Every guest uses the same address ([`GUEST_IP`]); namespaces keep them
//! apart, so a clone needs no re-addressing. The host reaches a guest port by
//! creating the socket inside the namespace ([`Netns::connect`]): a
//! short-lived thread enters the namespace with `setns`, creates the socket
//! and exits; a socket keeps the namespace it was created in.
//!
//! The guest's way out is a veth pair with a /31 from the pool
//! ([`set_pool`], default [`DEFAULT_POOL`]), NAT-ed twice (in the namespace
//! to its veth address, on the host to the host's own); what it may reach is
//! the namespace's firewall ([`crate::firewall`]). A new namespace is
//! closed (forwarding off: nothing leaves it) until a policy is set
//! ([`Netns::set_egress`]), which costs no `nft` run on the create path.
//!
//! Creation uses iproute2 (`ip netns add` sets up the `/run/netns` bind
//! mount that other tools such as `ip netns exec` understand, and `ip
//! -batch` configures the rest) and one `nft -f`: a few process spawns, a
//! few ms, and the operator can inspect everything with the usual tools.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::OnceLock;

use nix::sched::{setns, CloneFlags};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};
use crate::firewall::{self, EgressRules};
use crate::netaddr::Net4;

pub use crate::netaddr::{
    DEFAULT_POOL, GUEST_IP, HOST_IP, NAME_PREFIX, PREFIX_LEN, TAP_NAME, VETH_HOST_PREFIX, VETH_NAME,
};

static POOL: OnceLock<Net4> = OnceLock::new();
static SCOPE: OnceLock<String> = OnceLock::new();

/// Name this process's namespaces `tine-<scope>-<vm id>` rather than
/// `tine-<vm id>`: for servers on one host that may run a VM of the same
/// id (nodes of a cluster on one machine, where a sandbox moves from one to
/// another). Only the first call counts, and only before the first
/// namespace is made or opened.
pub fn set_scope(scope: &str) {
    let _ = SCOPE.set(scope.to_string());
}

/// The name of VM `vm_id`'s namespace.
pub fn name_of(vm_id: &str) -> String {
    match SCOPE.get() {
        Some(scope) => format!("{NAME_PREFIX}{scope}-{vm_id}"),
        None => format!("{NAME_PREFIX}{vm_id}"),
    }
}

/// Take veth addresses from `pool` (a /31 per VM) instead of
/// [`DEFAULT_POOL`]; only the first call counts, and only before the first
/// namespace is made.
pub fn set_pool(pool: Net4) {
    let _ = POOL.set(pool);
}

pub fn pool() -> Net4 {
    *POOL.get().unwrap_or(&DEFAULT_POOL)
}

/// The host's and the namespace's veth addresses of pair `index`.
fn veth_addrs(pool: Net4, index: u32) -> Option<(Ipv4Addr, Ipv4Addr)> {
    let size = 1u64 << (32 - u32::from(pool.prefix));
    if u64::from(index) * 2 + 1 >= size {
        return None;
    }
    let base = u32::from(pool.network()) + index * 2;
    Some((Ipv4Addr::from(base), Ipv4Addr::from(base + 1)))
}

/// Indexes of the veth pairs on the host now.
fn used_indexes() -> std::collections::BTreeSet<u32> {
    std::fs::read_dir("/sys/class/net")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_prefix(VETH_HOST_PREFIX)?
                        .parse()
                        .ok()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Serialises index choice within this process; another process racing
/// for the same index loses at `ip link add` and tries the next.
static ALLOCATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug)]
pub struct Netns {
    name: String,
    file: File,
    /// What this handle knows of the namespace's firewall (the lock
    /// serialises changes).
    egress: tokio::sync::Mutex<Egress>,
}

#[derive(Debug, Default)]
struct Egress {
    /// Made by this handle and given no firewall yet: the first ruleset
    /// need not replace one (which costs `nft` a cache fetch, ≈ 12 ms).
    fresh: bool,
    /// The ruleset this handle last applied.
    applied: Option<EgressRules>,
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
    /// Create namespace [`name_of`]`(vm_id)` with `lo` up, a tap device that has
    /// the gateway address, and a veth pair to the host; closed until
    /// [`Netns::set_egress`].
    pub async fn create(vm_id: &str) -> Result<Self> {
        let name = name_of(vm_id);
        firewall::host_setup(pool()).await?;
        ip(&name, &["netns", "add", &name], None).await?;
        let made = async {
            let t = std::time::Instant::now();
            let mut ns = Self::open(&name)?;
            ns.egress.get_mut().fresh = true;
            // Closed until a policy is set: a new namespace inherits the
            // host's forwarding (on), so switch it off before any route.
            ns.set_forwarding(false)?;
            let (host_ip, ns_ip) = Self::add_veth(&name).await?;
            let t_veth = t.elapsed();
            let batch = format!(
                "link set lo up\n\
                 tuntap add dev {TAP_NAME} mode tap\n\
                 addr add {HOST_IP}/{PREFIX_LEN} dev {TAP_NAME}\n\
                 link set {TAP_NAME} up\n\
                 addr add {ns_ip}/31 dev {VETH_NAME}\n\
                 link set {VETH_NAME} up\n\
                 route add default via {host_ip}\n"
            );
            ip(&name, &["-n", &name, "-batch", "-"], Some(&batch)).await?;
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(
                ns = %name,
                veth_ms = ms(t_veth),
                devices_ms = ms(t.elapsed() - t_veth),
                "namespace devices"
            );
            Ok(ns)
        }
        .await;
        if made.is_err() {
            let _ = ip(&name, &["netns", "delete", &name], None).await;
        }
        made
    }

    /// Add the veth pair `tnv<i>` (host) / `veth0` (namespace `name`) with
    /// the lowest free index; returns (host address, namespace address).
    async fn add_veth(name: &str) -> Result<(Ipv4Addr, Ipv4Addr)> {
        let pool = pool();
        let _one = ALLOCATING.lock().await;
        let used = used_indexes();
        let mut index = 0u32;
        for _attempt in 0..64 {
            while used.contains(&index) {
                index += 1;
            }
            let (host_ip, ns_ip) = veth_addrs(pool, index)
                .ok_or_else(|| netns_err(name, format!("the veth pool {pool} is full")))?;
            let host = format!("{VETH_HOST_PREFIX}{index}");
            let batch = format!(
                "link add {host} type veth peer name {VETH_NAME} netns {name}\n\
                 addr add {host_ip}/31 dev {host}\n\
                 link set {host} up\n"
            );
            match ip(name, &["-batch", "-"], Some(&batch)).await {
                Ok(()) => return Ok((host_ip, ns_ip)),
                // Another process took it; a half-made pair goes with the
                // namespace or is removed here.
                Err(e) if e.to_string().contains("File exists") => index += 1,
                Err(e) => {
                    let _ = ip(name, &["link", "delete", &host], None).await;
                    return Err(e);
                }
            }
        }
        Err(netns_err(name, "no free veth index after 64 tries"))
    }

    /// Switch the namespace's IPv4 forwarding (the guest's only way out)
    /// on or off. `/proc/sys/net` shows the namespace of the thread that
    /// opens it.
    fn set_forwarding(&self, on: bool) -> Result<()> {
        let ns = self
            .file
            .try_clone()
            .map_err(|e| netns_err(&self.name, e.to_string()))?;
        std::thread::spawn(move || -> std::io::Result<()> {
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
            std::fs::write("/proc/sys/net/ipv4/ip_forward", if on { "1" } else { "0" })
        })
        .join()
        .map_err(|_| netns_err(&self.name, "forwarding thread panicked"))?
        .map_err(|e| netns_err(&self.name, format!("setting forwarding: {e}")))
    }

    /// Replace the namespace's egress firewall with `rules` (atomically;
    /// nothing to do when they are the rules it has), then, if `open`, let
    /// the guest out.
    pub async fn set_egress(&self, rules: &EgressRules, open: bool) -> Result<()> {
        let mut egress = self.egress.lock().await;
        if egress.applied.as_ref() != Some(rules) {
            let first = std::mem::take(&mut egress.fresh);
            let added = first
                && firewall::nft(
                    &self.name,
                    Some(&self.file),
                    &firewall::render(rules, false),
                )
                .await
                .is_ok();
            if !added {
                firewall::nft(&self.name, Some(&self.file), &firewall::render(rules, true)).await?;
            }
            egress.applied = Some(rules.clone());
        }
        if open {
            self.set_forwarding(true)?;
        }
        Ok(())
    }

    /// Open an existing namespace by name (e.g. when adopting a VM).
    pub fn open(name: &str) -> Result<Self> {
        let file = File::open(Self::path_of(name))
            .map_err(|e| netns_err(name, format!("opening: {e}")))?;
        Ok(Self {
            name: name.to_string(),
            file,
            egress: Default::default(),
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
            egress: Default::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file; a child process can `setns` into it.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The namespace's tap, opened (attached) here so a jailed QEMU gets
    /// it as a descriptor and needs neither `/dev/net/tun` nor
    /// `CAP_NET_ADMIN`. Opened with a virtio-net header, as QEMU opens it
    /// by name, so device state saved either way loads either way.
    pub fn open_tap(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
        const IFF_TAP: i16 = 0x0002;
        const IFF_NO_PI: i16 = 0x1000;
        const IFF_VNET_HDR: i16 = 0x4000;
        let ns = self.file.try_clone()?;
        std::thread::spawn(move || -> std::io::Result<std::os::fd::OwnedFd> {
            // A tun file belongs to the namespace it was opened in; this
            // thread exists only for that.
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
            let tun = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/net/tun")?;
            // struct ifreq: the name, then the flags (a short).
            let mut ifr = [0u8; 40];
            ifr[..TAP_NAME.len()].copy_from_slice(TAP_NAME.as_bytes());
            ifr[16..18].copy_from_slice(&(IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).to_ne_bytes());
            // SAFETY: TUNSETIFF reads and writes a struct ifreq (40 bytes)
            // at the pointer, which stays valid for the call.
            let r = unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF as _, ifr.as_mut_ptr()) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(tun.into())
        })
        .join()
        .map_err(|_| std::io::Error::other("tap thread panicked"))?
    }

    /// A non-blocking TCP socket that lives in this namespace.
    fn socket(&self) -> std::io::Result<socket2::Socket> {
        let ns = self.file.try_clone()?;
        std::thread::spawn(move || -> std::io::Result<socket2::Socket> {
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
        .map_err(|_| std::io::Error::other("netns socket thread panicked"))?
    }

    /// Open a TCP connection to `port` of the guest in this namespace.
    pub async fn connect(&self, port: u16) -> std::io::Result<tokio::net::TcpStream> {
        self.connect_out(SocketAddrV4::new(GUEST_IP, port)).await
    }

    /// Open a TCP connection from this namespace to `addr` (through its
    /// veth when `addr` is outside; the host's table still applies).
    pub async fn connect_out(&self, addr: SocketAddrV4) -> std::io::Result<tokio::net::TcpStream> {
        let socket = self.socket()?;
        let socket = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(socket));
        socket.connect(SocketAddr::V4(addr)).await
    }

    /// Listen on `port` of the gateway address inside this namespace.
    pub fn listen(&self, port: u16) -> std::io::Result<tokio::net::TcpListener> {
        self.listen_at(SocketAddr::from((HOST_IP, port)))
    }

    /// Listen on `addr` inside this namespace.
    pub fn listen_at(&self, addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
        let s = self.socket()?;
        s.set_reuse_address(true)?;
        s.bind(&addr.into())?;
        s.listen(128)?;
        tokio::net::TcpListener::from_std(std::net::TcpListener::from(s))
    }
}

/// Delete namespace `name`; a namespace that is already gone is fine.
///
/// Its veth pair goes at once, with its host end deleted by name: the
/// namespace itself can outlive its bind mount for minutes while sockets
/// the host opened in it (to a guest that is gone) time out.
pub async fn delete_by_name(name: &str) -> Result<()> {
    if !Netns::path_of(name).exists() {
        return Ok(());
    }
    let mut batch = String::new();
    for (link, _) in host_veths()
        .await
        .iter()
        .filter(|(_, peer)| peer.as_deref() == Some(name))
    {
        batch += &format!("link delete {link}\n");
    }
    batch += &format!("netns delete {name}\n");
    ip(name, &["-batch", "-"], Some(&batch)).await
}

/// The host ends of veth pairs (`tnv*`), each with the name of its peer's
/// namespace (`None` once that namespace has lost its name).
async fn host_veths() -> Vec<(String, Option<String>)> {
    let Ok(out) = tokio::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .stderr(Stdio::null())
        .output()
        .await
    else {
        return Vec::new();
    };
    parse_host_veths(&String::from_utf8_lossy(&out.stdout))
}

fn parse_host_veths(text: &str) -> Vec<(String, Option<String>)> {
    text.lines()
        .filter_map(|line| {
            let name = line.split_whitespace().nth(1)?.split('@').next()?;
            let name = name.trim_end_matches(':');
            if !name.starts_with(VETH_HOST_PREFIX) {
                return None;
            }
            let mut words = line.split_whitespace();
            let peer = words
                .by_ref()
                .find(|w| *w == "link-netns")
                .and_then(|_| words.next())
                .map(str::to_string);
            Some((name.to_string(), peer))
        })
        .collect()
}

/// Delete host ends of veth pairs whose namespace has no name any more
/// (left by VMs of an earlier process, their namespaces still draining).
/// Set up the host for sandboxes' networks, once per process: IPv4
/// forwarding, the host's firewall table for veths from `pool`, and the
/// veths an earlier run left behind removed.
pub async fn host_setup(pool: Net4) -> Result<()> {
    firewall::host_setup(pool).await?;
    remove_dangling_veths().await;
    Ok(())
}

pub async fn remove_dangling_veths() {
    let dangling: Vec<String> = host_veths()
        .await
        .into_iter()
        .filter(|(_, peer)| peer.is_none())
        .map(|(link, _)| link)
        .collect();
    for link in dangling {
        tracing::info!(link, "removing a veth whose namespace is gone");
        let _ = ip(&link, &["link", "delete", &link], None).await;
    }
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
    fn set_egress<'a>(
        &'a self,
        rules: &'a EgressRules,
        open: bool,
    ) -> crate::driver::BoxFuture<'a, Result<()>> {
        Box::pin(Netns::set_egress(self, rules, open))
    }
    fn listen(&self, port: u16) -> std::io::Result<tokio::net::TcpListener> {
        Netns::listen(self, port)
    }
    fn connect_out(
        &self,
        addr: SocketAddrV4,
    ) -> crate::driver::BoxFuture<'_, std::io::Result<tokio::net::TcpStream>> {
        Box::pin(Netns::connect_out(self, addr))
    }
    fn run_inside(&self, f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
        let ns = self.file.try_clone()?;
        std::thread::spawn(move || -> std::io::Result<()> {
            // This thread exists only for `f`: it never returns to the
            // host's namespace.
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
            f();
            Ok(())
        })
        .join()
        .map_err(|_| std::io::Error::other("netns thread panicked"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_veths_name_their_peer_namespace() {
        let text = "1: lo: <LOOPBACK,UP> mtu 65536 qdisc noqueue\\    link/loopback 00:00:00:00:00:00\n\
                    441: tnv25@if2: <BROADCAST,UP> mtu 1500 qdisc noqueue\\    link/ether ae:ff brd ff:ff link-netnsid 26\n\
                    442: tnv3@if2: <BROADCAST,UP> mtu 1500 qdisc noqueue\\    link/ether ae:ff brd ff:ff link-netns tine-iabc\n\
                    443: e2e-inet0@if2: <BROADCAST,UP> mtu 1500\\    link/ether ae:ff link-netns e2e-inet\n";
        assert_eq!(
            parse_host_veths(text),
            vec![
                ("tnv25".to_string(), None),
                ("tnv3".to_string(), Some("tine-iabc".to_string()))
            ]
        );
    }

    #[test]
    fn veth_pairs_are_slash_31s_inside_the_pool() {
        let pool = Net4::parse("10.233.0.0/16").unwrap();
        assert_eq!(
            veth_addrs(pool, 0),
            Some((Ipv4Addr::new(10, 233, 0, 0), Ipv4Addr::new(10, 233, 0, 1)))
        );
        assert_eq!(
            veth_addrs(pool, 200),
            Some((
                Ipv4Addr::new(10, 233, 1, 144),
                Ipv4Addr::new(10, 233, 1, 145)
            ))
        );
        assert!(veth_addrs(pool, 32767).is_some());
        assert_eq!(veth_addrs(pool, 32768), None);
    }
}
