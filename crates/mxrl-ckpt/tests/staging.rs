//! Output staging: a source can never be eaten by its own staging or backup directory, and a
//! `--force` replacement killed at any point of its commit loses neither the old nor the new
//! output and leaves no `.old` / `.partial` behind once the next run has recovered.

use mxrl_ckpt::synth::{write_synthetic, Arch, SynthSpec};
use mxrl_ckpt::{
    backup_path, convert, dequantize, partial_path, ConvertOptions, NoProgress, StagedDir,
    STAGING_MARKER,
};
use mxrl_plan::Recipe;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Every file under `dir` with its bytes (relative paths).
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn rec(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rec(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut m = BTreeMap::new();
    rec(dir, dir, &mut m);
    m
}

fn synth(dir: &Path) {
    write_synthetic(&SynthSpec::tiny(Arch::Qwen3Moe), dir).unwrap();
}

fn run_convert(src: &Path, dst: &Path, force: bool) -> mxrl_ckpt::Result<()> {
    let opts = ConvertOptions {
        force,
        ..ConvertOptions::default()
    };
    convert(
        src,
        &Recipe::preset("mxfp8").unwrap(),
        "mxfp8",
        dst,
        &opts,
        &NoProgress,
    )
    .map(|_| ())
}

#[test]
fn regression_source_named_out_partial_is_not_deleted() {
    let d = tempfile::tempdir().unwrap();
    let dst = d.path().join("out");
    let src = partial_path(&dst);
    synth(&src);
    let before = snapshot(&src);
    let e = run_convert(&src, &dst, false).unwrap_err().to_string();
    assert!(
        e.contains("staging directory") && e.contains("source"),
        "{e}"
    );
    assert_eq!(snapshot(&src), before, "the source was modified");
    assert!(!dst.exists());
    let e = dequantize(&src, &dst, false, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(e.contains("staging directory"), "{e}");
    assert_eq!(snapshot(&src), before);
}

#[test]
fn regression_source_named_out_old_is_not_deleted_by_force() {
    let d = tempfile::tempdir().unwrap();
    let dst = d.path().join("out");
    let src = backup_path(&dst);
    synth(&src);
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("previous"), "p").unwrap();
    let before = snapshot(&src);
    let e = run_convert(&src, &dst, true).unwrap_err().to_string();
    assert!(
        e.contains("backup directory") && e.contains("source"),
        "{e}"
    );
    assert_eq!(snapshot(&src), before, "the source was modified");
    assert_eq!(snapshot(&dst).len(), 1, "the previous output was touched");
}

#[test]
fn output_inside_or_around_the_source_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    synth(&src);
    for dst in [src.clone(), src.join("out"), d.path().to_path_buf()] {
        let e = run_convert(&src, &dst, true).unwrap_err().to_string();
        assert!(e.contains("source"), "{}: {e}", dst.display());
    }
    assert!(snapshot(&src).contains_key("config.json"));
}

#[test]
fn foreign_partial_and_old_directories_are_never_removed() {
    let d = tempfile::tempdir().unwrap();
    let dst = d.path().join("out");
    for p in [partial_path(&dst), backup_path(&dst)] {
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("mine"), "m").unwrap();
        let e = StagedDir::create(&dst, true).unwrap_err().to_string();
        assert!(e.contains("not left by an interrupted mxrl run"), "{e}");
        assert!(p.join("mine").exists());
        std::fs::remove_dir_all(&p).unwrap();
    }
}

#[test]
fn symlink_out_of_the_source_is_not_followed() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("model");
    synth(&src);
    let secret = d.path().join("secret.txt");
    std::fs::write(&secret, "s").unwrap();
    std::os::unix::fs::symlink(&secret, src.join("notes.txt")).unwrap();
    let dst = d.path().join("out");
    let e = run_convert(&src, &dst, false).unwrap_err().to_string();
    assert!(
        e.contains("notes.txt") && e.contains("symbolic link"),
        "{e}"
    );
    assert!(!dst.exists() && !partial_path(&dst).exists());
    // A link to a file inside the source is copied as that file.
    std::fs::remove_file(src.join("notes.txt")).unwrap();
    std::os::unix::fs::symlink(src.join("config.json"), src.join("notes.txt")).unwrap();
    run_convert(&src, &dst, false).unwrap();
    assert_eq!(
        std::fs::read(dst.join("notes.txt")).unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
}

/// The child half of the kill test: stages `KILL_DST` with a file `new` and commits with
/// `--force`, aborting the process right after filesystem step `KILL_AT` of the commit.
#[test]
fn kill_child() {
    let (Ok(dst), Ok(at)) = (std::env::var("KILL_DST"), std::env::var("KILL_AT")) else {
        return; // only runs as the child of `force_commit_killed_at_each_step_recovers`
    };
    let at: u32 = at.parse().unwrap();
    let s = StagedDir::create(Path::new(&dst), true).unwrap();
    std::fs::write(s.path().join("new"), "n").unwrap();
    s.commit_with(&mut |step| {
        if step == at {
            std::process::abort();
        }
    })
    .unwrap();
}

#[test]
fn force_commit_killed_at_each_step_recovers() {
    let exe = std::env::current_exe().unwrap();
    for at in 0..=4u32 {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("out");
        std::fs::create_dir(&dst).unwrap();
        std::fs::write(dst.join("old"), "o").unwrap();
        let status = Command::new(&exe)
            .args(["--exact", "kill_child", "--nocapture", "--test-threads=1"])
            .env("KILL_DST", &dst)
            .env("KILL_AT", at.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        // Step 0 never happens: the child commits fully and exits cleanly.
        assert_eq!(status.success(), at == 0, "step {at}: {status}");
        // Whatever the kill left, one complete output is under the final name or in the
        // backup waiting to be restored; the next run recovers it.
        let s = StagedDir::create(&dst, true).unwrap();
        let names: Vec<String> = snapshot(&dst).into_keys().collect();
        let expected_new = at >= 2 || at == 0;
        assert_eq!(
            names,
            if expected_new {
                vec!["new"]
            } else {
                vec!["old"]
            },
            "step {at}"
        );
        assert!(!backup_path(&dst).exists(), "step {at}: .old left behind");
        drop(s);
        assert!(!partial_path(&dst).exists(), "step {at}");
        assert!(!dst.join(STAGING_MARKER).exists());
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "step {at}: only the output remains");
    }
}

/// An error type of another crate, as the atomic-write helper's callers have.
#[derive(Debug)]
enum CallerError {
    Ckpt(mxrl_ckpt::CkptError),
    Drawing(&'static str),
}

impl From<mxrl_ckpt::CkptError> for CallerError {
    fn from(e: mxrl_ckpt::CkptError) -> Self {
        CallerError::Ckpt(e)
    }
}

/// The one atomic-write helper: the target appears only complete, a failed write leaves the
/// old file and no temporary behind, and the temporary file is hidden and does not carry the
/// target's extension (directory scans for `*.safetensors`, `*.png` never take it).
#[test]
fn write_atomic_replaces_only_on_success_and_hides_its_temporary() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("model.safetensors");
    std::fs::write(&path, b"old").unwrap();
    let r: Result<(), CallerError> = mxrl_ckpt::write_atomic(&path, |tmp| {
        assert!(tmp.file_name().unwrap().to_str().unwrap().starts_with('.'));
        assert_ne!(tmp.extension(), path.extension(), "{}", tmp.display());
        assert_eq!(tmp.parent(), path.parent());
        std::fs::write(tmp, b"half").unwrap();
        Err(CallerError::Drawing("failed midway"))
    });
    assert!(matches!(r, Err(CallerError::Drawing("failed midway"))));
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    let names = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(names(d.path()), ["model.safetensors"]);
    mxrl_ckpt::write_bytes_atomic(&path, b"new").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"new");
    assert_eq!(names(d.path()), ["model.safetensors"]);
    // The helper's own errors reach the caller's type: a path without a file name.
    let r: Result<(), CallerError> = mxrl_ckpt::write_atomic(Path::new("/"), |_| Ok(()));
    assert!(
        matches!(&r, Err(CallerError::Ckpt(e)) if e.to_string().contains("has no file name")),
        "{r:?}"
    );
}
