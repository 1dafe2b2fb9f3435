//! supervisor.yaml(5), written from `docs/configuration.md`: the reference a reader of the
//! docs has is the page a reader of `man` gets, from the same text.
//!
//! The Markdown is read by pulldown-cmark and written as roff by the `roff` crate (which
//! escapes what roff would read as requests). Paragraphs become paragraphs, `code` and
//! **strong** bold, *emphasis* italic, headings sections, code blocks unfilled blocks, and a
//! table one tagged paragraph per row: the first cell is the tag, the middle cells follow
//! as `column: value.`, then the last cell. A link keeps its words, followed by where it
//! leads (a page of the installed docs, or its address).

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};
use roff::{bold, italic, roman, Inline, Roff};

/// The reference the page is made from.
pub const SOURCE: &str = include_str!("../../../docs/configuration.md");

/// Where the package installs the docs a link may lead to.
const DOCS: &str = "/usr/share/doc/dsv4/docs";

/// The page, as roff.
pub fn render() -> String {
    let mut page = Roff::new();
    let version = format!("dsv4 {}", env!("CARGO_PKG_VERSION"));
    page.control("TH", ["SUPERVISOR.YAML", "5", "", &version, "dsv4"]);
    page.control("SH", ["NAME"]);
    page.text([roman(
        "supervisor.yaml, supervisor.yaml.d, profiles - the settings of dsv4d and its \
         engine profiles",
    )]);
    page.control("SH", ["SYNOPSIS"]);
    for (i, file) in [
        "/etc/dsv4/supervisor.yaml",
        "/etc/dsv4/supervisor.yaml.d/*.yaml",
        "/etc/dsv4/profiles/NAME.yaml",
    ]
    .into_iter()
    .enumerate()
    {
        if i > 0 {
            page.control("br", [] as [&str; 0]);
        }
        page.text([bold(file)]);
    }
    page.control("SH", ["DESCRIPTION"]);
    let mut writer = Writer::default();
    for event in Parser::new_ext(SOURCE, Options::ENABLE_TABLES) {
        writer.event(&mut page, event);
    }
    page.control("SH", ["SEE ALSO"]);
    page.text([
        bold("dsv4d"),
        roman("(8), "),
        bold("dsv4ctl"),
        roman("(1), and the documentation in "),
        bold(DOCS),
        roman("."),
    ]);
    page.render()
}

/// A table being read: its head and its rows, each a list of cells.
#[derive(Default)]
struct Table {
    head: Vec<Vec<Inline>>,
    rows: Vec<Vec<Vec<Inline>>>,
    row: Vec<Vec<Inline>>,
}

#[derive(Default)]
struct Writer {
    /// The words of the paragraph, heading or cell being read.
    words: Vec<Inline>,
    /// Inside **strong** (or a heading), inside *emphasis*.
    strong: usize,
    emphasis: usize,
    /// Inside a level-1 heading: the document's title, which the page's NAME replaces.
    title: bool,
    table: Option<Table>,
    /// The text of a code block being read.
    code: Option<String>,
    /// Where the link being read leads.
    link: Option<String>,
}

impl Writer {
    fn event(&mut self, page: &mut Roff, event: Event) {
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(page, tag),
            Event::Text(text) if self.code.is_some() => {
                self.code.as_mut().unwrap().push_str(&text);
            }
            Event::Text(text) => self.word(&text),
            Event::Code(text) => self.words.push(bold(text.to_string())),
            Event::SoftBreak => self.words.push(roman(" ")),
            Event::HardBreak => self.words.push(Inline::LineBreak),
            _ => {}
        }
    }

    fn word(&mut self, text: &str) {
        if self.title {
            return;
        }
        self.words.push(match (self.strong, self.emphasis) {
            (0, 0) => roman(text),
            (0, _) => italic(text),
            _ => bold(text),
        });
    }

    fn start(&mut self, tag: Tag) {
        match tag {
            Tag::Heading {
                level: HeadingLevel::H1,
                ..
            } => self.title = true,
            Tag::Strong => self.strong += 1,
            Tag::Emphasis => self.emphasis += 1,
            Tag::Table(_) => self.table = Some(Table::default()),
            Tag::CodeBlock(_) => self.code = Some(String::new()),
            Tag::Link { dest_url, .. } => self.link = link_target(&dest_url),
            _ => {}
        }
    }

    fn end(&mut self, page: &mut Roff, tag: TagEnd) {
        let words = std::mem::take(&mut self.words);
        match tag {
            TagEnd::Heading(HeadingLevel::H1) => self.title = false,
            TagEnd::Heading(level) => {
                let text: String = words.iter().map(plain).collect();
                let request = if level == HeadingLevel::H2 {
                    "SH"
                } else {
                    "SS"
                };
                page.control(request, [text.to_uppercase().as_str()]);
            }
            TagEnd::Paragraph => {
                page.control("PP", [] as [&str; 0]);
                page.text(words);
            }
            TagEnd::Strong => {
                self.strong -= 1;
                self.words = words;
            }
            TagEnd::Emphasis => {
                self.emphasis -= 1;
                self.words = words;
            }
            TagEnd::Link => {
                self.words = words;
                if let Some(target) = self.link.take() {
                    self.words.push(roman(format!(" ({target})")));
                }
            }
            TagEnd::TableCell => {
                if let Some(table) = self.table.as_mut() {
                    table.row.push(words);
                }
            }
            TagEnd::TableHead => {
                if let Some(table) = self.table.as_mut() {
                    table.head = std::mem::take(&mut table.row);
                }
            }
            TagEnd::TableRow => {
                if let Some(table) = self.table.as_mut() {
                    let row = std::mem::take(&mut table.row);
                    table.rows.push(row);
                }
            }
            TagEnd::Table => {
                if let Some(table) = self.table.take() {
                    write_table(page, table);
                }
            }
            TagEnd::CodeBlock => {
                let code = self.code.take().unwrap_or_default();
                page.control("PP", [] as [&str; 0]);
                page.control("RS", ["4"]);
                page.control("nf", [] as [&str; 0]);
                for line in code.lines() {
                    page.text([roman(line)]);
                }
                page.control("fi", [] as [&str; 0]);
                page.control("RE", [] as [&str; 0]);
            }
            // Inside a paragraph or a cell: the words go on.
            _ => self.words = words,
        }
    }
}

/// One tagged paragraph per row.
fn write_table(page: &mut Roff, table: Table) {
    for row in table.rows {
        let Some((tag, rest)) = row.split_first() else {
            continue;
        };
        page.control("TP", [] as [&str; 0]);
        page.text(tag.clone());
        let mut body = Vec::new();
        if let Some((last, middle)) = rest.split_last() {
            for (i, cell) in middle.iter().enumerate() {
                let column: Option<String> =
                    table.head.get(i + 1).map(|h| h.iter().map(plain).collect());
                body.push(roman(format!("{}: ", column.unwrap_or_default())));
                body.extend(cell.iter().cloned());
                body.push(roman(". "));
            }
            body.extend(last.iter().cloned());
        }
        page.text(body);
    }
}

/// An inline's text, without its font.
fn plain(inline: &Inline) -> String {
    match inline {
        Inline::Roman(t) | Inline::Italic(t) | Inline::Bold(t) => t.clone(),
        Inline::LineBreak => " ".to_string(),
    }
}

/// Where a link of the docs leads, as the page says it: an installed page of the docs, or
/// the address.
pub fn link_target(dest: &str) -> Option<String> {
    let file = dest.split('#').next().unwrap_or_default();
    if file.is_empty() {
        return None;
    }
    if file.starts_with("http://") || file.starts_with("https://") {
        return Some(file.to_string());
    }
    let name = file.rsplit('/').next().unwrap_or(file);
    Some(match name {
        "README.md" => "/usr/share/doc/dsv4/README.md".to_string(),
        _ => format!("{DOCS}/{name}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// The page as `man` shows it, wide enough that no line is broken, with groff's
    /// warnings.
    fn shown(page: &str) -> (String, String) {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("dsv4-man-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("supervisor.yaml.5");
        std::fs::write(&file, page).unwrap();
        let out = Command::new("man")
            .args(["--warnings=all", "-E", "UTF-8", "-l"])
            .arg(&file)
            .env("MANWIDTH", "400")
            .env("MAN_KEEP_FORMATTING", "0")
            .env("LC_ALL", "C.UTF-8")
            .stdin(Stdio::null())
            .output()
            .expect("man (from man-db) runs");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        // Bold and underline as overstrikes, taken out.
        let mut clean = String::new();
        for c in text.chars() {
            if c == '\u{8}' {
                clean.pop();
            } else {
                clean.push(c);
            }
        }
        (clean, String::from_utf8_lossy(&out.stderr).into_owned())
    }

    #[test]
    fn every_key_of_the_reference_is_on_the_page_as_man_shows_it() {
        let (text, warnings) = shown(&render());
        assert_eq!(warnings, "", "groff warned about the page");
        // Each row of the reference's tables: its key, then its words.
        let mut rows = 0;
        for line in SOURCE.lines() {
            let Some(key) = line
                .strip_prefix("| `")
                .and_then(|rest| rest.split('`').next())
            else {
                continue;
            };
            rows += 1;
            // A short tag shares its line with the words.
            let tag = |l: &str| {
                let l = l.trim();
                l == key
                    || l.strip_prefix(key)
                        .is_some_and(|rest| rest.starts_with(' '))
            };
            assert!(text.lines().any(tag), "{key} is not a tag of the page");
        }
        assert!(rows > 60, "only {rows} rows found in the reference");
        // Words as a reader sees them, whatever the lines' justification.
        let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
        for words in [
            "SUPERVISOR.YAML(5)",
            "/etc/dsv4/supervisor.yaml.d/*.yaml",
            "Drop-ins. Every *.yaml file in supervisor.yaml.d/",
            "default: 127.0.0.1:8080. address to listen on",
            "engines: llama-server. the multimodal projector (--mmproj)",
            "EVERY KEY",
            "command: vllm",
            "SEE ALSO",
        ] {
            assert!(flat.contains(words), "{words:?} not on the page:\n{text}");
        }
        // No roff request leaked into the text, nor Markdown.
        for leaked in ["\\f", ".PP", "**", "](", "| `"] {
            assert!(!text.contains(leaked), "{leaked:?} on the page:\n{text}");
        }
    }

    #[test]
    fn a_line_of_text_that_starts_like_a_request_stays_text() {
        let mut page = Roff::new();
        let mut writer = Writer::default();
        let source = "# T\n\nA paragraph\n.SH INJECTED\nand 'quotes'.\n\n```\n.TH X\n```\n";
        page.control("TH", ["T", "5"]);
        for event in Parser::new_ext(source, Options::ENABLE_TABLES) {
            writer.event(&mut page, event);
        }
        let (text, warnings) = shown(&page.render());
        assert_eq!(warnings, "");
        assert!(text.contains(".SH INJECTED"), "{text}");
        assert!(text.contains(".TH X"), "{text}");
    }

    #[test]
    fn links_lead_to_the_installed_docs() {
        let table = [
            ("security.md", Some("/usr/share/doc/dsv4/docs/security.md")),
            (
                "http-api.md#streamed-answers-never-go-silent",
                Some("/usr/share/doc/dsv4/docs/http-api.md"),
            ),
            ("../README.md", Some("/usr/share/doc/dsv4/README.md")),
            ("https://example.org/x", Some("https://example.org/x")),
            ("#every-key", None),
        ];
        for (dest, want) in table {
            assert_eq!(link_target(dest).as_deref(), want, "{dest}");
        }
    }
}
