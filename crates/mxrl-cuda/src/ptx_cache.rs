//! Where the compiled op modules (NVRTC's PTX) are kept between processes.

use std::ffi::OsString;
use std::path::PathBuf;

/// The folder compiled op modules are kept in between processes, so that only the first
/// process on a machine pays NVRTC's compile (over a minute for every module of the engine):
/// `MXRL_PTX_CACHE` when set (empty or `off`: none, every process compiles), else
/// `$XDG_CACHE_HOME/mxrl/ptx`, else `$HOME/.cache/mxrl/ptx` (none when neither is set).
pub fn ptx_cache_dir() -> Option<PathBuf> {
    ptx_cache_dir_from(|k| std::env::var_os(k))
}

/// [`ptx_cache_dir`] with the environment read through `get`.
fn ptx_cache_dir_from(get: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    match get("MXRL_PTX_CACHE") {
        Some(d) if d.is_empty() || d.eq_ignore_ascii_case("off") => None,
        Some(d) => Some(PathBuf::from(d)),
        None => {
            let base = get("XDG_CACHE_HOME")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .or_else(|| {
                    get("HOME")
                        .filter(|h| !h.is_empty())
                        .map(|h| PathBuf::from(h).join(".cache"))
                })?;
            Some(base.join("mxrl").join("ptx"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_cache_folder_follows_mxrl_ptx_cache_then_xdg_then_home() {
        let dir = |vars: &[(&str, &str)]| ptx_cache_dir_from(env(vars));
        let home = ("HOME", "/home/u");
        let xdg = ("XDG_CACHE_HOME", "/var/cache/u");
        assert_eq!(dir(&[home]), Some(PathBuf::from("/home/u/.cache/mxrl/ptx")));
        assert_eq!(
            dir(&[home, xdg]),
            Some(PathBuf::from("/var/cache/u/mxrl/ptx"))
        );
        assert_eq!(
            dir(&[home, ("XDG_CACHE_HOME", "")]),
            Some(PathBuf::from("/home/u/.cache/mxrl/ptx"))
        );
        assert_eq!(
            dir(&[home, xdg, ("MXRL_PTX_CACHE", "/tmp/ptx")]),
            Some(PathBuf::from("/tmp/ptx"))
        );
        for off in ["off", "OFF", ""] {
            assert_eq!(dir(&[home, xdg, ("MXRL_PTX_CACHE", off)]), None, "{off:?}");
        }
        assert_eq!(dir(&[]), None);
        assert_eq!(dir(&[("HOME", "")]), None);
    }
}
