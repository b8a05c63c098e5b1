//! The output of one process, shared by every client attached to it.
//!
//! A bounded buffer of output chunks with a sequence number each. Every
//! attached subscriber has a cursor into it. When the buffer is full the
//! oldest chunk is dropped only if no subscriber still needs it; otherwise
//! the producer (the task reading the process's pipe or PTY) waits, which
//! stops reading and so pushes back on the process. So a connected client
//! never loses or reorders output, and memory stays bounded (`capacity`
//! bytes plus one chunk) when nobody reads. A client that attaches later
//! (`Connect`) first gets what is still buffered.
//!
//! A client that stops reading altogether (a dead connection, or an SDK
//! handle nobody iterates) must not stall the process forever: when the
//! producer has waited [`STALL_LIMIT`] without any progress, the subscribers
//! holding it back are detached (they get [`Item::Lagged`]) and the process
//! goes on. Real envd does the same with a 15 s write deadline per send.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use super::proto::{DataEvent, EndEvent};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Stdout,
    Stderr,
    Pty,
}

impl Source {
    pub fn event(self, data: Bytes) -> DataEvent {
        match self {
            Source::Stdout => DataEvent::Stdout(data),
            Source::Stderr => DataEvent::Stderr(data),
            Source::Pty => DataEvent::Pty(data),
        }
    }
}

/// How a process ended, as subscribers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub event: EndEvent,
    /// It was killed because its `Connect-Timeout-Ms` deadline passed.
    pub deadline_exceeded: bool,
}

/// How long the producer waits for a stuck subscriber before detaching it.
pub const STALL_LIMIT: Duration = Duration::from_secs(15);

struct Inner {
    chunks: VecDeque<(Source, Bytes)>,
    /// Sequence number of `chunks[0]`.
    first_seq: u64,
    bytes: usize,
    ended: Option<Ended>,
    cursors: HashMap<u64, u64>,
    /// Subscribers detached for not reading.
    lagged: HashSet<u64>,
    next_subscriber: u64,
}

pub struct Output {
    inner: Mutex<Inner>,
    capacity: usize,
    /// Bumped on every push and at the end: wakes subscribers.
    produced: watch::Sender<u64>,
    /// Bumped whenever a subscriber advances or leaves: wakes the producer.
    consumed: watch::Sender<u64>,
}

/// One item a subscriber receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Data(Source, Bytes),
    End(Ended),
    /// This subscriber was detached for not reading (see [`STALL_LIMIT`]).
    Lagged,
}

impl Output {
    pub fn new(capacity: usize) -> Arc<Output> {
        Arc::new(Output {
            inner: Mutex::new(Inner {
                chunks: VecDeque::new(),
                first_seq: 0,
                bytes: 0,
                ended: None,
                cursors: HashMap::new(),
                lagged: HashSet::new(),
                next_subscriber: 0,
            }),
            capacity,
            produced: watch::Sender::new(0),
            consumed: watch::Sender::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends a chunk, waiting while the buffer is full of output that an
    /// attached subscriber has not read yet.
    pub async fn push(&self, source: Source, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let mut consumed = self.consumed.subscribe();
        loop {
            consumed.borrow_and_update();
            {
                let mut st = self.lock();
                loop {
                    if st.bytes + data.len() <= self.capacity || st.chunks.is_empty() {
                        st.bytes += data.len();
                        st.chunks.push_back((source, data));
                        drop(st);
                        self.produced.send_modify(|v| *v += 1);
                        return;
                    }
                    let first = st.first_seq;
                    if st.cursors.values().any(|c| *c <= first) {
                        break; // someone still needs the oldest chunk: wait
                    }
                    if let Some((_, old)) = st.chunks.pop_front() {
                        st.bytes -= old.len();
                        st.first_seq += 1;
                    }
                }
            }
            match tokio::time::timeout(STALL_LIMIT, consumed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_stalled) => self.detach_blockers(),
            }
        }
    }

    /// Detaches the subscribers that still need the oldest chunk.
    fn detach_blockers(&self) {
        let mut st = self.lock();
        let first = st.first_seq;
        let stuck: Vec<u64> = st
            .cursors
            .iter()
            .filter(|(_, c)| **c <= first)
            .map(|(id, _)| *id)
            .collect();
        for id in stuck {
            tracing::warn!(
                subscriber = id,
                "detaching an output stream that stopped reading"
            );
            st.cursors.remove(&id);
            st.lagged.insert(id);
        }
        drop(st);
        self.produced.send_modify(|v| *v += 1);
    }

    /// Records the end; subscribers get it after the buffered output.
    pub fn finish(&self, ended: Ended) {
        self.lock().ended = Some(ended);
        self.produced.send_modify(|v| *v += 1);
    }

    /// Attaches a reader starting at the oldest buffered chunk.
    pub fn subscribe(self: &Arc<Self>) -> Subscriber {
        let mut st = self.lock();
        let id = st.next_subscriber;
        st.next_subscriber += 1;
        let start = st.first_seq;
        st.cursors.insert(id, start);
        drop(st);
        Subscriber {
            output: self.clone(),
            id,
            produced: self.produced.subscribe(),
        }
    }
}

pub struct Subscriber {
    output: Arc<Output>,
    id: u64,
    produced: watch::Receiver<u64>,
}

impl Subscriber {
    /// The next item; after `Item::End` it keeps returning the end.
    pub async fn next(&mut self) -> Item {
        loop {
            self.produced.borrow_and_update();
            {
                let mut st = self.output.lock();
                if st.lagged.remove(&self.id) {
                    return Item::Lagged;
                }
                let first = st.first_seq;
                let cursor = st
                    .cursors
                    .get(&self.id)
                    .copied()
                    .unwrap_or(first)
                    .max(first);
                let idx = (cursor - first) as usize;
                if let Some((source, data)) = st.chunks.get(idx).cloned() {
                    st.cursors.insert(self.id, cursor + 1);
                    drop(st);
                    self.output.consumed.send_modify(|v| *v += 1);
                    return Item::Data(source, data);
                }
                if let Some(ended) = st.ended.clone() {
                    return Item::End(ended);
                }
            }
            if self.produced.changed().await.is_err() {
                // The sender lives in `output`, which we hold: cannot happen.
                std::future::pending::<()>().await;
            }
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let mut st = self.output.lock();
        st.cursors.remove(&self.id);
        st.lagged.remove(&self.id);
        drop(st);
        self.output.consumed.send_modify(|v| *v += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end() -> Ended {
        Ended {
            event: EndEvent {
                exit_code: 0,
                exited: true,
                status: "exit status 0".into(),
                error: None,
            },
            deadline_exceeded: false,
        }
    }

    #[tokio::test]
    async fn nobody_reading_keeps_memory_bounded() {
        let out = Output::new(10);
        for i in 0..100u8 {
            out.push(Source::Stdout, Bytes::from(vec![i; 4])).await;
        }
        out.finish(end());
        let mut sub = out.subscribe();
        let mut got = Vec::new();
        while let Item::Data(_, d) = sub.next().await {
            got.push(d[0]);
        }
        // Only the newest chunks that fit remain, in order.
        assert_eq!(got, vec![98, 99]);
    }

    #[tokio::test]
    async fn a_slow_subscriber_loses_nothing() {
        let out = Output::new(16);
        let mut sub = out.subscribe();
        let producer = {
            let out = out.clone();
            tokio::spawn(async move {
                for i in 0..1000u32 {
                    let src = if i % 2 == 0 {
                        Source::Stdout
                    } else {
                        Source::Stderr
                    };
                    out.push(src, Bytes::from(i.to_be_bytes().to_vec())).await;
                }
                out.finish(end());
            })
        };
        let mut expect = 0u32;
        loop {
            match sub.next().await {
                Item::Data(src, d) => {
                    assert_eq!(u32::from_be_bytes(d[..].try_into().unwrap()), expect);
                    assert_eq!(src == Source::Stdout, expect & 1 == 0);
                    expect += 1;
                    if expect & 127 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                Item::End(e) => {
                    assert_eq!(e, end());
                    break;
                }
                Item::Lagged => panic!("a reading subscriber was detached"),
            }
        }
        assert_eq!(expect, 1000);
        producer.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscriber_that_stops_reading_is_detached() {
        let out = Output::new(4);
        let mut stuck = out.subscribe();
        let mut reader = out.subscribe();
        out.push(Source::Stdout, Bytes::from_static(b"1234")).await;
        assert_eq!(
            reader.next().await,
            Item::Data(Source::Stdout, Bytes::from_static(b"1234"))
        );
        // `stuck` never reads: after STALL_LIMIT (virtual time) the push goes on.
        out.push(Source::Stdout, Bytes::from_static(b"5678")).await;
        assert_eq!(
            reader.next().await,
            Item::Data(Source::Stdout, Bytes::from_static(b"5678"))
        );
        assert_eq!(stuck.next().await, Item::Lagged);
    }

    #[tokio::test]
    async fn a_dropped_subscriber_releases_the_producer() {
        let out = Output::new(4);
        let sub = out.subscribe();
        out.push(Source::Stdout, Bytes::from_static(b"1234")).await;
        let blocked = {
            let out = out.clone();
            tokio::spawn(async move { out.push(Source::Stdout, Bytes::from_static(b"5678")).await })
        };
        tokio::task::yield_now().await;
        assert!(!blocked.is_finished());
        drop(sub);
        blocked.await.unwrap();
        let mut late = out.subscribe();
        assert_eq!(
            late.next().await,
            Item::Data(Source::Stdout, Bytes::from_static(b"5678"))
        );
    }
}
