//! Guest networking with the classic interface ioctls: one address on eth0
//! and a default route. Every guest uses the same address (each lives in its
//! own network namespace on the host), so clones need no re-addressing.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{bail, Context};

fn socket() -> anyhow::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("socket(AF_INET)");
    }
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> anyhow::Result<libc::ifreq> {
    if name.len() >= libc::IFNAMSIZ {
        bail!("interface name {name:?} too long");
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn sockaddr(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size and the kernel
    // reads the family field to interpret the bytes.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

// The SIOC* constants are `c_ulong` while `ioctl` takes `Ioctl` (`c_int`
// on musl, `c_ulong` on glibc), hence the cast at the call.
fn ioctl(
    fd: &OwnedFd,
    request: libc::c_ulong,
    arg: *mut libc::c_void,
    what: &str,
) -> anyhow::Result<()> {
    // SAFETY: `arg` points to a live, correctly typed struct for `request`
    // (ifreq or rtentry), owned by the caller for the duration of the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), request as libc::Ioctl, arg) } < 0 {
        return Err(std::io::Error::last_os_error()).context(what.to_string());
    }
    Ok(())
}

fn set_up(fd: &OwnedFd, name: &str) -> anyhow::Result<()> {
    let mut req = ifreq(name)?;
    ioctl(
        fd,
        libc::SIOCGIFFLAGS,
        &mut req as *mut _ as *mut _,
        "SIOCGIFFLAGS",
    )?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    ioctl(
        fd,
        libc::SIOCSIFFLAGS,
        &mut req as *mut _ as *mut _,
        "SIOCSIFFLAGS",
    )
}

pub fn up_loopback() -> anyhow::Result<()> {
    set_up(&socket()?, "lo")
}

/// Parse `a.b.c.d/len`.
pub fn parse_cidr(cidr: &str) -> anyhow::Result<(Ipv4Addr, Ipv4Addr)> {
    let (ip, len) = cidr.split_once('/').unwrap_or((cidr, "24"));
    let ip: Ipv4Addr = ip.parse().with_context(|| format!("bad address {ip:?}"))?;
    let len: u32 = len
        .parse()
        .with_context(|| format!("bad prefix length {len:?}"))?;
    if len > 32 {
        bail!("prefix length {len} > 32");
    }
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok((ip, Ipv4Addr::from(mask)))
}

/// Give `name` the address `cidr`, bring it up, and route everything via `gw`.
pub fn configure(name: &str, cidr: &str, gw: Option<&str>) -> anyhow::Result<()> {
    let (ip, mask) = parse_cidr(cidr)?;
    let fd = socket()?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr(ip);
    ioctl(
        &fd,
        libc::SIOCSIFADDR,
        &mut req as *mut _ as *mut _,
        "SIOCSIFADDR",
    )?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr(mask);
    ioctl(
        &fd,
        libc::SIOCSIFNETMASK,
        &mut req as *mut _ as *mut _,
        "SIOCSIFNETMASK",
    )?;
    set_up(&fd, name)?;
    if let Some(gw) = gw {
        let gw: Ipv4Addr = gw.parse().with_context(|| format!("bad gateway {gw:?}"))?;
        // SAFETY: rtentry is plain old data; all-zero is a valid value.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr(gw);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        ioctl(
            &fd,
            libc::SIOCADDRT,
            &mut rt as *mut _ as *mut _,
            "SIOCADDRT (default route)",
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_parsing() {
        assert_eq!(
            parse_cidr("10.11.0.2/24").unwrap(),
            (
                "10.11.0.2".parse().unwrap(),
                "255.255.255.0".parse().unwrap()
            )
        );
        assert_eq!(
            parse_cidr("10.0.0.1/30").unwrap().1,
            "255.255.255.252".parse::<Ipv4Addr>().unwrap()
        );
        assert!(parse_cidr("10.0.0.1/33").is_err());
        assert!(parse_cidr("nonsense/24").is_err());
    }
}

/// Point the guest's resolver at `server` (the host forwards port 53 of the
/// gateway to its own resolver). A symlink (systemd-resolved's stub, in some
/// images) is replaced by a file.
pub fn write_resolv_conf(path: &std::path::Path, server: &str) -> anyhow::Result<()> {
    let server: Ipv4Addr = server
        .parse()
        .with_context(|| format!("bad DNS server {server:?}"))?;
    if path.is_symlink() {
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    }
    std::fs::write(
        path,
        format!("# written by the tine agent at boot\nnameserver {server}\n"),
    )
    .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod resolv_tests {
    use super::*;

    #[test]
    fn resolv_conf_names_the_server_and_replaces_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("stub");
        let path = dir.path().join("resolv.conf");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        write_resolv_conf(&path, "10.11.0.1").unwrap();
        assert!(!path.is_symlink());
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .contains("nameserver 10.11.0.1\n"));
        assert!(write_resolv_conf(&path, "not-an-ip").is_err());
    }
}
