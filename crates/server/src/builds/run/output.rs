//! A build step's output: its lines go to the build log as they come
//! (capped per step), and its tail goes into a failed step's message.

use tine_agent_client::ExecOutput;

use super::{Level, Log};

/// A step's output as log lines: stdout and stderr each split at
/// newlines, at most `MAX_STEP_LINES` lines a step.
pub(super) struct LineLog {
    log: Log,
    partial: [Vec<u8>; 2],
    lines: usize,
}

const MAX_STEP_LINES: usize = 5000;

impl LineLog {
    pub(super) fn new(log: Log) -> Self {
        Self {
            log,
            partial: [Vec::new(), Vec::new()],
            lines: 0,
        }
    }

    pub(super) fn push(&mut self, stdout: &[u8], stderr: &[u8]) {
        for (i, bytes) in [stdout, stderr].into_iter().enumerate() {
            self.partial[i].extend_from_slice(bytes);
            while let Some(n) = self.partial[i].iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.partial[i].drain(..=n).collect();
                self.emit(&line[..line.len() - 1]);
            }
        }
    }

    fn emit(&mut self, line: &[u8]) {
        self.lines += 1;
        if self.lines < MAX_STEP_LINES {
            (self.log)(Level::Info, String::from_utf8_lossy(line).into_owned());
        } else if self.lines == MAX_STEP_LINES {
            (self.log)(
                Level::Warn,
                "(more output of this step is left out of the log)".into(),
            );
        }
    }

    pub(super) fn flush(&mut self) {
        for i in 0..2 {
            let rest = std::mem::take(&mut self.partial[i]);
            if !rest.is_empty() {
                self.emit(&rest);
            }
        }
    }
}

pub(super) fn tail(out: &ExecOutput) -> String {
    let mut all = out.stdout.clone();
    all.extend_from_slice(&out.stderr);
    let s = String::from_utf8_lossy(&all[all.len().saturating_sub(2000)..])
        .trim()
        .to_string();
    if s.is_empty() {
        "(no output)".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn output_becomes_lines_across_chunks() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        let log: Log = Arc::new(move |_, m| sink.lock().unwrap().push(m));
        let mut l = LineLog::new(log);
        l.push(b"hel", b"");
        l.push(b"lo\nwor", b"err\n");
        l.push(b"ld\n", b"tail");
        l.flush();
        assert_eq!(*got.lock().unwrap(), ["hello", "err", "world", "tail"]);
    }

    #[test]
    fn a_steps_lines_are_capped() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        let log: Log = Arc::new(move |_, m| sink.lock().unwrap().push(m));
        let mut l = LineLog::new(log);
        l.push("x\n".repeat(MAX_STEP_LINES + 10).as_bytes(), b"");
        let got = got.lock().unwrap();
        assert_eq!(got.len(), MAX_STEP_LINES);
        assert!(got.last().unwrap().contains("left out"));
    }
}
