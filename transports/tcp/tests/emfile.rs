//! Out of descriptors: the accept loop backs off instead of spinning, and serves again once
//! descriptors are free. Its own test binary, because it lowers the process's descriptor limit.

use std::time::{Duration, Instant};

use te_base::config::MapEnv;
use te_transport_tcp::wire::{Header, Opcode, HEADER_LEN};
use te_transport_tcp::{TcpConfig, TcpTransport};

fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut u), 0);
        u
    };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn set_fd_limit(soft: u64) -> libc::rlimit {
    // SAFETY: plain rlimit calls on structs we own.
    unsafe {
        let mut old: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let new = libc::rlimit {
            rlim_cur: soft,
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &new), 0);
        old
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_backs_off_under_emfile_and_recovers() {
    let env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
    let target = TcpTransport::start(TcpConfig::from_env(&env).unwrap()).await.unwrap();
    let token = target.tcp_endpoint().token;
    let addr = target.local_addr();

    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let old = set_fd_limit(open + 32);
    // Use up every descriptor, then free one for the attacker's socket.
    let mut hog = Vec::new();
    for _ in 0..10_000 {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hog.push(f),
            Err(_) => break,
        }
    }
    assert!(std::fs::File::open("/dev/null").is_err(), "the limit was not reached");
    hog.pop();
    let pending = std::net::TcpStream::connect(addr).expect("the kernel completes the handshake");

    // The listener is readable but accept fails with EMFILE: measure what that costs.
    let (wall0, cpu0) = (Instant::now(), cpu_time());
    std::thread::sleep(Duration::from_secs(2));
    let (wall, cpu) = (wall0.elapsed(), cpu_time() - cpu0);
    drop(hog);
    set_fd_limit(old.rlim_cur);
    assert!(
        cpu < Duration::from_millis(400),
        "accept spun: {cpu:?} of CPU over {wall:?} while out of descriptors"
    );

    // Descriptors are back: the pending connection is served.
    pending.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    use std::io::{Read, Write};
    let mut s = pending;
    let hello = Header {
        token,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).unwrap();
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).expect("served after descriptors came back");
    assert_eq!(Header::decode(&raw).unwrap().opcode, Opcode::HelloAck);
}
