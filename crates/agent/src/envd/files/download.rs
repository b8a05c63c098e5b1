//! The body of a `GET /files`: a file read to end of file (never trusting
//! the size `stat` gives: procfs and sysfs files say 0, a file being
//! written grows), as bytes or gzip, or one byte range of it.

use std::fs::{File, Metadata};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use tokio::sync::mpsc;

use crate::envd::error::{EnvdError, Result};
use crate::envd::user::blocking;

/// Bytes read per chunk sent.
const CHUNK: usize = 256 << 10;
/// A range of a file whose size `stat` cannot tell is served from memory,
/// up to this much; a larger such file is served whole (a server may
/// ignore `Range`).
const UNSIZED_RANGE_MAX: u64 = 16 << 20;

/// One `Range: bytes=…` request; several ranges are not served (the whole
/// file is, as a server may).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteRange {
    /// `a-b` or `a-` (inclusive end).
    From(u64, Option<u64>),
    /// `-n`: the last n bytes.
    Suffix(u64),
}

/// Parses a single byte range; anything else is `None` (ignored).
pub fn parse_range(v: &str) -> Option<ByteRange> {
    let spec = v.trim().strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    if a.is_empty() {
        return b.parse().ok().map(ByteRange::Suffix);
    }
    let start = a.parse().ok()?;
    if b.is_empty() {
        return Some(ByteRange::From(start, None));
    }
    let end: u64 = b.parse().ok()?;
    (end >= start).then_some(ByteRange::From(start, Some(end)))
}

impl ByteRange {
    /// The inclusive `[start, end]` of this range in a file of `size`
    /// bytes, or `None` when it is not satisfiable.
    fn within(self, size: u64) -> Option<(u64, u64)> {
        match self {
            ByteRange::From(start, _) if start >= size => None,
            ByteRange::From(start, end) => Some((start, end.map_or(size - 1, |e| e.min(size - 1)))),
            ByteRange::Suffix(0) => None,
            ByteRange::Suffix(_) if size == 0 => None,
            ByteRange::Suffix(n) => Some((size - n.min(size), size - 1)),
        }
    }
}

/// Whether the client takes a gzip body (`Accept-Encoding` names gzip with
/// a non-zero q).
pub fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or("").trim();
            let zero_q = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            name.eq_ignore_ascii_case("gzip") && !zero_q
        })
}

fn base_response(status: StatusCode, body: Body) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    resp
}

/// The whole file, read to end of file by a blocking-pool reader and sent
/// chunk by chunk (no `Content-Length`: the size is known only at the end).
pub fn whole(file: File, gzip: bool, path: PathBuf) -> Response {
    let body = streamed(path, move |tx| pump(file, gzip, tx));
    let mut resp = base_response(StatusCode::OK, body);
    if gzip {
        resp.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    resp
}

type Tx = mpsc::Sender<std::io::Result<Bytes>>;

/// A body that `produce` feeds from a blocking-pool thread. A read error
/// after the first chunk aborts the body, so the client sees a broken
/// transfer, never a short file that looks whole.
fn streamed<F>(path: PathBuf, produce: F) -> Body
where
    F: FnOnce(&Tx) -> std::io::Result<()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = produce(&tx) {
            tracing::warn!(path = %path.display(), error = %e, "reading a file for download");
            let _ = tx.blocking_send(Err(e));
        }
    });
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// Sends what `r` reads until its end, gzip-compressed or as it is. A
/// receiver that went away ends the read without an error.
fn pump(mut r: impl Read, gzip: bool, tx: &Tx) -> std::io::Result<()> {
    let mut enc =
        gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let out = match &mut enc {
            Some(enc) => {
                enc.write_all(&buf[..n])?;
                std::mem::take(enc.get_mut())
            }
            None => buf[..n].to_vec(),
        };
        if !out.is_empty() && tx.blocking_send(Ok(Bytes::from(out))).is_err() {
            return Ok(());
        }
    }
    if let Some(enc) = enc {
        let _ = tx.blocking_send(Ok(Bytes::from(enc.finish()?)));
    }
    Ok(())
}

/// One byte range: 206 with `Content-Range`, or 416 when it lies past the
/// end. A regular file with a size is read at the range; a file whose
/// size `stat` cannot tell is read to its end first (small: procfs, sysfs).
pub async fn ranged(file: File, meta: Metadata, range: ByteRange, path: &Path) -> Result<Response> {
    let p = path.to_path_buf();
    if meta.is_file() && meta.len() > 0 {
        let size = meta.len();
        let Some((start, end)) = range.within(size) else {
            return Ok(unsatisfiable(size));
        };
        let len = end - start + 1;
        let mut file = file;
        let body = streamed(p, move |tx| {
            file.seek(SeekFrom::Start(start))?;
            pump(file.take(len), false, tx)
        });
        return Ok(partial(body, start, end, size));
    }
    let read = blocking(move || {
        let mut data = Vec::new();
        (&file)
            .take(UNSIZED_RANGE_MAX + 1)
            .read_to_end(&mut data)
            .map_err(|e| EnvdError::io(&e, p.display()))?;
        Ok((data, file))
    })
    .await?;
    let (data, file) = read;
    if data.len() as u64 > UNSIZED_RANGE_MAX {
        // Too large to hold: the whole file, from the start again.
        let mut file = file;
        file.seek(SeekFrom::Start(0))
            .map_err(|e| EnvdError::io(&e, path.display()))?;
        return Ok(whole(file, false, path.to_path_buf()));
    }
    let size = data.len() as u64;
    let Some((start, end)) = range.within(size) else {
        return Ok(unsatisfiable(size));
    };
    let body = Bytes::from(data).slice(start as usize..=end as usize);
    Ok(partial(Body::from(body), start, end, size))
}

fn partial(body: Body, start: u64, end: u64, size: u64) -> Response {
    let mut resp = base_response(StatusCode::PARTIAL_CONTENT, body);
    let h = resp.headers_mut();
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(end - start + 1));
    if let Ok(v) = HeaderValue::from_str(&format!("bytes {start}-{end}/{size}")) {
        h.insert(header::CONTENT_RANGE, v);
    }
    resp
}

fn unsatisfiable(size: u64) -> Response {
    let body = serde_json::json!({
        "code": 416,
        "message": format!("the requested range is not satisfiable (the file has {size} bytes)"),
    });
    let mut resp = base_response(
        StatusCode::RANGE_NOT_SATISFIABLE,
        Body::from(body.to_string()),
    );
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}")) {
        h.insert(header::CONTENT_RANGE, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_fit_like_rfc_9110() {
        assert_eq!(parse_range("bytes=0-9"), Some(ByteRange::From(0, Some(9))));
        assert_eq!(parse_range("bytes=5-"), Some(ByteRange::From(5, None)));
        assert_eq!(parse_range("bytes=-3"), Some(ByteRange::Suffix(3)));
        assert_eq!(parse_range("bytes=9-2"), None);
        assert_eq!(parse_range("bytes=0-1,4-5"), None);
        assert_eq!(parse_range("items=0-1"), None);
        assert_eq!(parse_range("bytes=x-1"), None);
        let r = |s| parse_range(s).unwrap();
        assert_eq!(r("bytes=0-9").within(5), Some((0, 4)));
        assert_eq!(r("bytes=5-").within(5), None);
        assert_eq!(r("bytes=2-").within(5), Some((2, 4)));
        assert_eq!(r("bytes=-3").within(5), Some((2, 4)));
        assert_eq!(r("bytes=-30").within(5), Some((0, 4)));
        assert_eq!(r("bytes=-0").within(5), None);
        assert_eq!(r("bytes=0-0").within(0), None);
    }

    #[test]
    fn gzip_is_taken_unless_refused() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::ACCEPT_ENCODING, HeaderValue::from_str(v).unwrap());
            accepts_gzip(&m)
        };
        assert!(h("gzip"));
        assert!(h("br, GZIP;q=0.5"));
        assert!(!h("gzip;q=0"));
        assert!(!h("identity"));
        assert!(!accepts_gzip(&HeaderMap::new()));
    }
}
