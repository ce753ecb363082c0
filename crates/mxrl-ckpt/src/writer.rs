//! Writing: safetensors shards streamed tensor by tensor, and output directories that appear
//! under their final name only when complete.

use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Name, dtype and shape of one tensor to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// New spec.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Bytes of data.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Builds the header bytes (length prefix + JSON padded with spaces to a multiple of 8) for
/// tensors laid out back to back in the given order.
pub fn header_bytes(specs: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut obj = Map::new();
    if !metadata.is_empty() {
        obj.insert("__metadata__".into(), json!(metadata));
    }
    let mut off = 0usize;
    for s in specs {
        let n = s.nbytes();
        obj.insert(
            s.name.clone(),
            json!({"dtype": s.dtype.name(), "shape": s.shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    let mut text = serde_json::to_vec(&Value::Object(obj)).expect("header serializes");
    // 8 + len must be a multiple of 8 so the data section is 8-byte aligned.
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out
}

/// Streams one safetensors file: the header is written first from the full list of specs,
/// then each tensor's bytes in that order, so memory holds one tensor at a time.
pub struct ShardWriter {
    path: PathBuf,
    out: BufWriter<File>,
    specs: Vec<TensorSpec>,
    next: usize,
    bytes: u64,
}

impl ShardWriter {
    /// Creates `path` and writes its header. Tensor names must be unique.
    pub fn create(
        path: impl Into<PathBuf>,
        specs: Vec<TensorSpec>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        let path = path.into();
        let mut seen = std::collections::HashSet::new();
        for s in &specs {
            if !seen.insert(s.name.as_str()) {
                return Err(CkptError::Invalid(format!(
                    "{}: tensor `{}` would be written twice",
                    path.display(),
                    s.name
                )));
            }
        }
        let f = File::create(&path).map_err(|e| CkptError::io(&path, "create", e))?;
        let mut out = BufWriter::with_capacity(8 << 20, f);
        let h = header_bytes(&specs, metadata);
        out.write_all(&h)
            .map_err(|e| CkptError::io(&path, "write", e))?;
        Ok(ShardWriter {
            path,
            out,
            specs,
            next: 0,
            bytes: h.len() as u64,
        })
    }

    /// The spec of the tensor expected next, if any.
    pub fn next_spec(&self) -> Option<&TensorSpec> {
        self.specs.get(self.next)
    }

    /// Writes the next tensor's bytes; its name and byte length must match the next spec.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            CkptError::Invalid(format!(
                "{}: tensor `{name}` written after the last declared tensor",
                self.path.display()
            ))
        })?;
        if spec.name != name || spec.nbytes() != data.len() {
            return Err(CkptError::Invalid(format!(
                "{}: expected tensor `{}` ({} bytes) next, got `{name}` ({} bytes)",
                self.path.display(),
                spec.name,
                spec.nbytes(),
                data.len()
            )));
        }
        self.out
            .write_all(data)
            .map_err(|e| CkptError::io(&self.path, "write", e))?;
        self.bytes += data.len() as u64;
        self.next += 1;
        Ok(())
    }

    /// Flushes and syncs the file; every declared tensor must have been written. Returns the
    /// file size.
    pub fn finish(mut self) -> Result<u64> {
        if self.next != self.specs.len() {
            return Err(CkptError::Invalid(format!(
                "{}: {} of {} tensors written (next: `{}`)",
                self.path.display(),
                self.next,
                self.specs.len(),
                self.specs[self.next].name
            )));
        }
        self.out
            .flush()
            .map_err(|e| CkptError::io(&self.path, "write", e))?;
        let f = self
            .out
            .into_inner()
            .map_err(|e| CkptError::io(&self.path, "write", e.into_error()))?;
        f.sync_all()
            .map_err(|e| CkptError::io(&self.path, "sync", e))?;
        Ok(self.bytes)
    }
}

/// Writes a whole safetensors file from in-memory tensors (names, dtypes, shapes, bytes).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(TensorSpec, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) -> Result<u64> {
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = ShardWriter::create(path, specs, metadata)?;
    for (s, d) in tensors {
        w.write_tensor(&s.name, d)?;
    }
    w.finish()
}

/// Writes `value` as pretty JSON to `path` (with a trailing newline), atomically.
pub fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(value).expect("JSON serializes");
    s.push('\n');
    write_bytes_atomic(path, s.as_bytes())
}

/// The one atomic-write helper of the project: `write` fills a temporary file next to `path`
/// (`.NAME.tmp-PID`, hidden and without the final extension, so that no directory scan takes
/// it for an output), which is renamed to `path` only when `write` succeeded; on failure the
/// temporary file is removed and `path` is untouched. `write` may return any error type that a
/// [`CkptError`] converts into (the helper's own errors: a path without a file name, the
/// rename).
pub fn write_atomic<T, E: From<CkptError>>(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<T, E>,
) -> Result<T, E> {
    let name = path.file_name().ok_or_else(|| {
        CkptError::Invalid(format!("output path {} has no file name", path.display()))
    })?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    match write(&tmp) {
        Ok(v) => {
            fs::rename(&tmp, path).map_err(|e| {
                let _ = fs::remove_file(&tmp);
                CkptError::io(path, "rename into place", e)
            })?;
            Ok(v)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `bytes` written to `path` through [`write_atomic`].
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic(path, |tmp| {
        fs::write(tmp, bytes).map_err(|e| CkptError::io(tmp, "write", e))
    })
}

/// [`write_safetensors`] through [`write_atomic`].
pub fn write_safetensors_atomic(
    path: &Path,
    tensors: &[(TensorSpec, Vec<u8>)],
    metadata: &BTreeMap<String, String>,
) -> Result<u64> {
    write_atomic(path, |tmp| write_safetensors(tmp, tensors, metadata))
}

/// An output directory under construction: everything is written into `DST.partial`, which is
/// renamed to `DST` by [`StagedDir::commit`]. Dropped without a commit, the partial directory is
/// removed, so a failed run never leaves anything under the final name.
///
/// Replacing an existing `DST` (`force`) keeps it until the new directory is complete: commit
/// renames `DST` to `DST.old`, `DST.partial` to `DST`, then removes `DST.old`. The staging
/// directory carries a marker file ([`STAGING_MARKER`]) from creation until the end of the
/// commit, so a later run can tell what an interrupted one left behind:
/// - `DST.partial` with the marker: stale staging, removed;
/// - `DST.old` and a marked `DST.partial` but no `DST` (killed between the two renames): the
///   old output is renamed back to `DST`;
/// - `DST.old` and a marked `DST` (killed after the second rename): `DST.old` is removed.
///
/// A `DST.partial` or `DST.old` without that evidence is never removed: it is an error naming
/// it. [`StagedDir::create_for`] also refuses `DST`, `DST.partial` or `DST.old` that is, lies
/// inside or contains the source directory.
#[derive(Debug)]
pub struct StagedDir {
    dst: PathBuf,
    partial: PathBuf,
    force: bool,
    committed: bool,
}

/// Marker file inside a staging directory (and inside `DST` until a commit finishes).
pub const STAGING_MARKER: &str = ".mxrl-staging";

/// `DST.partial` for an output directory `DST`.
pub fn partial_path(dst: &Path) -> PathBuf {
    suffixed(dst, ".partial")
}

/// `DST.old` (the previous output while a `--force` commit replaces it).
pub fn backup_path(dst: &Path) -> PathBuf {
    suffixed(dst, ".old")
}

fn suffixed(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// `p` made absolute with symbolic links resolved as far as it exists.
fn resolved(p: &Path) -> PathBuf {
    if let Ok(c) = p.canonicalize() {
        return c;
    }
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => resolved(parent).join(name),
        _ => abs,
    }
}

/// Refuses an output directory whose final, staging or backup path is, lies inside or contains
/// the source directory `src` (writing or replacing it would destroy the input).
pub fn check_output_vs_source(src: &Path, dst: &Path) -> Result<()> {
    let s = resolved(src);
    for (what, p) in [
        ("output", dst.to_path_buf()),
        ("staging directory", partial_path(dst)),
        ("backup directory", backup_path(dst)),
    ] {
        let r = resolved(&p);
        if r == s || r.starts_with(&s) || s.starts_with(&r) {
            return Err(CkptError::Invalid(format!(
                "{what} {} must not be, contain or lie inside the source {}",
                p.display(),
                src.display()
            )));
        }
    }
    Ok(())
}

fn marked(dir: &Path) -> bool {
    dir.join(STAGING_MARKER).is_file()
}

fn remove_dir(p: &Path) -> Result<()> {
    fs::remove_dir_all(p).map_err(|e| CkptError::io(p, "remove", e))
}

/// Finishes or undoes what an interrupted run left at `dst` (see [`StagedDir`]); never removes
/// anything without the marker's evidence that mxrl staged it.
fn recover(dst: &Path) -> Result<()> {
    let partial = partial_path(dst);
    let old = backup_path(dst);
    let foreign = |p: &Path| {
        CkptError::Invalid(format!(
            "{} exists and was not left by an interrupted mxrl run; move it away",
            p.display()
        ))
    };
    if old.exists() {
        if dst.is_dir() && marked(dst) {
            // Killed after `partial → dst`: the new output is complete.
            remove_dir(&old)?;
        } else if !dst.exists() && partial.is_dir() && marked(&partial) {
            // Killed between the renames: restore the old output.
            fs::rename(&old, dst).map_err(|e| CkptError::io(&old, "rename", e))?;
        } else {
            return Err(foreign(&old));
        }
    }
    if dst.is_dir() && marked(dst) {
        let m = dst.join(STAGING_MARKER);
        fs::remove_file(&m).map_err(|e| CkptError::io(&m, "remove", e))?;
    }
    if partial.exists() {
        if partial.is_dir() && marked(&partial) {
            remove_dir(&partial)?;
        } else {
            return Err(foreign(&partial));
        }
    }
    Ok(())
}

impl StagedDir {
    /// Starts writing `dst`. Fails if `dst` exists and `force` is false. What an interrupted
    /// run left behind is recovered first (see [`StagedDir`]).
    pub fn create(dst: &Path, force: bool) -> Result<Self> {
        if dst.as_os_str().is_empty() {
            return Err(CkptError::Invalid("output directory path is empty".into()));
        }
        recover(dst)?;
        if dst.exists() && !force {
            return Err(CkptError::OutputExists { path: dst.into() });
        }
        let partial = partial_path(dst);
        fs::create_dir_all(&partial).map_err(|e| CkptError::io(&partial, "create", e))?;
        let marker = partial.join(STAGING_MARKER);
        fs::write(&marker, b"mxrl staging directory\n")
            .map_err(|e| CkptError::io(&marker, "write", e))?;
        Ok(StagedDir {
            dst: dst.into(),
            partial,
            force,
            committed: false,
        })
    }

    /// [`StagedDir::create`] for an output made from the source directory `src`: refuses
    /// output, staging and backup paths that are, contain or lie inside `src` before touching
    /// anything.
    pub fn create_for(src: &Path, dst: &Path, force: bool) -> Result<Self> {
        check_output_vs_source(src, dst)?;
        StagedDir::create(dst, force)
    }

    /// The directory to write into (`DST.partial`).
    pub fn path(&self) -> &Path {
        &self.partial
    }

    /// The final directory.
    pub fn dst(&self) -> &Path {
        &self.dst
    }

    /// Renames `DST.partial` to `DST` (replacing an existing `DST` only when created with
    /// `force`, keeping it as `DST.old` until the new one is in place). Returns the final path.
    pub fn commit(self) -> Result<PathBuf> {
        self.commit_with(&mut |_| {})
    }

    /// [`StagedDir::commit`] calling `step(n)` after its `n`-th filesystem change (1: `DST` →
    /// `DST.old`, 2: `DST.partial` → `DST`, 3: `DST.old` removed, 4: marker removed), so tests
    /// can stop the process at each point.
    #[doc(hidden)]
    pub fn commit_with(mut self, step: &mut dyn FnMut(u32)) -> Result<PathBuf> {
        if self.dst.exists() {
            if !self.force {
                return Err(CkptError::OutputExists {
                    path: self.dst.clone(),
                });
            }
            let old = backup_path(&self.dst);
            if old.exists() {
                return Err(CkptError::Invalid(format!(
                    "{} exists; move it away before replacing {}",
                    old.display(),
                    self.dst.display()
                )));
            }
            fs::rename(&self.dst, &old).map_err(|e| CkptError::io(&self.dst, "rename", e))?;
            step(1);
            if let Err(e) = fs::rename(&self.partial, &self.dst) {
                // Put the old output back before reporting.
                let _ = fs::rename(&old, &self.dst);
                return Err(CkptError::io(&self.partial, "rename", e));
            }
            self.committed = true;
            step(2);
            let rm = if old.is_dir() {
                fs::remove_dir_all(&old)
            } else {
                fs::remove_file(&old)
            };
            rm.map_err(|e| CkptError::io(&old, "remove", e))?;
            step(3);
        } else {
            fs::rename(&self.partial, &self.dst)
                .map_err(|e| CkptError::io(&self.partial, "rename", e))?;
            self.committed = true;
            step(2);
        }
        let marker = self.dst.join(STAGING_MARKER);
        fs::remove_file(&marker).map_err(|e| CkptError::io(&marker, "remove", e))?;
        step(4);
        Ok(self.dst.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.partial);
        }
    }
}

/// Copies every regular file of `src` (recursively) into `dst`, except those for which
/// `skip(relative_path)` is true. Returns the relative paths copied, sorted.
///
/// A symbolic link is followed only to a file inside `src` (or, for a Hugging Face hub cache
/// snapshot `…/snapshots/REV`, inside that repository's `…/blobs`); a link leading anywhere
/// else, or to a directory, is an error naming the link and its target.
pub fn copy_other_files(
    src: &Path,
    dst: &Path,
    skip: &dyn Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    let root = src
        .canonicalize()
        .map_err(|e| CkptError::io(src, "resolve", e))?;
    let mut allowed = vec![root.clone()];
    if let Some(repo) = root.parent().filter(|p| p.ends_with("snapshots")) {
        if let Some(repo) = repo.parent() {
            allowed.push(repo.join("blobs"));
        }
    }
    copy_rec(src, dst, "", skip, &allowed, &mut copied)?;
    copied.sort();
    Ok(copied)
}

fn copy_rec(
    src: &Path,
    dst: &Path,
    rel: &str,
    skip: &dyn Fn(&str) -> bool,
    allowed: &[PathBuf],
    copied: &mut Vec<String>,
) -> Result<()> {
    let dir = if rel.is_empty() {
        src.to_path_buf()
    } else {
        src.join(rel)
    };
    let rd = fs::read_dir(&dir).map_err(|e| CkptError::io(&dir, "read directory", e))?;
    for ent in rd {
        let ent = ent.map_err(|e| CkptError::io(&dir, "read directory", e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        let r = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        if skip(&r) {
            continue;
        }
        let ft = ent
            .file_type()
            .map_err(|e| CkptError::io(ent.path(), "stat", e))?;
        if ft.is_dir() {
            let d = dst.join(&r);
            fs::create_dir_all(&d).map_err(|e| CkptError::io(&d, "create", e))?;
            copy_rec(src, dst, &r, skip, allowed, copied)?;
        } else if ft.is_file() || ft.is_symlink() {
            if ft.is_symlink() {
                let link = ent.path();
                let target = link
                    .canonicalize()
                    .map_err(|e| CkptError::io(&link, "resolve symbolic link", e))?;
                if !target.is_file() || !allowed.iter().any(|a| target.starts_with(a)) {
                    return Err(CkptError::Invalid(format!(
                        "{}: symbolic link to {} leads outside the source directory {} (or to a directory); it is not followed",
                        link.display(),
                        target.display(),
                        src.display()
                    )));
                }
            }
            let to = dst.join(&r);
            fs::copy(ent.path(), &to).map_err(|e| CkptError::io(ent.path(), "copy", e))?;
            copied.push(r);
        }
    }
    Ok(())
}
