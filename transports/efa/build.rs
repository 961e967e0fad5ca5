//! Compiles the C shim over libfabric's inline functions against the libfabric 2.6 headers that
//! travel with the crate (`libfabric/include`, see `libfabric/README.md`). Nothing links libfabric:
//! the shim opens it at run time (`te_fi_load` in `csrc/fi_shim.c`), so building needs no
//! libfabric-dev and the binary starts on a host without libfabric.so.1.
//!
//! We keep our own shim instead of the published `ofi-libfabric-sys` 0.2.0 because that crate's
//! generated bindings target libfabric 2.x headers, fail to build against 1.17 (Debian 12;
//! measured) and link the library; a few forwarding functions compiled here work with 1.17 and 2.x.
//!
//! The host's libfabric headers are never looked at (no pkg-config, no /usr/include/rdma, no
//! LIBFABRIC_DIR): after compiling, the compiler's dependency list is checked, and a libfabric
//! header read from anywhere but the vendored directory fails the build.

use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let include = manifest.join("libfabric").join("include");
    println!("cargo:rerun-if-changed=csrc/fi_shim.c");
    println!("cargo:rerun-if-changed=libfabric/include");

    let deps = out.join("fi_shim.d");
    cc::Build::new()
        .file("csrc/fi_shim.c")
        .include(&include)
        .flag_if_supported("-std=gnu11")
        // The headers the compiler read, for the check below.
        .flag("-MD")
        .flag("-MF")
        .flag(deps.to_str().expect("OUT_DIR is UTF-8"))
        .warnings(true)
        .compile("te_fi_shim");
    check_headers(&deps, &include);

    // dlopen/dlvsym: in libc itself from glibc 2.34 on, in libdl before.
    println!("cargo:rustc-link-lib=dl");
    // For tests that compile C probes against the same headers (tests/refusal_probe.c).
    println!("cargo:rustc-env=TE_FI_INCLUDE_DIRS={}", include.display());
}

/// Fails the build when the shim read a libfabric header (`rdma/fabric.h`, `rdma/fi_*.h`) from
/// anywhere but `include`: the host's headers must play no part.
fn check_headers(deps: &Path, include: &Path) {
    let text = std::fs::read_to_string(deps)
        .unwrap_or_else(|e| panic!("te-transport-efa: reading the compiler's dependency file {deps:?}: {e}"));
    let vendored = include.canonicalize().unwrap_or_else(|_| include.to_path_buf());
    let mut seen = 0;
    // Make syntax: `target: dep dep \` lines; our paths have no spaces.
    for dep in text.split_whitespace().filter(|w| *w != "\\" && !w.ends_with(':')) {
        let path = Path::new(dep);
        let is_libfabric = path.parent().and_then(|p| p.file_name()).is_some_and(|d| d == "rdma")
            && path
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f == "fabric.h" || f.starts_with("fi_"));
        if !is_libfabric {
            continue;
        }
        let real = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        if !real.starts_with(&vendored) {
            panic!(
                "te-transport-efa: csrc/fi_shim.c read the libfabric header {dep}, which is not one of the \
                 vendored headers in {}; the build must use only those",
                include.display()
            );
        }
        seen += 1;
    }
    if seen == 0 {
        panic!("te-transport-efa: the compiler's dependency file {deps:?} names no libfabric header");
    }
}
