//! Resolving a batch's requests against the live region tables: the local side in the initiator's
//! own table, the remote side in the target's. This is the security boundary of the transport: a
//! remote range that is not inside one registered, exported, live region of the target is refused,
//! whatever the request or the (possibly stale or forged) descriptor says.
//!
//! Consecutive requests usually fall in the region the previous one used, so each side remembers
//! its last region and only searches when the request leaves it.

use te_base::{Error, ExportedBuffer, ResolvedRequest, TransferOp};

use crate::plan::Fragment;
use crate::table::{Entry, RegionTable};
use crate::NAME;

/// Resolves requests of one batch; the tables are read-locked by the caller for the whole batch.
pub(crate) struct Resolver<'a> {
    local: &'a RegionTable,
    remote: &'a RegionTable,
    segment: &'a str,
    exported: &'a [ExportedBuffer],
    last_local: usize,
    last_remote: usize,
}

impl<'a> Resolver<'a> {
    /// A resolver for requests from `local` to segment `segment`, whose live table is `remote` and
    /// whose descriptor lists `exported`.
    pub fn new(
        local: &'a RegionTable,
        remote: &'a RegionTable,
        segment: &'a str,
        exported: &'a [ExportedBuffer],
    ) -> Self {
        Resolver {
            local,
            remote,
            segment,
            exported,
            last_local: usize::MAX,
            last_remote: usize::MAX,
        }
    }

    /// The source and destination of `r`, or why it cannot be served.
    #[inline]
    pub fn resolve(&mut self, r: &ResolvedRequest) -> Result<Fragment, Error> {
        if r.len == 0 {
            return Err(Error::ZeroLength {
                index: r.index as usize,
            });
        }
        // A remembered region already passed every check below; only containment is new.
        let local_hit = self
            .local
            .get(self.last_local)
            .is_some_and(|e| e.id == r.local_region && e.contains(r.local_addr, r.len));
        if !local_hit {
            self.last_local = self.find_local(r)?;
        }
        // The buffer the request names must hold the range (a consistency check of the request);
        // the live table below is what grants access.
        let named = self
            .exported
            .get(r.remote_buffer as usize)
            .is_some_and(|b| b.contains(r.remote_addr, r.len));
        if !named {
            return Err(self.out_of_bounds(r));
        }
        let remote_hit = self
            .remote
            .get(self.last_remote)
            .is_some_and(|e| e.contains(r.remote_addr, r.len));
        if !remote_hit {
            self.last_remote = self.find_remote(r)?;
        }
        Ok(match r.op {
            TransferOp::Write => Fragment {
                dst: r.remote_addr,
                src: r.local_addr,
                len: r.len,
                index: r.index,
            },
            TransferOp::Read => Fragment {
                dst: r.local_addr,
                src: r.remote_addr,
                len: r.len,
                index: r.index,
            },
        })
    }

    fn find_local(&self, r: &ResolvedRequest) -> Result<usize, Error> {
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
        check_host(e, "local")?;
        Ok(i)
    }

    fn find_remote(&self, r: &ResolvedRequest) -> Result<usize, Error> {
        let (addr, len) = (r.remote_addr, r.len);
        // Unexported and unregistered memory read the same to a peer: out of bounds.
        let found = self
            .remote
            .find(addr)
            .filter(|&i| self.remote.get(i).is_some_and(|e| e.exported && e.contains(addr, len)));
        let Some(i) = found else {
            return Err(self.out_of_bounds(r));
        };
        if let Some(e) = self.remote.get(i) {
            check_host(e, "remote")?;
        }
        Ok(i)
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

fn check_host(e: &Entry, side: &str) -> Result<(), Error> {
    if e.host {
        Ok(())
    } else {
        Err(Error::WrongMemoryKind {
            transport: NAME.to_owned(),
            what: format!("{side} {}", e.location),
        })
    }
}
