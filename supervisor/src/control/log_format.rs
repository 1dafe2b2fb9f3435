//! How dsv4d's log lines are written: tracing-subscriber's own format, except for the engine's
//! output, which is written the same way for less.
//!
//! Owns: the text of each log line. Must not: drop, reorder or rewrite a line beyond the
//! escaping below.
//!
//! Why: the engine's lines (llama-server writes about ten per request) are other people's
//! text, so they are escaped as tracing-subscriber escapes every message (terminal control
//! characters written out as `\x1b` and the like). Its escaping writes the message a character
//! at a time, each through a `dyn Write`: about 2,400 instructions for one 45-character line,
//! more than a tenth of what proxying the request that caused it costs (callgrind). Here a
//! line with nothing to escape, nearly every line, is written whole, and one that has is
//! written in runs between the characters escaped. The text that comes out is the same.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{Format, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// tracing-subscriber's full format, with the engine's lines written directly.
pub struct LogFormat {
    default: Format,
    /// The same without the time, for the journal.
    untimed: Format<tracing_subscriber::fmt::format::Full, ()>,
    /// Writing to the journal: each line starts with its level's syslog priority (`<3>` to
    /// `<7>`, sd-daemon(3)), which journald takes for the entry's priority, and carries no
    /// time (the journal stamps each entry).
    journal: bool,
}

impl LogFormat {
    /// The full format without targets, as `tracing_subscriber::fmt()` writes it.
    pub fn new() -> Self {
        LogFormat {
            default: Format::default().with_target(false),
            untimed: Format::default().with_target(false).without_time(),
            journal: false,
        }
    }

    /// For stderr connected to journald: priorities, no time.
    pub fn journal() -> Self {
        LogFormat {
            journal: true,
            ..LogFormat::new()
        }
    }
}

/// The syslog priority of a level, as sd-daemon(3)'s prefixes write it.
pub fn priority(level: &tracing::Level) -> &'static str {
    crate::log::entry::prefix(crate::log::journal::priority(level))
}

/// Whether stderr is the journal's stream: `$JOURNAL_STREAM` (`DEVICE:INODE`, set by
/// systemd) names the file stderr is, per systemd.exec(5).
pub fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    is_journal(std::io::stderr().as_fd())
}

/// Whether stdout is the journal's stream (see [`stderr_is_journal`]).
pub fn stdout_is_journal() -> bool {
    use std::os::fd::AsFd;
    is_journal(std::io::stdout().as_fd())
}

fn is_journal(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let Ok(st) = nix::sys::stat::fstat(fd) else {
        return false;
    };
    dev.parse::<u64>().ok() == Some(st.st_dev) && ino.parse::<u64>().ok() == Some(st.st_ino)
}

impl Default for LogFormat {
    fn default() -> Self {
        Self::new()
    }
}

impl<S, N> FormatEvent<S, N> for LogFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        if self.journal {
            writer.write_str(priority(meta.level()))?;
        }
        // With colours (a terminal), tracing-subscriber's own: it colours the level.
        if meta.target() != dsv4_engine::LOG_TARGET
            || writer.has_ansi_escapes()
            || ctx.lookup_current().is_some()
        {
            if self.journal {
                return self.untimed.format_event(ctx, writer, event);
            }
            return self.default.format_event(ctx, writer, event);
        }
        if !self.journal {
            if SystemTime.format_time(&mut writer).is_err() {
                writer.write_str("<unknown time>")?;
            }
            writer.write_char(' ')?;
        }
        write!(writer, "{:>5} ", meta.level().as_str())?;
        // A batch of the engine's lines (a `lines` field): a heading with its pid and stream,
        // then the lines, each after a newline.
        let mut batch = Batch::default();
        event.record(&mut batch);
        let heading = batch.lines.is_some();
        if let (Some(n), Some(pid)) = (batch.lines, batch.pid) {
            write!(writer, "engine pid={pid} {}, {n} lines:", batch.stream)?;
        }
        let mut fields = Fields {
            writer: &mut writer,
            text: String::new(),
            first: true,
            skip_batch_fields: heading,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writeln!(writer)
    }
}

/// A batch's heading: the `pid`, `stream` and `lines` fields of an engine's event.
#[derive(Default)]
struct Batch {
    pid: Option<u64>,
    stream: String,
    lines: Option<u64>,
}

impl Visit for Batch {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "pid" => self.pid = Some(value),
            "lines" => self.lines = Some(value),
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "stream" {
            self.stream = value.to_string();
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

/// Writes an event's fields as tracing-subscriber's default visitor does: the message first
/// and escaped, then ` name=value` for each other field.
struct Fields<'w, 'a> {
    writer: &'w mut Writer<'a>,
    /// The message, formatted before it is escaped.
    text: String,
    first: bool,
    /// A batch's `pid`, `stream` and `lines` are in its heading, not after its last line.
    skip_batch_fields: bool,
    result: fmt::Result,
}

impl Fields<'_, '_> {
    fn skip(&self, field: &Field) -> bool {
        self.skip_batch_fields && matches!(field.name(), "pid" | "stream" | "lines")
    }

    fn pad(&mut self) -> fmt::Result {
        if !std::mem::take(&mut self.first) {
            self.writer.write_char(' ')?;
        }
        Ok(())
    }
}

impl Visit for Fields<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.result.is_err() || self.skip(field) {
            return;
        }
        self.result = match field.name() {
            "message" => self.pad().and_then(|()| write_escaped(self.writer, value)),
            name => self
                .pad()
                .and_then(|()| write!(self.writer, "{name}={value:?}")),
        };
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() || self.skip(field) {
            return;
        }
        self.result = match field.name() {
            "message" => {
                self.text.clear();
                let mut text = std::mem::take(&mut self.text);
                let r = write!(text, "{value:?}")
                    .and_then(|()| self.pad())
                    .and_then(|()| write_escaped(self.writer, &text));
                self.text = text;
                r
            }
            name => self
                .pad()
                .and_then(|()| write!(self.writer, "{name}={value:?}")),
        };
    }
}

/// Whether tracing-subscriber escapes this byte's character: ESC, BEL, BS, FF and DEL, and
/// (their UTF-8 lead byte) the C1 controls U+0080 to U+009F.
fn may_escape(b: u8) -> bool {
    matches!(b, 0x1b | 0x07 | 0x08 | 0x0c | 0x7f | 0xc2)
}

/// `text` as tracing-subscriber's escaping writer writes it, in runs.
fn write_escaped(w: &mut impl fmt::Write, text: &str) -> fmt::Result {
    // Nearly every line has nothing to escape: one pass without an early exit, which the
    // compiler turns into vector instructions, finds so.
    let suspect = text.bytes().fold(false, |any, b| any | may_escape(b));
    if !suspect {
        return w.write_str(text);
    }
    let mut rest = text;
    while let Some(i) = rest.bytes().position(may_escape) {
        w.write_str(&rest[..i])?;
        // `i` starts a character: every byte `may_escape` matches is ASCII or a lead byte.
        let Some(c) = rest[i..].chars().next() else {
            break;
        };
        match c {
            '\x1b' => w.write_str("\\x1b")?,
            '\x07' => w.write_str("\\x07")?,
            '\x08' => w.write_str("\\x08")?,
            '\x0c' => w.write_str("\\x0c")?,
            '\x7f' => w.write_str("\\x7f")?,
            c if ('\u{80}'..='\u{9f}').contains(&c) => write!(w, "\\u{{{:x}}}", c as u32)?,
            c => w.write_char(c)?,
        }
        rest = &rest[i + c.len_utf8()..];
    }
    w.write_str(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Buffer {
        /// Each line without its timestamp (which differs between two writes).
        fn lines(&self) -> Vec<String> {
            let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
            text.split_inclusive('\n')
                .map(|l| l.split_once(' ').map_or(l, |(_, rest)| rest).to_string())
                .collect()
        }
    }

    /// Logs the same events through tracing-subscriber's format and through ours.
    fn both(log: impl Fn()) -> (Vec<String>, Vec<String>) {
        both_as(&log, &log)
    }

    /// Logs `theirs` through tracing-subscriber's format and `ours` through ours.
    fn both_as(theirs_log: &dyn Fn(), log: &dyn Fn()) -> (Vec<String>, Vec<String>) {
        let theirs = Buffer::default();
        let ours = Buffer::default();
        let w = theirs.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .with_target(false)
            .finish();
        tracing::subscriber::with_default(sub, theirs_log);
        let w = ours.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .event_format(LogFormat::new())
            .finish();
        tracing::subscriber::with_default(sub, log);
        (theirs.lines(), ours.lines())
    }

    #[test]
    fn engine_lines_come_out_as_tracing_subscriber_writes_them() {
        let lines = [
            "plain text, as nearly every line is",
            "",
            "colour \x1b[31mred\x1b[0m, a bell \x07, a backspace \x08, a form feed \x0c, DEL \x7f",
            "C1 \u{80}\u{9b}31m\u{9f} and Latin-1 \u{a0}\u{a9}\u{c2}, tab\tand \"quotes\" \\",
            "\x1b]8;;http://example.invalid/\x1b\\a link\x1b]8;;\x1b\\",
            "emoji \u{1f600} and \u{3042}",
        ];
        // A batch is written as tracing-subscriber writes its heading and lines as one
        // message.
        let logged = |batch: &dyn Fn(u32, &str, &str)| {
            for line in lines {
                let (pid, which) = (42u32, "stderr");
                tracing::info!(target: "engine", pid, stream = which, "{line}");
                let text: String = lines.iter().map(|l| format!("\n{l}")).collect();
                batch(pid, which, &text);
                tracing::warn!(target: "engine", "{line}");
            }
        };
        let (theirs, ours) = both_as(
            &|| {
                logged(
                    &|pid, which, text| tracing::info!(target: "engine", "engine pid={pid} {which}, 6 lines:{text}"),
                )
            },
            &|| {
                logged(
                    &|pid, which, text| tracing::info!(target: "engine", pid, stream = which, lines = 6u64, "{text}"),
                )
            },
        );
        assert_eq!(ours, theirs);
        assert!(ours.iter().any(|l| l.contains("\\x1b[31mred")), "{ours:?}");
        assert!(ours.iter().any(|l| l.contains("\\u{9b}31m")), "{ours:?}");
    }

    #[test]
    fn for_the_journal_each_line_starts_with_its_priority_and_has_no_time() {
        let out = Buffer::default();
        let w = out.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .event_format(LogFormat::journal())
            .finish();
        tracing::subscriber::with_default(sub, || {
            tracing::error!("the engine exited");
            tracing::warn!("not enough memory");
            tracing::info!(target: "engine", "an engine line");
            tracing::debug!("a detail");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            text,
            "<3>ERROR the engine exited\n<4> WARN not enough memory\n\
             <6> INFO an engine line\n"
        );
    }

    #[test]
    fn other_events_are_tracing_subscribers_own() {
        let (theirs, ours) = both(|| {
            tracing::info!(pid = 7, "dsv4d's own \x1b[2J line");
            tracing::warn!(target: "dsv4::lifecycle", "a warning");
            let span = tracing::info_span!("request", id = 3);
            let _in = span.enter();
            tracing::info!(target: "engine", "an engine line in a span");
        });
        assert_eq!(ours, theirs);
        assert_eq!(ours.len(), 3);
    }

    #[test]
    fn escaping_in_runs_matches_a_character_at_a_time() {
        let mut text = String::new();
        for c in (0u32..0x300).filter_map(char::from_u32) {
            text.push(c);
            text.push('x');
        }
        let mut ours = String::new();
        write_escaped(&mut ours, &text).unwrap();
        let mut theirs = String::new();
        for c in text.chars() {
            match c {
                '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' => {
                    theirs.push_str(&format!("\\x{:02x}", c as u32))
                }
                c if (0x80..=0x9f).contains(&(c as u32)) => {
                    theirs.push_str(&format!("\\u{{{:x}}}", c as u32))
                }
                c => theirs.push(c),
            }
        }
        assert_eq!(ours, theirs);
    }
}
