//! `te.umbp.Store`: the UMBP store in its three modes, configured as the Rust builder is, with
//! ranged calls taking numpy arrays; and `Server`, a standalone `umbp-server` in this process.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::conversion::FromPyObjectOwned;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use te_base::config::{Env, MapEnv};
#[cfg(feature = "distributed")]
use umbp::cluster::config::{ClusterKey, ClusterSettings};
use umbp::config::{StoreKey, Value, ValueKind};
use umbp::standalone::config::StandaloneSettings;
use umbp::standalone::StandaloneKey;
use umbp::{Range, RangedGet, RangedPut, Store, StoreError};

use crate::arrays::{common_len, U64s};
use crate::errors::{invalid, store_error, IntoPyResult};
use crate::memory::{acquire, release_pending};
use crate::runtime::block_on;

/// A UMBP store (local, standalone or distributed, chosen by its configuration).
#[pyclass(module = "te._native", name = "Store", frozen, subclass)]
pub struct PyStore {
    pub(crate) store: Store,
}

/// Caller memory registered with a store; `close()` (or collection) deregisters it. The store
/// holds the memory's owner (the array and its buffer export) until the buffer is deregistered
/// and the last call using it has ended, so no order of close, del, gc and threads can free
/// memory a get still writes into.
#[pyclass(module = "te._native", name = "StoreBuffer", frozen)]
pub struct PyStoreBuffer {
    store: Store,
    open: AtomicBool,
    #[pyo3(get)]
    addr: u64,
    #[pyo3(get)]
    length: u64,
}

/// A KV buffer from `Store.alloc_buffer`: a sealed memfd mapped shared (in standalone mode the
/// only memory the server can map). Exposes the buffer protocol: `np.frombuffer(buf, ...)`.
#[pyclass(module = "te._native", name = "KvBuffer", frozen)]
pub struct PyKvBuffer {
    buf: Mutex<Option<umbp::KvBuffer>>,
    addr: u64,
    len: usize,
    exports: AtomicUsize,
}

/// A standalone server (what `umbp-server` runs) inside this process, until `stop()`.
#[pyclass(module = "te._native", name = "Server", frozen)]
pub struct PyServer {
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    done: Mutex<Option<tokio::task::JoinHandle<umbp::Result<()>>>>,
    #[pyo3(get)]
    socket: PathBuf,
}

/// Store options as keyword arguments, the Rust builder's setters by name: the local-mode
/// settings of `umbp::config::StoreKey` (one loop over its table), the workers' standalone-mode
/// settings of `umbp::standalone::StandaloneKey` (one loop over its table), `local`, and the
/// distributed-mode settings of `umbp::cluster::config::ClusterKey` (one loop over its table).
#[derive(Default)]
pub struct StoreOptions {
    segment_name: Option<String>,
    /// The `StoreKey` settings given, in the table's order.
    settings: Vec<(StoreKey, Value)>,
    /// The workers' `StandaloneKey` settings given, in the table's order.
    standalone: Vec<(StandaloneKey, Value)>,
    local: Option<bool>,
    /// The `ClusterKey` settings given, in the table's order.
    #[cfg(feature = "distributed")]
    cluster: Vec<(ClusterKey, Value)>,
    /// Whether `cluster` was given (a build without distributed mode refuses it).
    #[cfg(not(feature = "distributed"))]
    cluster: bool,
}

/// The keyword options besides the settings of the tables (the first comes before them in the
/// list an unknown option is answered with, the other after the standalone-mode ones).
const SEGMENT_NAME: &str = "segment_name";
const LOCAL: &str = "local";

/// The workers' standalone-mode settings (`connect`, `key_handle_slots`, ...): a `Store`'s
/// keywords.
fn worker_keys() -> impl Iterator<Item = StandaloneKey> {
    StandaloneKey::ALL.iter().copied().filter(|k| k.read_by_workers())
}

/// The server's standalone-mode settings (`connect` names its socket, as its first argument
/// does; that wins): a `Server`'s keywords.
fn server_keys() -> impl Iterator<Item = StandaloneKey> {
    StandaloneKey::ALL.iter().copied().filter(|k| k.read_by_server())
}

/// The distributed-mode keywords: the `ClusterKey` table's (without distributed mode, the two
/// this binding took before it, refused or ignored as before).
#[cfg(feature = "distributed")]
fn cluster_keywords() -> impl Iterator<Item = &'static str> {
    ClusterKey::ALL.iter().map(|k| k.keyword())
}
#[cfg(not(feature = "distributed"))]
fn cluster_keywords() -> impl Iterator<Item = &'static str> {
    ["cluster", "cluster_listen"].into_iter()
}

/// The keyword's value as `T`, None when absent or None.
fn get<'py, T: FromPyObjectOwned<'py>>(o: &Bound<'py, PyDict>, name: &str) -> PyResult<Option<T>> {
    let Some(v) = o.get_item(name)?.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let got: PyResult<T> = v.extract().map_err(Into::into);
    got.map(Some)
        .map_err(|e| invalid("InvalidArgument", format!("{name}: {e}")))
}

/// The keyword `k`'s value as a setting of `kind` takes it, None when absent or None.
fn value_of(o: &Bound<'_, PyDict>, k: &str, kind: ValueKind) -> PyResult<Option<Value>> {
    Ok(match kind {
        ValueKind::Bytes => get(o, k)?.map(Value::Bytes),
        ValueKind::Fraction => get(o, k)?.map(Value::Fraction),
        ValueKind::Count => get(o, k)?.map(Value::Count),
        ValueKind::Switch => get(o, k)?.map(Value::Switch),
        ValueKind::Dirs => get(o, k)?.map(Value::Dirs),
        ValueKind::Choice => get(o, k)?.map(Value::Choice),
        ValueKind::Path => get(o, k)?.map(Value::Path),
    })
}

impl StoreOptions {
    /// Reads the keyword arguments; a name neither known nor in `also` (the caller's own)
    /// raises.
    fn from_kwargs(o: Option<&Bound<'_, PyDict>>, also: &[&'static str]) -> PyResult<Self> {
        let Some(o) = o else { return Ok(StoreOptions::default()) };
        let known = || {
            std::iter::once(SEGMENT_NAME)
                .chain(StoreKey::ALL.iter().map(|k| k.keyword()))
                .chain(worker_keys().map(|k| k.keyword()))
                .chain(std::iter::once(LOCAL))
                .chain(cluster_keywords())
                .chain(also.iter().copied())
        };
        for k in o.keys() {
            let k: String = k.extract()?;
            if !known().any(|n| n == k) {
                return Err(invalid(
                    "InvalidArgument",
                    format!(
                        "Store: unknown option {k:?} (known: {})",
                        known().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        let segment_name = get(o, SEGMENT_NAME)?;
        let mut settings = Vec::new();
        for &key in StoreKey::ALL {
            if let Some(v) = value_of(o, key.keyword(), key.kind())? {
                settings.push((key, v));
            }
        }
        let mut standalone = Vec::new();
        for key in worker_keys() {
            if let Some(v) = value_of(o, key.keyword(), key.kind())? {
                standalone.push((key, v));
            }
        }
        let local = get(o, LOCAL)?;
        #[cfg(feature = "distributed")]
        let cluster = {
            let mut cluster = Vec::new();
            for &key in ClusterKey::ALL {
                if let Some(v) = value_of(o, key.keyword(), key.kind())? {
                    cluster.push((key, v));
                }
            }
            cluster
        };
        #[cfg(not(feature = "distributed"))]
        let cluster = {
            let _: Option<String> = get(o, "cluster_listen")?;
            get::<String>(o, "cluster")?.is_some()
        };
        Ok(StoreOptions {
            segment_name,
            settings,
            standalone,
            local,
            cluster,
        })
    }
}

fn builder(o: StoreOptions, env: Option<Arc<dyn Env>>) -> PyResult<umbp::StoreBuilder> {
    let mut b = Store::builder();
    if let Some(e) = env {
        b = b.env(e);
    }
    if let Some(v) = o.segment_name {
        b = b.segment_name(v);
    }
    for (key, v) in o.settings {
        let shown = v.to_string();
        b = b
            .set(key, v)
            .map_err(|e| invalid("InvalidArgument", format!("{}={shown:?}: {e}", key.keyword())))?;
    }
    for (key, v) in o.standalone {
        let shown = v.to_string();
        b = b
            .set_standalone(key, v)
            .map_err(|e| invalid("InvalidArgument", format!("{}={shown:?}: {e}", key.keyword())))?;
    }
    if o.local == Some(true) {
        b = b.local();
    }
    #[cfg(feature = "distributed")]
    {
        // Distributed mode with `cluster=`: the cluster keywords over their defaults, no
        // `UMBP_CLUSTER_*` variable read; without it they are not used.
        let url = o.cluster.iter().find_map(|(key, v)| match (key, v) {
            (ClusterKey::Cluster, Value::Choice(url)) => Some(url.clone()),
            _ => None,
        });
        if let Some(url) = url {
            // A malformed cluster is refused before the other keywords are looked at.
            umbp::ClusterConfig::parse(&url).py()?;
            let mut s = ClusterSettings::default();
            for (key, v) in o.cluster {
                let shown = v.to_string();
                s.set(key, v)
                    .map_err(|e| invalid("InvalidArgument", format!("{}={shown:?}: {e}", key.keyword())))?;
            }
            if let Some(c) = umbp::ClusterConfig::explicit(&s).py()? {
                b = b.cluster(c);
            }
        }
    }
    #[cfg(not(feature = "distributed"))]
    if o.cluster {
        return Err(invalid(
            "NotAvailableError",
            "distributed mode: this build of te has no cluster support (cargo feature distributed)",
        ));
    }
    Ok(b)
}

fn env_map(env: Option<&Bound<'_, PyDict>>) -> PyResult<Option<Arc<dyn Env>>> {
    let Some(env) = env else { return Ok(None) };
    let mut map = std::collections::HashMap::new();
    for (k, v) in env.iter() {
        map.insert(k.extract::<String>()?, v.str()?.to_string());
    }
    Ok(Some(Arc::new(MapEnv(map))))
}

macro_rules! dict {
    ($py:expr, $s:expr, [$($f:ident),* $(,)?]) => {{
        let d = PyDict::new($py);
        $(d.set_item(stringify!($f), &$s.$f)?;)*
        d
    }};
}

fn core_stats<'py>(py: Python<'py>, s: &umbp::CoreStats) -> PyResult<Bound<'py, PyDict>> {
    Ok(dict!(
        py,
        s,
        [
            dram_objects,
            dram_used_bytes,
            dram_capacity_bytes,
            dram_read_bytes,
            ssd_objects,
            ssd_read_bytes,
            ssd_written_bytes,
            ssd_delivered_bytes,
            demoted,
            dropped,
            demotion_failed,
            promoted,
            puts_ok,
            puts_failed,
            ssd_torn_dropped,
            ssd_corrupt_records,
            ssd_file_bytes,
            ssd_capacity_bytes,
            ssd_segments_compacted,
            ssd_compaction_written_bytes,
            ssd_compaction_freed_bytes,
            ssd_io_engine,
            ssd_direct_io,
            local_hits,
            misses,
            resolve_reused,
        ]
    ))
}

/// Per-key results as Python values: bytes delivered (int), or the key's exception (not raised).
fn results<T>(py: Python<'_>, rs: Vec<umbp::Result<T>>, ok: impl Fn(T) -> Py<PyAny>) -> PyResult<Py<PyList>> {
    let out = PyList::empty(py);
    for r in rs {
        match r {
            Ok(v) => out.append(ok(v))?,
            Err(e) => out.append(store_error(py, &e).into_value(py))?,
        }
    }
    Ok(out.unbind())
}

/// Groups ranges given as parallel arrays by key index: the ranges of one key must be
/// consecutive in the arrays (a connector's natural order); returns `(key index, start, end)`.
fn runs(key_index: &U64s, n: usize, keys: usize) -> PyResult<Vec<(usize, usize, usize)>> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    let mut seen = vec![false; keys];
    for i in 0..n {
        let k = key_index.get(i);
        if k >= keys as u64 {
            return Err(invalid(
                "InvalidArgument",
                format!("key_index[{i}] = {k} but only {keys} key(s) were given"),
            ));
        }
        let k = k as usize;
        match out.last_mut() {
            Some(run) if run.0 == k => run.2 = i + 1,
            _ => {
                if seen[k] {
                    return Err(invalid(
                        "ShapeError",
                        format!("key_index: the ranges of key {k} are not consecutive (range {i}); group them by key"),
                    ));
                }
                seen[k] = true;
                out.push((k, i, i + 1));
            }
        }
    }
    Ok(out)
}

/// Reads the four range arrays into `Range`s (no Python object per range).
fn ranges_of(
    key_index: &Bound<'_, PyAny>,
    offsets: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
    addrs: &Bound<'_, PyAny>,
) -> PyResult<(U64s, Vec<Range>)> {
    let ki = U64s::extract(key_index, "key_index")?;
    let off = U64s::extract(offsets, "offsets")?;
    let len = U64s::extract(lengths, "lengths")?;
    let addr = U64s::extract(addrs, "addrs")?;
    let n = common_len(&[
        (&ki, "key_index"),
        (&off, "offsets"),
        (&len, "lengths"),
        (&addr, "addrs"),
    ])?;
    let mut ranges = Vec::with_capacity(n);
    match (off.as_slice(), len.as_slice(), addr.as_slice()) {
        (Some(o), Some(l), Some(a)) => ranges.extend(o.iter().zip(l).zip(a).map(|((&o, &l), &a)| Range::new(o, l, a))),
        _ => ranges.extend((0..n).map(|i| Range::new(off.get(i), len.get(i), addr.get(i)))),
    }
    Ok((ki, ranges))
}

#[pymethods]
impl PyStore {
    /// Opens a store: keyword arguments are the Rust `StoreBuilder`'s setters (unset ones come
    /// from the `UMBP_*` variables, of `env` when given); `connect=socket` is standalone mode,
    /// `cluster="etcd://host:port[/prefix]"` distributed mode, neither local mode.
    #[new]
    #[pyo3(signature = (*, env=None, **options))]
    fn new(py: Python<'_>, env: Option<&Bound<'_, PyDict>>, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        release_pending(py);
        let opts = StoreOptions::from_kwargs(options, &[])?;
        let b = builder(opts, env_map(env)?)?;
        let store = py.detach(|| block_on(b.open())).py()?;
        Ok(PyStore { store })
    }

    /// The mode: "local", "standalone" or "distributed".
    #[getter]
    fn mode(&self) -> &'static str {
        self.store.config().mode.name()
    }

    /// The resolved configuration, shaped as Rust's `StoreConfig`: `segment_name`, `core`
    /// (CoreConfig's fields), `mode` and the mode's settings (`standalone`, `cluster`).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.store.config();
        let d = PyDict::new(py);
        d.set_item("segment_name", &c.segment_name)?;
        let core = PyDict::new(py);
        let k = &c.core;
        core.set_item("dram_capacity", k.dram_capacity)?;
        core.set_item("dram_page_bytes", k.dram_page_bytes)?;
        core.set_item("dram_high_watermark", k.dram_high_watermark)?;
        core.set_item("dram_low_watermark", k.dram_low_watermark)?;
        core.set_item("eviction", format!("{:?}", k.eviction))?;
        core.set_item("ssd", k.ssd.as_ref().map(|s| format!("{s:?}")))?;
        core.set_item("ssd_staging_bytes", k.ssd_staging_bytes)?;
        core.set_item("ssd_staging_slots", k.ssd_staging_slots)?;
        core.set_item("write_through", k.write_through)?;
        core.set_item("promote_on_read", k.promote_on_read)?;
        core.set_item("ranged_call_debug", k.ranged_call_debug)?;
        d.set_item("core", core)?;
        d.set_item("mode", c.mode.name())?;
        match &c.mode {
            umbp::ModeConfig::Standalone(s) => {
                let sd = PyDict::new(py);
                sd.set_item("socket", &s.socket)?;
                sd.set_item("timeout", s.timeout.as_secs_f64())?;
                sd.set_item("spin", s.spin.as_secs_f64())?;
                sd.set_item("key_handle_slots", s.key_handle_slots)?;
                sd.set_item("key_handle_debug", s.key_handle_debug)?;
                sd.set_item("auth", s.auth.is_some())?;
                d.set_item("standalone", sd)?;
            }
            #[cfg(feature = "distributed")]
            umbp::ModeConfig::Cluster(cc) => {
                let cd = PyDict::new(py);
                cd.set_item("endpoints", &cc.endpoints)?;
                cd.set_item("prefix", &cc.prefix)?;
                cd.set_item("listen", cc.listen.to_string())?;
                cd.set_item("lease_ttl_s", cc.lease_ttl_s)?;
                cd.set_item("timeout", cc.timeout.as_secs_f64())?;
                d.set_item("cluster", cd)?;
            }
            _ => {}
        }
        Ok(d)
    }

    /// Allocates a KV buffer (a sealed memfd; in standalone mode the only memory the server can
    /// map). View it with `np.frombuffer(buf, dtype)` and register that view.
    fn alloc_buffer(&self, len: usize) -> PyResult<PyKvBuffer> {
        let buf = self.store.alloc_buffer(len).py()?;
        Ok(PyKvBuffer {
            addr: buf.addr(),
            len: buf.len(),
            buf: Mutex::new(Some(buf)),
            exports: AtomicUsize::new(0),
        })
    }

    /// Releases a KV buffer from `alloc_buffer` (deregistering it); refused while a view of it
    /// exists (`te.InFlightError`).
    fn free_buffer(&self, py: Python<'_>, buf: &Bound<'_, PyKvBuffer>) -> PyResult<()> {
        self.free_kv(py, buf)
    }

    /// Registers caller memory (a writable buffer-protocol object, `__dlpack__` host tensor...)
    /// so ranged calls can read into and write from it. The store keeps the memory alive until
    /// the returned handle is closed (or collected) and the last call using it has ended.
    fn register(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PyStoreBuffer> {
        release_pending(py);
        let a = acquire(obj, None)?;
        if !a.location.is_host() {
            return Err(invalid("WrongMemoryKindError", "the store registers host memory only"));
        }
        let (addr, len, owner) = (a.addr, a.len, a.owner);
        let store = self.store.clone();
        // SAFETY: `owner` holds the object and its buffer export, so the memory stays valid while
        // the store holds `owner` (until deregistered and no transfer uses it).
        py.detach(|| block_on(unsafe { store.register_buffer_owned(addr, len, Box::new(owner)) }))
            .py()?;
        Ok(PyStoreBuffer {
            store: self.store.clone(),
            open: AtomicBool::new(true),
            addr,
            length: len,
        })
    }

    /// True if `key` is in any tier.
    fn exists(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        py.detach(|| self.store.exists(key)).py()
    }

    /// How many of `keys`, from the first, are stored (stops at the first miss).
    fn batch_exists_consecutive(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<usize> {
        py.detach(|| self.store.batch_exists_consecutive(&keys)).py()
    }

    /// Removes `key` from every tier; False if it was in none.
    fn remove(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        py.detach(|| self.store.remove(key)).py()
    }

    /// Reads ranges of the objects `keys` into registered memory. Range `i` is `lengths[i]`
    /// bytes at object offset `offsets[i]` of `keys[key_index[i]]`, landing at `addrs[i]`; the
    /// ranges of a key are consecutive. Each argument is a 1-D uint64 array or one int for every
    /// range. Shape errors raise before any byte moves; per key, the result list holds the bytes
    /// delivered or that key's exception (e.g. `te.NotFoundError`), not raised. GIL released.
    fn batch_get_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        key_index: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        addrs: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyList>> {
        release_pending(py);
        let (ki, ranges) = ranges_of(key_index, offsets, lengths, addrs)?;
        let runs = runs(&ki, ranges.len(), keys.len())?;
        drop(ki);
        let items: Vec<RangedGet<'_>> = runs
            .iter()
            .map(|&(k, s, e)| RangedGet {
                key: &keys[k],
                ranges: &ranges[s..e],
            })
            .collect();
        let got = py.detach(|| self.store.batch_get_ranges(&items)).py()?;
        results(py, got, |n| n.into_pyobject(py).expect("int").into_any().unbind())
    }

    /// Reads whole objects into registered memory: `keys[i]` into `capacities[i]` bytes at
    /// `addrs[i]` (arrays or one int each). Per key: the object's length, or that key's exception
    /// (`te.BufferTooSmallError` when it does not fit, `te.NotFoundError`), not raised. Size and
    /// bytes come from one lookup. GIL released.
    fn batch_get_whole(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        addrs: &Bound<'_, PyAny>,
        capacities: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyList>> {
        release_pending(py);
        let addr = U64s::extract(addrs, "addrs")?;
        let cap = U64s::extract(capacities, "capacities")?;
        for (a, what) in [(&addr, "addrs"), (&cap, "capacities")] {
            if let Some(c) = a.count() {
                if c != keys.len() {
                    return Err(invalid(
                        "ShapeError",
                        format!("{what} has {c} values for {} keys", keys.len()),
                    ));
                }
            }
        }
        let items: Vec<(&str, u64, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), addr.get(i), cap.get(i)))
            .collect();
        drop(addr);
        drop(cap);
        let got = py.detach(|| self.store.batch_get(&items)).py()?;
        results(py, got, |n| n.into_pyobject(py).expect("int").into_any().unbind())
    }

    /// The objects' lengths in bytes, None where absent (one lookup per tier).
    fn object_lens(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<Option<u64>>> {
        py.detach(|| self.store.object_lens(keys.iter().map(String::as_str)))
            .py()
    }

    /// Writes objects from registered memory: object `keys[k]` has `object_lens[k]` bytes (and
    /// prefix depth `depths[k]`, default 0), tiled exactly by its ranges (as in
    /// `batch_get_ranges`). Per key: None once stored, or that key's exception (not raised).
    #[pyo3(signature = (keys, object_lens, key_index, offsets, lengths, addrs, depths=None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_put_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        object_lens: &Bound<'_, PyAny>,
        key_index: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        addrs: &Bound<'_, PyAny>,
        depths: Option<Vec<u32>>,
    ) -> PyResult<Py<PyList>> {
        release_pending(py);
        let (ki, ranges) = ranges_of(key_index, offsets, lengths, addrs)?;
        let object_lens = U64s::extract(object_lens, "object_lens")?;
        if let Some(c) = object_lens.count() {
            if c != keys.len() {
                return Err(invalid(
                    "ShapeError",
                    format!("object_lens has {c} values for {} keys", keys.len()),
                ));
            }
        }
        if let Some(d) = &depths {
            if d.len() != keys.len() {
                return Err(invalid(
                    "ShapeError",
                    format!("depths has {} values for {} keys", d.len(), keys.len()),
                ));
            }
        }
        let runs = runs(&ki, ranges.len(), keys.len())?;
        let items: Vec<RangedPut<'_>> = runs
            .iter()
            .map(|&(k, s, e)| RangedPut {
                key: &keys[k],
                object_len: object_lens.get(k),
                ranges: &ranges[s..e],
                depth: depths.as_ref().map_or(0, |d| d[k]),
            })
            .collect();
        drop(ki);
        drop(object_lens);
        let put = py.detach(|| self.store.batch_put_ranges(&items)).py()?;
        results(py, put, |()| py.None())
    }

    /// Counters since open: `{"core": {...}, "standalone": {...} | None, "cluster": {...} | None}`
    /// (Rust's `StoreStats`); `te.umbp.Store.stats()` wraps it in attribute objects.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.store.stats()).py()?;
        let d = PyDict::new(py);
        d.set_item("core", core_stats(py, &s.core)?)?;
        match &s.standalone {
            Some(sa) => d.set_item(
                "standalone",
                dict!(
                    py,
                    sa,
                    [
                        key_handle_hits,
                        key_handle_misses,
                        key_handle_mints,
                        key_handle_remints,
                        server_key_handle_hits,
                        server_key_handle_misses,
                        server_key_handle_mints,
                        server_key_handle_held,
                        server_key_handle_bytes,
                        server_sessions,
                        server_mapped_buffers,
                    ]
                ),
            )?,
            None => d.set_item("standalone", py.None())?,
        }
        #[cfg(feature = "distributed")]
        match &s.cluster {
            Some(c) => d.set_item(
                "cluster",
                dict!(
                    py,
                    c,
                    [
                        remote_hits,
                        remote_bytes,
                        remote_requests,
                        remote_control_bytes,
                        remote_stale,
                        remote_errors,
                        directory_entries,
                        directory_messages,
                        directory_refused_identity,
                        directory_refused_capped,
                        directory_lookups_throttled,
                        lease_rejoins
                    ]
                ),
            )?,
            None => d.set_item("cluster", py.None())?,
        }
        #[cfg(not(feature = "distributed"))]
        d.set_item("cluster", py.None())?;
        Ok(d)
    }

    /// Makes every acknowledged put durable (SSD tier).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.store.flush()).py()
    }

    /// Flushes, releases registrations and shuts the store's engine down.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store.clone();
        py.detach(move || block_on(async move { store.close().await })).py()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

impl Drop for PyStoreBuffer {
    /// Collected without `close()`: deregistered on the runtime; the store drops the memory's
    /// owner once no call uses it.
    fn drop(&mut self) {
        if self.open.swap(false, Ordering::AcqRel) {
            let store = self.store.clone();
            let addr = self.addr;
            crate::runtime::runtime().spawn(async move {
                let _ = store.deregister_buffer(addr).await;
            });
        }
    }
}

#[pymethods]
impl PyStoreBuffer {
    /// Deregisters. True when released now; False when a call on another thread still uses the
    /// buffer: it then refuses new calls at once, and its memory is released when that call
    /// ends. Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<bool> {
        if !self.open.swap(false, Ordering::AcqRel) {
            return Ok(true);
        }
        let store = self.store.clone();
        let addr = self.addr;
        let out = py.detach(move || block_on(async move { store.deregister_buffer(addr).await }));
        release_pending(py);
        match out {
            Ok(_) => Ok(true),
            Err(StoreError::Engine(te_base::Error::InFlight { .. })) => Ok(false),
            // Closed with the store: its registrations went with it.
            Err(StoreError::Closed) => Ok(true),
            Err(e) => Err(e).py(),
        }
    }

    /// True until closed.
    #[getter]
    fn open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

#[pymethods]
impl PyKvBuffer {
    #[getter]
    fn addr(&self) -> u64 {
        self.addr
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Exposes the mapping as a writable buffer; the exporter (this object) stays alive while a
    /// view exists.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        if me.buf.lock().is_none() {
            return Err(invalid("ClosedError", "the KV buffer was freed"));
        }
        // SAFETY: `view` is the caller's Py_buffer to fill; the memory is `len` mapped bytes that
        // live while the buffer is not freed, and freeing is refused while an export exists.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.addr as *mut std::os::raw::c_void,
                me.len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        me.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    unsafe fn __releasebuffer__(slf: Bound<'_, Self>, _view: *mut ffi::Py_buffer) {
        slf.get().exports.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PyStore {
    /// Releases a KV buffer from `alloc_buffer` (deregistering it); refused while a view of it
    /// exists.
    fn free_kv(&self, py: Python<'_>, buf: &Bound<'_, PyKvBuffer>) -> PyResult<()> {
        // Views the store let go of (closed registrations) release their exports first.
        release_pending(py);
        let b = buf.get();
        if b.exports.load(Ordering::Acquire) > 0 {
            return Err(invalid(
                "InFlightError",
                "the KV buffer still has views (numpy arrays over it); delete them first",
            ));
        }
        let Some(kv) = b.buf.lock().take() else { return Ok(()) };
        let store = self.store.clone();
        py.detach(move || block_on(async move { store.free_buffer(kv).await }))
            .py()
    }
}

#[pymethods]
impl PyServer {
    /// Starts a standalone server on `socket` (else `UMBP_STANDALONE_SOCKET`) owning a local
    /// store configured as `Store(...)`, plus the server's settings of
    /// `umbp::standalone::StandaloneKey` (`allow_gid`, `key_handle_capacity`, ...); serves until
    /// `stop()`.
    #[new]
    #[pyo3(signature = (socket=None, *, env=None, **options))]
    fn new(
        py: Python<'_>,
        socket: Option<PathBuf>,
        env: Option<&Bound<'_, PyDict>>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let own: Vec<&'static str> = server_keys()
            .filter(|k| !k.read_by_workers())
            .map(|k| k.keyword())
            .collect();
        let opts = StoreOptions::from_kwargs(options, &own)?;
        let mut settings = StandaloneSettings::default();
        let mut set = |key: StandaloneKey, v: Value| {
            let shown = v.to_string();
            settings
                .set(key, v)
                .map_err(|e| invalid("InvalidArgument", format!("{}={shown:?}: {e}", key.keyword())))
        };
        if let Some(o) = options {
            for key in server_keys() {
                if let Some(v) = value_of(o, key.keyword(), key.kind())? {
                    set(key, v)?;
                }
            }
        }
        if let Some(s) = socket {
            set(StandaloneKey::Socket, Value::Path(s))?;
        }
        let env = env_map(env)?;
        let server_env: Arc<dyn Env> = env.clone().unwrap_or_else(|| Arc::new(te_base::config::ProcessEnv));
        let b = builder(opts, env)?.local();
        let sopts = umbp::standalone::server::ServerOptions::resolve(&settings, &*server_env).py()?;
        let socket = sopts.socket.clone();
        let store = py.detach(|| block_on(b.open())).py()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let done = crate::runtime::runtime().spawn(async move {
            let out = umbp::standalone::server::serve(store.clone(), sopts, async move {
                let _ = rx.await;
            })
            .await;
            let _ = store.close().await;
            out
        });
        // Listening once the socket accepts.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if done.is_finished() {
                let out = py.detach(|| block_on(done));
                return match out {
                    Ok(Ok(())) => Err(invalid("ServerError", "the server stopped at once")),
                    Ok(Err(e)) => Err(e).py(),
                    Err(e) => Err(invalid("ServerError", e.to_string())),
                };
            }
            if std::time::Instant::now() > deadline {
                return Err(invalid("ServerError", "the server did not start listening within 20 s"));
            }
            py.detach(|| std::thread::sleep(std::time::Duration::from_millis(5)));
        }
        Ok(PyServer {
            stop: Mutex::new(Some(tx)),
            done: Mutex::new(Some(done)),
            socket,
        })
    }

    /// Stops accepting, flushes, unlinks the socket and waits for the server to end.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(tx) = self.stop.lock().take() {
            let _ = tx.send(());
        }
        let Some(done) = self.done.lock().take() else {
            return Ok(());
        };
        match py.detach(|| block_on(done)) {
            Ok(r) => r.py(),
            Err(e) => Err(invalid("ServerError", e.to_string())),
        }
    }

    /// Blocks (GIL released, Ctrl-C interrupts) until the server ends.
    fn serve_forever(&self, py: Python<'_>) -> PyResult<()> {
        loop {
            let finished = self.done.lock().as_ref().is_none_or(|d| d.is_finished());
            if finished {
                return self.stop(py);
            }
            py.detach(|| std::thread::sleep(std::time::Duration::from_millis(50)));
            py.check_signals()?;
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) -> PyResult<bool> {
        self.stop(py)?;
        Ok(false)
    }
}

/// `umbp-server`'s flags, from the settings tables: `(flag, value name or None for a switch,
/// the variable it stands for, doc line)` each (Python's `te.server` builds its parser from it).
#[pyfunction]
fn server_flags() -> Vec<(&'static str, Option<&'static str>, &'static str, &'static str)> {
    umbp::standalone::server::server_flags()
        .iter()
        .map(|f| (f.flag, f.value, f.var(), f.doc()))
        .collect()
}

/// Registers the store classes in the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(server_flags, m)?)?;
    m.add_class::<PyStore>()?;
    m.add_class::<PyStoreBuffer>()?;
    m.add_class::<PyKvBuffer>()?;
    m.add_class::<PyServer>()?;
    let _ = StoreError::Closed;
    Ok(())
}
