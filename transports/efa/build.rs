//! Compiles the C shim over libfabric's inline functions and links libfabric.
//!
//! We keep our own shim instead of the published `ofi-libfabric-sys` 0.2.0 because that crate's
//! generated bindings target libfabric 2.x headers and fail to build against 1.17 (Debian 12's
//! libfabric-dev; measured), while the EFA installer ships 2.x: compiling a few forwarding functions
//! against whatever headers the host has works on both.

use std::path::PathBuf;

const PACKAGE_HINT: &str = "install the libfabric development files (Debian/Ubuntu: `apt-get install libfabric-dev`; \
     Amazon Linux with the EFA installer: /opt/amazon/efa, set PKG_CONFIG_PATH=/opt/amazon/efa/lib/pkgconfig)";

fn main() {
    println!("cargo:rerun-if-changed=csrc/fi_shim.c");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=LIBFABRIC_DIR");

    let mut include_dirs: Vec<PathBuf> = Vec::new();
    let mut lib_dirs: Vec<PathBuf> = Vec::new();
    if let Ok(dir) = std::env::var("LIBFABRIC_DIR") {
        // An explicit prefix wins (the EFA installer puts libfabric under /opt/amazon/efa; the
        // tests build the vendored 2.6 into target/). This package's own binaries and tests find
        // that library at run time through an rpath; other binaries need LD_LIBRARY_PATH.
        let dir = PathBuf::from(dir);
        include_dirs.push(dir.join("include"));
        for lib in ["lib", "lib64"].map(|l| dir.join(l)).into_iter().filter(|l| l.exists()) {
            println!("cargo:rustc-link-search=native={}", lib.display());
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
            lib_dirs.push(lib);
        }
        println!("cargo:rustc-link-lib=fabric");
    } else {
        match pkg_config::Config::new().atleast_version("1.17").probe("libfabric") {
            Ok(lib) => {
                include_dirs.extend(lib.include_paths);
                lib_dirs.extend(lib.link_paths);
            }
            Err(e) => {
                // Debian's libfabric-dev ships a .pc file; fall back to the plain header location
                // for distributions that do not.
                let header = PathBuf::from("/usr/include/rdma/fabric.h");
                if header.exists() {
                    println!("cargo:rustc-link-lib=fabric");
                } else {
                    panic!(
                        "te-transport-efa needs libfabric >= 1.17 headers and library, which were not found \
                         (pkg-config: {e}); {PACKAGE_HINT}"
                    );
                }
            }
        }
    }

    let header_found = include_dirs
        .iter()
        .chain(std::iter::once(&PathBuf::from("/usr/include")))
        .any(|d| d.join("rdma/fabric.h").exists());
    if !header_found {
        panic!("te-transport-efa: rdma/fabric.h not found in {include_dirs:?} or /usr/include; {PACKAGE_HINT}");
    }

    // Where the headers and library came from, for tests that compile C probes against the same
    // libfabric (tests/refusal_probe.c).
    let join = |dirs: &[PathBuf]| std::env::join_paths(dirs).map(|p| p.to_string_lossy().into_owned());
    println!(
        "cargo:rustc-env=TE_FI_INCLUDE_DIRS={}",
        join(&include_dirs).unwrap_or_default()
    );
    println!("cargo:rustc-env=TE_FI_LIB_DIRS={}", join(&lib_dirs).unwrap_or_default());

    cc::Build::new()
        .file("csrc/fi_shim.c")
        .includes(&include_dirs)
        .flag_if_supported("-std=gnu11")
        .warnings(true)
        .compile("te_fi_shim");
}
