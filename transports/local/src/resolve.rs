//! Resolving a batch's requests against the live region tables: the local side in the initiator's
//! own table, the remote side in the target's. This is the security boundary of the transport: a
//! remote range that is not inside one registered, exported, live region of the target is refused,
//! whatever the request or the (possibly stale or forged) descriptor says.
//!
//! Consecutive requests usually fall in the region the previous one used, so each side remembers
//! its last region and only searches when the request leaves it.
//!
//! A request between two host regions is a [`Resolved::Host`] fragment for the CPU copy; one with a
//! device side is a [`Resolved::Device`] fragment routed to the plugin of its memory kind, or fails
//! with `Error::WrongMemoryKind` naming the plugin that is not loaded.

/// Where a resolved request goes.
pub(crate) enum Resolved {
    /// Host to host: the CPU copy.
    Host(Fragment),
    /// At least one device side: a device plugin's copy.
    Device(DeviceFragment),
}

use te_base::{Error, ExportedBuffer, ResolvedRequest, TransferOp};

use crate::device::{DeviceFragment, DeviceRoutes, Side};
use crate::plan::Fragment;
use crate::table::{Entry, RegionTable};

/// Resolves requests of one batch; the tables are read-locked by the caller for the whole batch.
pub(crate) struct Resolver<'a> {
    local: &'a RegionTable,
    remote: &'a RegionTable,
    segment: &'a str,
    exported: &'a [ExportedBuffer],
    devices: &'a DeviceRoutes,
    /// Copies of the last regions used: the next request is compared against them without
    /// indexing the tables.
    last_local: Option<Entry>,
    last_remote: Option<Entry>,
}

impl<'a> Resolver<'a> {
    /// A resolver for requests from `local` to segment `segment`, whose live table is `remote` and
    /// whose descriptor lists `exported`; device sides go to `devices`.
    pub fn new(
        local: &'a RegionTable,
        remote: &'a RegionTable,
        segment: &'a str,
        exported: &'a [ExportedBuffer],
        devices: &'a DeviceRoutes,
    ) -> Self {
        Resolver {
            local,
            remote,
            segment,
            exported,
            devices,
            last_local: None,
            last_remote: None,
        }
    }

    /// The source and destination of `r`, or why it cannot be served.
    #[inline]
    pub fn resolve(&mut self, r: &ResolvedRequest) -> Result<Resolved, Error> {
        match self.cached_host(r) {
            Some(f) => Ok(Resolved::Host(f)),
            None => self.search(r),
        }
    }

    /// The fragment of `r` when it is host to host and lies in the regions the previous request
    /// used: the common case, answered with the checks of [`Resolver::search`] combined without a
    /// branch each (measured: 0.955x against 0.890x the memcpy loop at 1,728 B without this path).
    /// `None` sends the request to the search, which also says what is wrong.
    #[inline]
    fn cached_host(&self, r: &ResolvedRequest) -> Option<Fragment> {
        let local = self.last_local.as_ref()?;
        // A remembered remote region was found exported and live by `find_remote`.
        let remote = self.last_remote.as_ref()?;
        let named = self.exported.get(r.remote_buffer as usize)?;
        let ok = (r.len != 0)
            & (local.id == r.local_region)
            & local.host
            & remote.host
            & local.contains(r.local_addr, r.len)
            & remote.contains(r.remote_addr, r.len)
            & named.contains(r.remote_addr, r.len);
        if !ok {
            return None;
        }
        let (dst, src) = match r.op {
            TransferOp::Write => (r.remote_addr, r.local_addr),
            TransferOp::Read => (r.local_addr, r.remote_addr),
        };
        Some(Fragment {
            dst,
            src,
            len: r.len,
            index: r.index,
        })
    }

    /// Resolves `r` against the remembered regions or, when it leaves them, by searching the
    /// tables; says what is wrong when it cannot be served.
    fn search(&mut self, r: &ResolvedRequest) -> Result<Resolved, Error> {
        if r.len == 0 {
            return Err(Error::ZeroLength {
                index: r.index as usize,
            });
        }
        // A remembered region already passed every check below; only containment is new.
        let local = match self.last_local {
            Some(e) if e.id == r.local_region && e.contains(r.local_addr, r.len) => e,
            _ => *self.last_local.insert(self.find_local(r)?),
        };
        // The buffer the request names must hold the range (a consistency check of the request);
        // the live table below is what grants access.
        let named = self
            .exported
            .get(r.remote_buffer as usize)
            .is_some_and(|b| b.contains(r.remote_addr, r.len));
        if !named {
            return Err(self.out_of_bounds(r));
        }
        let remote = match self.last_remote {
            Some(e) if e.contains(r.remote_addr, r.len) => e,
            _ => *self.last_remote.insert(self.find_remote(r)?),
        };
        let (dst, src) = match r.op {
            TransferOp::Write => (r.remote_addr, r.local_addr),
            TransferOp::Read => (r.local_addr, r.remote_addr),
        };
        if local.host & remote.host {
            return Ok(Resolved::Host(Fragment {
                dst,
                src,
                len: r.len,
                index: r.index,
            }));
        }
        let ((src_loc, src_side), (dst_loc, dst_side)) = match r.op {
            TransferOp::Write => ((local.location, Side::Local), (remote.location, Side::Remote)),
            TransferOp::Read => ((remote.location, Side::Remote), (local.location, Side::Local)),
        };
        let group = self.devices.route(src_loc, src_side, dst_loc, dst_side)?;
        Ok(Resolved::Device(DeviceFragment {
            group,
            dst,
            src,
            len: r.len,
            index: r.index,
        }))
    }

    fn find_local(&self, r: &ResolvedRequest) -> Result<Entry, Error> {
        let (addr, len) = (r.local_addr, r.len);
        if addr.checked_add(len).is_none() {
            return Err(Error::LengthOverflow { addr, len });
        }
        let unregistered = Error::Unregistered { addr, len };
        let i = self.local.find(addr).ok_or_else(|| unregistered.clone())?;
        let e = self.local.get(i).ok_or_else(|| unregistered.clone())?;
        if e.id != r.local_region {
            // The range is registered, but not as the region the request names.
            return Err(unregistered);
        }
        if !e.contains(addr, len) {
            return Err(Error::PartlyRegistered {
                addr,
                len,
                region_base: e.base,
                region_len: e.end - e.base,
            });
        }
        Ok(*e)
    }

    fn find_remote(&self, r: &ResolvedRequest) -> Result<Entry, Error> {
        let (addr, len) = (r.remote_addr, r.len);
        // Unexported and unregistered memory read the same to a peer: out of bounds.
        let remote = self.remote;
        remote
            .find(addr)
            .and_then(|i| remote.get(i))
            .filter(|e| e.exported && e.contains(addr, len))
            .copied()
            .ok_or_else(|| self.out_of_bounds(r))
    }
}

impl Resolver<'_> {
    fn out_of_bounds(&self, r: &ResolvedRequest) -> Error {
        if r.remote_addr.checked_add(r.len).is_none() {
            return Error::LengthOverflow {
                addr: r.remote_addr,
                len: r.len,
            };
        }
        Error::OutOfBounds {
            segment: self.segment.to_owned(),
            addr: r.remote_addr,
            len: r.len,
        }
    }
}
