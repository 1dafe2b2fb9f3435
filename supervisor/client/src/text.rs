//! Text that came from elsewhere (an engine's output, which can echo a client's request) on
//! its way to a terminal or a desktop: control characters out, markup escaped.
//!
//! Owns: what a line may carry to a terminal (no ESC sequences, no carriage return, no
//! bell: nothing that moves the cursor, links, clears or retitles) and to a notification
//! server that reads markup (`<`, `>` and `&` escaped, so `<a href>` and `<img>` stay text).

use std::borrow::Cow;

/// Whether `c` is kept: printable characters, the newline and the tab.
fn kept(c: char) -> bool {
    c == '\n' || c == '\t' || !c.is_control()
}

/// `text` without control characters (C0, DEL and C1), except newlines and tabs. An ESC
/// sequence loses its ESC and is left as inert text.
pub fn printable(text: &str) -> Cow<'_, str> {
    if text.chars().all(kept) {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(text.chars().filter(|c| kept(*c)).collect())
    }
}

/// `text` as the body of a notification whose server reads the markup subset of the
/// Desktop Notifications specification: control characters out, and `&`, `<` and `>`
/// escaped.
pub fn markup_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in printable(text).chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_go_and_lines_stay() {
        assert!(matches!(
            printable("plain line\n\tindented"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            printable("\u{1b}]8;;http://x.example\u{1b}\\click\u{1b}]8;;\u{1b}\\"),
            "]8;;http://x.example\\click]8;;\\"
        );
        assert_eq!(printable("AAAA\rBB\u{7}\u{7f}\u{9b}2J"), "AAAABB2J");
        assert_eq!(printable("\u{1b}[2J\u{1b}[31mred"), "[2J[31mred");
        assert_eq!(printable("ünïcode ✓"), "ünïcode ✓");
    }

    #[test]
    fn markup_is_text() {
        assert_eq!(
            markup_escaped("<a href=\"http://x\">x</a> & <img src=\"file:///y\">\u{1b}[1m"),
            "&lt;a href=\"http://x\"&gt;x&lt;/a&gt; &amp; &lt;img src=\"file:///y\"&gt;[1m"
        );
    }
}
