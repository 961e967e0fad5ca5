//! The engine's segments: publishing its own descriptor, and opening (and refreshing) peers'.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use te_base::{Error, ExportedBuffer, Result, SegmentDescriptor, SegmentId, TransportEndpoint};

use super::EngineInner;
use crate::segment::{OpenSegment, Route, SegmentHandle};

impl EngineInner {
    pub(super) fn descriptor(&self) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new(self.name.clone(), self.instance);
        d.transports = self
            .transports
            .iter()
            .map(|t| TransportEndpoint {
                transport: t.name().to_string(),
                info: t.endpoint(),
            })
            .collect();
        d.buffers = self
            .registry
            .snapshot()
            .iter()
            .filter(|r| r.info.exported && !r.dying.load(Ordering::Acquire))
            .map(|r| ExportedBuffer {
                base: r.info.base,
                len: r.info.len,
                location: r.info.location,
                keys: r
                    .keys
                    .iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(n, v)| (n.to_string(), v.clone()))
                    .collect(),
            })
            .collect();
        d
    }

    #[tracing::instrument(name = "publish", level = "debug", skip_all, fields(segment = %self.name))]
    pub(super) async fn publish(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        let desc = self.descriptor();
        self.metadata.publish(&desc).await?;
        self.refresh_own_segment(desc).await
    }

    /// If this engine opened its own segment, keep that open segment current: reconnect its
    /// routes with the new descriptor, so memory registered after the open is reachable without
    /// reopening (a store that registers as it grows relies on this).
    #[tracing::instrument(name = "reconnect", level = "debug", skip_all, fields(segment = %self.name))]
    async fn refresh_own_segment(&self, desc: SegmentDescriptor) -> Result<()> {
        let Some(id) = self.segment_ids.lock().get(&self.name).copied() else {
            return Ok(());
        };
        let current = self.segments.read()[id as usize].clone();
        let desc = Arc::new(desc);
        let mut routes = Vec::with_capacity(current.routes.len());
        for r in &current.routes {
            let peer = self.transports[r.transport].connect(&desc).await?;
            routes.push(Route {
                transport: r.transport,
                caps: r.caps,
                peer,
            });
        }
        self.segments.write()[id as usize] = Arc::new(OpenSegment {
            descriptor: desc,
            routes,
        });
        Ok(())
    }

    #[tracing::instrument(name = "open", level = "debug", skip(self), fields(reconnect = false))]
    pub(super) async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        let desc = Arc::new(self.metadata.fetch(name).await?);
        desc.validate()?;
        let existing = self.segment_ids.lock().get(name).copied();
        if let Some(id) = existing {
            let current = self.segments.read()[id as usize].clone();
            if *current.descriptor == *desc && current.routes.iter().all(|r| r.peer.is_healthy()) {
                return Ok(SegmentHandle {
                    id: SegmentId(id),
                    descriptor: current.descriptor.clone(),
                });
            }
            // Open before, and changed or broken since: this open reconnects.
            tracing::Span::current().record("reconnect", true);
        }
        let mut routes: Vec<Route> = Vec::new();
        let mut failures: Vec<String> = Vec::new();
        for (ti, t) in self.transports.iter().enumerate() {
            if !t.can_reach(&desc) {
                continue;
            }
            let caps = t.capabilities();
            let covered = routes.iter().any(|r| r.caps == caps);
            if covered {
                continue;
            }
            match t.connect(&desc).await {
                Ok(peer) => routes.push(Route {
                    transport: ti,
                    caps,
                    peer,
                }),
                Err(e) => failures.push(format!("{}: {e}", t.name())),
            }
        }
        if routes.is_empty() {
            let offered: Vec<&str> = desc.transports.iter().map(|t| t.transport.as_str()).collect();
            let installed: Vec<&str> = self.transports.iter().map(|t| t.name()).collect();
            let mut reason = format!("segment offers {offered:?}, this engine has {installed:?}");
            if !failures.is_empty() {
                reason.push_str(&format!("; connect failed: {}", failures.join("; ")));
            }
            return Err(Error::NoTransport {
                segment: name.to_string(),
                reason,
            });
        }
        let seg = Arc::new(OpenSegment {
            descriptor: desc.clone(),
            routes,
        });
        let mut ids = self.segment_ids.lock();
        let mut segs = self.segments.write();
        let id = match ids.get(name) {
            Some(&id) => {
                segs[id as usize] = seg;
                id
            }
            None => {
                let id = segs.len() as u32;
                segs.push(seg);
                ids.insert(name.to_string(), id);
                id
            }
        };
        Ok(SegmentHandle {
            id: SegmentId(id),
            descriptor: desc,
        })
    }
}
