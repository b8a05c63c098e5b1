//! The name a client connection asks for, read from its first bytes: the
//! server name (SNI) of a TLS ClientHello, or the `Host` of an HTTP/1
//! request. Nothing is decrypted; the bytes are passed on unchanged.

/// What the first bytes of a connection tell so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Sniffed {
    /// Read more (the hello or the request head is not complete yet).
    More,
    /// The name the client asked for, lowercase, without a port.
    Name(String),
    /// Complete but without a name (or not TLS/HTTP at all).
    NoName,
}

/// Largest head read before giving up on finding a name.
pub const MAX_HEAD: usize = 16 * 1024;

pub fn sniff(buf: &[u8]) -> Sniffed {
    match buf.first() {
        None => Sniffed::More,
        Some(0x16) => tls_sni(buf),
        Some(_) => http_host(buf),
    }
}

fn be16(b: &[u8], at: usize) -> Option<usize> {
    Some(usize::from(*b.get(at)?) << 8 | usize::from(*b.get(at + 1)?))
}

/// SNI of a ClientHello that fits in its first record (every mainstream
/// client's does).
fn tls_sni(buf: &[u8]) -> Sniffed {
    let Some(rec_len) = be16(buf, 3) else {
        return Sniffed::More;
    };
    if buf.len() < 5 + rec_len {
        return if 5 + rec_len > MAX_HEAD {
            Sniffed::NoName
        } else {
            Sniffed::More
        };
    }
    client_hello_sni(&buf[5..5 + rec_len]).map_or(Sniffed::NoName, Sniffed::Name)
}

fn client_hello_sni(h: &[u8]) -> Option<String> {
    if *h.first()? != 1 {
        return None; // not a ClientHello
    }
    // type(1) length(3) version(2) random(32)
    let mut at = 4 + 2 + 32;
    at += 1 + usize::from(*h.get(at)?); // session id
    at += 2 + be16(h, at)?; // cipher suites
    at += 1 + usize::from(*h.get(at)?); // compression methods
    let ext_end = (at + 2 + be16(h, at)?).min(h.len());
    at += 2;
    while at + 4 <= ext_end {
        let kind = be16(h, at)?;
        let len = be16(h, at + 2)?;
        let body = h.get(at + 4..at + 4 + len)?;
        if kind == 0 {
            // server_name list: len(2), then type(1) len(2) name
            let mut p = 2;
            while p + 3 <= body.len() {
                let n = be16(body, p + 1)?;
                let name = body.get(p + 3..p + 3 + n)?;
                if body[p] == 0 {
                    return std::str::from_utf8(name).ok().map(str::to_ascii_lowercase);
                }
                p += 3 + n;
            }
            return None;
        }
        at += 4 + len;
    }
    None
}

fn http_host(buf: &[u8]) -> Sniffed {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() >= MAX_HEAD {
            Sniffed::NoName
        } else {
            Sniffed::More
        };
    };
    let Ok(head) = std::str::from_utf8(&buf[..end]) else {
        return Sniffed::NoName;
    };
    for line in head.split("\r\n").skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("host") {
                let v = v.trim();
                // Strip a port, but not from a bracketed IPv6 literal.
                let host = match v.rsplit_once(':') {
                    Some((h, p)) if !h.ends_with(']') || p.is_empty() => {
                        if p.bytes().all(|b| b.is_ascii_digit()) {
                            h
                        } else {
                            v
                        }
                    }
                    _ => v,
                };
                return Sniffed::Name(host.to_ascii_lowercase());
            }
        }
    }
    Sniffed::NoName
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello record naming `name`.
    fn client_hello(name: &str) -> Vec<u8> {
        let n = name.as_bytes();
        let mut sni = vec![0, 0];
        let list_len = 3 + n.len();
        let mut ext = Vec::new();
        ext.extend_from_slice(&(list_len as u16).to_be_bytes());
        ext.push(0);
        ext.extend_from_slice(&(n.len() as u16).to_be_bytes());
        ext.extend_from_slice(n);
        sni.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        sni.extend_from_slice(&ext);
        // another extension first (supported_groups), to walk past it
        let mut exts = vec![0, 10, 0, 2, 0, 29];
        exts.extend_from_slice(&sni);
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
        body.extend_from_slice(&[1, 0]); // null compression
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn finds_the_sni_of_a_client_hello() {
        let rec = client_hello("Api.Example.test");
        assert_eq!(sniff(&rec), Sniffed::Name("api.example.test".into()));
        assert_eq!(sniff(&rec[..rec.len() - 1]), Sniffed::More);
        assert_eq!(sniff(&rec[..3]), Sniffed::More);
        let mut not_hello = rec.clone();
        not_hello[5] = 2;
        assert_eq!(sniff(&not_hello), Sniffed::NoName);
    }

    #[test]
    fn finds_the_host_of_an_http_request() {
        let req = b"GET / HTTP/1.1\r\nUser-Agent: x\r\nHOST: Example.test:8080\r\n\r\n";
        assert_eq!(sniff(req), Sniffed::Name("example.test".into()));
        assert_eq!(sniff(&req[..20]), Sniffed::More);
        assert_eq!(sniff(b"GET / HTTP/1.0\r\n\r\n"), Sniffed::NoName);
        assert_eq!(sniff(&[b'x'; MAX_HEAD]), Sniffed::NoName);
    }
}
