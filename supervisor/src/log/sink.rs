//! Where dsv4d's log lines go: a thread of their own that writes them to stderr, or sends
//! them to journald as entries with fields.
//!
//! Owns: the log queue and its writer thread. Must not: drop a line (a full queue makes the
//! logger wait), or make a request wait for a write while there is room in the queue.
//!
//! Why: the engine's chatter (llama-server logs several lines per request) is written while
//! requests are served on the same runtime; a write that blocks (a slow terminal, a busy
//! journald) must stall only this thread. The text lines of a burst are written with one
//! `write` once the queue is empty (a buffered stderr), and each journal entry is one
//! datagram on journald's native socket (systemd.io's "Native Journal Protocol").

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::thread::JoinHandle;

use super::entry::{encode, line_as_text, Entry};

/// journald's socket for entries sent in its native protocol.
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

/// What the writer thread is given.
pub(crate) enum Item {
    /// Text for stderr, whole lines.
    Text(Vec<u8>),
    /// An entry for the journal.
    Entry(Box<Entry>),
    /// Write what is buffered and end.
    Stop,
}

/// The sending side of the queue: cheap to clone, one per layer.
#[derive(Clone)]
pub struct Sink {
    tx: SyncSender<Item>,
}

/// Ends the writer thread when dropped, once what was queued before is written.
pub struct Guard {
    tx: SyncSender<Item>,
    thread: Option<JoinHandle<()>>,
}

/// Starts the writer thread with room for `queue` items, writing text to stderr through a
/// buffer of `buffer` bytes. `journal` is the socket entries go to, once connected; entries
/// are written as text (with their priority prefix) when it cannot take them.
pub fn start(queue: usize, buffer: usize, journal: Option<UnixDatagram>) -> (Sink, Guard) {
    start_to(queue, buffer, journal, Box::new(std::io::stderr()))
}

/// [`start`], with text written to `text` instead of stderr.
pub fn start_to(
    queue: usize,
    buffer: usize,
    journal: Option<UnixDatagram>,
    text: Box<dyn Write + Send>,
) -> (Sink, Guard) {
    let (tx, rx) = sync_channel(queue);
    let thread = std::thread::Builder::new()
        .name("dsv4d-log".into())
        .spawn(move || write_all(&rx, buffer, journal.as_ref(), text))
        .ok();
    (Sink { tx: tx.clone() }, Guard { tx, thread })
}

/// journald's native socket, connected, if it is there.
pub fn connect_journal() -> Option<UnixDatagram> {
    let socket = UnixDatagram::unbound().ok()?;
    socket.connect(JOURNAL_SOCKET).ok()?;
    Some(socket)
}

impl Sink {
    /// Queues `item`, waiting while the queue is full. With the writer thread gone (it never
    /// started), text goes to stderr from here.
    pub(crate) fn send(&self, item: Item) {
        if let Err(e) = self.tx.send(item) {
            match e.0 {
                Item::Text(t) => {
                    let _ = std::io::stderr().write_all(&t);
                }
                Item::Entry(entry) => {
                    let _ = std::io::stderr().write_all(&entry.as_text());
                }
                Item::Stop => {}
            }
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.tx.send(Item::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How many journal entries go out in one `sendmmsg(2)`.
const ENTRIES_AT_ONCE: usize = 64;

fn write_all(
    rx: &Receiver<Item>,
    buffer: usize,
    journal: Option<&UnixDatagram>,
    text: Box<dyn Write + Send>,
) {
    let mut w = Writer {
        out: std::io::BufWriter::with_capacity(buffer, text),
        journal,
        entries: Vec::with_capacity(ENTRIES_AT_ONCE),
        datagrams: Vec::with_capacity(ENTRIES_AT_ONCE),
        used: 0,
        sources: Vec::with_capacity(ENTRIES_AT_ONCE),
    };
    'outer: while let Ok(first) = rx.recv() {
        if !w.take(first) {
            break;
        }
        loop {
            match rx.try_recv() {
                Ok(item) => {
                    if !w.take(item) {
                        break 'outer;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => break 'outer,
            }
        }
        w.flush();
    }
    w.flush();
}

/// The writer thread's state: text buffered for stderr, and entries encoded for the
/// journal, sent together once the queue is empty or [`ENTRIES_AT_ONCE`] wait: one system
/// call for them all. (The `log` bench, per engine line: a `send` for each entry cost 4.8 us
/// of CPU, `sendmmsg` 3.0, and with a batch of the engine's lines one item in the queue,
/// 1.9; text costs 0.2.) Text and entries keep their order: each flushes the other first.
struct Writer<'j> {
    out: std::io::BufWriter<Box<dyn Write + Send>>,
    journal: Option<&'j UnixDatagram>,
    entries: Vec<Entry>,
    /// Buffers for the encoded entries, kept for the next batch; the first `used` wait.
    datagrams: Vec<Vec<u8>>,
    used: usize,
    /// For each waiting datagram: its entry (in `entries`) and its message, for the text
    /// written when the socket refuses it.
    sources: Vec<(usize, std::ops::Range<usize>)>,
}

impl Writer<'_> {
    /// Takes one item; `false` for the end. A log line that cannot be written has nowhere
    /// else to go: write errors are dropped.
    fn take(&mut self, item: Item) -> bool {
        match item {
            Item::Text(t) => {
                self.send_entries();
                let _ = self.out.write_all(&t);
            }
            Item::Entry(entry) if self.journal.is_some() => {
                if self.used == 0 {
                    let _ = self.out.flush();
                }
                let index = self.entries.len();
                let base = entry.message.as_ptr() as usize;
                for message in entry.messages() {
                    if self.used == self.datagrams.len() {
                        self.datagrams.push(Vec::with_capacity(512));
                    }
                    let buf = &mut self.datagrams[self.used];
                    buf.clear();
                    encode(&entry, message, buf);
                    self.used += 1;
                    let start = message.as_ptr() as usize - base;
                    self.sources.push((index, start..start + message.len()));
                }
                self.entries.push(*entry);
                if self.used >= ENTRIES_AT_ONCE {
                    self.send_entries();
                }
            }
            Item::Entry(entry) => {
                let _ = self.out.write_all(&entry.as_text());
            }
            Item::Stop => return false,
        }
        true
    }

    fn flush(&mut self) {
        self.send_entries();
        let _ = self.out.flush();
    }

    /// Sends the entries waiting, in order; those the socket refuses (too large, or
    /// journald gone) are written as text instead.
    fn send_entries(&mut self) {
        let Some(journal) = self.journal else { return };
        let mut next = 0;
        while next < self.used {
            match send_many(journal, &self.datagrams[next..self.used]) {
                Ok(n) if n > 0 => next += n,
                // The first of the rest cannot go: it goes as text, and the others are tried.
                _ => {
                    let (entry, range) = &self.sources[next];
                    let entry = &self.entries[*entry];
                    let text = line_as_text(entry.priority, &entry.message[range.clone()]);
                    let _ = self.out.write_all(text.as_bytes());
                    next += 1;
                }
            }
        }
        self.entries.clear();
        self.sources.clear();
        self.used = 0;
    }
}

/// `sendmmsg(2)`: as many of `datagrams` as the socket takes at once, each a datagram of
/// its own; how many went.
fn send_many(socket: &UnixDatagram, datagrams: &[Vec<u8>]) -> nix::Result<usize> {
    use nix::sys::socket::{sendmmsg, MsgFlags, MultiHeaders, UnixAddr};
    use std::io::IoSlice;
    use std::os::fd::AsRawFd;
    let slices: Vec<[IoSlice<'_>; 1]> = datagrams.iter().map(|d| [IoSlice::new(d)]).collect();
    let addrs: Vec<Option<UnixAddr>> = vec![None; datagrams.len()];
    let mut headers = MultiHeaders::<UnixAddr>::preallocate(datagrams.len(), None);
    let sent = sendmmsg(
        socket.as_raw_fd(),
        &mut headers,
        &slices,
        &addrs,
        [],
        MsgFlags::empty(),
    )?;
    Ok(sent.count())
}

/// tracing-subscriber's writer for text: each event's text, gathered, is queued whole when
/// the writer is dropped (the fmt layer drops it after the event).
pub struct TextWriter {
    sink: Sink,
    buf: Vec<u8>,
}

impl Write for TextWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for TextWriter {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.sink.send(Item::Text(std::mem::take(&mut self.buf)));
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Sink {
    type Writer = TextWriter;
    fn make_writer(&'a self) -> TextWriter {
        TextWriter {
            sink: self.clone(),
            buf: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_reach_the_socket_one_datagram_each_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let server = UnixDatagram::bind(&path).unwrap();
        let client = UnixDatagram::unbound().unwrap();
        client.connect(&path).unwrap();
        let (sink, guard) = start(4, 1024, Some(client));
        for i in 0..10 {
            sink.send(Item::Entry(Box::new(Entry::new(6, format!("line {i}")))));
        }
        drop(guard);
        let mut buf = [0u8; 1024];
        for i in 0..10 {
            let n = server.recv(&mut buf).unwrap();
            let got = String::from_utf8_lossy(&buf[..n]).into_owned();
            assert!(got.contains(&format!("MESSAGE=line {i}\n")), "{got}");
            assert!(got.starts_with("PRIORITY=6\n"), "{got}");
        }
    }
}
