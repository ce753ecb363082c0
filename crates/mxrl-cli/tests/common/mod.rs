//! Running the `mxrl` binary from the integration tests.
#![allow(dead_code)] // each test binary uses its own part

use std::path::Path;
use std::process::{Command, Output};

/// The `mxrl` binary under test (no backtraces in its error output): `$MXRL_BIN` where the
/// tests run on another machine than they were built on (the GPU tests), else the one cargo
/// built beside them.
pub fn mxrl() -> Command {
    let bin = std::env::var("MXRL_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_mxrl").into());
    let mut c = Command::new(bin);
    c.env("RUST_BACKTRACE", "0");
    c
}

/// `mxrl ARGS` in `cwd`.
pub fn run(args: &[&str], cwd: &Path) -> Output {
    mxrl().args(args).current_dir(cwd).output().unwrap()
}

/// Standard output then standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `mxrl ARGS` must succeed; its output.
pub fn ok(args: &[&str], cwd: &Path) -> String {
    let o = run(args, cwd);
    assert!(o.status.success(), "mxrl {args:?} failed:\n{}", text(&o));
    text(&o)
}

/// `mxrl ARGS` must fail; its output.
pub fn fails(args: &[&str], cwd: &Path) -> String {
    let o = run(args, cwd);
    assert!(
        !o.status.success(),
        "mxrl {args:?} succeeded:\n{}",
        text(&o)
    );
    text(&o)
}
