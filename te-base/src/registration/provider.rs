//! The registration provider trait: register one buffer on one domain (one NIC's protection or
//! libfabric domain). Transports implement it (libfabric: `fi_mr_regattr` on a domain; verbs:
//! `ibv_reg_mr` on a protection domain) and so does the simulated provider; the batch functions here
//! put every buffer on each of its domains through a [`RegistrationPool`].

use std::sync::Arc;

use parking_lot::Mutex;

use super::pool::RegistrationPool;
use crate::error::{Error, Result};
use crate::memory::RegionInfo;

/// Registers single buffers on single domains.
pub trait RegistrationProvider: Send + Sync + 'static {
    /// What a registration produces (a memory region handle, a key...). Released by
    /// [`deregister`](Self::deregister).
    type Handle: Send + 'static;

    /// Short name for reports (`sim`, `efa`, `rdma`).
    fn name(&self) -> &str;

    /// True if registrations are modelled rather than performed (reports label them simulated).
    fn simulated(&self) -> bool {
        false
    }

    /// Number of domains (NICs) this provider registers on.
    fn domain_count(&self) -> usize;

    /// The domains `region` is registered on, each once. All of them by default; a topology-aware
    /// provider returns the rails local to the buffer's device.
    fn domains_for(&self, _region: &RegionInfo) -> Vec<usize> {
        (0..self.domain_count()).collect()
    }

    /// Registers `region` on `domain`. Called from pool workers, concurrently for different
    /// regions (possibly on the same domain).
    fn register(&self, domain: usize, region: &RegionInfo) -> Result<Self::Handle>;

    /// Releases a registration made by [`register`](Self::register).
    fn deregister(&self, domain: usize, region: &RegionInfo, handle: Self::Handle) -> Result<()>;
}

/// The registrations of one region: `(domain, handle)` for each domain it landed on.
pub type DomainHandles<H> = Vec<(usize, H)>;

/// A region waiting to be released, its handles taken out exactly once by the releasing worker.
type PendingRelease<H> = (RegionInfo, Mutex<Option<DomainHandles<H>>>);

/// Registers every region on each of its domains (one pool item per region, its domains in turn).
/// Results come back in the caller's order. On any failure, every registration the batch made is
/// released (including the domains a failing region had already reached) and the error lists every
/// failed region: see [`RegistrationPool`].
pub fn register_regions<P: RegistrationProvider>(
    pool: &RegistrationPool,
    provider: &Arc<P>,
    regions: Vec<RegionInfo>,
) -> Result<Vec<DomainHandles<P::Handle>>> {
    let reg = Arc::clone(provider);
    let rel = Arc::clone(provider);
    pool.register_batch(
        regions,
        move |region| register_on_domains(&*reg, region),
        move |region, handles| release_domains(&*rel, region, handles),
    )
}

/// Releases regions registered by [`register_regions`], attempting every registration; the error
/// lists every region one of whose registrations could not be released.
pub fn deregister_regions<P: RegistrationProvider>(
    pool: &RegistrationPool,
    provider: &Arc<P>,
    regions: Vec<(RegionInfo, DomainHandles<P::Handle>)>,
) -> Result<()> {
    let items: Vec<PendingRelease<P::Handle>> = regions.into_iter().map(|(r, h)| (r, Mutex::new(Some(h)))).collect();
    let rel = Arc::clone(provider);
    pool.deregister_batch(items, move |(region, slot)| match slot.lock().take() {
        Some(handles) => release_domains(&*rel, region, handles),
        None => Ok(()),
    })
}

fn register_on_domains<P: RegistrationProvider>(provider: &P, region: &RegionInfo) -> Result<DomainHandles<P::Handle>> {
    let domains = provider.domains_for(region);
    let mut handles = Vec::with_capacity(domains.len());
    for domain in domains {
        match provider.register(domain, region) {
            Ok(h) => handles.push((domain, h)),
            Err(e) => {
                let undo = release_domains(provider, region, handles);
                let mut message = format!("{} domain {domain}", provider.name());
                if let Err(u) = undo {
                    message.push_str(&format!(" (releasing its earlier domains also failed: {u})"));
                }
                // The provider's error stays the source, with its own source (an errno...).
                return Err(Error::transport_caused(provider.name().to_string(), message, e));
            }
        }
    }
    Ok(handles)
}

/// Releases every handle, attempting all of them; the first failure is returned with a count.
fn release_domains<P: RegistrationProvider>(
    provider: &P,
    region: &RegionInfo,
    handles: DomainHandles<P::Handle>,
) -> Result<()> {
    let mut failed: Vec<String> = Vec::new();
    for (domain, handle) in handles {
        if let Err(e) = provider.deregister(domain, region, handle) {
            failed.push(format!("domain {domain}: {e}"));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::transport(
            provider.name().to_string(),
            format!(
                "could not release {} registration(s): {}",
                failed.len(),
                failed.join("; ")
            ),
        ))
    }
}
