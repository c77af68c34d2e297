//! Plain-text tables for the terminal, with colour only where it helps and only on a TTY, and
//! the escaping of untrusted text ([`printable`]) that every table cell goes through.
//!
//! Colour is used when stdout is a terminal and `NO_COLOR` is unset (<https://no-color.org>).
//! Columns are padded to their display width (`unicode-width`: a CJK character takes two
//! terminal cells), so a table holding a wide tag or command line stays aligned.
//!
//! Hand-written, by choice: `comfy-table` and `tabled` were considered. Either would need to
//! be configured down to exactly this layout (no borders, two spaces between columns, no
//! trailing blanks, a bold header), which scripts and tests read; neither escapes control
//! characters, so [`printable`] would stay ours all the same; and what they add (borders,
//! wrapping to the terminal's width) is nothing these tables want. Display width, the one
//! thing they would do better than the old code, is the one dependency taken.

use std::borrow::Cow;
use std::io::IsTerminal;

use unicode_width::UnicodeWidthStr;

/// `s` safe to print to a terminal: control characters (ESC, BEL, CR, LF, DEL, C1, ...) and
/// invisible formatting characters (bidirectional overrides, zero-width characters) are
/// written as escapes (`\n`, `\r`, `\t`, else `\u{1b}` style), so that strings from records
/// (another user's command line, tags, call sites) can neither drive the reader's terminal nor
/// hide or fake what is shown. Every table cell goes through it; text printed outside tables
/// from records must too. JSON output needs none of it (JSON escapes control characters).
pub fn printable(s: &str) -> Cow<'_, str> {
    fn hidden(c: char) -> bool {
        c.is_control()
            || matches!(c,
                '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{2069}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}')
    }
    if !s.chars().any(hidden) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hidden(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Whether to colour output written to stdout.
pub fn use_colour() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stdout().is_terminal()
}

/// [`printable`] line by line: the line breaks of a message of ours stay, everything else in
/// it is escaped (for errors and warnings, which may quote a record or a trace).
pub fn printable_lines(s: &str) -> String {
    s.split('\n').map(printable).collect::<Vec<_>>().join("\n")
}

/// How a cell is aligned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// A table: a header and rows of cells; a cell may carry an ANSI colour (used only when
/// colour is on).
pub struct Table {
    header: Vec<(String, Align)>,
    rows: Vec<Vec<(String, Option<&'static str>)>>,
}

/// ANSI green (best in a column).
pub const GREEN: &str = "\x1b[32m";
/// ANSI red (failed).
pub const RED: &str = "\x1b[31m";
/// ANSI yellow (needs a look).
pub const YELLOW: &str = "\x1b[33m";
/// ANSI bold.
pub const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

impl Table {
    /// A table with these columns.
    pub fn new(header: &[(&str, Align)]) -> Table {
        Table {
            header: header.iter().map(|(h, a)| (h.to_string(), *a)).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row whose cells may be coloured. Each cell is escaped with [`printable`].
    pub fn row_coloured(&mut self, cells: Vec<(String, Option<&'static str>)>) {
        self.rows.push(
            cells
                .into_iter()
                .map(|(c, col)| (printable(&c).into_owned(), col))
                .collect(),
        );
    }

    /// Renders with two spaces between columns.
    pub fn render(&self, colour: bool) -> String {
        let n = self.header.len();
        let mut width: Vec<usize> = self.header.iter().map(|(h, _)| h.width()).collect();
        for r in &self.rows {
            for (i, (c, _)) in r.iter().enumerate().take(n) {
                width[i] = width[i].max(c.width());
            }
        }
        let mut out = String::new();
        let pad = |s: &str, w: usize, a: Align| {
            let fill = " ".repeat(w.saturating_sub(s.width()));
            match a {
                Align::Left => format!("{s}{fill}"),
                Align::Right => format!("{fill}{s}"),
            }
        };
        let head: Vec<String> = self
            .header
            .iter()
            .enumerate()
            .map(|(i, (h, a))| pad(h, width[i], *a))
            .collect();
        let head = head.join("  ");
        if colour {
            out.push_str(&format!("{BOLD}{}{RESET}\n", head.trim_end()));
        } else {
            out.push_str(head.trim_end());
            out.push('\n');
        }
        for r in &self.rows {
            let cells: Vec<String> = r
                .iter()
                .enumerate()
                .take(n)
                .map(|(i, (c, col))| {
                    let text = pad(c, width[i], self.header[i].1);
                    match (colour, col) {
                        (true, Some(code)) => format!("{code}{text}{RESET}"),
                        _ => text,
                    }
                })
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns_and_colours_only_when_asked() {
        let mut t = Table::new(&[("allocator", Align::Left), ("peak", Align::Right)]);
        t.row_coloured(vec![("cistern".into(), None), ("1.0 GiB".into(), None)]);
        t.row_coloured(vec![
            ("pytorch".into(), None),
            ("12.5 GiB".into(), Some(RED)),
        ]);
        let plain = t.render(false);
        assert_eq!(
            plain,
            "allocator      peak\ncistern     1.0 GiB\npytorch    12.5 GiB\n"
        );
        assert!(!plain.contains('\x1b'));
        assert!(t.render(true).contains(RED));
    }

    /// A wide (CJK) character takes two terminal cells: the next column still lines up.
    #[test]
    fn wide_characters_keep_the_columns_aligned() {
        let mut t = Table::new(&[("tag", Align::Left), ("bytes", Align::Right)]);
        t.row_coloured(vec![("日本語".into(), None), ("1".into(), None)]);
        t.row_coloured(vec![("abcdef".into(), None), ("22".into(), None)]);
        let text = t.render(false);
        let ends: Vec<usize> = text.lines().map(UnicodeWidthStr::width).collect();
        assert_eq!(ends, [13, 13, 13], "{text}");
    }

    #[test]
    fn untrusted_text_is_escaped_in_every_cell() {
        assert!(matches!(printable("python train.py"), Cow::Borrowed(_)));
        assert_eq!(
            printable("a\x1b[2Jb\x07c\rd\ne\tf\u{7f}g\u{9b}h\u{202e}i"),
            "a\\u{1b}[2Jb\\u{7}c\\rd\\ne\\tf\\u{7f}g\\u{9b}h\\u{202e}i"
        );
        assert_eq!(printable("naïve 日本"), "naïve 日本");
        let mut t = Table::new(&[("command", Align::Left)]);
        t.row_coloured(vec![("evil\x1b]0;pwned\x07\r\n".into(), None)]);
        let text = t.render(true);
        assert!(text.contains("evil\\u{1b}]0;pwned\\u{7}\\r\\n"), "{text}");
        assert!(!text.contains('\x07') && !text.contains('\r'));
        assert_eq!(text.matches('\n').count(), 2, "{text}");
    }

    #[test]
    fn messages_keep_their_line_breaks_and_nothing_else() {
        assert_eq!(
            printable_lines("bad `\x1b[2J`\r\n(see the README)"),
            "bad `\\u{1b}[2J`\\r\n(see the README)"
        );
    }
}
