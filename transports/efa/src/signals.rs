//! Loading libfabric must not take the process's signals. Debian's libfabric1 pulls in
//! libinfinipath (its psm provider), whose constructor installs handlers for SIGINT, SIGTERM,
//! SIGSEGV, SIGBUS, SIGILL and SIGABRT that end the process: a Python program then dies on
//! Ctrl-C instead of raising KeyboardInterrupt (measured: exit status 1, nothing printed). The
//! handlers are the application's, so whatever the load changed is put back (the psm provider is
//! never used by this transport). Only the load is covered: a handler a provider installs when
//! the transport opens its endpoints guards what the transport uses, and stays.

/// The standard signals (the real-time ones are left alone: nothing here touches them).
const SIGNALS: std::ops::RangeInclusive<libc::c_int> = 1..=31;

/// Runs `load` and then restores every signal disposition it changed; the signals restored.
pub(crate) fn keeping_dispositions<T>(load: impl FnOnce() -> T) -> (T, Vec<libc::c_int>) {
    let saved: Vec<(libc::c_int, libc::sigaction)> = SIGNALS
        .filter(|&s| s != libc::SIGKILL && s != libc::SIGSTOP)
        .filter_map(|s| disposition(s).map(|d| (s, d)))
        .collect();
    let out = load();
    let mut restored = Vec::new();
    for (s, before) in &saved {
        let changed = disposition(*s)
            .is_some_and(|now| now.sa_sigaction != before.sa_sigaction || now.sa_flags != before.sa_flags);
        // SAFETY: `before` is a disposition sigaction(2) itself returned for this signal.
        if changed && unsafe { libc::sigaction(*s, before, std::ptr::null_mut()) } == 0 {
            restored.push(*s);
        }
    }
    (out, restored)
}

fn disposition(signal: libc::c_int) -> Option<libc::sigaction> {
    // SAFETY: sigaction with a null new action only writes the current one into `old`, a
    // zeroed plain C struct of the right type.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(signal, std::ptr::null(), &mut old) == 0).then_some(old)
    }
}
