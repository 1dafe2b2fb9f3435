//! dsv4d's lines in the journal: each event an entry at its level's priority, with the
//! fields a reader filters on.
//!
//! Owns: the journal's field names ([`FIELDS`]), the layer that turns events into entries,
//! and their encoding in journald's native protocol. Must not: send anything itself (the
//! log sink's thread does), or invent a field an event or its spans did not give.
//!
//! Why: stderr under systemd lands in the journal as plain text at one priority, so
//! `journalctl -p warning -u dsv4` could not find a crash, and nothing could pick out one
//! profile's or one engine's lines. The fields come from spans: the lifecycle's turns run in
//! the span of the engine generation they act on (`profile`, `generation`, `engine_pid`),
//! the engine's output readers in that same span, and a request in a span with its
//! `request_id` (the number `dsv4ctl status` shows). They are made only when the journal is
//! the output ([`enabled`]): a terminal's lines stay as they were.

use std::fmt::{self, Write as _};
use std::sync::OnceLock;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

use super::entry::Entry;
use super::sink::{Item, Sink};

/// The fields taken from spans and events into entries: each tracing name, and the journal's.
pub const FIELDS: [(&str, &str); 4] = [
    ("profile", "PROFILE"),
    ("generation", "GENERATION"),
    ("engine_pid", "ENGINE_PID"),
    ("request_id", "REQUEST_ID"),
];

static ENABLED: OnceLock<bool> = OnceLock::new();

/// Whether the journal takes the log (set once, at start): the spans that carry its fields
/// are made only then.
pub fn enabled() -> bool {
    ENABLED.get().copied().unwrap_or(false)
}

/// The span of one engine generation: the lifecycle's turns and the engine's output readers
/// run in it. [`tracing::Span::none`] unless the journal takes the log.
pub fn engine_span(profile: &str, generation: Option<u64>) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "engine",
        profile,
        generation,
        engine_pid = tracing::field::Empty
    )
}

/// The span of one request; its `request_id` is recorded once it has one.
pub fn request_span() -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    tracing::info_span!("request", request_id = tracing::field::Empty)
}

/// The target of dsv4d's events at notice (priority 5: a normal but significant change, such
/// as an engine that is not the one of the last start): `tracing` has no such level, so these
/// are info events of this target.
pub const NOTICE: &str = "dsv4::notice";

/// The syslog priority of a level (3 to 7).
pub fn priority(level: &tracing::Level) -> u8 {
    match *level {
        tracing::Level::ERROR => 3,
        tracing::Level::WARN => 4,
        tracing::Level::INFO => 6,
        _ => 7,
    }
}

/// The layer that sends each event to the journal through the log sink.
pub struct JournalLayer {
    sink: Sink,
}

impl JournalLayer {
    /// The layer, and the journal marked as the log's output (see [`enabled`]).
    pub fn new(sink: Sink) -> Self {
        let _ = ENABLED.set(true);
        JournalLayer { sink }
    }
}

/// The journal fields a span carries, kept in its extensions.
#[derive(Default)]
struct SpanFields(Vec<(&'static str, String)>);

impl SpanFields {
    fn set(&mut self, name: &'static str, value: String) {
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.0.push((name, value)),
        }
    }
}

impl Visit for SpanFields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if let Some(name) = journal_name(field.name()) {
            self.set(name, format!("{value:?}"));
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if let Some(name) = journal_name(field.name()) {
            self.set(name, value.to_string());
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        if let Some(name) = journal_name(field.name()) {
            self.set(name, value.to_string());
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        if let Some(name) = journal_name(field.name()) {
            self.set(name, value.to_string());
        }
    }
}

fn journal_name(tracing_name: &str) -> Option<&'static str> {
    FIELDS
        .iter()
        .find(|(t, _)| *t == tracing_name)
        .map(|(_, j)| *j)
}

impl<S> tracing_subscriber::Layer<S> for JournalLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = SpanFields::default();
        attrs.record(&mut fields);
        span.extensions_mut().insert(fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        match ext.get_mut::<SpanFields>() {
            Some(fields) => values.record(fields),
            None => {
                let mut fields = SpanFields::default();
                values.record(&mut fields);
                ext.insert(fields);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let meta = event.metadata();
        let priority = match meta.target() {
            NOTICE => 5,
            _ => priority(meta.level()),
        };
        // The spans' fields, the outermost first, so that an inner one's value wins.
        let mut fields = SpanFields::default();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(f) = span.extensions().get::<SpanFields>() {
                    for (n, v) in &f.0 {
                        fields.set(n, v.clone());
                    }
                }
            }
        }
        let mut visit = EventText {
            engine: meta.target() == dsv4_engine::LOG_TARGET,
            ..EventText::default()
        };
        event.record(&mut visit);
        for (n, v) in visit.fields.0 {
            fields.set(n, v);
        }
        if visit.engine {
            // The engine's lines: each its own entry, with the engine's pid and stream.
            if let Some(pid) = visit.pid {
                fields.set("ENGINE_PID", pid.to_string());
            }
            if let Some(stream) = visit.stream {
                fields.set("ENGINE_STREAM", stream);
            }
            let message = match visit.message.strip_prefix('\n') {
                Some(lines) => lines.to_string(),
                None => visit.message,
            };
            self.sink.send(Item::Entry(Box::new(Entry {
                priority,
                message,
                fields: fields.0,
                each_line: true,
            })));
            return;
        }
        let mut message = visit.message;
        message.push_str(&visit.rest);
        self.sink.send(Item::Entry(Box::new(Entry {
            priority,
            message,
            fields: fields.0,
            each_line: false,
        })));
    }
}

/// An event's message, its other fields written after it as ` name=value` (as the text
/// format writes them), and the journal fields among them.
#[derive(Default)]
struct EventText {
    /// An event of the engine's lines: its `pid`, `stream` and `lines` are kept apart.
    engine: bool,
    message: String,
    rest: String,
    fields: SpanFields,
    /// For the engine's lines: the pid and stream they came from.
    pid: Option<u64>,
    stream: Option<String>,
}

impl EventText {
    fn other(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let _ = write!(self.rest, " {}={value:?}", field.name());
    }
}

impl Visit for EventText {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message.push_str(value),
            "stream" if self.engine => self.stream = Some(value.to_string()),
            _ => {
                self.fields.record_str(field, value);
                self.other(field, &value);
            }
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "pid" if self.engine => self.pid = Some(value),
            "lines" if self.engine => {}
            _ => {
                self.fields.record_u64(field, value);
                self.other(field, &value);
            }
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match field.name() {
            "message" => {
                let _ = write!(self.message, "{value:?}");
            }
            _ => {
                self.fields.record_debug(field, value);
                self.other(field, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logs through a [`JournalLayer`] whose sink sends to a socket of the test's own, and
    /// returns each datagram received as text.
    fn entries(log: impl FnOnce()) -> Vec<String> {
        use std::os::unix::net::UnixDatagram;
        use tracing_subscriber::layer::SubscriberExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let server = UnixDatagram::bind(&path).unwrap();
        let client = UnixDatagram::unbound().unwrap();
        client.connect(&path).unwrap();
        let (sink, guard) = crate::log::sink::start(64, 1024, Some(client));
        let sub = tracing_subscriber::registry().with(JournalLayer::new(sink));
        tracing::subscriber::with_default(sub, log);
        drop(guard);
        server.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = server.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        got
    }

    #[test]
    fn a_notice_is_an_entry_at_priority_5() {
        let got = entries(|| {
            tracing::info!(target: NOTICE, "engine changed: a -> b");
            tracing::info!("engine identity: b");
        });
        assert_eq!(got.len(), 2, "{got:#?}");
        assert!(got[0].contains("PRIORITY=5\n"), "{}", got[0]);
        assert!(
            got[0].contains("MESSAGE=engine changed: a -> b\n"),
            "{}",
            got[0]
        );
        assert!(got[1].contains("PRIORITY=6\n"), "{}", got[1]);
    }

    #[test]
    fn events_carry_their_spans_fields_and_the_engines_lines_are_entries_each() {
        let got = entries(|| {
            // As the lifecycle makes them (the journal is marked as the output above).
            let engine = engine_span("320k", Some(3));
            engine.record("engine_pid", 4242u32);
            engine.in_scope(|| {
                tracing::warn!("the engine exited with code 1");
                tracing::info!(target: "engine", pid = 4242u32, stream = "stderr", lines = 2u64,
                    "\nfirst line\nsecond line");
            });
            let request = request_span();
            request.record("request_id", 17u64);
            request.in_scope(|| tracing::error!(status = 502, "the engine's answer broke off"));
            tracing::debug!(pid = 9u32, "a process");
        });
        assert_eq!(got.len(), 5, "{got:#?}");
        let warn = &got[0];
        for want in [
            "PRIORITY=4\n",
            "MESSAGE=the engine exited with code 1\n",
            "PROFILE=320k\n",
            "GENERATION=3\n",
            "ENGINE_PID=4242\n",
        ] {
            assert!(warn.contains(want), "{want} in {warn}");
        }
        for (entry, line) in [(&got[1], "first line"), (&got[2], "second line")] {
            assert!(entry.contains(&format!("MESSAGE={line}\n")), "{entry}");
            assert!(entry.contains("PRIORITY=6\n"), "{entry}");
            assert!(entry.contains("ENGINE_STREAM=stderr\n"), "{entry}");
            assert!(entry.contains("PROFILE=320k\n"), "{entry}");
            assert!(entry.contains("ENGINE_PID=4242\n"), "{entry}");
        }
        let error = &got[3];
        assert!(error.contains("REQUEST_ID=17\n"), "{error}");
        assert!(
            error.contains("MESSAGE=the engine's answer broke off status=502\n"),
            "{error}"
        );
        assert!(!error.contains("PROFILE="), "{error}");
        // A `pid` outside the engine's lines is the message's, as the text format writes it.
        assert!(got[4].contains("MESSAGE=a process pid=9\n"), "{}", got[4]);
        assert!(got[4].contains("PRIORITY=7\n"), "{}", got[4]);
    }
}
