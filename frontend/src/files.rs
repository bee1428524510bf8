//! File-system checks of the spec: corpus paths must exist and be readable; a directory stands
//! for every `*.txt` file under it.

use std::fs::{self, File};
use std::io::ErrorKind;
use std::path::Path;

use crate::ast::Span;
use crate::diagnostics::SpecError;

/// Directories are searched for `*.txt` files this many levels deep.
const MAX_DIR_DEPTH: usize = 8;

/// Resolves corpus path `p` (as written at `span`) against `base_dir` and checks it: a readable
/// regular file gives itself, a directory gives every `*.txt` file under it (sorted).
///
/// # Errors
/// A diagnostic on `span` when the path is empty, missing or cannot be opened, or when a
/// directory holds no `*.txt` file.
pub fn check_corpus_path(
    base_dir: &Path,
    p: &str,
    span: Span,
) -> Result<Vec<String>, Box<SpecError>> {
    if p.trim().is_empty() {
        return Err(Box::new(SpecError::new(
            "spec::corpus-file",
            span,
            "empty corpus path",
            "empty path",
        )));
    }
    let path = base_dir.join(p);
    let shown = path.display().to_string();
    let relative_help = || {
        let dir = if base_dir.as_os_str().is_empty() {
            ".".to_string()
        } else {
            base_dir.display().to_string()
        };
        format!("relative paths are resolved from the spec file's folder (`{dir}`)")
    };
    match fs::metadata(&path) {
        Err(e) if e.kind() == ErrorKind::NotFound => Err(Box::new(
            SpecError::new(
                "spec::corpus-file",
                span,
                format!("corpus file not found: `{p}`"),
                format!("no such file: {shown}"),
            )
            .with_help(relative_help()),
        )),
        Err(e) => Err(unreadable(p, span, &e)),
        Ok(m) if m.is_dir() => {
            let mut files = Vec::new();
            collect_txt(&path, MAX_DIR_DEPTH, &mut files).map_err(|e| unreadable(p, span, &e))?;
            files.sort();
            if files.is_empty() {
                return Err(Box::new(SpecError::new(
                    "spec::corpus-file",
                    span,
                    format!("corpus directory `{p}` holds no `.txt` file"),
                    format!("no *.txt under {shown}"),
                )));
            }
            Ok(files)
        }
        Ok(_) => match File::open(&path) {
            Ok(_) => Ok(vec![shown]),
            Err(e) => Err(unreadable(p, span, &e)),
        },
    }
}

fn unreadable(p: &str, span: Span, e: &std::io::Error) -> Box<SpecError> {
    Box::new(SpecError::new(
        "spec::corpus-file",
        span,
        format!("cannot read corpus file `{p}`: {e}"),
        "unreadable",
    ))
}

/// Appends the `*.txt` regular files under `dir` (recursing `depth` levels) to `out`.
fn collect_txt(dir: &Path, depth: usize, out: &mut Vec<String>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let Ok(m) = fs::metadata(&path) else {
            continue;
        };
        if m.is_dir() && depth > 0 {
            collect_txt(&path, depth - 1, out)?;
        } else if m.is_file() && path.extension().is_some_and(|e| e == "txt") {
            out.push(path.display().to_string());
        }
    }
    Ok(())
}
