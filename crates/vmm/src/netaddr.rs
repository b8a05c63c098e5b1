//! The fixed names and addresses of sandbox networks, and [`Net4`]: what
//! both the firewall ([`crate::firewall`]) and the namespaces
//! ([`crate::netns`]) use, so neither imports the other for them.

use std::net::Ipv4Addr;

/// An IPv4 network (address and prefix length), the unit of every rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Net4 {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Net4 {
    pub const fn new(addr: Ipv4Addr, prefix: u8) -> Self {
        Self { addr, prefix }
    }
    /// Everything.
    pub const ALL: Net4 = Net4::new(Ipv4Addr::UNSPECIFIED, 0);

    fn mask(self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.prefix.min(32)))
        }
    }
    /// The network address (host bits cleared).
    pub fn network(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & self.mask())
    }
    pub fn contains(self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.network())
    }
    /// Parse `a.b.c.d` or `a.b.c.d/n`; host bits are cleared.
    pub fn parse(s: &str) -> Option<Net4> {
        let (ip, prefix) = match s.split_once('/') {
            Some((ip, p)) => (ip, p.parse::<u8>().ok().filter(|p| *p <= 32)?),
            None => (s, 32),
        };
        let addr: Ipv4Addr = ip.parse().ok()?;
        let n = Net4::new(addr, prefix);
        Some(Net4::new(n.network(), prefix))
    }
}

impl std::fmt::Display for Net4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Address of every guest.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 11, 0, 2);
/// Address of the tap device (the guest's gateway) inside each namespace.
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 11, 0, 1);
pub const PREFIX_LEN: u8 = 24;
/// Name of the tap device inside each namespace.
pub const TAP_NAME: &str = "tap0";
/// Namespaces we create are named with this prefix (cleanup finds them).
pub const NAME_PREFIX: &str = "tine-";
/// The namespace's end of its veth pair.
pub const VETH_NAME: &str = "veth0";
/// The host's ends are `tnv<index>`.
pub const VETH_HOST_PREFIX: &str = "tnv";
/// Where veth addresses come from unless [`set_pool`] says otherwise.
pub const DEFAULT_POOL: Net4 = Net4::new(Ipv4Addr::new(10, 233, 0, 0), 16);
