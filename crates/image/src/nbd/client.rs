//! A minimal NBD client (fixed newstyle, `NBD_OPT_GO`, simple replies),
//! for `tine image fetch`: it reads through the daemon exactly as QEMU
//! does, so what it reports is what a guest would see.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::{IHAVEOPT, OPT_GO, REP_ACK, REP_INFO, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC};

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

pub struct Client {
    stream: UnixStream,
    pub size: u64,
    next: u64,
}

impl Client {
    /// Connect to `socket` and open `export`.
    pub async fn open(socket: &std::path::Path, export: &str) -> std::io::Result<Self> {
        let mut stream = UnixStream::connect(socket).await?;
        let mut hello = [0u8; 18];
        stream.read_exact(&mut hello).await?;
        if hello[8..16] != IHAVEOPT.to_be_bytes() {
            return Err(bad("not an NBD server"));
        }
        // FIXED_NEWSTYLE | NO_ZEROES.
        stream.write_all(&3u32.to_be_bytes()).await?;
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut opt = IHAVEOPT.to_be_bytes().to_vec();
        opt.extend_from_slice(&OPT_GO.to_be_bytes());
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(&data);
        stream.write_all(&opt).await?;
        let mut size = None;
        loop {
            let mut head = [0u8; 20];
            stream.read_exact(&mut head).await?;
            let kind = u32::from_be_bytes(head[12..16].try_into().expect("4"));
            let len = u32::from_be_bytes(head[16..20].try_into().expect("4"));
            if len > 4096 {
                return Err(bad("option reply too long"));
            }
            let mut body = vec![0u8; len as usize];
            stream.read_exact(&mut body).await?;
            match kind {
                REP_INFO if body.len() >= 10 && body[..2] == [0, 0] => {
                    size = Some(u64::from_be_bytes(body[2..10].try_into().expect("8")));
                }
                REP_INFO => {}
                REP_ACK => break,
                _ => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("export {export}: {}", String::from_utf8_lossy(&body)),
                    ))
                }
            }
        }
        Ok(Self {
            stream,
            size: size.ok_or_else(|| bad("no export size"))?,
            next: 1,
        })
    }

    /// `len` bytes from `offset`, or the server's error number.
    pub async fn read(&mut self, offset: u64, len: u32) -> std::io::Result<Result<Vec<u8>, u32>> {
        let handle = self.next;
        self.next += 1;
        let mut req = Vec::with_capacity(28);
        req.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&handle.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        self.stream.write_all(&req).await?;
        let mut head = [0u8; 16];
        self.stream.read_exact(&mut head).await?;
        if head[..4] != SIMPLE_REPLY_MAGIC.to_be_bytes() || head[8..16] != handle.to_be_bytes() {
            return Err(bad("unexpected reply"));
        }
        let error = u32::from_be_bytes(head[4..8].try_into().expect("4"));
        if error != 0 {
            return Ok(Err(error));
        }
        let mut data = vec![0u8; len as usize];
        self.stream.read_exact(&mut data).await?;
        Ok(Ok(data))
    }
}
