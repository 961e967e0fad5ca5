//! One metadata test suite (`pub async fn`s taking `&dyn MetadataStore`, with backend differences
//! passed as flags) run against every backend: in-process, peer-to-peer and etcd (a real
//! etcd-server started on a loopback port in a temporary directory).

use std::sync::Arc;
use std::time::Duration;

use te_base::{Error, ExportedBuffer, MemoryLocation, MetadataStore, SegmentDescriptor, TransportEndpoint};
use te_core::metadata::p2p::{P2pConfig, P2pStore};
use te_core::metadata::InProcessStore;

/// What differs between backends.
#[derive(Debug, Clone, Copy)]
pub struct Flags {
    /// Whether a store sees descriptors published through another store of the same cluster
    /// by their plain name (etcd: yes; in-process: only clones of one store; p2p: no, those are
    /// fetched by address).
    pub shared_by_name: bool,
    /// Whether the store pushes descriptor changes ([`MetadataStore::watch`]; p2p cannot).
    pub watches: bool,
}

fn descriptor(name: &str, instance: u64, buffers: u64) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, instance);
    d.transports.push(TransportEndpoint {
        transport: "tcp".into(),
        info: serde_json::json!({"addrs": ["127.0.0.1:9"], "token": instance}),
    });
    for i in 0..buffers {
        d.buffers.push(ExportedBuffer {
            base: 0x10000 + i * 0x2000,
            len: 0x1000,
            location: MemoryLocation::HOST,
            keys: Default::default(),
        });
    }
    d
}

/// Publish, fetch, replace, remove.
pub async fn round_trip(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-rt");
    let d = descriptor(&name, 1, 3);
    store.publish(&d).await.unwrap();
    assert_eq!(store.fetch(&name).await.unwrap(), d, "{}", store.name());
    let d2 = descriptor(&name, 2, 5);
    store.publish(&d2).await.unwrap();
    assert_eq!(store.fetch(&name).await.unwrap(), d2, "{}: replaced", store.name());
    store.remove(&name).await.unwrap();
    assert!(matches!(store.fetch(&name).await, Err(Error::UnknownSegment(n)) if n == name));
    // Removing again is not an error.
    store.remove(&name).await.unwrap();
}

/// Unknown names are `UnknownSegment`.
pub async fn unknown_segment(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-nobody");
    assert!(matches!(store.fetch(&name).await, Err(Error::UnknownSegment(n)) if n == name));
}

/// Invalid descriptors are refused on publish and nothing is stored.
pub async fn invalid_descriptors_are_refused(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-bad");
    let mut d = descriptor(&name, 1, 2);
    d.buffers[1].base = d.buffers[0].base; // overlapping buffers
    assert!(matches!(store.publish(&d).await, Err(Error::InvalidDescriptor(_))));
    let mut d = descriptor(&name, 1, 1);
    d.version = 999;
    assert!(matches!(store.publish(&d).await, Err(Error::InvalidDescriptor(_))));
    assert!(matches!(store.fetch(&name).await, Err(Error::UnknownSegment(_))));
}

/// Many segments side by side; each is fetched as published.
pub async fn many_segments(store: &dyn MetadataStore, prefix: &str) {
    let names: Vec<String> = (0..20).map(|i| format!("{prefix}-many-{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        store
            .publish(&descriptor(n, i as u64 + 100, i as u64 % 4))
            .await
            .unwrap();
    }
    for (i, n) in names.iter().enumerate() {
        assert_eq!(store.fetch(n).await.unwrap().instance, i as u64 + 100);
    }
    for n in &names {
        store.remove(n).await.unwrap();
    }
}

/// A large descriptor (10k buffers) survives the trip intact.
pub async fn large_descriptor(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-large");
    let d = descriptor(&name, 7, 10_000);
    store.publish(&d).await.unwrap();
    assert_eq!(store.fetch(&name).await.unwrap(), d);
    store.remove(&name).await.unwrap();
}

/// A second store of the same cluster sees what the first published (and its replacement).
pub async fn visible_across_stores(a: &dyn MetadataStore, b: &dyn MetadataStore, prefix: &str, flags: Flags) {
    if !flags.shared_by_name {
        return;
    }
    let name = format!("{prefix}-shared");
    a.publish(&descriptor(&name, 1, 1)).await.unwrap();
    assert_eq!(b.fetch(&name).await.unwrap().instance, 1);
    a.remove(&name).await.unwrap();
    assert!(matches!(b.fetch(&name).await, Err(Error::UnknownSegment(_))));
}

async fn next_change(watch: &mut dyn te_base::DescriptorWatch) -> te_base::DescriptorEvent {
    tokio::time::timeout(Duration::from_secs(20), watch.next())
        .await
        .expect("a change was never pushed")
        .expect("the watch ended")
}

/// A watch on one store sees what another store of the cluster publishes and removes, in order,
/// and nothing about other names.
pub async fn watch_pushes_changes(a: &dyn MetadataStore, b: &dyn MetadataStore, prefix: &str, flags: Flags) {
    use te_base::DescriptorEvent;
    let name = format!("{prefix}-watched");
    let Some(mut watch) = b.watch(&name).await.unwrap() else {
        assert!(!flags.watches, "{}: no watch", b.name());
        return;
    };
    assert!(flags.watches && flags.shared_by_name, "{}: unexpected watch", b.name());
    a.publish(&descriptor(&format!("{prefix}-other"), 9, 1)).await.unwrap();
    for instance in [1, 2] {
        let d = descriptor(&name, instance, instance);
        a.publish(&d).await.unwrap();
        assert_eq!(
            next_change(watch.as_mut()).await,
            DescriptorEvent::Changed(d),
            "{}",
            b.name()
        );
    }
    a.remove(&name).await.unwrap();
    assert_eq!(
        next_change(watch.as_mut()).await,
        DescriptorEvent::Removed,
        "{}",
        b.name()
    );
    a.remove(&format!("{prefix}-other")).await.unwrap();
}

/// Every check against one store (and a second store of the same cluster).
pub async fn run_all(a: &dyn MetadataStore, b: &dyn MetadataStore, prefix: &str, flags: Flags) {
    round_trip(a, prefix).await;
    unknown_segment(a, prefix).await;
    invalid_descriptors_are_refused(a, prefix).await;
    many_segments(a, prefix).await;
    large_descriptor(a, prefix).await;
    visible_across_stores(a, b, prefix, flags).await;
    watch_pushes_changes(a, b, prefix, flags).await;
}

// ---------------------------------------------------------------------------------------------
// In-process

#[tokio::test]
async fn in_process_passes_the_suite() {
    let a = InProcessStore::new();
    let b = a.clone();
    run_all(
        &a,
        &b,
        "inproc",
        Flags {
            shared_by_name: true,
            watches: true,
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Peer-to-peer

async fn p2p() -> P2pStore {
    P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_passes_the_suite() {
    let a = p2p().await;
    let b = p2p().await;
    run_all(
        &a,
        &b,
        "p2p",
        Flags {
            shared_by_name: false,
            watches: false,
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_fetches_directly_from_the_peer_by_address() {
    let a = p2p().await;
    let b = p2p().await;
    let addr = a.local_addr().to_string();
    // Nothing published yet.
    assert!(matches!(b.fetch(&addr).await, Err(Error::UnknownSegment(_))));
    let d = descriptor("node-a", 1, 2);
    a.publish(&d).await.unwrap();
    a.publish(&descriptor("node-a-2", 5, 1)).await.unwrap();
    // "host:port" is the peer's primary (first published) segment; "name@host:port" any other.
    assert_eq!(b.fetch(&addr).await.unwrap(), d);
    assert_eq!(b.fetch(&format!("node-a-2@{addr}")).await.unwrap().instance, 5);
    assert!(matches!(
        b.fetch(&format!("ghost@{addr}")).await,
        Err(Error::UnknownSegment(_))
    ));
    // The peer republishes (a new instance): the next fetch sees it.
    a.publish(&descriptor("node-a", 2, 2)).await.unwrap();
    assert_eq!(b.fetch(&addr).await.unwrap().instance, 2);
    // The peer goes away: fetching by its address is an error naming it.
    drop(a);
    let err = b.fetch(&addr).await.unwrap_err();
    assert!(err.to_string().contains(&addr), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_rejects_hostile_answers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let b = p2p().await;
    // A fake peer that answers with a malformed descriptor, then one announcing a huge payload,
    // then one that does not speak the protocol.
    let answers: Vec<Vec<u8>> = vec![
        {
            let body = br#"{"version":1,"name":"x","instance":1,"transports":[],"buffers":[{"base":0,"len":0,"location":{"kind":"host","numa":null}}]}"#;
            let mut v = b"TEmd\x01\x00".to_vec();
            v.extend_from_slice(&(body.len() as u32).to_le_bytes());
            v.extend_from_slice(body);
            v
        },
        {
            let mut v = b"TEmd\x01\x00".to_vec();
            v.extend_from_slice(&u32::MAX.to_le_bytes());
            v
        },
        b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
    ];
    for answer in answers {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 8];
            let _ = s.read_exact(&mut req).await;
            let _ = s.write_all(&answer).await;
        });
        let err = b.fetch(&addr).await.unwrap_err();
        assert!(matches!(err, Error::InvalidDescriptor(_) | Error::Metadata(_)), "{err}");
        server.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_configuration_is_strict() {
    use te_base::config::MapEnv;
    let err = P2pStore::from_env(&MapEnv::new([("TE_P2P_LISTEN", "nowhere")]), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_P2P_LISTEN"));
    let err = P2pStore::from_env(&MapEnv::new([("TE_P2P_TIMEOUT_MS", "0")]), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_P2P_TIMEOUT_MS"));
    let ok = P2pStore::from_env(&MapEnv::new([("TE_P2P_LISTEN", "127.0.0.1:0")]), None)
        .await
        .unwrap();
    assert!(ok.local_addr().ip().is_loopback());
}

// ---------------------------------------------------------------------------------------------
// p2p with a shared key, limits and hostile peers

const SECRET_INSTANCE: u64 = 987_654_321_987;

fn key(byte: u8) -> te_base::auth::AuthKey {
    te_base::auth::AuthKey::from_bytes(&[byte; 32]).unwrap()
}

fn p2p_config(auth: Option<te_base::auth::AuthKey>) -> P2pConfig {
    let mut c = P2pConfig::new("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5));
    c.auth = auth;
    c
}

/// Reads what a server sends until it closes (at most 64 KiB, within 5 s).
async fn read_to_close(s: &mut tokio::net::TcpStream) -> Vec<u8> {
    te_base::test_support::read_until_closed(s, 64 << 10, Duration::from_secs(5))
        .await
        .expect("the server kept the connection open")
}

fn reveals_nothing(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    !text.contains(&SECRET_INSTANCE.to_string()) && !text.contains("127.0.0.1:9") && !text.contains("secret-seg")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_with_a_key_serves_only_peers_that_prove_it() {
    use te_core::metadata::p2p::frame::{self, Op, Status};
    use tokio::io::AsyncWriteExt;

    let server = P2pStore::start(p2p_config(Some(key(1)))).await.unwrap();
    let d = descriptor("secret-seg", SECRET_INSTANCE, 2);
    server.publish(&d).await.unwrap();
    let addr = server.local_addr().to_string();

    // The same key: served.
    let friend = P2pStore::start(p2p_config(Some(key(1)))).await.unwrap();
    assert_eq!(friend.fetch(&addr).await.unwrap(), d);
    assert_eq!(friend.fetch(&format!("secret-seg@{addr}")).await.unwrap(), d);

    // Another key, or none: refused, and the error says nothing that grants access.
    let stranger = P2pStore::start(p2p_config(Some(key(2)))).await.unwrap();
    let open = P2pStore::start(p2p_config(None)).await.unwrap();
    for (who, store) in [("wrong key", &stranger), ("no key", &open)] {
        for name in [addr.clone(), format!("secret-seg@{addr}"), format!("ghost@{addr}")] {
            let err = store.fetch(&name).await.unwrap_err();
            assert!(matches!(err, Error::Unauthenticated { .. }), "{who}: {err}");
            assert!(reveals_nothing(err.to_string().as_bytes()), "{who}: {err}");
        }
    }
    // A client with a key does not trust a server without one.
    open.publish(&descriptor("open-seg", 3, 1)).await.unwrap();
    let err = friend.fetch(&open.local_addr().to_string()).await.unwrap_err();
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");

    // On the wire: a bare GET, a GET after HELLO without proof, a forged proof and garbage each
    // get the same fixed refusal, then a closed connection.
    let refusal = frame::encode_answer(Status::Unauthenticated, b"authentication required").unwrap();
    let hello = frame::encode_request(Op::Hello, &[5u8; 32]).unwrap();
    let get = frame::encode_request(Op::Get, b"").unwrap();
    let forged = frame::encode_request(Op::Proof, &[0u8; 32]).unwrap();
    let attempts: Vec<(&str, Vec<u8>)> = vec![
        ("bare GET", get.clone()),
        ("GET after HELLO", [hello.clone(), get.clone()].concat()),
        ("forged proof", [hello.clone(), forged, get.clone()].concat()),
        ("garbage", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
    ];
    for (what, bytes) in attempts {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(&bytes).await.unwrap();
        let got = read_to_close(&mut s).await;
        assert!(reveals_nothing(&got), "{what}: {}", String::from_utf8_lossy(&got));
        // Only a challenge (nonce and proof of the server) may precede the refusal.
        let mut rest = &got[..];
        if bytes.starts_with(&hello) {
            let (a, used) = frame::decode_answer(rest, 64).unwrap().unwrap();
            assert_eq!((a.status, a.payload.len()), (Status::Challenge, 64), "{what}");
            rest = &rest[used..];
        }
        assert_eq!(rest, &refusal[..], "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_listener_caps_connections_and_times_out_handshakes() {
    let mut c = p2p_config(Some(key(1)));
    c.limits.max_per_source = 2;
    c.limits.handshake_timeout = Duration::from_millis(300);
    let server = P2pStore::start(c).await.unwrap();
    server.publish(&descriptor("capped", 1, 1)).await.unwrap();
    let addr = server.local_addr().to_string();
    let friend = P2pStore::start(p2p_config(Some(key(1)))).await.unwrap();

    // Two silent connections hold the source's places; a third is closed at once, unanswered.
    let mut idle1 = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut idle2 = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut third = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let started = std::time::Instant::now();
    assert!(
        read_to_close(&mut third).await.is_empty(),
        "over the cap: closed without an answer"
    );
    assert!(friend.fetch(&addr).await.is_err(), "the source is at its cap");
    // The silent ones are refused when the handshake deadline passes, which frees their places.
    for idle in [&mut idle1, &mut idle2] {
        let got = read_to_close(idle).await;
        assert!(got.ends_with(b"authentication required"), "{got:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    // A permit is released right after the server's close; a few quick tries cover that moment.
    let mut fetched = None;
    for _ in 0..50 {
        if let Ok(d) = friend.fetch(&addr).await {
            fetched = Some(d);
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(fetched.map(|d| d.name), Some("capped".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_answer_cap_is_configurable_and_strict() {
    use te_base::config::MapEnv;
    for bad in ["abc", "0", "100", " 4096", "99999999999"] {
        let err = P2pConfig::from_env(&MapEnv::new([("TE_P2P_MAX_ANSWER_BYTES", bad)]), None).unwrap_err();
        assert!(err.to_string().contains("TE_P2P_MAX_ANSWER_BYTES"), "{bad}: {err}");
    }
    let c = P2pConfig::from_env(&MapEnv::new([("TE_P2P_MAX_ANSWER_BYTES", "4096")]), None).unwrap();
    assert_eq!(c.max_answer_bytes, 4096);
    // A size like every other: the documented default reads back as itself.
    let c = P2pConfig::from_env(&MapEnv::new([("TE_P2P_MAX_ANSWER_BYTES", "4M")]), None).unwrap();
    assert_eq!(c.max_answer_bytes, 4 << 20);
    let err = P2pConfig::from_env(&MapEnv::new([("TE_P2P_MAX_CONNECTIONS_PER_SOURCE", "0")]), None).unwrap_err();
    assert!(err.to_string().contains("TE_P2P_MAX_CONNECTIONS_PER_SOURCE"), "{err}");

    // A descriptor larger than the reader's cap is refused by the reader, not truncated.
    let server = p2p().await;
    let big = descriptor("big", 1, 200);
    assert!(big.to_json().len() > 4096);
    server.publish(&big).await.unwrap();
    let mut small = p2p_config(None);
    small.max_answer_bytes = 4096;
    let reader = P2pStore::start(small).await.unwrap();
    let err = reader.fetch(&server.local_addr().to_string()).await.unwrap_err();
    assert!(
        matches!(err, Error::Metadata(_)) && err.to_string().contains("4096"),
        "{err}"
    );
}

/// Counts the bytes allocated and not yet freed by the current thread, and their peak, so a test
/// can measure what one fetch costs without the noise of the other tests of this binary.
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    pub struct Counting;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
        static BASE: Cell<isize> = const { Cell::new(0) };
    }

    fn add(delta: isize) {
        // `try_with`: no panic while the thread's locals are being torn down.
        let _ = LIVE.try_with(|l| {
            let now = l.get() + delta;
            l.set(now);
            let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        });
    }

    /// Starts a measurement on this thread.
    pub fn reset() {
        let live = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(live));
        BASE.with(|b| b.set(live));
    }

    /// The peak since [`reset`], over what was live then (not over what is live now, which
    /// would hide memory the measured call still holds).
    pub fn peak_growth() -> usize {
        (PEAK.with(Cell::get) - BASE.with(Cell::get)).max(0) as usize
    }

    // SAFETY: every call is forwarded unchanged to the system allocator; the counters are plain
    // thread-local cells (const-initialized, no destructor, no allocation).
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            add(layout.size() as isize);
            // SAFETY: the caller's contract for `alloc` is passed on unchanged.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            add(layout.size() as isize);
            // SAFETY: as for `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            add(-(layout.size() as isize));
            // SAFETY: `ptr` came from `System` with this layout (every allocation goes through it).
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            add(new_size as isize - layout.size() as isize);
            // SAFETY: as for `dealloc`; `new_size` is the caller's.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }
}

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

/// A hostile peer (a plain thread with a std socket) answering one connection with `answer`,
/// written in `chunk`-byte pieces `pause` apart, until the client goes away.
fn hostile_peer(answer: Vec<u8>, chunk: usize, pause: Duration) -> (String, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else { return };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut req = [0u8; 8];
        let _ = s.read_exact(&mut req);
        for piece in answer.chunks(chunk.max(1)) {
            if s.write_all(piece).is_err() {
                return;
            }
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    });
    (addr, t)
}

fn answer_with(announced: u32, body: &[u8]) -> Vec<u8> {
    let mut v = b"TEmd\x01\x00".to_vec();
    v.extend_from_slice(&announced.to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// Hostile answers cost at most about twice the answer cap (allocation peak of the fetching
/// thread) and are refused within the fetch timeout.
#[test]
fn p2p_hostile_answers_cost_bounded_memory_and_time() {
    const CAP: usize = 1 << 20;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = p2p_config(None);
        c.max_answer_bytes = CAP;
        c.timeout = Duration::from_millis(1500);
        let client = P2pStore::start(c).await.unwrap();

        let deep = {
            let mut body = br#"{"version":1,"name":"x","instance":1,"transports":[{"transport":"t","info":"#.to_vec();
            body.resize(CAP - 2, b'[');
            body
        };
        let wide = {
            let mut body =
                br#"{"version":1,"name":"w","instance":1,"transports":[{"transport":"tcp","info":["#.to_vec();
            while body.len() < CAP - 64 {
                body.extend_from_slice(b"0,");
            }
            body.extend_from_slice(br#"0]}],"buffers":[]}"#);
            body
        };
        let cases: Vec<(&str, Vec<u8>, usize, Duration)> = vec![
            // Announces 4 GiB and sends 8 MiB: refused on the header.
            (
                "oversized announcement",
                answer_with(u32::MAX, &vec![b' '; 8 * CAP]),
                64 << 10,
                Duration::ZERO,
            ),
            // Announces the cap, then drips: the fetch times out having kept only what arrived.
            (
                "slow drip",
                answer_with(CAP as u32, &[b' '; 4096]),
                16,
                Duration::from_millis(20),
            ),
            // Announces the cap and stops after a few bytes, keeping the connection open.
            (
                "stalled",
                answer_with(CAP as u32, b"{\"version\":"),
                1 << 16,
                Duration::from_secs(2),
            ),
            // A valid descriptor whose free-form endpoint info is one wide array of zeros: small
            // on the wire, ~17x as parsed values (17.8 MB from 1 MiB, measured without the budget). The
            // value budget refuses it before parsing.
            (
                "wide array",
                answer_with(wide.len() as u32, &wide),
                64 << 10,
                Duration::ZERO,
            ),
            // Exactly the cap of nesting: serde_json's recursion limit refuses it.
            (
                "deep nesting",
                answer_with(deep.len() as u32, &deep),
                64 << 10,
                Duration::ZERO,
            ),
        ];
        for (what, answer, chunk, pause) in cases {
            let (addr, peer) = hostile_peer(answer, chunk, pause);
            counting::reset();
            let started = std::time::Instant::now();
            let err = client.fetch(&addr).await.unwrap_err();
            let took = started.elapsed();
            let peak = counting::peak_growth();
            assert!(
                matches!(
                    err,
                    Error::Metadata(_) | Error::InvalidDescriptor(_) | Error::Timeout { .. }
                ),
                "{what}: {err}"
            );
            assert!(took < Duration::from_millis(2500), "{what}: refused after {took:?}");
            assert!(peak <= 2 * CAP + (256 << 10), "{what}: peak {peak} bytes (cap {CAP})");
            eprintln!("{what}: {err} after {took:?}, peak {peak} bytes");
            peer.join().unwrap();
        }
    });
}

// ---------------------------------------------------------------------------------------------
// etcd

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use te_base::test_support::etcd::EtcdServer;
    use te_core::metadata::etcd::{EtcdConfig, EtcdStore, SegmentEvent};

    async fn store(server: &EtcdServer, prefix: &str, ttl: i64) -> EtcdStore {
        let mut c = EtcdConfig::new(vec![server.endpoint.clone()]);
        c.prefix = prefix.into();
        c.lease_ttl_s = ttl;
        EtcdStore::connect(c).await.unwrap()
    }

    async fn next_event(rx: &mut tokio::sync::broadcast::Receiver<SegmentEvent>, want: &SegmentEvent) {
        let found = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match rx.recv().await {
                    Ok(ev) if &ev == want => return,
                    Ok(_) => continue,
                    Err(e) => panic!("watch channel: {e}"),
                }
            }
        })
        .await;
        assert!(found.is_ok(), "no {want:?} within 30 s");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_passes_the_suite_and_sees_restarts_and_deaths() {
        let Some(server) = EtcdServer::start_on_loopback() else {
            return;
        };
        let a = store(&server, "/te-test/cluster-1", 10).await;
        let b = store(&server, "/te-test/cluster-1", 10).await;
        run_all(
            &a,
            &b,
            "etcd",
            Flags {
                shared_by_name: true,
                watches: true,
            },
        )
        .await;

        // Another cluster id does not see cluster-1's segments.
        let other = store(&server, "/te-test/cluster-2", 10).await;
        a.publish(&descriptor("seg-iso", 1, 1)).await.unwrap();
        assert!(matches!(other.fetch("seg-iso").await, Err(Error::UnknownSegment(_))));

        // A restarted peer (new instance) is picked up through the watch.
        let mut events = b.subscribe();
        let first = store(&server, "/te-test/cluster-1", 10).await;
        first.publish(&descriptor("node-x", 1, 1)).await.unwrap();
        next_event(
            &mut events,
            &SegmentEvent::Published {
                name: "node-x".into(),
                instance: 1,
            },
        )
        .await;
        assert_eq!(b.fetch("node-x").await.unwrap().instance, 1);
        first.close().await.unwrap();
        next_event(&mut events, &SegmentEvent::Removed { name: "node-x".into() }).await;
        let second = store(&server, "/te-test/cluster-1", 10).await;
        second.publish(&descriptor("node-x", 2, 1)).await.unwrap();
        next_event(
            &mut events,
            &SegmentEvent::Published {
                name: "node-x".into(),
                instance: 2,
            },
        )
        .await;
        assert_eq!(b.cached("node-x").unwrap().instance, 2);
        assert_eq!(b.fetch("node-x").await.unwrap().instance, 2);

        // An engine that dies without closing: its lease runs out and its segment disappears.
        let dying = store(&server, "/te-test/cluster-1", 2).await;
        dying.publish(&descriptor("node-dying", 9, 1)).await.unwrap();
        next_event(
            &mut events,
            &SegmentEvent::Published {
                name: "node-dying".into(),
                instance: 9,
            },
        )
        .await;
        drop(dying);
        next_event(
            &mut events,
            &SegmentEvent::Removed {
                name: "node-dying".into(),
            },
        )
        .await;
        assert!(b.cached("node-dying").is_none());
        assert!(matches!(b.fetch("node-dying").await, Err(Error::UnknownSegment(_))));

        // A hostile value written straight into etcd is an error for that segment only.
        let mut raw = etcd_client::Client::connect([&server.endpoint], None).await.unwrap();
        raw.put("/te-test/cluster-1/segments/evil", "{\"version\":1", None)
            .await
            .unwrap();
        let fresh = store(&server, "/te-test/cluster-1", 10).await;
        assert!(matches!(fresh.fetch("evil").await, Err(Error::InvalidDescriptor(_))));
        assert_eq!(fresh.fetch("node-x").await.unwrap().instance, 2);

        // A late withdrawal by the first owner of a name leaves its successor's descriptor.
        let early = store(&server, "/te-test/cluster-1", 10).await;
        early.publish(&descriptor("node-w", 1, 1)).await.unwrap();
        let late = store(&server, "/te-test/cluster-1", 10).await;
        late.publish(&descriptor("node-w", 2, 1)).await.unwrap();
        early.withdraw("node-w", 1).await.unwrap();
        assert_eq!(fresh.fetch("node-w").await.unwrap().instance, 2);
        late.withdraw("node-w", 1).await.unwrap();
        assert_eq!(fresh.fetch("node-w").await.unwrap().instance, 2);
        late.withdraw("node-w", 2).await.unwrap();
        assert!(matches!(fresh.fetch("node-w").await, Err(Error::UnknownSegment(_))));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn descriptors_come_back_after_etcd_restarts_without_its_data() {
        let Some(mut server) = EtcdServer::start_on_loopback() else {
            return;
        };
        let a = store(&server, "/te-test/restart", 3).await;
        a.publish(&descriptor("node-r", 7, 1)).await.unwrap();
        server.restart_empty().unwrap();
        // The lease and the key died with etcd's data: the keep-alive must notice that the
        // lease is gone (an error, not a TTL of 0), take a new one and write the key again.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let observer = loop {
            match EtcdStore::connect(EtcdConfig {
                prefix: "/te-test/restart".into(),
                ..EtcdConfig::new(vec![server.endpoint.clone()])
            })
            .await
            {
                Ok(s) => break s,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!("etcd not back yet: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("etcd did not come back: {e}"),
            }
        };
        loop {
            match observer.fetch("node-r").await {
                Ok(d) => {
                    assert_eq!(d.instance, 7);
                    break;
                }
                Err(Error::UnknownSegment(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("node-r not republished within 30 s of etcd's restart: {e}"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_etcd_is_an_error_not_a_hang() {
        let mut c = EtcdConfig::new(vec![format!(
            "http://127.0.0.1:{}",
            te_base::test_support::free_port().unwrap()
        )]);
        c.timeout = Duration::from_millis(500);
        let err = EtcdStore::connect(c).await.unwrap_err();
        assert!(matches!(err, Error::Metadata(_) | Error::Timeout { .. }), "{err}");
    }
}

#[allow(dead_code)]
fn _assert_object_safe(_: Arc<dyn MetadataStore>) {}

#[test]
fn p2p_outside_a_runtime_is_an_error_not_a_panic() {
    let fut = P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(1));
    let err = futures::executor::block_on(fut).unwrap_err();
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// HTTP key-value server (Mooncake's `/metadata?key=` protocol)

#[cfg(feature = "http-metadata")]
mod http {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use parking_lot::Mutex;
    use te_base::{Error, MetadataStore};
    use te_core::metadata::http::{HttpMetadataConfig, HttpMetadataStore};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::{run_all, Flags};

    /// A stand-in for `mooncake_http_metadata_server` as its source reads: GET answers the value
    /// or 404, PUT stores the body, DELETE answers 404 for an absent key; one request per
    /// connection. Returns `http://127.0.0.1:port/metadata`.
    async fn server() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/metadata", listener.local_addr().unwrap());
        let store: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let head_end = loop {
                        let mut chunk = [0u8; 4096];
                        let n = s.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                    let mut lines = head.lines();
                    let mut first = lines.next().unwrap_or("").split(' ');
                    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
                    let len: usize = lines
                        .filter_map(|l| l.split_once(':'))
                        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                        .and_then(|(_, v)| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut chunk = vec![0u8; 65536];
                        let n = s.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    let key = target.split_once("?key=").map(|(_, k)| decode(k)).unwrap_or_default();
                    let (status, body): (&str, Vec<u8>) = match (method, key.is_empty()) {
                        (_, true) => ("400 Bad Request", b"metadata key is required".to_vec()),
                        ("GET", _) => match store.lock().get(&key) {
                            Some(v) => ("200 OK", v.clone()),
                            None => ("404 Not Found", b"metadata not found".to_vec()),
                        },
                        ("PUT", _) => {
                            store.lock().insert(key, buf[head_end..head_end + len].to_vec());
                            ("200 OK", b"metadata updated".to_vec())
                        }
                        ("DELETE", _) => match store.lock().remove(&key) {
                            Some(_) => ("200 OK", b"metadata deleted".to_vec()),
                            None => ("404 Not Found", b"metadata not found".to_vec()),
                        },
                        _ => ("405 Method Not Allowed", Vec::new()),
                    };
                    let head = format!(
                        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = s.write_all(head.as_bytes()).await;
                    let _ = s.write_all(&body).await;
                });
            }
        });
        url
    }

    fn decode(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' && i + 2 < b.len() {
                out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    fn store(url: &str) -> HttpMetadataStore {
        HttpMetadataStore::new(HttpMetadataConfig::from_url(url).unwrap())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn http_passes_the_suite() {
        let url = server().await;
        let (a, b) = (store(&url), store(&url));
        run_all(
            &a,
            &b,
            "http",
            Flags {
                shared_by_name: true,
                watches: false,
            },
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_or_silent_server_is_an_error_within_the_timeout() {
        // Nothing listens: refused at once.
        let port = te_base::test_support::free_port().unwrap();
        let err = store(&format!("http://127.0.0.1:{port}/metadata"))
            .fetch("x")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Metadata(_)), "{err}");
        // Accepts and never answers: the call's timeout ends it.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut c = HttpMetadataConfig::from_url(&format!("http://{}/metadata", silent.local_addr().unwrap())).unwrap();
        c.timeout = Duration::from_millis(300);
        let held = tokio::spawn(async move {
            let conn = silent.accept().await;
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(conn);
        });
        let err = HttpMetadataStore::new(c).fetch("x").await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        held.abort();
    }
}
