//! Finding and opening libfabric at run time, once per process.
//!
//! Nothing links libfabric (see `build.rs`): the first call that needs it opens `libfabric.so.1`
//! from [`VAR_LIBRARY`] when that is set (that path only), otherwise from [`DEFAULT_SEARCH`] in order
//! (the EFA installer's copy first, then the dynamic loader's own search), and resolves the few
//! functions libfabric exports (`te_fi_load` in `csrc/fi_shim.c`). A host without it gets
//! [`te_base::Error::NotAvailable`] "libfabric.so.1 not found (tried: ...)", and the engine goes on
//! without the transport.

use std::ffi::{c_char, CStr, CString};
use std::path::Path;
use std::sync::OnceLock;

use te_base::{Error, Result};

use crate::config::VAR_LIBRARY;
use crate::ffi;

/// Where libfabric is looked for when [`VAR_LIBRARY`] is not set, in order: the EFA installer's
/// prefix (`/opt/amazon/efa`, `lib` on Debian/Ubuntu, `lib64` on Amazon Linux and RHEL), then the
/// bare soname, which the dynamic loader searches for as for any library (`LD_LIBRARY_PATH`, the
/// executable's run path, `/etc/ld.so.cache`, `/lib` and `/usr/lib`: the system's libfabric1).
pub const DEFAULT_SEARCH: [&str; 3] = [
    "/opt/amazon/efa/lib/libfabric.so.1",
    "/opt/amazon/efa/lib64/libfabric.so.1",
    "libfabric.so.1",
];

/// The oldest libfabric this transport runs on (Debian 12's; the one it is tested with).
pub const MIN_VERSION: (u32, u32) = (1, 17);

/// The libfabric this process loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libfabric {
    /// The file the dynamic loader opened (resolved, also when found through the soname).
    pub path: String,
    /// What was asked for: [`VAR_LIBRARY`]'s value or an entry of [`DEFAULT_SEARCH`].
    pub requested: String,
    /// True when [`VAR_LIBRARY`] named it.
    pub from_env: bool,
    /// Its `fi_version()`.
    pub version: (u32, u32),
    /// The API version `fi_getinfo` is asked for: the older of [`HEADER_VERSION`] and `version`.
    pub api_version: (u32, u32),
    /// The symbol version `fi_getinfo`, `fi_freeinfo` and `fi_dupinfo` were resolved at
    /// (`FABRIC_1.3` on 1.17, `FABRIC_1.9` on 2.6).
    pub abi: String,
}

/// The version of the headers the shim was compiled against (the vendored 2.6).
pub const HEADER_VERSION: (u32, u32) = (2, 6);

/// Why libfabric could not be used, kept for every later call.
#[derive(Debug, Clone)]
enum LoadError {
    /// Not found or not loadable; the text is the `NotAvailable` reason.
    NotAvailable(String),
    /// [`VAR_LIBRARY`] is set to something that names no library.
    Config { value: String, reason: String },
}

static LOADED: OnceLock<std::result::Result<Libfabric, LoadError>> = OnceLock::new();

/// The loaded libfabric, opening it on the first call (reading [`VAR_LIBRARY`] from the process
/// environment then; the library stays loaded for the life of the process).
/// [`Error::NotAvailable`] when none could be opened: "libfabric.so.1 not found (tried: ...)"
/// when no candidate exists, "libfabric.so.1 did not load (...)" when one exists but failed (a
/// missing dependency, missing symbols, older than [`MIN_VERSION`]); [`Error::Config`] when
/// [`VAR_LIBRARY`] is set but empty.
pub fn libfabric() -> Result<&'static Libfabric> {
    match LOADED.get_or_init(|| load(std::env::var_os(VAR_LIBRARY).map(|v| v.to_string_lossy().into_owned()))) {
        Ok(lib) => Ok(lib),
        Err(LoadError::NotAvailable(reason)) => Err(Error::not_available("efa transport", reason.clone())),
        Err(LoadError::Config { value, reason }) => Err(Error::config(VAR_LIBRARY, value, reason.clone())),
    }
}

/// One candidate that did not load, for the error text.
struct Tried {
    what: String,
    failed: Failed,
}

/// Why a candidate did not load.
struct Failed {
    why: String,
    /// The file does not exist (as opposed to: exists and failed to load).
    absent: bool,
}

/// A candidate that loaded.
struct Opened {
    path: String,
    version: (u32, u32),
    abi: String,
}

fn load(from_env: Option<String>) -> std::result::Result<Libfabric, LoadError> {
    // libfabric reads its parameters when it initialises (at the first fi_getinfo, not at dlopen);
    // the registration-cache variables go into the environment before even the dlopen.
    crate::mr_cache::settings();
    let candidates: Vec<(String, bool)> = match from_env {
        Some(v) if v.trim().is_empty() => {
            return Err(LoadError::Config {
                value: v,
                reason: "is empty; name the libfabric.so.1 to load, or unset it for the default search".into(),
            })
        }
        Some(v) => vec![(v, true)],
        None => DEFAULT_SEARCH.iter().map(|c| (c.to_string(), false)).collect(),
    };
    let mut tried: Vec<Tried> = Vec::with_capacity(candidates.len());
    for (candidate, env) in candidates {
        let what = if env {
            format!("{candidate} (from {VAR_LIBRARY})")
        } else {
            candidate.clone()
        };
        // A path (not a bare soname) that does not exist: say so plainly, without dlopen's text.
        if candidate.contains('/') && !Path::new(&candidate).exists() {
            tried.push(Tried {
                what,
                failed: Failed {
                    why: "no such file".into(),
                    absent: true,
                },
            });
            continue;
        }
        match open(&candidate) {
            Ok(Opened { path, version, abi }) => {
                if version < MIN_VERSION {
                    let why = format!(
                        "libfabric {}.{} at {path} is older than {}.{}, the oldest supported",
                        version.0, version.1, MIN_VERSION.0, MIN_VERSION.1
                    );
                    tried.push(Tried {
                        what,
                        failed: Failed { why, absent: false },
                    });
                    // Loaded and kept (libfabric is never unloaded), but unused: every call into
                    // the shim goes through `libfabric()`, which reports this error.
                    break;
                }
                let api_version = version.min(HEADER_VERSION);
                return Ok(Libfabric {
                    path,
                    requested: candidate,
                    from_env: env,
                    version,
                    api_version,
                    abi,
                });
            }
            Err(failed) => tried.push(Tried { what, failed }),
        }
    }
    let list = tried
        .iter()
        .map(|t| format!("{}: {}", t.what, t.failed.why))
        .collect::<Vec<_>>()
        .join("; ");
    let reason = if tried.iter().all(|t| t.failed.absent) {
        format!("libfabric.so.1 not found (tried: {list}); install libfabric1 or the EFA installer, or set {VAR_LIBRARY} to its path")
    } else {
        format!("libfabric.so.1 did not load ({list})")
    };
    Err(LoadError::NotAvailable(reason))
}

/// `te_fi_load` on one candidate: the resolved path, `fi_version()` and the symbol version of
/// `fi_getinfo`; or dlopen's (or the shim's) reason, and whether it means the file is absent.
fn open(candidate: &str) -> std::result::Result<Opened, Failed> {
    let c = CString::new(candidate).map_err(|_| Failed {
        why: "contains a NUL byte".into(),
        absent: false,
    })?;
    let mut err = [0 as c_char; 512];
    // SAFETY: `c` is a NUL-terminated path and `err` a writable buffer of the length passed; the
    // shim writes a NUL-terminated message into it. Calls are serialised by LOADED's OnceLock.
    let (rc, restored) =
        crate::signals::keeping_dispositions(|| unsafe { ffi::te_fi_load(c.as_ptr(), err.as_mut_ptr(), err.len()) });
    if !restored.is_empty() {
        tracing::debug!(library = candidate, signals = ?restored, "loading libfabric changed signal handlers; restored");
    }
    if rc != 0 {
        // SAFETY: the shim NUL-terminated `err` (snprintf) before returning non-zero.
        let why = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        // dlopen of a bare soname that nothing provides: "libfabric.so.1: cannot open shared object
        // file: No such file or directory" (a missing dependency names the dependency instead).
        let absent = rc == 1 && why.starts_with(&format!("{candidate}: ")) && why.contains("No such file");
        return Err(Failed { why, absent });
    }
    // SAFETY: plain value-returning calls; after a successful te_fi_load the ABI name and the path
    // are static NUL-terminated strings (or null, handled by `static_str`).
    let (v, abi, path) = unsafe {
        (
            ffi::te_fi_runtime_version(),
            ffi::te_fi_abi_version(),
            ffi::te_fi_loaded_path(),
        )
    };
    let path = static_str(path).unwrap_or_else(|| candidate.to_string());
    Ok(Opened {
        path,
        version: (v >> 16, v & 0xffff),
        abi: static_str(abi).unwrap_or_default(),
    })
}

fn static_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated, and valid for the life of the process (see `open`).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_path_is_not_found_and_named() {
        let Err(LoadError::NotAvailable(reason)) = load(Some("/nonexistent/libfabric.so.1".into())) else {
            panic!("expected NotAvailable");
        };
        assert!(
            reason.starts_with(
                "libfabric.so.1 not found (tried: /nonexistent/libfabric.so.1 (from TE_FABRIC_LIBRARY): no such file)"
            ),
            "{reason}"
        );
    }

    #[test]
    fn an_existing_file_that_is_no_library_did_not_load() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let path = file.path().to_string_lossy().into_owned();
        let Err(LoadError::NotAvailable(reason)) = load(Some(path.clone())) else {
            panic!("expected NotAvailable");
        };
        assert!(reason.starts_with("libfabric.so.1 did not load ("), "{reason}");
        assert!(reason.contains(&path), "{reason}");
    }

    #[test]
    fn the_header_version_is_the_one_compiled_against() {
        // SAFETY: plain value-returning calls; both are valid before libfabric is loaded.
        let (h, api) = unsafe { (ffi::te_fi_header_version(), ffi::te_fi_api_version()) };
        assert_eq!((h >> 16, h & 0xffff), HEADER_VERSION);
        // Only what the loaded library allows is ever asked for (0 while none is loaded).
        let loaded = LOADED.get().and_then(|l| l.as_ref().ok()).map(|l| l.api_version);
        assert!(
            api == 0 || loaded == Some((api >> 16, api & 0xffff)),
            "{api:#x} {loaded:?}"
        );
    }

    #[test]
    fn an_empty_variable_is_a_configuration_error() {
        assert!(matches!(load(Some(" ".into())), Err(LoadError::Config { .. })));
    }
}
