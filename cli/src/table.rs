//! Plain-text tables for the terminal, with colour only where it helps and only on a TTY.
//!
//! Colour is used when stdout is a terminal and `NO_COLOR` is unset (https://no-color.org).

use std::io::IsTerminal;

/// Whether to colour output written to stdout.
pub fn use_colour() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stdout().is_terminal()
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

    /// Adds a row whose cells may be coloured.
    pub fn row_coloured(&mut self, cells: Vec<(String, Option<&'static str>)>) {
        self.rows.push(cells);
    }

    /// Renders with two spaces between columns.
    pub fn render(&self, colour: bool) -> String {
        let n = self.header.len();
        let mut width: Vec<usize> = self.header.iter().map(|(h, _)| h.chars().count()).collect();
        for r in &self.rows {
            for (i, (c, _)) in r.iter().enumerate().take(n) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let pad = |s: &str, w: usize, a: Align| {
            let fill = " ".repeat(w.saturating_sub(s.chars().count()));
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
}
