//! A minimal DNS client (RFC 1035, A records over UDP) for the injecting
//! proxy: plain HTTP to a host whose transform matched by name goes to the
//! address the sandboxes' resolver gives for that name, never to the
//! address the guest dialled (a guest could otherwise send `Host: <name>`
//! to an address of its own and receive the secret).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

/// How long one query may wait for its answer, and how many are sent.
const TIMEOUT: Duration = Duration::from_secs(2);
const TRIES: usize = 2;

/// The A records of `name` from `resolver`.
pub async fn resolve_a(resolver: SocketAddrV4, name: &str) -> std::io::Result<Vec<Ipv4Addr>> {
    let mut id = [0u8; 2];
    getrandom::fill(&mut id).map_err(|e| std::io::Error::other(e.to_string()))?;
    let query = build_query(u16::from_be_bytes(id), name)?;
    let sock = tokio::net::UdpSocket::bind("0.0.0.0:0").await?;
    sock.connect(resolver).await?;
    let mut buf = vec![0u8; 1500];
    for _ in 0..TRIES {
        sock.send(&query).await?;
        let Ok(n) = tokio::time::timeout(TIMEOUT, sock.recv(&mut buf)).await else {
            continue;
        };
        if let Some(addrs) = parse_answer(&buf[..n?], u16::from_be_bytes(id)) {
            return Ok(addrs);
        }
    }
    Err(std::io::Error::other(format!(
        "no answer for {name} from {resolver}"
    )))
}

fn build_query(id: u16, name: &str) -> std::io::Result<Vec<u8>> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a DNS name");
    let mut q = Vec::with_capacity(name.len() + 18);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(bad());
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    if q.len() > 12 + 255 {
        return Err(bad());
    }
    q.push(0);
    q.extend_from_slice(&[0, 1, 0, 1]); // A, IN
    Ok(q)
}

/// Skip a (possibly compressed) name at `at`; where it ends.
fn skip_name(msg: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *msg.get(at)? as usize;
        if len == 0 {
            return Some(at + 1);
        }
        if len & 0xc0 == 0xc0 {
            return Some(at + 2);
        }
        at += 1 + len;
    }
}

/// The A records of a response to query `id` (`None`: not an answer to it).
fn parse_answer(msg: &[u8], id: u16) -> Option<Vec<Ipv4Addr>> {
    if msg.len() < 12 || u16::from_be_bytes([msg[0], msg[1]]) != id || msg[2] & 0x80 == 0 {
        return None;
    }
    let rcode = msg[3] & 0x0f;
    let qd = u16::from_be_bytes([msg[4], msg[5]]) as usize;
    let an = u16::from_be_bytes([msg[6], msg[7]]) as usize;
    if rcode != 0 {
        return Some(Vec::new());
    }
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(msg, at)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        at = skip_name(msg, at)?;
        let rr = msg.get(at..at + 10)?;
        let (kind, class) = (
            u16::from_be_bytes([rr[0], rr[1]]),
            u16::from_be_bytes([rr[2], rr[3]]),
        );
        let len = u16::from_be_bytes([rr[8], rr[9]]) as usize;
        let data = msg.get(at + 10..at + 10 + len)?;
        if kind == 1 && class == 1 && len == 4 {
            out.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]));
        }
        at += 10 + len;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_built_and_answers_with_pointers_parsed() {
        let q = build_query(0x1234, "api.example.test.").unwrap();
        assert_eq!(&q[..2], &[0x12, 0x34]);
        assert_eq!(&q[12..16], b"\x03api");
        assert!(build_query(1, "a..b").is_err());
        // The question back, a CNAME by pointer, then an A record.
        let mut r = q.clone();
        r[2] = 0x81;
        r[3] = 0x80;
        r[7] = 2;
        r.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 2, 0xc0, 12]);
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 203, 0, 113, 10]);
        assert_eq!(
            parse_answer(&r, 0x1234),
            Some(vec![Ipv4Addr::new(203, 0, 113, 10)])
        );
        assert_eq!(parse_answer(&r, 0x9999), None, "another query's answer");
        assert_eq!(parse_answer(&r[..r.len() - 3], 0x1234), None, "cut short");
        let mut nx = q.clone();
        nx[2] = 0x81;
        nx[3] = 0x83;
        assert_eq!(parse_answer(&nx, 0x1234), Some(vec![]));
    }
}
