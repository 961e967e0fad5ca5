//! Helpers of the standalone tests: a real `umbp-server` process per test, a raw wire client for
//! the cases the `Store` API never produces, /proc counters, and the behaviour suite both modes run.

#![allow(dead_code)]

use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp::standalone::io::{recv_frame, send_frame};
use umbp::standalone::wire::{self, Op, Put, Reader, Welcome};
use umbp::{Range, RangedGet, RangedPut, Store, StoreError};

/// A running `umbp-server`, killed on drop.
pub struct Server {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: PathBuf,
}

impl Server {
    /// Starts a server on `<dir>/umbp.sock` with `args` and `env`, and waits (bounded) until it
    /// accepts connections.
    pub fn start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let socket = dir.join("umbp.sock");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_umbp-server"));
        cmd.arg("--socket").arg(&socket).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.env_remove("UMBP_STANDALONE_SOCKET");
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().unwrap();
        let s = Server {
            child,
            socket,
            dir: dir.to_path_buf(),
        };
        s.wait_ready();
        s
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "umbp-server did not start listening");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for the exit status (bounded).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < deadline, "umbp-server ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Open descriptors of `pid`.
/// The standalone section of a standalone client's stats.
#[allow(dead_code)]
pub fn sa(s: &umbp::StoreStats) -> &umbp::StandaloneStats {
    s.standalone
        .as_ref()
        .expect("a standalone client's stats have a standalone section")
}

pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// `pid`'s descriptor count once it has not changed for 200 ms (connections the server is still
/// closing, such as a readiness probe's, are gone by then), within 10 s.
pub fn settled_fd_count(pid: u32) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = fd_count(pid);
    let mut same = 0;
    while same < 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        let n = fd_count(pid);
        same = if n == last { same + 1 } else { 0 };
        last = n;
    }
    last
}

/// What `pid`'s descriptors point at (for failure messages).
pub fn fd_targets(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect()
}

/// Mappings of worker memfds in `pid`.
pub fn memfd_maps(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:umbp-kv"))
        .count()
}

/// Polls `f` until true, failing after `secs`.
pub fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A wire-level client: sends frames the `Store` API never would.
pub struct Raw {
    pub stream: UnixStream,
    pub rx: Vec<u8>,
    pub token: [u8; 16],
}

impl Raw {
    /// Connects and opens (or with `join`, joins) a session.
    pub fn connect(socket: &Path, join: [u8; 16]) -> Result<Raw, StoreError> {
        let stream = UnixStream::connect(socket).map_err(|e| StoreError::io("connect", e))?;
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = Raw {
            stream,
            rx: Vec::new(),
            token: [0; 16],
        };
        let mut tx = Vec::new();
        wire::begin(&mut tx, Op::Hello);
        tx.extend_from_slice(&join);
        wire::finish(&mut tx).unwrap();
        match r.call(&tx, None)? {
            Op::Ok => r.token = Welcome::decode(&r.rx).unwrap().token,
            op => panic!("hello answered {op:?}"),
        }
        Ok(r)
    }

    /// Sends `frame` and reads the reply; an `Err` reply is returned as the error.
    pub fn call(&mut self, frame: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<Op, StoreError> {
        let sent = send_frame(&self.stream, frame, fd);
        let (h, _) = recv_frame(&self.stream, &mut self.rx, 1 << 30, false)
            .map_err(|e| StoreError::Protocol { detail: e.to_string() })?;
        if h.op == Op::Err {
            return Err(wire::decode_error(&mut Reader::new(&self.rx)).unwrap());
        }
        sent.map_err(|e| StoreError::io("send", e))?;
        Ok(h.op)
    }

    /// Registers a memfd buffer mapped here at `base`.
    pub fn register(&mut self, base: u64, len: u64, fd: BorrowedFd<'_>) -> Result<Op, StoreError> {
        let mut tx = Vec::new();
        wire::begin(&mut tx, Op::Register);
        tx.u64(base);
        tx.u64(len);
        wire::finish(&mut tx).unwrap();
        self.call(&tx, Some(fd))
    }

    /// A ranged get: returns the reply op and, for `Ok`, the minted handle and results.
    pub fn get(
        &mut self,
        handle: u64,
        fingerprint: u64,
        items: &[RangedGet<'_>],
    ) -> Result<(Op, u64, Vec<umbp::Result<u64>>), StoreError> {
        let mut tx = Vec::new();
        wire::encode_get_ranges(&mut tx, handle, fingerprint, items, handle == 0).unwrap();
        let op = self.call(&tx, None)?;
        if op != Op::Ok {
            return Ok((op, 0, Vec::new()));
        }
        let mut r = Reader::new(&self.rx);
        let minted = r.u64("minted handle").unwrap();
        let v = wire::decode_results(&mut r, items.len()).unwrap();
        Ok((op, minted, v))
    }
}

/// Puts key `i` of `keys` as one object of `len` bytes read from `base + i * len`, and requires
/// every put to succeed.
pub fn put_whole(store: &Store, keys: &[String], base: u64, len: u64) {
    let ranges: Vec<[Range; 1]> = (0..keys.len() as u64)
        .map(|i| [Range::new(0, len, base + i * len)])
        .collect();
    put_ranged(store, keys, &ranges, len);
}

/// Puts key `i` of `keys` as an object of `object_len` bytes from `ranges[i]`, and requires every
/// put to succeed.
pub fn put_ranged<R: AsRef<[Range]>>(store: &Store, keys: &[String], ranges: &[R], object_len: u64) {
    let puts: Vec<RangedPut<'_>> = keys
        .iter()
        .zip(ranges)
        .map(|(k, r)| RangedPut {
            key: k,
            object_len,
            ranges: r.as_ref(),
            depth: 0,
        })
        .collect();
    for r in store.batch_put_ranges(&puts).unwrap() {
        r.unwrap();
    }
}

/// The byte at `pos` of object `key`.
pub fn pattern(key: &str, pos: u64) -> u8 {
    te_base::pattern::pattern(te_base::pattern::key_seed(key), pos)
}

/// Fills `buf[at..at + len]` with object `key`'s bytes `[offset, offset + len)`.
pub fn fill(buf: &mut [u8], at: usize, key: &str, offset: u64, len: usize) {
    for i in 0..len {
        buf[at + i] = pattern(key, offset + i as u64);
    }
}

/// Checks `buf[at..at + len]` against object `key` from `offset`.
pub fn check(buf: &[u8], at: usize, key: &str, offset: u64, len: usize) -> bool {
    (0..len).all(|i| buf[at + i] == pattern(key, offset + i as u64))
}

/// The behaviour every mode must show, through the public `Store` API only.
pub async fn behaviour_suite(store: &Store) {
    const LAYERS: u64 = 4;
    const LAYER: u64 = 1728;
    let obj = LAYERS * LAYER;
    let buf = store.alloc_buffer((8 * obj) as usize).unwrap();
    // SAFETY: the buffer outlives its registration (freed at the end).
    unsafe { store.register_buffer(buf.addr(), buf.len() as u64) }
        .await
        .unwrap();
    let keys: Vec<String> = (0..4).map(|i| format!("suite/page-{i}")).collect();

    // Ranged put of 4 objects, each as one range per layer, from a [layer][page] layout.
    {
        // SAFETY: no call uses the buffer now.
        let b = unsafe { buf.bytes_mut() };
        for (p, k) in keys.iter().enumerate() {
            for l in 0..LAYERS {
                let at = ((l * 4 + p as u64) * LAYER) as usize;
                fill(b, at, k, l * LAYER, LAYER as usize);
            }
        }
    }
    let ranges: Vec<Vec<Range>> = (0..4)
        .map(|p| {
            (0..LAYERS)
                .map(|l| Range::new(l * LAYER, LAYER, buf.addr() + (l * 4 + p) * LAYER))
                .collect()
        })
        .collect();
    put_ranged(store, &keys, &ranges, obj);
    assert!(store.exists(&keys[0]).unwrap());
    assert!(!store.exists("suite/absent").unwrap());
    let mut probe: Vec<&str> = keys.iter().map(String::as_str).collect();
    probe.insert(2, "suite/absent");
    assert_eq!(store.batch_exists_consecutive(&probe).unwrap(), 2);
    assert_eq!(
        store.object_lens(keys.iter().map(String::as_str)).unwrap(),
        vec![Some(obj); 4]
    );

    // Ranged get of layers 1..3 of every page into the second half, twice (the second names its
    // key set by handle in standalone mode).
    let half = 4 * obj;
    for _ in 0..2 {
        // SAFETY: no call uses the buffer now.
        unsafe { buf.bytes_mut()[half as usize..].fill(0) };
        let rs: Vec<Vec<Range>> = (0..4)
            .map(|p| {
                (1..3)
                    .map(|l| Range::new(l * LAYER, LAYER, buf.addr() + half + (p * 2 + (l - 1)) * LAYER))
                    .collect()
            })
            .collect();
        let gets: Vec<RangedGet<'_>> = keys
            .iter()
            .zip(&rs)
            .map(|(k, r)| RangedGet { key: k, ranges: r })
            .collect();
        let got = store.batch_get_ranges(&gets).unwrap();
        for g in got {
            assert_eq!(g.unwrap(), 2 * LAYER);
        }
        // SAFETY: the get has returned.
        let b = unsafe { buf.bytes() };
        for (p, k) in keys.iter().enumerate() {
            for l in 1..3u64 {
                let at = (half + (p as u64 * 2 + (l - 1)) * LAYER) as usize;
                assert!(check(b, at, k, l * LAYER, LAYER as usize), "{k} layer {l}");
            }
        }
    }

    // Per-key data errors and call-level shape errors.
    let r = [Range::new(0, 16, buf.addr())];
    let got = store
        .batch_get_ranges(&[RangedGet {
            key: "suite/absent",
            ranges: &r,
        }])
        .unwrap();
    assert!(matches!(got[0], Err(StoreError::NotFound { .. })), "{got:?}");
    let outside = [Range::new(obj - 8, 16, buf.addr())];
    let e = store
        .batch_get_ranges(&[RangedGet {
            key: &keys[0],
            ranges: &outside,
        }])
        .unwrap_err();
    assert!(matches!(e, StoreError::RangeOutsideObject { .. }), "{e}");
    let mut foreign = vec![0u8; 64];
    let unreg = [Range::new(0, 64, foreign.as_mut_ptr() as u64)];
    let e = store
        .batch_get_ranges(&[RangedGet {
            key: &keys[0],
            ranges: &unreg,
        }])
        .unwrap_err();
    assert!(matches!(e, StoreError::Unregistered { .. }), "{e}");

    // Whole-object calls and the convenience calls.
    let got = store.batch_get(&[(&keys[1], buf.addr(), obj)]).unwrap();
    assert_eq!(*got[0].as_ref().unwrap(), obj);
    // SAFETY: the get has returned.
    assert!(check(unsafe { buf.bytes() }, 0, &keys[1], 0, obj as usize));
    let small = store.batch_get(&[(&keys[1], buf.addr(), 10)]).unwrap();
    assert!(matches!(small[0], Err(StoreError::BufferTooSmall { need, .. }) if need == obj));
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    store.put("suite/whole", &data, 0).await.unwrap();
    assert_eq!(store.get("suite/whole").await.unwrap(), data);
    // SAFETY: no call uses the buffer now.
    unsafe { buf.bytes_mut()[..100].fill(9) };
    for r in store.batch_put(&[("suite/whole2", buf.addr(), 100, 0)]).unwrap() {
        r.unwrap();
    }
    assert_eq!(store.get("suite/whole2").await.unwrap(), vec![9u8; 100]);

    assert!(store.remove(&keys[3]).unwrap());
    assert!(!store.remove(&keys[3]).unwrap());
    assert!(!store.exists(&keys[3]).unwrap());
    let st = store.stats().unwrap();
    assert!(st.core.dram_objects >= 5, "{st:?}");
    assert!(st.core.puts_ok >= 6);
    assert!(st.core.dram_read_bytes > 0);
    store.flush().unwrap();
    store.reset_phase_report().unwrap();
    let _ = store.phase_report().unwrap();
    store.free_buffer(buf).await.unwrap();
}
