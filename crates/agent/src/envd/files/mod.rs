//! `GET /files` (download) and `POST /files` (multipart or raw upload).
//!
//! Both directions stream: a download is the file read in chunks, an
//! upload is written chunk by chunk by a blocking-pool writer fed through
//! a small channel, so neither ever holds a whole file in memory. As in
//! envd, both run as the agent (root); files and missing parent
//! directories that an upload creates are handed to the caller's user.
//! Downloads read to end of file whatever `stat` says (procfs, sysfs and
//! files still being written), with gzip and single byte ranges
//! (`download.rs`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Query, Request, State};
use axum::http::{header, HeaderMap};
use axum::response::Response;
use axum::routing::get;
use axum::{Json, Router};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::error::{EnvdError, Result};
use super::user::{blocking, chown, ensure_dirs, User};
use super::Envd;

mod download;

pub fn routes() -> Router<Arc<Envd>> {
    Router::new().route(
        "/files",
        get(download)
            .post(upload)
            .layer(DefaultBodyLimit::disable()),
    )
}

#[derive(Debug, Default, Deserialize)]
pub struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<String>,
}

#[derive(Debug, Serialize)]
struct UploadedEntry {
    name: String,
    path: String,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    metadata: BTreeMap<String, String>,
}

/// `X-Metadata-<key>: <value>` headers, keys lowercased.
fn metadata_headers(headers: &HeaderMap) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (name, value) in headers {
        if let Some(key) = name.as_str().strip_prefix("x-metadata-") {
            if key.is_empty() {
                continue;
            }
            let value = value.to_str().map_err(|_| {
                EnvdError::InvalidArgument(format!("metadata {key:?} is not valid text"))
            })?;
            out.insert(key.to_ascii_lowercase(), value.to_string());
        }
    }
    Ok(out)
}

/// Stores the request's metadata on a written file, replacing any: a
/// write without metadata clears what an earlier write stored (as envd).
async fn apply_metadata(path: &Path, meta: &BTreeMap<String, String>) -> Result<()> {
    let (p, m) = (path.to_path_buf(), meta.clone());
    blocking(move || {
        super::xattr::replace_metadata(&p, &m).map_err(|e| match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) => EnvdError::FailedPrecondition(format!(
                "{}: the filesystem does not support file metadata (xattrs)",
                p.display()
            )),
            _ => EnvdError::io(&e, format!("setting metadata on {}", p.display())),
        })
    })
    .await
}

/// Authorizes and resolves the caller of a `/files` request.
fn authorize(envd: &Envd, headers: &HeaderMap, q: &FilesQuery, operation: &str) -> Result<User> {
    let expiration = match q.signature_expiration.as_deref() {
        Some(s) => Some(s.parse::<i64>().map_err(|_| {
            EnvdError::InvalidArgument(format!("invalid signature_expiration {s:?}"))
        })?),
        None => None,
    };
    envd.auth.check_signature(
        headers,
        q.path.as_deref().unwrap_or(""),
        operation,
        q.username.as_deref(),
        q.signature.as_deref(),
        expiration,
    )?;
    envd.user_from_headers(headers, q.username.as_deref())
}

fn resolve(envd: &Envd, user: &User, path: &str) -> Result<PathBuf> {
    if path.is_empty() {
        return Err(EnvdError::InvalidArgument("path is required".into()));
    }
    user.resolve(path, envd.defaults().workdir.as_deref())
}

fn parse_query(
    raw: std::result::Result<Query<FilesQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<FilesQuery> {
    raw.map(|Query(q)| q)
        .map_err(|e| EnvdError::InvalidArgument(format!("invalid query: {e}")))
}

async fn download(
    State(envd): State<Arc<Envd>>,
    query: std::result::Result<Query<FilesQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Result<Response> {
    let q = parse_query(query)?;
    let user = authorize(&envd, &headers, &q, "read")?;
    let path = resolve(&envd, &user, q.path.as_deref().unwrap_or(""))?;
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(download::parse_range);
    // A range is served as bytes (as envd, which falls back to identity).
    let gzip = range.is_none() && download::accepts_gzip(&headers);
    let p = path.clone();
    let (file, meta) = blocking(move || {
        let file = File::open(&p).map_err(|e| EnvdError::io(&e, p.display()))?;
        let meta = file
            .metadata()
            .map_err(|e| EnvdError::io(&e, p.display()))?;
        if meta.is_dir() {
            return Err(EnvdError::InvalidArgument(format!(
                "path '{}' is a directory",
                p.display()
            )));
        }
        Ok((file, meta))
    })
    .await?;
    match range {
        Some(range) => download::ranged(file, meta, range, &path).await,
        None => Ok(download::whole(file, gzip, path)),
    }
}

async fn upload(
    State(envd): State<Arc<Envd>>,
    query: std::result::Result<Query<FilesQuery>, axum::extract::rejection::QueryRejection>,
    req: Request,
) -> Result<Json<Vec<UploadedEntry>>> {
    let q = parse_query(query)?;
    let headers = req.headers().clone();
    let user = authorize(&envd, &headers, &q, "write")?;
    let metadata = metadata_headers(&headers)?;
    let media = super::rpc::media_type(&headers);
    let written = match media.as_str() {
        "multipart/form-data" => upload_multipart(&envd, &user, q.path.as_deref(), &metadata, req).await?,
        "application/octet-stream" => {
            let path = resolve(&envd, &user, q.path.as_deref().unwrap_or(""))?;
            let gzip = match headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()).map(|v| v.trim().to_ascii_lowercase()) {
                None => false,
                Some(e) if e.is_empty() || e == "identity" => false,
                Some(e) if e == "gzip" => true,
                Some(e) => return Err(EnvdError::InvalidArgument(format!("unsupported Content-Encoding {e:?}"))),
            };
            let mut sink = Sink::open(&user, path.clone(), gzip).await?;
            let mut body = req.into_body().into_data_stream();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| EnvdError::InvalidArgument(format!("reading the upload: {e}")))?;
                sink.write(chunk).await?;
            }
            sink.finish().await?;
            apply_metadata(&path, &metadata).await?;
            vec![uploaded(&path, &metadata)]
        }
        other => return Err(EnvdError::InvalidArgument(format!("unsupported content type {other:?}: use multipart/form-data or application/octet-stream"))),
    };
    Ok(Json(written))
}

fn uploaded(path: &Path, metadata: &BTreeMap<String, String>) -> UploadedEntry {
    UploadedEntry {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        path: path.display().to_string(),
        kind: "file",
        metadata: metadata.clone(),
    }
}

async fn upload_multipart(
    envd: &Envd,
    user: &User,
    query_path: Option<&str>,
    metadata: &BTreeMap<String, String>,
    req: Request,
) -> Result<Vec<UploadedEntry>> {
    let bad = |e: axum::extract::multipart::MultipartError| {
        EnvdError::InvalidArgument(format!("invalid multipart body: {e}"))
    };
    let mut form = axum::extract::Multipart::from_request(req, &())
        .await
        .map_err(|e| EnvdError::InvalidArgument(format!("invalid multipart body: {e}")))?;
    let mut written = Vec::new();
    while let Some(mut field) = form.next_field().await.map_err(bad)? {
        let file_name = field.file_name().map(str::to_string);
        if field.name() != Some("file") && file_name.is_none() {
            continue; // not a file part
        }
        let dest = match (
            query_path.filter(|p| !p.is_empty()),
            file_name.as_deref().filter(|f| !f.is_empty()),
        ) {
            (Some(p), _) => p.to_string(),
            (None, Some(f)) => f.to_string(),
            (None, None) => {
                return Err(EnvdError::InvalidArgument(
                    "a file part has no filename and there is no path parameter".into(),
                ))
            }
        };
        let path = resolve(envd, user, &dest)?;
        let mut sink = Sink::open(user, path.clone(), false).await?;
        while let Some(chunk) = field.chunk().await.map_err(bad)? {
            sink.write(chunk).await?;
        }
        sink.finish().await?;
        apply_metadata(&path, metadata).await?;
        written.push(uploaded(&path, metadata));
    }
    if written.is_empty() {
        return Err(EnvdError::InvalidArgument("the request has no file".into()));
    }
    Ok(written)
}

/// A file being written by a blocking-pool thread.
struct Sink {
    tx: Option<mpsc::Sender<Bytes>>,
    writer: tokio::task::JoinHandle<Result<()>>,
}

impl Sink {
    /// Opens `path` for writing as envd does: missing parent directories
    /// are made and handed to the user, an existing file is truncated, and
    /// the file is handed to the user once written (a watch sees create,
    /// write, chmod, as envd's), also when the write fails half-way.
    async fn open(user: &User, path: PathBuf, gzip: bool) -> Result<Sink> {
        let p = path.clone();
        let owner = user.owner();
        let file = blocking(move || {
            if let Some(parent) = p.parent() {
                ensure_dirs(parent, owner)?;
            }
            if p.is_dir() {
                return Err(EnvdError::InvalidArgument(format!(
                    "path is a directory: {}",
                    p.display()
                )));
            }
            File::create(&p).map_err(|e| EnvdError::io(&e, p.display()))
        })
        .await?;
        let (tx, mut rx) = mpsc::channel::<Bytes>(8);
        let writer = tokio::task::spawn_blocking(move || {
            let fail = |e: std::io::Error| EnvdError::io(&e, path.display());
            let gzip_fail = |e: std::io::Error| {
                EnvdError::InvalidArgument(format!("gzip body of {}: {e}", path.display()))
            };
            let written = if gzip {
                let mut dec = flate2::write::GzDecoder::new(std::io::BufWriter::with_capacity(
                    256 << 10,
                    file,
                ));
                (|| {
                    while let Some(chunk) = rx.blocking_recv() {
                        dec.write_all(&chunk).map_err(gzip_fail)?;
                    }
                    dec.try_finish().map_err(gzip_fail)?;
                    dec.get_mut().flush().map_err(fail)
                })()
            } else {
                let mut out = std::io::BufWriter::with_capacity(256 << 10, file);
                (|| {
                    while let Some(chunk) = rx.blocking_recv() {
                        out.write_all(&chunk).map_err(fail)?;
                    }
                    out.flush().map_err(fail)
                })()
            };
            // The user's file, whether or not all of it was written.
            let handed = chown(&path, owner);
            written.and(handed)
        });
        Ok(Sink {
            tx: Some(tx),
            writer,
        })
    }

    async fn write(&mut self, chunk: Bytes) -> Result<()> {
        let sent = match &self.tx {
            Some(tx) => tx.send(chunk).await.is_ok(),
            None => false,
        };
        if sent {
            return Ok(());
        }
        // The writer stopped: report its error.
        self.tx = None;
        match (&mut self.writer).await {
            Ok(Err(e)) => Err(e),
            _ => Err(EnvdError::Internal("the file writer stopped".into())),
        }
    }

    async fn finish(mut self) -> Result<()> {
        self.tx = None;
        (&mut self.writer)
            .await
            .map_err(|e| EnvdError::Internal(format!("file writer: {e}")))?
    }
}
