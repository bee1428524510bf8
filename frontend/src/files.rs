//! File-system checks of the spec: corpus and shard paths must exist and be readable. A corpus
//! directory or glob pattern stands for the UTF-8 text files it holds; a shard path may be a
//! glob pattern (`"DIR/*train*.bin"`). Everything is expanded in sorted order, so the plan
//! lists the same files in the same order on every machine.

use std::fs::{self, File};
use std::io::{ErrorKind, Read};
use std::path::Path;

use crate::ast::Span;
use crate::diagnostics::SpecError;

/// Directories are searched for text files this many levels deep.
const MAX_DIR_DEPTH: usize = 8;
/// A note lists at most this many skipped files by name.
const MAX_NAMED_SKIPS: usize = 5;

/// What a corpus path stood for: its files, and a note when some were skipped.
pub struct Found {
    /// The files, sorted (displayed paths, resolved against the spec's folder).
    pub files: Vec<String>,
    /// "corpus directory `d`: skipped 2 files that are not UTF-8 text: ...", if any were.
    pub note: Option<String>,
}

/// Whether `p` is a glob pattern (holds `*`, `?` or `[`).
fn is_pattern(p: &str) -> bool {
    p.contains(['*', '?', '['])
}

/// Resolves corpus path `p` (as written at `span`) against `base_dir` and checks it: a readable
/// regular file gives itself; a directory gives every UTF-8 text file under it (sorted,
/// recursing [`MAX_DIR_DEPTH`] levels, hidden `.` entries left out); a glob pattern
/// (`"books/*.md"`) gives the UTF-8 text files it matches (sorted). Files of a directory or
/// pattern that are not UTF-8 text (a NUL byte or an invalid UTF-8 sequence anywhere) are
/// skipped and named in [`Found::note`].
///
/// # Errors
/// A diagnostic on `span` when the path is empty, missing or cannot be opened, when the
/// pattern is malformed or matches no file, or when a directory or pattern holds no UTF-8 text
/// file.
pub fn check_corpus_path(base_dir: &Path, p: &str, span: Span) -> Result<Found, Box<SpecError>> {
    let (what, candidates) = match expand(base_dir, p, span, "corpus")? {
        Expanded::File(f) => {
            return Ok(Found {
                files: vec![f],
                note: None,
            })
        }
        Expanded::Dir(files) => ("directory", files),
        Expanded::Pattern(files) => ("pattern", files),
    };
    let mut files = Vec::new();
    let mut skipped = Vec::new();
    for f in candidates {
        match utf8_text(Path::new(&f)) {
            Ok(None) => files.push(f),
            Ok(Some(why)) => skipped.push(format!("{f} ({why})")),
            Err(e) => return Err(unreadable("corpus file", &f, span, &e)),
        }
    }
    if files.is_empty() {
        let mut e = SpecError::new(
            "spec::corpus-file",
            span,
            format!("corpus {what} `{p}` holds no UTF-8 text file"),
            if skipped.is_empty() {
                format!("no files in {}", base_dir.join(p).display())
            } else {
                format!("{} file(s), none UTF-8 text", skipped.len())
            },
        );
        if !skipped.is_empty() {
            e = e.with_help(format!(
                "a text corpus is read as UTF-8 text; not text: {}",
                named(&skipped)
            ));
        }
        return Err(Box::new(e));
    }
    let note = (!skipped.is_empty()).then(|| {
        let n = skipped.len();
        let s = if n == 1 { "" } else { "s" };
        format!(
            "corpus {what} `{p}`: skipped {n} file{s} that {} not UTF-8 text: {}",
            if n == 1 { "is" } else { "are" },
            named(&skipped)
        )
    });
    Ok(Found { files, note })
}

/// Resolves token-shard path `p` (written at `span`, for the `key` `train` or `val`) against
/// `base_dir`: a readable regular file gives itself, a glob pattern (`"fineweb10B/*train*.bin"`)
/// every regular file it matches, sorted. Headers are checked when the run loads the shards.
///
/// # Errors
/// A diagnostic on `span` when the path is empty, missing or unreadable, a directory, or a
/// pattern that is malformed or matches no file.
pub fn check_shard_path(
    base_dir: &Path,
    p: &str,
    span: Span,
    key: &str,
) -> Result<Vec<String>, Box<SpecError>> {
    match expand(base_dir, p, span, "shard")? {
        Expanded::File(f) => Ok(vec![f]),
        Expanded::Pattern(files) => Ok(files),
        Expanded::Dir(_) => Err(Box::new(
            SpecError::new(
                "spec::shard-file",
                span,
                format!("`{key}` names the directory `{p}`, not token shards"),
                "a directory",
            )
            .with_help(format!(
                "name the shards with a pattern, e.g. `{key} = \"{}/*{key}*.bin\"`",
                p.trim_end_matches('/')
            )),
        )),
    }
}

/// What a path expanded to.
enum Expanded {
    /// A readable regular file.
    File(String),
    /// The regular files under a directory (sorted).
    Dir(Vec<String>),
    /// The regular files a glob pattern matched (sorted, at least one).
    Pattern(Vec<String>),
}

/// Resolves `p` against `base_dir` and lists what it names; `what` is "corpus" or "shard".
fn expand(base_dir: &Path, p: &str, span: Span, what: &str) -> Result<Expanded, Box<SpecError>> {
    let code = if what == "corpus" {
        "spec::corpus-file"
    } else {
        "spec::shard-file"
    };
    let file = format!("{what} file");
    if p.trim().is_empty() {
        return Err(Box::new(SpecError::new(
            code,
            span,
            format!("empty {what} path"),
            "empty path",
        )));
    }
    let relative_help = || {
        let dir = if base_dir.as_os_str().is_empty() {
            ".".to_string()
        } else {
            base_dir.display().to_string()
        };
        format!("relative paths are resolved from the spec file's folder (`{dir}`)")
    };
    let path = base_dir.join(p);
    let shown = path.display().to_string();
    if is_pattern(p) {
        return glob_files(base_dir, p, span, code).and_then(|files| {
            if files.is_empty() {
                Err(Box::new(
                    SpecError::new(
                        code,
                        span,
                        format!("the {what} pattern `{p}` matches no file"),
                        format!("nothing matches {shown}"),
                    )
                    .with_help(relative_help()),
                ))
            } else {
                Ok(Expanded::Pattern(files))
            }
        });
    }
    match fs::metadata(&path) {
        Err(e) if e.kind() == ErrorKind::NotFound => Err(Box::new(
            SpecError::new(
                code,
                span,
                format!("{file} not found: `{p}`"),
                format!("no such file: {shown}"),
            )
            .with_help(relative_help()),
        )),
        Err(e) => Err(unreadable(&file, p, span, &e)),
        Ok(m) if m.is_dir() => {
            let mut files = Vec::new();
            collect_files(&path, MAX_DIR_DEPTH, &mut files)
                .map_err(|e| unreadable(&file, p, span, &e))?;
            files.sort();
            Ok(Expanded::Dir(files))
        }
        Ok(_) => match File::open(&path) {
            Ok(_) => Ok(Expanded::File(shown)),
            Err(e) => Err(unreadable(&file, p, span, &e)),
        },
    }
}

/// The regular files matching the glob pattern `p` under `base_dir` (whose own name is taken
/// literally), sorted; `*` and `?` do not match a leading `.`.
fn glob_files(
    base_dir: &Path,
    p: &str,
    span: Span,
    code: &'static str,
) -> Result<Vec<String>, Box<SpecError>> {
    let pattern = if Path::new(p).is_absolute() || base_dir.as_os_str().is_empty() {
        p.to_string()
    } else {
        let base = glob::Pattern::escape(&base_dir.display().to_string());
        format!("{}/{p}", base.trim_end_matches('/'))
    };
    let options = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: true,
    };
    let paths = glob::glob_with(&pattern, options).map_err(|e| {
        Box::new(
            SpecError::new(
                code,
                span,
                format!("malformed glob pattern `{p}`: {}", e.msg),
                "malformed pattern",
            )
            .with_help("`*` matches within a name, `?` one character, `[abc]` one of a set"),
        )
    })?;
    let mut files = Vec::new();
    for entry in paths {
        // An unreadable directory on the way is not a match.
        let Ok(path) = entry else { continue };
        if fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            files.push(path.display().to_string());
        }
    }
    files.sort();
    Ok(files)
}

/// "cannot read corpus file `p`: error", on `span`.
fn unreadable(file: &str, p: &str, span: Span, e: &std::io::Error) -> Box<SpecError> {
    let code = if file.starts_with("corpus") {
        "spec::corpus-file"
    } else {
        "spec::shard-file"
    };
    Box::new(SpecError::new(
        code,
        span,
        format!("cannot read {file} `{p}`: {e}"),
        "unreadable",
    ))
}

/// Appends the regular files under `dir` (recursing `depth` levels) to `out`, leaving out
/// hidden entries (`.git`, `.DS_Store`).
fn collect_files(dir: &Path, depth: usize, out: &mut Vec<String>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let Ok(m) = fs::metadata(&path) else {
            continue;
        };
        if m.is_dir() && depth > 0 {
            collect_files(&path, depth - 1, out)?;
        } else if m.is_file() {
            out.push(path.display().to_string());
        }
    }
    Ok(())
}

/// `None` when the file at `path` is UTF-8 text (no NUL byte, no invalid UTF-8 sequence);
/// otherwise why not ("a NUL byte at offset 12", "invalid UTF-8 at offset 3"). Reads the
/// whole file, in 64 KiB pieces.
fn utf8_text(path: &Path) -> std::io::Result<Option<String>> {
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 16];
    // Bytes of a character cut at the end of the previous piece.
    let mut carry = 0usize;
    let mut offset = 0u64;
    loop {
        let n = file.read(&mut buf[carry..])?;
        if n == 0 {
            return Ok((carry > 0).then(|| format!("invalid UTF-8 at offset {offset}")));
        }
        let len = carry + n;
        let piece = &buf[..len];
        if let Some(k) = piece.iter().position(|&b| b == 0) {
            return Ok(Some(format!("a NUL byte at offset {}", offset + k as u64)));
        }
        let valid = match std::str::from_utf8(piece) {
            Ok(_) => len,
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(e) => {
                return Ok(Some(format!(
                    "invalid UTF-8 at offset {}",
                    offset + e.valid_up_to() as u64
                )))
            }
        };
        buf.copy_within(valid..len, 0);
        carry = len - valid;
        offset += valid as u64;
    }
}

/// The first [`MAX_NAMED_SKIPS`] of `items`, and how many more.
fn named(items: &[String]) -> String {
    let mut s = items
        .iter()
        .take(MAX_NAMED_SKIPS)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > MAX_NAMED_SKIPS {
        s.push_str(&format!(" and {} more", items.len() - MAX_NAMED_SKIPS));
    }
    s
}
