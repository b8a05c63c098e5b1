//! `process.Process`: start processes (pipes or PTY), attach to them from
//! any number of clients, feed their input, signal them, list them.

mod output;
pub mod proto;
mod spawn;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use tokio::sync::watch;

use self::output::{Ended, Item, Output, Source};
use self::proto::*;
use self::spawn::PtyMaster;
use super::error::{EnvdError, Result};
use super::rpc::{unary, Ctx, StreamTx, Wire};

/// Output kept per process for clients that attach later or read slowly.
const OUTPUT_BUFFER: usize = 1 << 20;
/// Largest single read from a pipe or PTY.
const READ_CHUNK: usize = 32 << 10;
/// After a process exits, at most this much more is read from its pipes
/// (output a still-running grandchild keeps writing is not waited for).
const DRAIN_LIMIT: usize = 1 << 20;

enum Stdin {
    Pipe(tokio::net::unix::pipe::Sender),
    Pty,
}

/// One running process.
pub struct Process {
    pid: u32,
    tag: Option<String>,
    config: ProcessConfig,
    output: Arc<Output>,
    stdin: tokio::sync::Mutex<Option<Stdin>>,
    pty: Option<Arc<PtyMaster>>,
}

impl Process {
    fn info(&self) -> ProcessInfo {
        ProcessInfo {
            config: self.config.clone(),
            pid: self.pid,
            tag: self.tag.clone(),
        }
    }

    async fn write_input(&self, input: ProcessInput) -> Result<()> {
        let closed = || {
            EnvdError::FailedPrecondition(format!(
                "stdin of process {} is closed or was not enabled",
                self.pid
            ))
        };
        if let Some(data) = input.pty {
            let pty = self.pty.as_ref().ok_or_else(|| {
                EnvdError::FailedPrecondition(format!("process {} has no PTY", self.pid))
            })?;
            return pty
                .write_all(&data)
                .await
                .map_err(|e| EnvdError::Internal(format!("writing to the PTY: {e}")));
        }
        let Some(data) = input.stdin else {
            return Ok(());
        };
        let mut guard = self.stdin.lock().await;
        match guard.as_mut().ok_or_else(closed)? {
            Stdin::Pipe(pipe) => {
                use tokio::io::AsyncWriteExt;
                pipe.write_all(&data)
                    .await
                    .map_err(|e| EnvdError::FailedPrecondition(format!("writing stdin: {e}")))
            }
            Stdin::Pty => {
                drop(guard);
                self.pty
                    .as_ref()
                    .ok_or_else(closed)?
                    .write_all(&data)
                    .await
                    .map_err(|e| EnvdError::Internal(format!("writing to the PTY: {e}")))
            }
        }
    }

    fn signal(&self, sig: nix::sys::signal::Signal) -> Result<()> {
        use nix::unistd::Pid;
        let pid = Pid::from_raw(self.pid as i32);
        // The whole process group (the child leads its own), else the child.
        if nix::sys::signal::killpg(pid, sig).is_err() {
            nix::sys::signal::kill(pid, sig)
                .map_err(|e| EnvdError::Internal(format!("signal {sig} to {}: {e}", self.pid)))?;
        }
        Ok(())
    }
}

/// Every process started through the API that has not ended yet.
#[derive(Default)]
pub struct Table {
    procs: Mutex<HashMap<u32, Arc<Process>>>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Process>>> {
        self.procs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn find(&self, sel: Option<&ProcessSelector>) -> Result<Arc<Process>> {
        let sel =
            sel.ok_or_else(|| EnvdError::InvalidArgument("process selector is missing".into()))?;
        let procs = self.lock();
        match (sel.pid, &sel.tag) {
            (Some(pid), _) => procs
                .get(&pid)
                .cloned()
                .ok_or_else(|| EnvdError::NotFound(format!("process with pid {pid} not found"))),
            (None, Some(tag)) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned()
                .ok_or_else(|| EnvdError::NotFound(format!("process with tag {tag:?} not found"))),
            (None, None) => Err(EnvdError::InvalidArgument(
                "process selector needs a pid or a tag".into(),
            )),
        }
    }
}

/// Dispatches one `process.Process` call.
pub async fn handle(method: &str, ctx: Result<Ctx>, wire: &Wire, body: Body) -> Option<Response> {
    let resp = match method {
        "Start" => match ctx {
            Ok(ctx) => match wire.read_stream_request(body).await {
                Ok(req) => start(ctx, wire, req).await,
                Err(e) => wire.stream_error(e),
            },
            Err(e) => wire.stream_error(e),
        },
        "Connect" => match ctx {
            Ok(ctx) => match wire.read_stream_request::<SelectorRequest>(body).await {
                Ok(req) => connect(ctx, wire, req),
                Err(e) => wire.stream_error(e),
            },
            Err(e) => wire.stream_error(e),
        },
        "StreamInput" => match ctx {
            Ok(ctx) => stream_input(ctx, wire, body).await,
            Err(e) => wire.stream_error(e),
        },
        "List" => wire.unary_response(
            unary(ctx, wire, body, |ctx, _: serde_json::Value| async move {
                Ok(list(&ctx))
            })
            .await,
        ),
        "SendInput" => wire.unary_response(unary(ctx, wire, body, send_input).await),
        "SendSignal" => wire.unary_response(unary(ctx, wire, body, send_signal).await),
        "CloseStdin" => wire.unary_response(unary(ctx, wire, body, close_stdin).await),
        "Update" => wire.unary_response(unary(ctx, wire, body, update).await),
        _ => return None,
    };
    Some(resp)
}

fn list(ctx: &Ctx) -> ListResponse {
    let mut processes: Vec<ProcessInfo> = ctx
        .envd
        .processes
        .lock()
        .values()
        .map(|p| p.info())
        .collect();
    processes.sort_by_key(|p| p.pid);
    ListResponse { processes }
}

async fn send_input(ctx: Ctx, req: SendInputRequest) -> Result<Empty> {
    let proc = ctx.envd.processes.find(req.process.as_ref())?;
    proc.write_input(req.input.unwrap_or_default()).await?;
    Ok(Empty {})
}

async fn send_signal(ctx: Ctx, req: SendSignalRequest) -> Result<Empty> {
    use nix::sys::signal::Signal;
    let num = req
        .signal
        .as_ref()
        .and_then(|s| s.resolve(SIGNAL))
        .ok_or_else(|| EnvdError::InvalidArgument("unknown or missing signal".into()))?;
    let sig = i32::try_from(num)
        .ok()
        .and_then(|n| Signal::try_from(n).ok())
        .ok_or_else(|| EnvdError::InvalidArgument(format!("invalid signal {num}")))?;
    let proc = ctx.envd.processes.find(req.process.as_ref())?;
    proc.signal(sig)?;
    Ok(Empty {})
}

async fn close_stdin(ctx: Ctx, req: SelectorRequest) -> Result<Empty> {
    let proc = ctx.envd.processes.find(req.process.as_ref())?;
    let mut stdin = proc.stdin.lock().await;
    if let Some(Stdin::Pty) = *stdin {
        // A terminal has no end of input; send the EOF character instead.
        drop(stdin);
        if let Some(pty) = &proc.pty {
            pty.write_all(&[4])
                .await
                .map_err(|e| EnvdError::Internal(format!("writing to the PTY: {e}")))?;
        }
        return Ok(Empty {});
    }
    stdin.take();
    Ok(Empty {})
}

async fn update(ctx: Ctx, req: UpdateRequest) -> Result<Empty> {
    let proc = ctx.envd.processes.find(req.process.as_ref())?;
    let Some(size) = req.pty.and_then(|p| p.size) else {
        return Ok(Empty {});
    };
    let pty = proc
        .pty
        .as_ref()
        .ok_or_else(|| EnvdError::FailedPrecondition(format!("process {} has no PTY", proc.pid)))?;
    let (cols, rows) = pty_dims(size)?;
    pty.resize(cols, rows)
        .map_err(|e| EnvdError::Internal(format!("resizing the PTY: {e}")))?;
    Ok(Empty {})
}

fn pty_dims(size: PtySize) -> Result<(u16, u16)> {
    let cols = u16::try_from(size.cols).ok().filter(|c| *c > 0);
    let rows = u16::try_from(size.rows).ok().filter(|r| *r > 0);
    match (cols, rows) {
        (Some(c), Some(r)) => Ok((c, r)),
        _ => Err(EnvdError::InvalidArgument(format!(
            "invalid PTY size {}x{}",
            size.cols, size.rows
        ))),
    }
}

async fn start(ctx: Ctx, wire: &Wire, req: StartRequest) -> Response {
    match spawn_process(&ctx, req) {
        Ok(proc) => {
            let sub = proc.output.subscribe();
            let (tx, resp) = wire.stream_response();
            tokio::spawn(pump_events(tx, proc.pid, sub, ctx.keepalive, None));
            resp
        }
        Err(e) => wire.stream_error(e),
    }
}

fn connect(ctx: Ctx, wire: &Wire, req: SelectorRequest) -> Response {
    match ctx.envd.processes.find(req.process.as_ref()) {
        Ok(proc) => {
            let sub = proc.output.subscribe();
            let (tx, resp) = wire.stream_response();
            tokio::spawn(pump_events(tx, proc.pid, sub, ctx.keepalive, ctx.timeout));
            resp
        }
        Err(e) => wire.stream_error(e),
    }
}

/// Sends `start`, the output, `end` and the end-of-stream to one client.
/// `deadline` bounds this stream only (the process keeps running).
async fn pump_events(
    tx: StreamTx,
    pid: u32,
    mut sub: output::Subscriber,
    keepalive: Option<Duration>,
    deadline: Option<Duration>,
) {
    let send = |ev: ProcessEvent| {
        let tx = &tx;
        async move { tx.send(&EventResponse { event: &ev }).await }
    };
    if send(ProcessEvent::Start { pid }).await.is_err() {
        return;
    }
    let deadline = deadline.map(|d| tokio::time::Instant::now() + d);
    let keepalive = keepalive.unwrap_or(Duration::from_secs(3600 * 24 * 365));
    loop {
        let next = tokio::select! {
            item = sub.next() => Some(item),
            _ = tokio::time::sleep(keepalive) => None,
            _ = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                tx.finish(Err(EnvdError::DeadlineExceeded("stream deadline exceeded".into()))).await;
                return;
            }
            _ = tx.closed() => return,
        };
        match next {
            None => {
                if send(ProcessEvent::Keepalive {}).await.is_err() {
                    return;
                }
            }
            Some(Item::Data(source, data)) => {
                if send(ProcessEvent::Data(source.event(data))).await.is_err() {
                    return;
                }
            }
            Some(Item::Lagged) => {
                let msg = format!("output stream of process {pid} stopped: the client did not read for {}s while the process kept writing", output::STALL_LIMIT.as_secs());
                tx.finish(Err(EnvdError::Internal(msg))).await;
                return;
            }
            Some(Item::End(ended)) => {
                drop(sub);
                if send(ProcessEvent::End(ended.event)).await.is_err() {
                    return;
                }
                let result = if ended.deadline_exceeded {
                    Err(EnvdError::DeadlineExceeded(
                        "process deadline exceeded (Connect-Timeout-Ms): the process was killed"
                            .into(),
                    ))
                } else {
                    Ok(())
                };
                tx.finish(result).await;
                return;
            }
        }
    }
}

fn spawn_process(ctx: &Ctx, req: StartRequest) -> Result<Arc<Process>> {
    let config = req
        .process
        .ok_or_else(|| EnvdError::InvalidArgument("process config is missing".into()))?;
    let pty_size = match &req.pty {
        Some(p) => Some(pty_dims(p.size.unwrap_or(PtySize { cols: 80, rows: 24 }))?),
        None => None,
    };
    let defaults = ctx.envd.defaults();
    let cwd = match &config.cwd {
        Some(c) if !c.is_empty() => ctx.user.resolve(c, defaults.workdir.as_deref())?,
        _ => defaults
            .workdir
            .clone()
            .unwrap_or_else(|| ctx.user.home.clone()),
    };
    let mut env = ctx.user.login_env();
    env.extend(
        defaults
            .env_vars
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    env.extend(config.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    let spawned = spawn::spawn(spawn::Spec {
        cmd: config.cmd.clone(),
        args: config.args.clone(),
        env,
        cwd,
        user: ctx.user.clone(),
        pty: pty_size,
        stdin: req.stdin.unwrap_or(false),
    })?;
    let exit = crate::reaper::global().watch(spawned.pid as i32);
    let output = Output::new(OUTPUT_BUFFER);
    let stdin = match (spawned.stdin, &spawned.pty) {
        (Some(pipe), _) => Some(Stdin::Pipe(pipe)),
        (None, Some(_)) => Some(Stdin::Pty),
        (None, None) => None,
    };
    let proc = Arc::new(Process {
        pid: spawned.pid,
        tag: req.tag.filter(|t| !t.is_empty()),
        config,
        output: output.clone(),
        stdin: tokio::sync::Mutex::new(stdin),
        pty: spawned.pty.clone(),
    });
    ctx.envd.processes.lock().insert(proc.pid, proc.clone());
    tracing::debug!(pid = proc.pid, cmd = %proc.config.cmd, user = %ctx.user.name, "process started");

    let (exited_tx, exited_rx) = watch::channel(false);
    let mut readers = Vec::new();
    if let Some(r) = spawned.stdout {
        readers.push(tokio::spawn(pump_pipe(
            r,
            Source::Stdout,
            output.clone(),
            exited_rx.clone(),
        )));
    }
    if let Some(r) = spawned.stderr {
        readers.push(tokio::spawn(pump_pipe(
            r,
            Source::Stderr,
            output.clone(),
            exited_rx.clone(),
        )));
    }
    if let Some(pty) = spawned.pty {
        readers.push(tokio::spawn(pump_pty(pty, output.clone(), exited_rx)));
    }
    tokio::spawn(supervise(
        ctx.envd.clone(),
        proc.clone(),
        exit,
        exited_tx,
        readers,
        ctx.timeout,
    ));
    Ok(proc)
}

/// Waits for the exit (killing the process at its deadline), lets the
/// readers drain, publishes the end and forgets the process.
async fn supervise(
    envd: Arc<super::Envd>,
    proc: Arc<Process>,
    exit: tokio::sync::oneshot::Receiver<crate::reaper::Exit>,
    exited_tx: watch::Sender<bool>,
    readers: Vec<tokio::task::JoinHandle<()>>,
    deadline: Option<Duration>,
) {
    let mut deadline_exceeded = false;
    tokio::pin!(exit);
    let exit = match deadline {
        Some(d) => tokio::select! {
            e = &mut exit => e,
            _ = tokio::time::sleep(d) => {
                deadline_exceeded = true;
                let _ = proc.signal(nix::sys::signal::Signal::SIGKILL);
                exit.await
            }
        },
        None => exit.await,
    };
    let _ = exited_tx.send(true);
    for r in readers {
        let _ = r.await;
    }
    let event = match exit {
        Ok(exit) => EndEvent {
            exit_code: exit.code(),
            exited: matches!(exit, crate::reaper::Exit::Code(_)),
            status: exit.status_string(),
            error: (exit != crate::reaper::Exit::Code(0)).then(|| exit.status_string()),
        },
        Err(_) => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some("exit status lost".into()),
        },
    };
    tracing::debug!(pid = proc.pid, status = %event.status, "process ended");
    envd.processes.lock().remove(&proc.pid);
    proc.stdin.lock().await.take();
    proc.output.finish(Ended {
        event,
        deadline_exceeded,
    });
}

async fn pump_pipe(
    pipe: tokio::net::unix::pipe::Receiver,
    source: Source,
    output: Arc<Output>,
    mut exited: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        tokio::select! {
            r = pipe.readable() => {
                if r.is_err() {
                    return;
                }
                match pipe.try_read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => output.push(source, Bytes::copy_from_slice(&buf[..n])).await,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => return,
                }
            }
            _ = async { let _ = exited.wait_for(|e| *e).await; } => {
                // A raw read: tokio's try_read answers WouldBlock from its
                // cached readiness without asking the kernel, which would
                // drop what the process wrote just before it exited.
                let mut drained = 0;
                while drained < DRAIN_LIMIT {
                    match nix::unistd::read(&pipe, &mut buf) {
                        Ok(n) if n > 0 => {
                            drained += n;
                            output.push(source, Bytes::copy_from_slice(&buf[..n])).await;
                        }
                        _ => break,
                    }
                }
                return;
            }
        }
    }
}

async fn pump_pty(pty: Arc<PtyMaster>, output: Arc<Output>, mut exited: watch::Receiver<bool>) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        tokio::select! {
            r = pty.readable() => {
                if r.is_err() {
                    return;
                }
                match pty.try_read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => output.push(Source::Pty, Bytes::copy_from_slice(&buf[..n])).await,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => return,
                }
            }
            _ = async { let _ = exited.wait_for(|e| *e).await; } => {
                let mut drained = 0;
                while drained < DRAIN_LIMIT {
                    match pty.try_read(&mut buf) {
                        Ok(n) if n > 0 => {
                            drained += n;
                            output.push(Source::Pty, Bytes::copy_from_slice(&buf[..n])).await;
                        }
                        _ => break,
                    }
                }
                return;
            }
        }
    }
}

/// `StreamInput`: a `start` naming the process, then `data` messages.
async fn stream_input(ctx: Ctx, wire: &Wire, body: Body) -> Response {
    let mut stream = match wire.client_stream(body) {
        Ok(s) => s,
        Err(e) => return wire.stream_error(e),
    };
    let result = async {
        let mut proc: Option<Arc<Process>> = None;
        while let Some(msg) = stream.next::<StreamInputRequest>().await? {
            if let Some(start) = msg.start {
                proc = Some(ctx.envd.processes.find(start.process.as_ref())?);
            } else if let Some(data) = msg.data {
                let p = proc.as_ref().ok_or_else(|| {
                    EnvdError::InvalidArgument("data before start in StreamInput".into())
                })?;
                p.write_input(data.input.unwrap_or_default()).await?;
            }
        }
        Ok(())
    }
    .await;
    let (tx, resp) = wire.stream_response();
    tokio::spawn(async move {
        if result.is_ok() && tx.send(&Empty {}).await.is_err() {
            return;
        }
        tx.finish(result).await;
    });
    resp
}
