//! The egress firewall of each VM, enforced on the host with nftables.
//!
//! Two tables:
//! - `inet tine_host` in the host's namespace, set once per process
//!   ([`host_setup`]): nothing arriving from a VM's veth (`tnv*`) may reach
//!   the host itself (every address it has, the tine API included) or
//!   another VM's veth; traffic leaving through another interface is
//!   masqueraded. IPv4 forwarding is switched on.
//! - `inet tine` inside each VM's namespace ([`render`], replaced atomically
//!   by [`EgressRules`] on every policy change): what the guest (behind
//!   `tap0`) may reach through `veth0`. Packets to the gateway's port 53
//!   are DNAT-ed to the resolver; TCP to ports 80/443 can be redirected to
//!   an egress proxy listening in the namespace, which decides by name
//!   (SNI / Host).
//!
//! Rule order in the namespace: blocked ranges (private, loopback,
//! link-local, multicast…) minus the ranges the operator opened; then the
//! allow list; then the deny list; then accept. A VM's namespace forwards
//! nothing until its owner sets a policy ([`crate::netns::Netns::set_egress`]).
//!
//! `nft -f` is used rather than a netlink crate: one spawn applies a whole
//! ruleset in one transaction, and operators inspect it with the same tool.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use nix::sched::{setns, CloneFlags};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};
pub use crate::netaddr::Net4;
use crate::netaddr::{DEFAULT_POOL, HOST_IP, TAP_NAME, VETH_HOST_PREFIX, VETH_NAME};

/// Ranges no sandbox reaches unless the operator opens them: "this
/// network", RFC 1918, CGNAT, loopback, link-local (cloud metadata),
/// IETF protocol assignments, benchmarking, multicast, reserved and
/// broadcast.
pub const NOT_INTERNET: &[Net4] = &[
    Net4::new(Ipv4Addr::new(0, 0, 0, 0), 8),
    Net4::new(Ipv4Addr::new(10, 0, 0, 0), 8),
    Net4::new(Ipv4Addr::new(100, 64, 0, 0), 10),
    Net4::new(Ipv4Addr::new(127, 0, 0, 0), 8),
    Net4::new(Ipv4Addr::new(169, 254, 0, 0), 16),
    Net4::new(Ipv4Addr::new(172, 16, 0, 0), 12),
    Net4::new(Ipv4Addr::new(192, 0, 0, 0), 24),
    Net4::new(Ipv4Addr::new(192, 168, 0, 0), 16),
    Net4::new(Ipv4Addr::new(198, 18, 0, 0), 15),
    Net4::new(Ipv4Addr::new(224, 0, 0, 0), 4),
    Net4::new(Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// TCP ports whose connections go to the egress proxy when one is set.
/// Ports of the gateway address a guest may connect to: the host serves
/// the volumes mounted into that guest there (NFS; one port a mount).
/// Nothing listening means a refused connection, as for any other port.
pub const VOLUME_PORTS: std::ops::RangeInclusive<u16> = 2049..=2056;

pub const INTERCEPTED_PORTS: [u16; 2] = [80, 443];

/// What one VM's guest may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressRules {
    /// Never reached (checked first)…
    pub blocked: Vec<Net4>,
    /// …except these (the operator's own networks).
    pub opened: Vec<Net4>,
    /// Reached even when `deny` covers them.
    pub allow: Vec<Net4>,
    pub deny: Vec<Net4>,
    /// Where the guest's DNS (to its gateway, port 53) goes; `None` refuses.
    pub resolver: Option<SocketAddrV4>,
    /// New TCP connections to [`INTERCEPTED_PORTS`] go to this port of the
    /// gateway, where an egress proxy decides by name.
    pub proxy_port: Option<u16>,
    /// With `proxy_port`: every new TCP connection goes there, not only
    /// those to the intercepted ports (the proxy tunnels them).
    pub tunnel_all: bool,
}

impl EgressRules {
    /// Nothing goes out (what the tests render).
    #[cfg(test)]
    fn closed() -> Self {
        Self {
            blocked: NOT_INTERNET.to_vec(),
            opened: Vec::new(),
            allow: Vec::new(),
            deny: vec![Net4::ALL],
            resolver: None,
            proxy_port: None,
            tunnel_all: false,
        }
    }
}

fn set(out: &mut String, name: &str, nets: &[Net4]) {
    let _ = write!(
        out,
        "  set {name} {{ type ipv4_addr; flags interval; auto-merge;"
    );
    if !nets.is_empty() {
        let list: Vec<String> = nets.iter().map(|n| n.to_string()).collect();
        let _ = write!(out, " elements = {{ {} }};", list.join(", "));
    }
    out.push_str(" }\n");
}

/// The namespace's ruleset for `r`; with `replace`, replacing an earlier
/// one atomically (without, for a namespace that has none yet).
pub fn render(r: &EgressRules, replace: bool) -> String {
    let mut o = String::new();
    if replace {
        o.push_str("table inet tine\ndelete table inet tine\n");
    }
    o.push_str("table inet tine {\n");
    set(&mut o, "blocked", &r.blocked);
    set(&mut o, "opened", &r.opened);
    set(&mut o, "allow", &r.allow);
    set(&mut o, "deny", &r.deny);
    let tap = TAP_NAME;
    let gw = HOST_IP;
    o.push_str(
        "  chain prerouting {\n    type nat hook prerouting priority dstnat; policy accept;\n",
    );
    if let Some(res) = r.resolver {
        for proto in ["udp", "tcp"] {
            let _ = writeln!(
                o,
                "    iifname \"{tap}\" ip daddr {gw} {proto} dport 53 dnat ip to {res}"
            );
        }
    }
    match r.proxy_port {
        Some(port) if r.tunnel_all => {
            let _ = writeln!(
                o,
                "    iifname \"{tap}\" ip daddr != {gw} meta l4proto tcp redirect to :{port}"
            );
        }
        Some(port) => {
            let ports: Vec<String> = INTERCEPTED_PORTS.iter().map(|p| p.to_string()).collect();
            let _ = writeln!(
                o,
                "    iifname \"{tap}\" ip daddr != {gw} tcp dport {{ {} }} redirect to :{port}",
                ports.join(", ")
            );
        }
        None => {}
    }
    o.push_str("  }\n");
    let _ = writeln!(
        o,
        "  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    oifname \"{VETH_NAME}\" masquerade\n  }}"
    );
    o.push_str("  chain forward {\n    type filter hook forward priority filter; policy drop;\n");
    o.push_str("    ct state established,related accept\n");
    let _ = writeln!(o, "    iifname != \"{tap}\" drop");
    o.push_str("    meta nfproto != ipv4 drop\n");
    if r.resolver.is_some() {
        // Only the gateway's port 53 is DNAT-ed towards the forward path.
        o.push_str("    ct status dnat accept\n");
    }
    // Refused at once (not dropped): a denied connection fails fast in
    // the guest instead of hanging until its timeout.
    o.push_str(
        "    ip daddr @blocked ip daddr != @opened reject with icmpx type admin-prohibited\n",
    );
    o.push_str("    ip daddr @allow accept\n");
    o.push_str("    ip daddr @deny reject with icmpx type admin-prohibited\n");
    o.push_str("    accept\n  }\n");
    // The guest opens nothing to the namespace itself but the proxy and
    // the volume servers. The
    // host's own connections to the guest may predate this table (conntrack
    // then meets their replies mid-stream, a SYN-ACK first), so refusals are
    // by what a packet is, not by conntrack's view: a bare SYN, or not TCP
    // (refused, so a denied DNS query fails at once).
    o.push_str("  chain input {\n    type filter hook input priority filter; policy accept;\n");
    let _ = writeln!(
        o,
        "    iifname \"{tap}\" ct state established,related accept"
    );
    if let Some(port) = r.proxy_port {
        let _ = writeln!(o, "    iifname \"{tap}\" tcp dport {port} accept");
    }
    let _ = writeln!(
        o,
        "    iifname \"{tap}\" ip daddr {} tcp dport {}-{} accept",
        HOST_IP,
        VOLUME_PORTS.start(),
        VOLUME_PORTS.end()
    );
    let _ = writeln!(
        o,
        "    iifname \"{tap}\" tcp flags & (syn | ack) == syn reject with tcp reset\n    iifname \"{tap}\" meta l4proto != tcp reject with icmpx type admin-prohibited\n  }}\n}}"
    );
    o
}

/// The host's table (see the module docs); `pool` holds every VM's veth
/// addresses.
/// The host table of a server whose veths come from `pool`: `tine_host`
/// for the default pool, one of its own for another (several servers on
/// one host, as in a cluster on one machine, each masquerade their pool).
pub fn host_table(pool: Net4) -> String {
    if pool == DEFAULT_POOL {
        "tine_host".into()
    } else {
        format!("tine_host_{}", pool.to_string().replace(['.', '/'], "_"))
    }
}

pub fn render_host(pool: Net4) -> String {
    let v = VETH_HOST_PREFIX;
    let t = host_table(pool);
    format!(
        "table inet {t}\n\
         delete table inet {t}\n\
         table inet {t} {{\n\
         \x20 chain input {{\n\
         \x20   type filter hook input priority filter - 5; policy accept;\n\
         \x20   iifname \"{v}*\" ct state established,related accept\n\
         \x20   iifname \"{v}*\" reject with icmpx type admin-prohibited\n\
         \x20 }}\n\
         \x20 chain forward {{\n\
         \x20   type filter hook forward priority filter - 5; policy accept;\n\
         \x20   iifname \"{v}*\" oifname \"{v}*\" drop\n\
         \x20 }}\n\
         \x20 chain postrouting {{\n\
         \x20   type nat hook postrouting priority srcnat; policy accept;\n\
         \x20   ip saddr {pool} oifname != \"{v}*\" masquerade\n\
         \x20 }}\n\
         }}\n"
    )
}

fn fw_err(name: &str, detail: impl Into<String>) -> Error {
    Error::Netns {
        name: name.to_string(),
        detail: detail.into(),
    }
}

/// Run `nft -f -` with `script`, inside the namespace open as `ns` (or the
/// host's when `None`).
pub(crate) async fn nft(label: &str, ns: Option<&std::fs::File>, script: &str) -> Result<()> {
    let mut cmd = std::process::Command::new("nft");
    cmd.args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(ns) = ns {
        let fd = ns.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and
        // makes one async-signal-safe system call (setns).
        unsafe {
            cmd.pre_exec(move || {
                // SAFETY: `fd` is the namespace file the caller holds open
                // for the whole spawn; fork copied the descriptor.
                let fd = std::os::fd::BorrowedFd::borrow_raw(fd);
                setns(fd, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
            });
        }
    }
    let mut child = tokio::process::Command::from(cmd)
        .spawn()
        .map_err(|e| fw_err(label, format!("running nft: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(|e| fw_err(label, format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| fw_err(label, format!("waiting for nft: {e}")))?;
    if !out.status.success() {
        return Err(fw_err(
            label,
            format!(
                "nft failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(())
}

/// Switch on IPv4 forwarding and install the host's table, once per
/// process (later calls return the first result). The host's whole
/// network set-up, veths of an earlier run included, is
/// [`crate::netns::host_setup`].
pub(crate) async fn host_setup(pool: Net4) -> Result<()> {
    static DONE: tokio::sync::OnceCell<std::result::Result<(), String>> =
        tokio::sync::OnceCell::const_new();
    DONE.get_or_init(|| async move {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| format!("enabling IPv4 forwarding: {e}"))?;
        nft("host", None, &render_host(pool))
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    })
    .await
    .clone()
    .map_err(|detail| fw_err("host", detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nets_parse_and_contain() {
        let n = Net4::parse("10.1.2.3/8").unwrap();
        assert_eq!(n.to_string(), "10.0.0.0/8");
        assert!(n.contains(Ipv4Addr::new(10, 200, 0, 1)));
        assert!(!n.contains(Ipv4Addr::new(11, 0, 0, 1)));
        assert_eq!(Net4::parse("1.2.3.4").unwrap().to_string(), "1.2.3.4/32");
        assert!(Net4::ALL.contains(Ipv4Addr::new(8, 8, 8, 8)));
        for bad in ["", "1.2.3", "1.2.3.4/33", "::1", "a.b.c.d", "1.2.3.4/"] {
            assert_eq!(Net4::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn closed_rules_deny_everything_and_resolve_nothing() {
        let s = render(&EgressRules::closed(), true);
        assert!(s.contains(
            "set deny { type ipv4_addr; flags interval; auto-merge; elements = { 0.0.0.0/0 }; }"
        ));
        assert!(s.contains("set allow { type ipv4_addr; flags interval; auto-merge; }"));
        assert!(!s.contains("dnat"), "{s}");
        assert!(!s.contains("redirect"), "{s}");
        assert!(s.starts_with("table inet tine\ndelete table inet tine\n"));
        assert!(render(&EgressRules::closed(), false).starts_with("table inet tine {\n"));
    }

    #[test]
    fn dns_and_proxy_rules_appear_when_asked() {
        let mut r = EgressRules::closed();
        r.resolver = Some("10.255.255.53:53".parse().unwrap());
        r.proxy_port = Some(15080);
        let s = render(&r, true);
        assert!(
            s.contains("udp dport 53 dnat ip to 10.255.255.53:53"),
            "{s}"
        );
        assert!(
            s.contains("tcp dport { 80, 443 } redirect to :15080"),
            "{s}"
        );
        assert!(s.contains("iifname \"tap0\" tcp dport 15080 accept"), "{s}");
        r.tunnel_all = true;
        let t = render(&r, true);
        assert!(t.contains("meta l4proto tcp redirect to :15080"), "{t}");
        assert!(!t.contains("dport { 80, 443 }"), "{t}");
        assert!(s.contains("ct status dnat accept"));
        // Blocked ranges come before the allow list.
        assert!(s.find("@blocked").unwrap() < s.find("@allow accept").unwrap());
    }

    /// `nft -c` (check only, nothing applied) accepts what we render,
    /// where the tool is present and we may use netlink (root).
    #[test]
    fn nft_accepts_the_rulesets() {
        if !nix::unistd::geteuid().is_root()
            || std::process::Command::new("nft")
                .arg("-v")
                .output()
                .is_err()
        {
            eprintln!("skipped: needs root and nft");
            return;
        }
        let mut full = EgressRules::closed();
        full.resolver = Some("10.255.255.53:53".parse().unwrap());
        full.proxy_port = Some(15080);
        full.allow = vec![
            Net4::parse("203.0.113.10").unwrap(),
            Net4::parse("203.0.113.0/24").unwrap(),
        ];
        full.opened = vec![Net4::parse("10.99.1.0/24").unwrap()];
        for script in [
            render(&EgressRules::closed(), true),
            render(&full, true),
            render(&full, false),
            render_host(Net4::parse("10.233.0.0/16").unwrap()),
        ] {
            use std::io::Write;
            let mut child = std::process::Command::new("nft")
                .args(["-c", "-f", "-"])
                .stdin(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(script.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}\n{script}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    #[test]
    fn host_table_closes_the_host_to_vms() {
        let s = render_host(Net4::parse("10.233.0.0/16").unwrap());
        assert!(s.contains("iifname \"tnv*\" reject"));
        assert!(s.contains("ip saddr 10.233.0.0/16 oifname != \"tnv*\" masquerade"));
        assert!(s.starts_with("table inet tine_host\n"));
        // Another pool (a second server on the host) has a table of its own.
        let other = render_host(Net4::parse("10.241.0.0/16").unwrap());
        assert!(other.starts_with("table inet tine_host_10_241_0_0_16\n"));
        assert!(other.contains("ip saddr 10.241.0.0/16 oifname"));
    }
}
