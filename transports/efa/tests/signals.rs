//! Loading libfabric leaves the process's signal handlers alone: an application's SIGINT and
//! SIGTERM handlers still run after the transport opened libfabric (on Debian, libfabric1's
//! libinfinipath used to replace them with handlers that end the process: Python lost
//! KeyboardInterrupt). Its own test binary, so nothing loaded libfabric before the handlers below
//! were installed.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;

static CAUGHT: AtomicUsize = AtomicUsize::new(0);

extern "C" fn count(_: libc::c_int) {
    CAUGHT.fetch_add(1, Ordering::SeqCst);
}

fn handler_of(signal: libc::c_int) -> libc::sighandler_t {
    // SAFETY: a null new action only reads the current one into a zeroed C struct.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(signal, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}

#[test]
fn an_applications_signal_handlers_survive_loading_libfabric() {
    let ours = count as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for s in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installs a handler that only bumps an atomic (async-signal-safe).
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = ours;
            assert_eq!(libc::sigaction(s, &act, std::ptr::null_mut()), 0);
        }
    }
    match te_transport_efa::libfabric() {
        Ok(lib) => eprintln!("loaded {lib:?}"),
        Err(e) if required("libfabric") => panic!("TE_REQUIRE contains libfabric but {e}"),
        Err(e) => {
            eprintln!("SKIP: {e}");
            return;
        }
    }
    // Providers initialise at the first fi_getinfo.
    eprintln!("providers: {:?}", te_transport_efa::available_providers());
    for (s, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        assert_eq!(
            handler_of(s),
            ours,
            "{name}'s handler was replaced by loading libfabric"
        );
        // SAFETY: raise(3) on this thread; the handler above only counts.
        assert_eq!(unsafe { libc::raise(s) }, 0);
    }
    assert_eq!(
        CAUGHT.load(Ordering::SeqCst),
        2,
        "both signals reached the application's handler"
    );
}
