//! A read-only NBD server (the fixed-newstyle protocol, simple replies) on
//! a unix socket: how QEMU reads a chunked image.
//!
//! Each sandbox's qcow2 overlay has an export of this server as its backing
//! file (QEMU's built-in NBD client: no kernel block driver on the host).
//! An export is an image's manifest digest (hex); a read is served chunk
//! by chunk from the [`ChunkCache`], which fetches what is missing. A
//! chunk that cannot be had (registry down, damaged) is an I/O error to
//! the guest, never other bytes.
//!
//! The protocol: <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>.

pub mod client;
pub mod daemon;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixListener;

use crate::chunks::cache::{ChunkCache, Disk};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;

const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
const REP_ERR_INVALID: u32 = (1 << 31) | 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;

const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

/// HAS_FLAGS | READ_ONLY.
const TRANSMISSION_FLAGS: u16 = 1 | 2;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_CACHE: u16 = 5;

const EPERM: u32 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;

/// Longest option or read accepted.
const MAX_OPTION: u32 = 4096;
const MAX_READ: u32 = 32 << 20;
/// Reads of one connection served at once.
const IN_FLIGHT: usize = 16;

/// What the server exports, by name.
#[async_trait::async_trait]
pub trait Exports: Send + Sync + 'static {
    async fn open(&self, name: &str) -> Option<Arc<Disk>>;
}

/// Serve `listener` until it fails; `connections` counts open ones.
pub async fn serve(
    listener: UnixListener,
    exports: Arc<dyn Exports>,
    cache: Arc<ChunkCache>,
    connections: Arc<AtomicUsize>,
) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("nbd accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (exports, cache, connections) = (exports.clone(), cache.clone(), connections.clone());
        connections.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            if let Err(e) = connection(stream, exports, cache).await {
                tracing::debug!("nbd connection ended: {e}");
            }
            connections.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

async fn connection(
    stream: tokio::net::UnixStream,
    exports: Arc<dyn Exports>,
    cache: Arc<ChunkCache>,
) -> std::io::Result<()> {
    let (mut rd, mut wr) = stream.into_split();
    let Some(disk) = handshake(&mut rd, &mut wr, exports.as_ref()).await? else {
        return Ok(());
    };
    transmission(rd, wr, disk, cache).await
}

async fn option_reply<W: AsyncWrite + Unpin>(
    w: &mut W,
    opt: u32,
    kind: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    w.write_all(&b).await
}

/// Negotiate until the client picks an export (Some) or leaves (None).
async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    exports: &dyn Exports,
) -> std::io::Result<Option<Arc<Disk>>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    wr.write_all(&hello).await?;
    let client_flags = rd.read_u32().await?;
    let no_zeroes = client_flags & u32::from(FLAG_NO_ZEROES) != 0;
    loop {
        if rd.read_u64().await? != IHAVEOPT {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "bad option magic",
            ));
        }
        let opt = rd.read_u32().await?;
        let len = rd.read_u32().await?;
        if len > MAX_OPTION {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "option too long",
            ));
        }
        let mut data = vec![0u8; len as usize];
        rd.read_exact(&mut data).await?;
        match opt {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data).into_owned();
                // This option has no error reply: an unknown name closes.
                let Some(disk) = exports.open(&name).await else {
                    return Ok(None);
                };
                let mut b = Vec::with_capacity(134);
                b.extend_from_slice(&export_size(&disk).to_be_bytes());
                b.extend_from_slice(&TRANSMISSION_FLAGS.to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                wr.write_all(&b).await?;
                return Ok(Some(disk));
            }
            OPT_ABORT => {
                option_reply(wr, opt, REP_ACK, &[]).await?;
                return Ok(None);
            }
            OPT_LIST => option_reply(wr, opt, REP_ACK, &[]).await?,
            OPT_INFO | OPT_GO => {
                let Some((name, infos)) = parse_info_request(&data) else {
                    option_reply(wr, opt, REP_ERR_INVALID, b"malformed request").await?;
                    continue;
                };
                let Some(disk) = exports.open(&name).await else {
                    let msg = format!("no image {name:?} here");
                    option_reply(wr, opt, REP_ERR_UNKNOWN, msg.as_bytes()).await?;
                    continue;
                };
                let mut export = Vec::with_capacity(12);
                export.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                export.extend_from_slice(&export_size(&disk).to_be_bytes());
                export.extend_from_slice(&TRANSMISSION_FLAGS.to_be_bytes());
                option_reply(wr, opt, REP_INFO, &export).await?;
                if infos.contains(&INFO_BLOCK_SIZE) {
                    let mut bs = Vec::with_capacity(14);
                    bs.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                    bs.extend_from_slice(&1u32.to_be_bytes());
                    bs.extend_from_slice(&4096u32.to_be_bytes());
                    bs.extend_from_slice(&MAX_READ.to_be_bytes());
                    option_reply(wr, opt, REP_INFO, &bs).await?;
                }
                option_reply(wr, opt, REP_ACK, &[]).await?;
                if opt == OPT_GO {
                    return Ok(Some(disk));
                }
            }
            _ => option_reply(wr, opt, REP_ERR_UNSUP, &[]).await?,
        }
    }
}

/// The size an export announces: the disk's, up to a whole 4 KiB (QEMU's
/// client stalls on a disk whose size is not a whole number of sectors);
/// the bytes past the disk read as zeros.
fn export_size(disk: &Disk) -> u64 {
    disk.index.disk_size.next_multiple_of(4096)
}

/// `u32 len, name, u16 n, n × u16` of NBD_OPT_INFO/GO.
fn parse_info_request(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let len = u32::from_be_bytes(data.get(..4)?.try_into().ok()?) as usize;
    let name = String::from_utf8_lossy(data.get(4..4 + len)?).into_owned();
    let rest = data.get(4 + len..)?;
    let n = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let infos = (0..n)
        .map(|i| {
            rest.get(2 + 2 * i..4 + 2 * i)
                .map(|b| u16::from_be_bytes([b[0], b[1]]))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((name, infos))
}

async fn transmission<R, W>(
    mut rd: R,
    wr: W,
    disk: Arc<Disk>,
    cache: Arc<ChunkCache>,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let mut header = [0u8; 28];
        if rd.read_exact(&mut header).await.is_err() {
            break;
        }
        let magic = u32::from_be_bytes(header[0..4].try_into().expect("4"));
        let kind = u16::from_be_bytes(header[6..8].try_into().expect("2"));
        let handle = u64::from_be_bytes(header[8..16].try_into().expect("8"));
        let offset = u64::from_be_bytes(header[16..24].try_into().expect("8"));
        let len = u32::from_be_bytes(header[24..28].try_into().expect("4"));
        if magic != REQUEST_MAGIC {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "bad request magic",
            ));
        }
        match kind {
            CMD_READ => {
                let in_range = offset
                    .checked_add(u64::from(len))
                    .is_some_and(|end| end <= export_size(&disk));
                if !in_range || len > MAX_READ {
                    reply(&wr, handle, EINVAL, &[]).await?;
                    continue;
                }
                let permit = slots.clone().acquire_owned().await.expect("never closed");
                let (wr, disk, cache) = (wr.clone(), disk.clone(), cache.clone());
                tasks.spawn(async move {
                    let _permit = permit;
                    match read(&cache, &disk, offset, len as usize).await {
                        Ok(data) => reply(&wr, handle, 0, &data).await,
                        Err(()) => reply(&wr, handle, EIO, &[]).await,
                    }
                });
            }
            CMD_WRITE => {
                // Drain the payload; the export is read-only.
                let mut left = u64::from(len);
                let mut sink = vec![0u8; 64 << 10];
                while left > 0 {
                    let n = left.min(sink.len() as u64) as usize;
                    rd.read_exact(&mut sink[..n]).await?;
                    left -= n as u64;
                }
                reply(&wr, handle, EPERM, &[]).await?;
            }
            CMD_DISC => break,
            CMD_FLUSH | CMD_CACHE => reply(&wr, handle, 0, &[]).await?,
            _ => reply(&wr, handle, EINVAL, &[]).await?,
        }
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

async fn reply<W: AsyncWrite + Unpin>(
    wr: &tokio::sync::Mutex<W>,
    handle: u64,
    error: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut head = [0u8; 16];
    head[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    head[4..8].copy_from_slice(&error.to_be_bytes());
    head[8..16].copy_from_slice(&handle.to_be_bytes());
    let mut w = wr.lock().await;
    w.write_all(&head).await?;
    w.write_all(data).await?;
    w.flush().await
}

/// `len` bytes of `disk` from `offset`, chunk by chunk.
async fn read(cache: &ChunkCache, disk: &Disk, offset: u64, len: usize) -> Result<Vec<u8>, ()> {
    let cs = disk.index.chunk_size;
    let mut out = vec![0u8; len];
    let mut pos = offset;
    let end = offset + len as u64;
    while pos < end {
        let i = (pos / cs) as usize;
        let within = (pos % cs) as usize;
        let take = ((cs - within as u64).min(end - pos)) as usize;
        let data = cache.read(disk, i).await.map_err(|_| ())?;
        let dst = &mut out[(pos - offset) as usize..][..take];
        // Bytes past the chunk's data (a short last chunk, a chunk of
        // zeros) stay zero.
        if within < data.len() {
            let n = take.min(data.len() - within);
            dst[..n].copy_from_slice(&data[within..within + n]);
        }
        pos += take as u64;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunks::{build, chunk_dir, CHUNK_SIZE};
    use std::os::unix::fs::FileExt;

    struct One(String, Arc<Disk>);

    #[async_trait::async_trait]
    impl Exports for One {
        async fn open(&self, name: &str) -> Option<Arc<Disk>> {
            (name == self.0).then(|| self.1.clone())
        }
    }

    async fn qemu_img(args: &[&str]) -> std::process::Output {
        tokio::process::Command::new("qemu-img")
            .args(args)
            .output()
            .await
            .unwrap()
    }

    /// QEMU's own NBD client reads back exactly the disk that was cut into
    /// chunks: through the export directly and as a qcow2 overlay's
    /// backing file; an unknown export and a write are refused.
    #[tokio::test]
    async fn qemu_reads_the_exact_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("disk");
        let f = std::fs::File::create(&disk).unwrap();
        f.set_len(5 * CHUNK_SIZE + 12345).unwrap();
        for (i, at) in [0, CHUNK_SIZE - 7, 3 * CHUNK_SIZE + 999, 5 * CHUNK_SIZE + 1]
            .iter()
            .enumerate()
        {
            let data: Vec<u8> = (0..70_000u32).map(|j| (j as u8) ^ (i as u8 * 31)).collect();
            f.write_all_at(
                &data[..data.len().min((5 * CHUNK_SIZE + 12345 - at) as usize)],
                *at,
            )
            .unwrap();
        }
        drop(f);
        let images = tmp.path().join("images");
        let index = build(&disk, &chunk_dir(&images)).unwrap();
        let cache = Arc::new(ChunkCache::open(&images, 1 << 30));
        let exports = Arc::new(One(
            "img".into(),
            Arc::new(Disk::new("test".into(), index, None)),
        ));
        let sock = tmp.path().join("s");
        let listener = UnixListener::bind(&sock).unwrap();
        let conns = Arc::new(AtomicUsize::new(0));
        tokio::spawn(serve(listener, exports, cache.clone(), conns));
        let url = format!("nbd+unix:///img?socket={}", sock.display());
        let out = tmp.path().join("out");
        let r = qemu_img(&[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &url,
            out.to_str().unwrap(),
        ])
        .await;
        assert!(
            r.status.success(),
            "{} {:?}",
            String::from_utf8_lossy(&r.stderr),
            cache.stats()
        );
        let (got, want) = (std::fs::read(&out).unwrap(), std::fs::read(&disk).unwrap());
        assert_eq!(got.len(), want.len().next_multiple_of(4096));
        assert_eq!(got[..want.len()], want[..]);
        assert!(got[want.len()..].iter().all(|&b| b == 0));

        let backing = format!(
            r#"json:{{"file.driver":"nbd","file.server.type":"unix","file.server.path":"{}","file.export":"img"}}"#,
            sock.display()
        );
        let ov = tmp.path().join("ov.qcow2");
        let r = qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            &backing,
            ov.to_str().unwrap(),
        ])
        .await;
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let r = qemu_img(&[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            ov.to_str().unwrap(),
            disk.to_str().unwrap(),
        ])
        .await;
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stdout));

        let unknown = format!("nbd+unix:///nope?socket={}", sock.display());
        let r = qemu_img(&["info", &unknown]).await;
        assert!(!r.status.success());
        let r = tokio::process::Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write 0 4k", &url])
            .output()
            .await
            .unwrap();
        let said =
            String::from_utf8_lossy(&r.stdout).to_string() + &String::from_utf8_lossy(&r.stderr);
        assert!(
            said.contains("read-only")
                || said.contains("Operation not permitted")
                || said.contains("Permission denied"),
            "{said}"
        );
    }
}
