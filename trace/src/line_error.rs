//! The error of the line-oriented text readers (cistern's own format, RMM and minimalloc CSVs):
//! the file could not be read, or a numbered line does not have the expected form.
//!
//! Each reader names it after itself ([`crate::own::OwnError`], [`crate::rmm::RmmError`],
//! [`crate::minimalloc::CsvError`]); they are one type.

use std::path::{Path, PathBuf};

/// Error reading a line-oriented text trace.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line does not have the expected form.
    #[error("line {line}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What was expected and found.
        message: String,
    },
}

impl LineError {
    /// A [`LineError::Parse`] at 1-based `line`.
    pub(crate) fn at(line: usize, message: impl Into<String>) -> Self {
        LineError::Parse {
            line,
            message: message.into(),
        }
    }
}

/// The whole text of the file at `path`, or a [`LineError::Io`] naming it.
pub(crate) fn read_text(path: &Path) -> Result<String, LineError> {
    std::fs::read_to_string(path).map_err(|source| LineError::Io {
        path: path.to_path_buf(),
        source,
    })
}
