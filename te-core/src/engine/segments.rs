//! The engine's segments: publishing its own descriptor, and opening, following and closing
//! peers'.
//!
//! An open segment follows its peer's descriptor. Where the metadata store can watch (etcd, the
//! in-process store) a task per open segment applies each change as it is published; otherwise
//! (peer-to-peer metadata) the descriptor is fetched again when a submit finds the connection
//! lost. Applying a descriptor reconnects the routes with it, so a buffer the peer added is
//! usable and one it removed is refused at submit (grouping checks remote ranges against the
//! descriptor). A new `instance` means the peer restarted: the old routes are aborted with
//! [`Error::PeerRestarted`], failing what was in flight to the old process, and new submits go to
//! the new one. Each change is reported on the handle's [`SegmentEvent`] channel.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use te_base::{
    DescriptorEvent, DescriptorWatch, Error, ExportedBuffer, Result, SegmentDescriptor, SegmentId, TransportEndpoint,
};
use tokio::sync::broadcast;
use tokio::task::AbortHandle;
use tracing::Instrument;

use super::EngineInner;
use crate::route_health::RouteHealth;
use crate::segment::{OpenSegment, Route, SegmentEvent, SegmentHandle, UnreachedRoute};

/// Events kept per segment for a slow subscriber before it sees `Lagged`.
const EVENT_CAPACITY: usize = 64;

/// The follow-up state of every open segment, by id.
#[derive(Default)]
pub(crate) struct LiveSegments {
    followers: Mutex<HashMap<u32, Follower>>,
    /// Serializes applying descriptors (opens, watch events, re-fetches, closes).
    apply: tokio::sync::Mutex<()>,
}

impl LiveSegments {
    /// The name segment `id` was opened by, if it is open.
    pub(crate) fn opened_as(&self, id: u32) -> Option<String> {
        self.followers.lock().get(&id).map(|f| f.name.clone())
    }
}

struct Follower {
    /// The name the segment was opened by (a p2p address, or the segment name).
    name: String,
    events: broadcast::Sender<SegmentEvent>,
    /// The task applying the metadata store's watch events, if the store can watch.
    watch: Option<AbortHandle>,
    /// A re-fetch after a lost connection, while one runs, and where its outcome is told.
    refetch: Option<(AbortHandle, Reconnected)>,
}

/// The outcome of a reconnect once it ended (`None` while it runs): `Err` says why it failed. A
/// closed channel means the segment was closed meanwhile.
pub(super) type Reconnected = tokio::sync::watch::Receiver<Option<std::result::Result<(), String>>>;

impl Follower {
    fn stop(&self) {
        for t in self.watch.iter().chain(self.refetch.as_ref().map(|(t, _)| t)) {
            t.abort();
        }
    }
}

impl LiveSegments {
    fn emit(&self, id: u32, event: SegmentEvent) {
        if let Some(f) = self.followers.lock().get(&id) {
            let _ = f.events.send(event);
        }
    }
}

impl LiveSegments {
    /// Stops following every segment (the engine shuts down).
    pub(super) fn stop_all(&self) {
        for f in self.followers.lock().values() {
            f.stop();
        }
    }
}

impl Drop for LiveSegments {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// What applying a descriptor changed.
enum Applied {
    Unchanged,
    Changed,
    Restarted,
}

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
        if !self.segment_ids.lock().contains_key(&self.name) {
            return Ok(());
        }
        let name = self.name.clone();
        self.apply(&name, Arc::new(desc)).await.map(|_| ())
    }

    #[tracing::instrument(name = "open", level = "debug", skip(self))]
    pub(super) async fn open_segment(self: &Arc<Self>, name: &str) -> Result<SegmentHandle> {
        // Watch before fetching, so a change published in between is not missed (a change the
        // fetch already saw comes again as an event and is found unchanged).
        let watch = self.metadata.watch(name).await?;
        let desc = Arc::new(self.metadata.fetch(name).await?);
        desc.validate()?;
        let (id, _) = self.apply(name, desc).await?;
        let handle = self.follow(id, name, watch);
        self.warm_on_open(id).await;
        Ok(handle)
    }

    /// Registers the follower of segment `id` (once) and returns a handle on it; starts the
    /// metadata watch task if the store gave one.
    fn follow(self: &Arc<Self>, id: u32, name: &str, watch: Option<Box<dyn DescriptorWatch>>) -> SegmentHandle {
        let descriptor = self.segments.read()[id as usize].descriptor.clone();
        let mut followers = self.live.followers.lock();
        let f = followers.entry(id).or_insert_with(|| Follower {
            name: name.to_string(),
            events: broadcast::channel(EVENT_CAPACITY).0,
            watch: None,
            refetch: None,
        });
        if let Some(watch) = watch.filter(|_| f.watch.is_none()) {
            let task = self
                .runtime
                .spawn(follow_watch(Arc::downgrade(self), id, name.to_string(), watch));
            f.watch = Some(task.abort_handle());
        }
        SegmentHandle {
            id: SegmentId(id),
            descriptor,
            events: f.events.clone(),
        }
    }

    /// The connection of segment `id` was found lost at submit: fetch its descriptor again and
    /// reconnect in the background (one at a time), so the next submit finds it current. This is
    /// how peer-to-peer metadata, which cannot watch, learns of a restart, and how a connection
    /// cut by a deadline comes back.
    pub(super) fn reconnect_later(self: &Arc<Self>, id: u32) -> Option<Reconnected> {
        let mut followers = self.live.followers.lock();
        let f = followers.get_mut(&id)?;
        if let Some((_, running)) = &f.refetch {
            return Some(running.clone());
        }
        let (tell, told) = tokio::sync::watch::channel(None);
        let engine = Arc::downgrade(self);
        let name = f.name.clone();
        let task = self.runtime.spawn(async move {
            let Some(e) = engine.upgrade() else { return };
            let outcome = match e.metadata.fetch(&name).await {
                Ok(d) => e.apply(&name, Arc::new(d)).await.map(|_| ()),
                Err(err) => Err(err),
            };
            if let Err(err) = &outcome {
                tracing::warn!(segment = %name, "reconnecting a lost segment failed: {err}");
            }
            let mut followers = e.live.followers.lock();
            if let Some(f) = followers.get_mut(&id) {
                f.refetch = None;
            }
            drop(followers);
            let _ = tell.send(Some(outcome.map_err(|err| err.to_string())));
        });
        f.refetch = Some((task.abort_handle(), told.clone()));
        Some(told)
    }

    /// Closes segment `id`: forgets its descriptor, drops its connections (requests in flight
    /// on them finish), stops following it. Later submits to `id` fail with
    /// [`Error::SegmentClosed`]; opening the name again gives a new id.
    pub(super) async fn close_segment(&self, id: SegmentId) -> Result<()> {
        let _guard = self.live.apply.lock().await;
        let unknown = || Error::UnknownSegment(format!("id {}", id.0));
        let Some(follower) = self.live.followers.lock().remove(&id.0) else {
            return Err(unknown());
        };
        follower.stop();
        self.segment_ids.lock().retain(|_, v| *v != id.0);
        let old = {
            let mut segs = self.segments.write();
            let slot = segs.get_mut(id.0 as usize).ok_or_else(unknown)?;
            let closed = Arc::new(OpenSegment {
                descriptor: slot.descriptor.clone(),
                routes: Vec::new(),
                unreached: Vec::new(),
                closed: true,
            });
            std::mem::replace(slot, closed)
        };
        drop(old);
        let _ = follower.events.send(SegmentEvent::Closed);
        Ok(())
    }

    /// Makes `desc` the descriptor of the segment opened as `name` (opening it if new): connects
    /// the routes it needs, replaces the old ones, and reports the change. Returns the id and
    /// the descriptor in use.
    async fn apply(&self, name: &str, desc: Arc<SegmentDescriptor>) -> Result<(u32, Arc<SegmentDescriptor>)> {
        let _guard = self.live.apply.lock().await;
        let existing = self.segment_ids.lock().get(name).copied();
        let current = existing.map(|id| self.segments.read()[id as usize].clone());
        let applied = match &current {
            None => Applied::Changed,
            Some(c) if c.descriptor.instance != desc.instance => Applied::Restarted,
            Some(c) if *c.descriptor == *desc && c.routes.iter().all(|r| r.peer.is_healthy()) => {
                return Ok((existing.unwrap_or_default(), c.descriptor.clone()));
            }
            Some(c) if *c.descriptor == *desc => Applied::Unchanged,
            Some(_) => Applied::Changed,
        };
        if let (Applied::Restarted, Some(c)) = (&applied, &current) {
            // The old process is gone for good: fail what is in flight to it (each transport
            // once it stopped touching the memory), whether or not the new one is reachable.
            for r in &c.routes {
                r.peer.abort(Error::PeerRestarted {
                    peer: c.descriptor.name.clone(),
                    reason: "its descriptor names a new instance".into(),
                });
            }
        }
        // Open before, and changed, restarted or broken since: this is a reconnect.
        let connect = self.connect_routes(name, &desc);
        let (routes, unreached) = if current.is_some() {
            let restarted = matches!(applied, Applied::Restarted);
            connect
                .instrument(tracing::debug_span!("reconnect", segment = %name, restarted))
                .await?
        } else {
            connect.await?
        };
        // Said once: when a transport starts refusing, or refuses for another reason.
        for u in &unreached {
            let known = current.as_ref().is_some_and(|c| c.unreached.contains(u));
            if !known {
                tracing::warn!(segment = %name, transport = u.transport, "not a route to it: {}", u.reason);
            }
        }
        let seg = Arc::new(OpenSegment {
            descriptor: desc.clone(),
            routes,
            unreached,
            closed: false,
        });
        let id = {
            let mut ids = self.segment_ids.lock();
            let mut segs = self.segments.write();
            match ids.get(name) {
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
            }
        };
        if existing.is_some() {
            match applied {
                Applied::Restarted => self.live.emit(id, SegmentEvent::Restarted(desc.clone())),
                Applied::Changed => self.live.emit(id, SegmentEvent::Changed(desc.clone())),
                Applied::Unchanged => {}
            }
        }
        Ok((id, desc))
    }

    /// Connects the routes to `desc`, in the engine's order of preference: with failover on,
    /// every transport that reaches it (the later ones carry what the earlier ones fail), except
    /// behind the in-process copy, which fails only with this process; with failover off, one
    /// per distinct capability set.
    async fn connect_routes(
        &self,
        name: &str,
        desc: &Arc<SegmentDescriptor>,
    ) -> Result<(Vec<Route>, Vec<UnreachedRoute>)> {
        let mut routes: Vec<Route> = Vec::new();
        let mut failures: Vec<UnreachedRoute> = Vec::new();
        for (transport, t) in self.transports.iter().enumerate() {
            if !t.can_reach(desc) {
                continue;
            }
            let caps = t.capabilities();
            let covered = routes
                .iter()
                .any(|r| r.caps == caps && (!self.failover.enabled() || r.in_process));
            if covered {
                continue;
            }
            match t.connect(desc).await {
                Ok(peer) => routes.push(Route {
                    transport,
                    transport_name: t.name(),
                    in_process: crate::install::reach_of(t.name()) == Some(te_base::Reach::InProcess),
                    caps,
                    peer,
                    health: Arc::new(RouteHealth::new(self.failover.first_pause)),
                    metrics: self.export.as_ref().map(|e| e.label_set(transport, name)),
                }),
                Err(e) => failures.push(UnreachedRoute {
                    transport: t.name(),
                    reason: e.to_string(),
                }),
            }
        }
        if routes.is_empty() {
            let offered: Vec<&str> = desc.transports.iter().map(|t| t.transport.as_str()).collect();
            let installed: Vec<&str> = self.transports.iter().map(|t| t.name()).collect();
            let mut reason = format!("segment offers {offered:?}, this engine has {installed:?}");
            if !failures.is_empty() {
                let each: Vec<String> = failures
                    .iter()
                    .map(|u| format!("{}: {}", u.transport, u.reason))
                    .collect();
                reason.push_str(&format!("; connect failed: {}", each.join("; ")));
            }
            return Err(Error::NoTransport {
                segment: name.to_string(),
                reason,
            });
        }
        Ok((routes, failures))
    }
}

/// Applies every change the metadata store reports for the segment opened as `name`, until the
/// engine goes away or the segment is closed (which aborts this task).
async fn follow_watch(engine: Weak<EngineInner>, id: u32, name: String, mut watch: Box<dyn DescriptorWatch>) {
    while let Some(event) = watch.next().await {
        let Some(e) = engine.upgrade() else { return };
        match event {
            DescriptorEvent::Changed(d) => {
                if let Err(err) = e.apply(&name, Arc::new(d)).await {
                    tracing::warn!(segment = %name, "applying its new descriptor failed: {err}");
                }
            }
            DescriptorEvent::Removed => e.live.emit(id, SegmentEvent::Gone),
            _ => {}
        }
    }
    // The watch ended (the store closed): fall back to re-fetching on a lost connection.
    if let Some(e) = engine.upgrade() {
        if let Some(f) = e.live.followers.lock().get_mut(&id) {
            f.watch = None;
        }
    }
}
