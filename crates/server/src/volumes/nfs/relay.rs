//! The relay between a guest's NFS connections (on the gateway address
//! of its namespace) and the NFS server on the namespace's loopback.
//!
//! It owns the guest's connections: when it is aborted (the sandbox's VM
//! is gone) they all close, and with them the server's side (nfsserve
//! sets no keepalive, and a socket left open would keep the namespace
//! alive). It also bounds what one guest can make the server hold: at most
//! [`CONNECTIONS`] connections a mount, calls of at most [`MAX_RECORD`]
//! bytes, and [`IN_FLIGHT`] calls a connection waiting for their replies
//! (a guest that sends calls and never reads the replies stops being read
//! from, instead of making the server queue a reply for each).

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use tine_vmm::Guest;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Connections one mount takes at once (the guest's client opens one, and
/// one more for the MOUNT call); those past it are closed at once.
const CONNECTIONS: usize = 4;
/// Calls one connection may have in the server at once.
const IN_FLIGHT: usize = 8;
/// The largest call taken from a guest: a 1 MiB WRITE and its header.
const MAX_RECORD: usize = (1 << 20) + (64 << 10);
/// Bytes moved per read.
const BUFFER: usize = 256 << 10;

/// Serve `outer`'s connections until aborted, each relayed to the server
/// on `127.0.0.1:port` of `guest`'s namespace.
pub(super) async fn run(outer: TcpListener, guest: Guest, port: u16) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = outer.accept() => match accepted {
                Ok((down, _)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        tracing::debug!(port, "volume relay: a connection past the limit, closed");
                        continue;
                    };
                    let guest = guest.clone();
                    conns.spawn(async move {
                        let _slot = slot;
                        let to = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
                        if let Ok(up) = guest.connect_out(to).await {
                            let _ = connection(down, up).await;
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("volume relay: accepting: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Relay one connection until either side ends it.
async fn connection(down: TcpStream, up: TcpStream) -> io::Result<()> {
    down.set_nodelay(true)?;
    let (dr, dw) = down.into_split();
    let (ur, uw) = up.into_split();
    let calls = Arc::new(Semaphore::new(IN_FLIGHT));
    tokio::select! {
        r = calls_up(BufReader::with_capacity(BUFFER, dr), uw, calls.clone()) => r,
        r = replies_down(BufReader::with_capacity(BUFFER, ur), dw, calls) => r,
    }
}

/// One record-marking header: a fragment's length, and whether it ends
/// its record.
async fn header(r: &mut (impl AsyncRead + Unpin)) -> io::Result<(u32, bool)> {
    let h = r.read_u32().await?;
    Ok((h & 0x7fff_ffff, h & 0x8000_0000 != 0))
}

/// Copy one fragment of `len` bytes (its header first) and flush it.
async fn fragment(
    from: &mut BufReader<OwnedReadHalf>,
    to: &mut BufWriter<impl AsyncWrite + Unpin>,
    len: u32,
    last: bool,
) -> io::Result<()> {
    to.write_u32(len | if last { 0x8000_0000 } else { 0 })
        .await?;
    let n = tokio::io::copy_buf(&mut from.take(len as u64), to).await?;
    if n != len as u64 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    to.flush().await
}

/// The guest's calls, each waiting for room among the calls in flight.
async fn calls_up(
    mut from: BufReader<OwnedReadHalf>,
    to: OwnedWriteHalf,
    calls: Arc<Semaphore>,
) -> io::Result<()> {
    let mut to = BufWriter::with_capacity(BUFFER, to);
    let mut record = 0usize;
    loop {
        let (len, last) = header(&mut from).await?;
        if record == 0 {
            calls.acquire().await.map_err(io::Error::other)?.forget();
        }
        record += len as usize;
        if record > MAX_RECORD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an NFS call of over {MAX_RECORD} bytes"),
            ));
        }
        fragment(&mut from, &mut to, len, last).await?;
        if last {
            record = 0;
        }
    }
}

/// The server's replies; each makes room for another call.
async fn replies_down(
    mut from: BufReader<OwnedReadHalf>,
    to: OwnedWriteHalf,
    calls: Arc<Semaphore>,
) -> io::Result<()> {
    let mut to = BufWriter::with_capacity(BUFFER, to);
    loop {
        let (len, last) = header(&mut from).await?;
        fragment(&mut from, &mut to, len, last).await?;
        if last {
            calls.add_permits(1);
        }
    }
}
