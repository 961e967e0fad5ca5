//! The device-memory plugin trait (CUDA, HIP) and the small types around it.
//!
//! A plugin crate (`te-plugin-cuda`, `te-plugin-hip`) opens the vendor runtime at run time and
//! returns an `Arc<dyn DevicePlugin>` from its `load()`, or [`Error::NotAvailable`] with the reason
//! when the library, the driver or a device is missing. The engine uses a plugin for four things:
//!
//! - registration: [`DevicePlugin::classify`] tells, once per registered buffer, whether an address
//!   is host, device `n` or managed memory (the data path never asks the driver again);
//! - topology: [`DevicePlugin::pci_bus_id`] maps a device ordinal, as the runtime numbers it after
//!   `CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`, to its PCI address;
//! - the local copy: [`DevicePlugin::copy`] and [`DevicePlugin::copy_async`] move bytes between
//!   host and device memory, a whole batch of fragments per call on a cached stream per device;
//! - network transports: [`DevicePlugin::export_dmabuf`] gives a dma-buf file descriptor for
//!   verbs (`ibv_reg_dmabuf_mr`) or libfabric (`FI_MR_DMABUF`) where the driver offers one.
//!
//! Copies take raw addresses and are `unsafe`: the caller (the engine, after checking both ranges
//! against its registration table) guarantees they are valid for the whole call.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::{MemoryKind, MemoryLocation};

/// What a device runtime says an address is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PointerKind {
    /// Ordinary (pageable) host memory the runtime knows nothing about.
    Host,
    /// Host memory allocated or pinned through the runtime (`cuMemHostAlloc`, `hipHostRegister`...).
    PinnedHost,
    /// Device memory of ordinal `device` (numbered as the runtime numbers visible devices).
    Device {
        /// Device ordinal.
        device: u32,
    },
    /// Managed (unified) memory that migrates between host and devices.
    Managed,
    /// A memory type the plugin does not handle (arrays...), with the runtime's raw type code.
    Unknown {
        /// The runtime's memory-type value.
        code: u32,
    },
}

impl PointerKind {
    /// Where the memory lives for the engine, given the plugin's kind of device memory.
    ///
    /// Host and pinned host memory are [`MemoryLocation::HOST`]; device memory is the plugin's
    /// location for that ordinal. Managed and unknown memory have no single location and give
    /// [`Error::WrongMemoryKind`].
    pub fn location(self, plugin: MemoryKind) -> Result<MemoryLocation> {
        match self {
            PointerKind::Host | PointerKind::PinnedHost => Ok(MemoryLocation::HOST),
            PointerKind::Device { device } => device_location(plugin, device),
            PointerKind::Managed | PointerKind::Unknown { .. } => Err(Error::WrongMemoryKind {
                transport: plugin.to_string(),
                what: self.to_string(),
            }),
        }
    }
}

impl fmt::Display for PointerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PointerKind::Host => write!(f, "host"),
            PointerKind::PinnedHost => write!(f, "pinned host"),
            PointerKind::Device { device } => write!(f, "device {device}"),
            PointerKind::Managed => write!(f, "managed"),
            PointerKind::Unknown { code } => write!(f, "unknown (memory type {code})"),
        }
    }
}

/// The memory location of device `device` for a plugin of kind `kind`.
pub fn device_location(kind: MemoryKind, device: u32) -> Result<MemoryLocation> {
    match kind {
        MemoryKind::Cuda => Ok(MemoryLocation::Cuda { device }),
        MemoryKind::Rocm => Ok(MemoryLocation::Rocm { device }),
        MemoryKind::Host => Err(Error::WrongMemoryKind {
            transport: "device plugin".into(),
            what: "host".into(),
        }),
    }
}

/// Direction of a copy. It decides which side is device memory and so which runtime call is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Host memory to device memory.
    HostToDevice,
    /// Device memory to host memory.
    DeviceToHost,
    /// Device memory to device memory (same or another device).
    DeviceToDevice,
}

impl CopyDirection {
    /// Picks the direction from the two sides' locations; `None` for host to host.
    pub fn between(src: MemoryLocation, dst: MemoryLocation) -> Option<CopyDirection> {
        match (src.is_host(), dst.is_host()) {
            (true, true) => None,
            (true, false) => Some(CopyDirection::HostToDevice),
            (false, true) => Some(CopyDirection::DeviceToHost),
            (false, false) => Some(CopyDirection::DeviceToDevice),
        }
    }
}

impl fmt::Display for CopyDirection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CopyDirection::HostToDevice => "host->device",
            CopyDirection::DeviceToHost => "device->host",
            CopyDirection::DeviceToDevice => "device->device",
        })
    }
}

/// One contiguous piece of a copy: `len` bytes from `src` to `dst` (process addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyFragment {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Number of bytes (never zero).
    pub len: u64,
}

impl CopyFragment {
    /// Checks that the fragment is not empty, not null and does not wrap around the address space.
    /// `index` names the fragment in the error.
    pub fn validate(&self, index: usize) -> Result<()> {
        if self.len == 0 {
            return Err(Error::ZeroLength { index });
        }
        if self.dst == 0 || self.src == 0 {
            return Err(Error::NullAddress);
        }
        for addr in [self.dst, self.src] {
            if addr.checked_add(self.len).is_none() {
                return Err(Error::LengthOverflow { addr, len: self.len });
            }
        }
        Ok(())
    }
}

/// A batch of asynchronous copies in flight on a device stream.
///
/// Dropping it without [`PendingCopy::wait`] blocks until the copies are done, so that memory the
/// caller frees afterwards is never still being read or written by the device.
pub trait PendingCopy: Send + Sync {
    /// True once every copy of the batch has finished. Never blocks.
    fn is_complete(&self) -> Result<bool>;

    /// Blocks until every copy of the batch has finished; the first failure is returned.
    fn wait(self: Box<Self>) -> Result<()>;
}

/// A dma-buf file descriptor covering a device range, for `ibv_reg_dmabuf_mr` or `FI_MR_DMABUF`.
#[derive(Debug)]
pub struct DmaBufExport {
    /// The dma-buf. Closing it does not free the device memory.
    pub fd: OwnedFd,
    /// Offset of the requested address inside the dma-buf (the exported range starts page-aligned).
    pub offset: u64,
    /// Length of the whole dma-buf range, page-aligned.
    pub len: u64,
}

/// What a loaded runtime reports about itself, for logs and the engine's availability report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRuntimeInfo {
    /// Plugin name: `cuda` or `hip`.
    pub name: &'static str,
    /// File name of the library that was opened.
    pub library: String,
    /// Driver version as text (`12.4`), when the runtime reports it.
    pub driver_version: Option<String>,
    /// Runtime version as text (`6.0.32830`), when the runtime reports it.
    pub runtime_version: Option<String>,
    /// Number of visible devices.
    pub devices: u32,
}

impl fmt::Display for DeviceRuntimeInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} device(s) via {}", self.name, self.devices, self.library)?;
        if let Some(v) = &self.driver_version {
            write!(f, ", driver {v}")?;
        }
        if let Some(v) = &self.runtime_version {
            write!(f, ", runtime {v}")?;
        }
        Ok(())
    }
}

/// A device-memory runtime loaded at run time (CUDA, HIP).
///
/// Object safe: the engine keeps `Arc<dyn DevicePlugin>` values. Every method validates its input
/// and maps driver failures to [`Error::Transport`] carrying the driver's own error text.
pub trait DevicePlugin: fmt::Debug + Send + Sync + 'static {
    /// Short name: `cuda` or `hip`.
    fn name(&self) -> &'static str;

    /// The kind of device memory this plugin serves.
    fn memory_kind(&self) -> MemoryKind;

    /// Library, versions and device count.
    fn info(&self) -> DeviceRuntimeInfo;

    /// Number of visible devices (after `CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`).
    fn device_count(&self) -> u32;

    /// PCI address of device `device` as sysfs spells it: `0000:53:00.0` (lower case, 4-digit
    /// domain). The runtime numbers devices after the visibility variable, so ordinal 0 is the first
    /// visible device, not the first device on the bus.
    fn pci_bus_id(&self, device: u32) -> Result<String>;

    /// What `addr` is. Meant for registration, once per buffer, not for the data path.
    fn classify(&self, addr: u64) -> Result<PointerKind>;

    /// Allocates `len` bytes of device memory on `device` and returns its address. Prefer
    /// [`DeviceBuffer::allocate`], which frees on drop.
    fn allocate(&self, device: u32, len: u64) -> Result<u64>;

    /// Frees memory returned by [`DevicePlugin::allocate`] on the same device.
    ///
    /// # Safety
    /// `addr` must come from `allocate(device, _)` of this plugin, must not have been freed, and no
    /// copy may still use it.
    unsafe fn free(&self, device: u32, addr: u64) -> Result<()>;

    /// Copies one fragment and returns when the bytes are at the destination. `device` is the
    /// device whose context runs the copy: the device side for host<->device, the source device
    /// for device->device.
    ///
    /// # Safety
    /// `[src, src + len)` must be readable and `[dst, dst + len)` writable memory of the kinds that
    /// `direction` names, valid for the whole call, and not overlapping.
    unsafe fn copy(&self, device: u32, direction: CopyDirection, fragment: CopyFragment) -> Result<()>;

    /// Starts every fragment of `fragments` on the cached stream of `device` (several fragments
    /// per driver call where the driver offers a batched copy) and returns a handle to wait on.
    /// All fragments are validated before any is started.
    ///
    /// Fragments of one batch may run in any order (a batched driver call does not order them), so
    /// no fragment's destination may overlap another fragment of the same batch.
    ///
    /// # Safety
    /// As for [`DevicePlugin::copy`], for every fragment, and the memory must stay valid until the
    /// returned [`PendingCopy`] reports completion or is dropped.
    unsafe fn copy_async(
        &self,
        device: u32,
        direction: CopyDirection,
        fragments: &[CopyFragment],
    ) -> Result<Box<dyn PendingCopy>>;

    /// Exports `[addr, addr + len)` of device memory on `device` as a dma-buf, for network
    /// transports. [`Error::NotAvailable`] when the driver or device does not offer dma-buf.
    fn export_dmabuf(&self, device: u32, addr: u64, len: u64) -> Result<DmaBufExport>;
}

/// Device memory allocated through a plugin and freed on drop.
pub struct DeviceBuffer {
    plugin: Arc<dyn DevicePlugin>,
    device: u32,
    addr: u64,
    len: u64,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device`.
    pub fn allocate(plugin: &Arc<dyn DevicePlugin>, device: u32, len: u64) -> Result<Self> {
        let addr = plugin.allocate(device, len)?;
        Ok(DeviceBuffer {
            plugin: Arc::clone(plugin),
            device,
            addr,
            len,
        })
    }

    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: allocations are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Where the memory lives (`cuda:N` or `rocm:N`).
    pub fn location(&self) -> MemoryLocation {
        match self.plugin.memory_kind() {
            MemoryKind::Rocm => MemoryLocation::Rocm { device: self.device },
            _ => MemoryLocation::Cuda { device: self.device },
        }
    }

    /// The plugin that owns the memory.
    pub fn plugin(&self) -> &Arc<dyn DevicePlugin> {
        &self.plugin
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("plugin", &self.plugin.name())
            .field("device", &self.device)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: `addr` came from `allocate(device, _)` of this very plugin and is freed only here;
        // copies borrowing it hold `PendingCopy` handles that wait before they are dropped.
        if let Err(e) = unsafe { self.plugin.free(self.device, self.addr) } {
            tracing::warn!(
                plugin = self.plugin.name(),
                device = self.device,
                "freeing device memory failed: {e}"
            );
        }
    }
}

/// The outcome of loading one plugin, for the engine's "compiled in but unusable" report.
#[derive(Clone)]
pub enum PluginAvailability {
    /// The runtime loaded and has at least one device.
    Loaded(Arc<dyn DevicePlugin>),
    /// Compiled in but unusable here; the error is [`Error::NotAvailable`] with the reason.
    Unavailable {
        /// Plugin name: `cuda` or `hip`.
        name: &'static str,
        /// Why it cannot be used.
        error: Error,
    },
}

impl PluginAvailability {
    /// Wraps the result of a plugin crate's `load()`.
    pub fn from_load(name: &'static str, loaded: Result<Arc<dyn DevicePlugin>>) -> Self {
        match loaded {
            Ok(plugin) => PluginAvailability::Loaded(plugin),
            Err(error) => PluginAvailability::Unavailable { name, error },
        }
    }

    /// The plugin, if it loaded.
    pub fn plugin(&self) -> Option<&Arc<dyn DevicePlugin>> {
        match self {
            PluginAvailability::Loaded(p) => Some(p),
            PluginAvailability::Unavailable { .. } => None,
        }
    }

    /// Why the plugin is unusable, if it is.
    pub fn load_error(&self) -> Option<&Error> {
        match self {
            PluginAvailability::Loaded(_) => None,
            PluginAvailability::Unavailable { error, .. } => Some(error),
        }
    }
}

impl fmt::Display for PluginAvailability {
    /// `cuda: 8 device(s) via libcuda.so.1, driver 12.4` or `cuda: not available: <reason>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginAvailability::Loaded(p) => write!(f, "{}", p.info()),
            PluginAvailability::Unavailable { error, .. } => write!(f, "{error}"),
        }
    }
}

impl fmt::Debug for PluginAvailability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PluginAvailability({self})")
    }
}

/// Normalises a PCI address reported by a runtime to the sysfs spelling: lower case with a 4-digit
/// domain (`00000000:1B:00.0` becomes `0000:1b:00.0`). Text that is not a PCI address gives
/// [`Error::Transport`] naming the plugin.
pub fn normalize_pci_bus_id(plugin: &str, raw: &str) -> Result<String> {
    let bad = || Error::transport(plugin, format!("runtime returned a malformed PCI bus id {raw:?}"));
    let raw = raw.trim_end_matches('\0').trim();
    let (domain, rest) = raw.split_once(':').ok_or_else(bad)?;
    let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
    let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
    let hex =
        |s: &str, max_digits: usize| !s.is_empty() && s.len() <= max_digits && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !(hex(domain, 8) && hex(bus, 2) && hex(dev, 2) && hex(func, 1)) {
        return Err(bad());
    }
    let domain = u32::from_str_radix(domain, 16).map_err(|_| bad())?;
    if domain > 0xffff {
        return Err(bad());
    }
    Ok(format!(
        "{domain:04x}:{}:{}.{}",
        bus.to_ascii_lowercase(),
        dev.to_ascii_lowercase(),
        func.to_ascii_lowercase()
    ))
}

/// Checks a device ordinal against the number of visible devices.
pub fn check_device(plugin: &str, device: u32, count: u32) -> Result<()> {
    if device < count {
        Ok(())
    } else {
        Err(Error::not_available(
            format!("{plugin}:{device}"),
            format!("device ordinal {device} is out of range: {count} device(s) visible"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_object_safe(_: Option<&dyn DevicePlugin>, _: Option<Box<dyn PendingCopy>>) {}

    #[test]
    fn plugin_traits_are_object_safe_and_shareable() {
        assert_object_safe(None, None);
        fn send_sync<T: Send + Sync + ?Sized>() {}
        send_sync::<dyn DevicePlugin>();
        send_sync::<dyn PendingCopy>();
        send_sync::<DeviceBuffer>();
        send_sync::<PluginAvailability>();
    }

    #[test]
    fn pci_bus_ids_are_normalised_to_sysfs_spelling() {
        assert_eq!(normalize_pci_bus_id("cuda", "0000:53:00.0").unwrap(), "0000:53:00.0");
        assert_eq!(
            normalize_pci_bus_id("cuda", "00000000:1B:00.0").unwrap(),
            "0000:1b:00.0"
        );
        assert_eq!(normalize_pci_bus_id("hip", "0001:C1:1f.7\0\0").unwrap(), "0001:c1:1f.7");
        for bad in [
            "",
            "53:00.0",
            "0000:53:00",
            "0000:5g:00.0",
            "100000000:53:00.0",
            "0000:53:00.00",
        ] {
            let err = normalize_pci_bus_id("cuda", bad).unwrap_err();
            assert!(matches!(err, Error::Transport { .. }), "{bad:?}: {err}");
        }
    }

    #[test]
    fn fragments_are_validated() {
        let ok = CopyFragment {
            dst: 0x1000,
            src: 0x2000,
            len: 16,
        };
        assert!(ok.validate(0).is_ok());
        assert!(matches!(
            CopyFragment { len: 0, ..ok }.validate(3),
            Err(Error::ZeroLength { index: 3 })
        ));
        assert!(matches!(
            CopyFragment { dst: 0, ..ok }.validate(0),
            Err(Error::NullAddress)
        ));
        assert!(matches!(
            CopyFragment {
                src: u64::MAX - 4,
                ..ok
            }
            .validate(0),
            Err(Error::LengthOverflow { .. })
        ));
    }

    #[test]
    fn pointer_kinds_map_to_locations() {
        assert_eq!(
            PointerKind::Host.location(MemoryKind::Cuda).unwrap(),
            MemoryLocation::HOST
        );
        assert_eq!(
            PointerKind::PinnedHost.location(MemoryKind::Rocm).unwrap(),
            MemoryLocation::HOST
        );
        assert_eq!(
            PointerKind::Device { device: 2 }.location(MemoryKind::Cuda).unwrap(),
            MemoryLocation::Cuda { device: 2 }
        );
        assert_eq!(
            PointerKind::Device { device: 1 }.location(MemoryKind::Rocm).unwrap(),
            MemoryLocation::Rocm { device: 1 }
        );
        assert!(matches!(
            PointerKind::Managed.location(MemoryKind::Cuda),
            Err(Error::WrongMemoryKind { .. })
        ));
        assert!(PointerKind::Unknown { code: 3 }.location(MemoryKind::Cuda).is_err());
    }

    #[test]
    fn copy_direction_follows_locations() {
        let host = MemoryLocation::HOST;
        let gpu = MemoryLocation::Cuda { device: 0 };
        assert_eq!(CopyDirection::between(host, host), None);
        assert_eq!(CopyDirection::between(host, gpu), Some(CopyDirection::HostToDevice));
        assert_eq!(CopyDirection::between(gpu, host), Some(CopyDirection::DeviceToHost));
        assert_eq!(CopyDirection::between(gpu, gpu), Some(CopyDirection::DeviceToDevice));
    }

    #[test]
    fn device_ordinals_are_checked() {
        assert!(check_device("cuda", 1, 2).is_ok());
        let err = check_device("cuda", 2, 2).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cuda:2: not available: device ordinal 2 is out of range: 2 device(s) visible"
        );
    }

    /// Records allocations and frees; hands out addresses that are never dereferenced.
    #[derive(Debug, Default)]
    struct Ledger {
        events: parking_lot::Mutex<Vec<(&'static str, u32, u64)>>,
    }

    impl DevicePlugin for Ledger {
        fn name(&self) -> &'static str {
            "ledger"
        }
        fn memory_kind(&self) -> MemoryKind {
            MemoryKind::Rocm
        }
        fn info(&self) -> DeviceRuntimeInfo {
            DeviceRuntimeInfo {
                name: "ledger",
                library: "libledger.so".into(),
                driver_version: Some("1.2".into()),
                runtime_version: None,
                devices: 2,
            }
        }
        fn device_count(&self) -> u32 {
            2
        }
        fn pci_bus_id(&self, device: u32) -> Result<String> {
            check_device("ledger", device, 2).map(|_| format!("0000:0{device}:00.0"))
        }
        fn classify(&self, _addr: u64) -> Result<PointerKind> {
            Ok(PointerKind::Host)
        }
        fn allocate(&self, device: u32, len: u64) -> Result<u64> {
            check_device("ledger", device, 2)?;
            let addr = 0x1000 * (u64::from(device) + 1) + len;
            self.events.lock().push(("alloc", device, addr));
            Ok(addr)
        }
        unsafe fn free(&self, device: u32, addr: u64) -> Result<()> {
            self.events.lock().push(("free", device, addr));
            Ok(())
        }
        unsafe fn copy(&self, _: u32, _: CopyDirection, _: CopyFragment) -> Result<()> {
            Err(Error::not_available("ledger", "moves no bytes"))
        }
        unsafe fn copy_async(&self, _: u32, _: CopyDirection, _: &[CopyFragment]) -> Result<Box<dyn PendingCopy>> {
            Err(Error::not_available("ledger", "moves no bytes"))
        }
        fn export_dmabuf(&self, _: u32, _: u64, _: u64) -> Result<DmaBufExport> {
            Err(Error::not_available("ledger", "no dma-buf"))
        }
    }

    #[test]
    fn device_buffers_free_exactly_once_on_their_device() {
        let ledger = Arc::new(Ledger::default());
        let plugin: Arc<dyn DevicePlugin> = ledger.clone();
        {
            let buf = DeviceBuffer::allocate(&plugin, 1, 64).unwrap();
            assert_eq!(buf.location(), MemoryLocation::Rocm { device: 1 });
            assert_eq!((buf.device(), buf.len()), (1, 64));
            assert!(DeviceBuffer::allocate(&plugin, 2, 64).is_err());
        }
        let events = ledger.events.lock().clone();
        assert_eq!(events, vec![("alloc", 1, 0x2040), ("free", 1, 0x2040)]);
    }

    #[test]
    fn loaded_plugins_report_their_runtime() {
        let a = PluginAvailability::from_load("ledger", Ok(Arc::new(Ledger::default())));
        assert!(a.load_error().is_none());
        assert_eq!(a.to_string(), "ledger: 2 device(s) via libledger.so, driver 1.2");
        assert_eq!(a.plugin().unwrap().pci_bus_id(1).unwrap(), "0000:01:00.0");
    }

    #[test]
    fn unavailable_plugins_report_their_reason() {
        let a = PluginAvailability::from_load("cuda", Err(Error::not_available("cuda", "libcuda.so not found")));
        assert!(a.plugin().is_none());
        assert_eq!(a.to_string(), "cuda: not available: libcuda.so not found");
        assert!(matches!(a.load_error(), Some(Error::NotAvailable { .. })));
    }
}
