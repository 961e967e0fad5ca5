//! Restricting a rank process to a CPU set, as `taskset` does. All ranks get the same set, so they
//! still contend with each other, just within a smaller budget.

/// Sets the affinity of the calling thread (before any worker starts, so every thread inherits it).
pub fn restrict_to(cpus: &[u32]) -> Result<(), String> {
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let limit = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &cpu in cpus {
        if cpu as usize >= limit {
            return Err(format!(
                "--cores: CPU {cpu} is beyond the {limit} CPUs a cpu_set_t can name"
            ));
        }
        // SAFETY: `cpu` is below the set's capacity, checked above.
        unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(format!(
            "--cores: sched_setaffinity({cpus:?}) failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
