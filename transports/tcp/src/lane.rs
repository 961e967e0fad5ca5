//! One persistent connection to a peer (a lane): a sending task, a receiving task and a watchdog.
//!
//! Jobs (a lane's share of one batch) are queued once per batch under one lock. The sending task
//! moves a job to the in-flight queue and streams its slices; the receiving task walks the same
//! slices in the same order (TCP keeps replies in order) and completes them. Writes complete on
//! the target's acknowledgement, which it sends only after the bytes are in its memory; read
//! payloads are received straight into the local registered memory.
//!
//! When the connection breaks, the peer refuses the instance, or the watchdog sees no progress for
//! the timeout while work is outstanding, the lane dies: every outstanding request it carries
//! fails with `PeerGone` naming the peer, and the peer reports itself unhealthy. A lane cut to stop
//! one batch whose deadline passed on its wire fails only that batch: the other batches' unsettled
//! slices go on a sibling lane, or on a fresh connection to the same instance when none is alive.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use te_base::{BatchState, Error, Result, TransferOp};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::frame_io::{write_all_raw, FrameReader, RawPart};
use crate::notify::NoteJob;
use crate::plan::{LaneCursor, Plan};
use crate::wire::{Header, Opcode, RefusalCode, HEADER_LEN};

/// Most slices sent with one vectored write.
const SEND_GROUP: usize = 32;
/// Most payload bytes sent with one vectored write.
const SEND_GROUP_BYTES: u64 = 8 << 20;

/// A lane's share of one batch.
#[derive(Clone)]
pub(crate) struct LaneJob {
    pub plan: Arc<Plan>,
    /// Where this job's slices start: the first slice of one lane's share, or, for a share
    /// handed over from a cut lane, the first slice that lane had not finished.
    pub cursor: LaneCursor,
    /// Number of slices the job carries from `cursor` on.
    pub slices: u64,
}

/// What a lane carries: a share of a batch, or a notification (see `crate::notify`).
#[derive(Clone)]
enum Job {
    Data(LaneJob),
    Note(Arc<NoteJob>),
}

#[derive(Default)]
struct Queues {
    queued: VecDeque<Job>,
    in_flight: VecDeque<Job>,
    dead: Option<Error>,
    /// The lane was cut to stop this batch (its deadline passed while it was on the wire): its
    /// requests fail with this error; the other batches' work goes on a sibling lane.
    cut_for: Option<(Arc<BatchState>, Error)>,
    /// Where the receiving task stopped inside the front job when it ended (the next slice it
    /// had not settled, and how many were left): a hand-over resumes there, so no slice is
    /// settled twice.
    resume_front: Option<(LaneCursor, u64)>,
}

/// Opens one more lane to the instance a connection reaches (greeted, running).
pub(crate) type LaneOpener = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Arc<Lane>>> + Send>> + Send + Sync>;

/// Where a lane cut for a batch's deadline hands the other batches' work.
struct Relief {
    siblings: Vec<Weak<Lane>>,
    open: LaneOpener,
}

/// One connection to a peer.
pub(crate) struct Lane {
    peer: String,
    token: u64,
    queues: Mutex<Queues>,
    wake: Notify,
    progress: AtomicU64,
    alive: AtomicBool,
    closing: AtomicBool,
    /// A second handle on the socket, so `kill` can shut it down under the I/O tasks.
    socket: Option<socket2::Socket>,
    /// Who takes over other batches' work when this lane is cut for a batch's deadline.
    relief: OnceLock<Relief>,
    /// Sending and receiving tasks still running; the last one out fails what is left.
    running: AtomicUsize,
    watchdog: Mutex<Option<AbortHandle>>,
    /// How often an idle lane pings the target so its idle timeout does not cut the connection
    /// (a third of the idle timeout the target announced); `None`: never.
    ping_every: Option<Duration>,
}

/// Runs when an I/O task ends (returns, fails or is dropped by a runtime shutdown): the last one
/// out fails every request still outstanding. Only then, because until both tasks have stopped
/// one of them may still be reading or writing the requests' memory.
struct TaskExit(Arc<Lane>);

impl Drop for TaskExit {
    fn drop(&mut self) {
        let lane = &self.0;
        if lane.running.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let (jobs, err, cut_for) = {
            let mut q = lane.queues.lock();
            let err = q.dead.get_or_insert_with(|| lane.gone("connection closed")).clone();
            lane.alive.store(false, Ordering::Release);
            let q = &mut *q;
            let resume = q.resume_front.take();
            let mut jobs: Vec<Job> = q.in_flight.drain(..).chain(q.queued.drain(..)).collect();
            if let (Some((cursor, left)), Some(Job::Data(front))) = (resume, jobs.first_mut()) {
                front.cursor = cursor;
                front.slices = left;
            }
            (jobs, err, q.cut_for.take())
        };
        match cut_for {
            Some((batch, own)) => {
                // Cut for one batch's deadline: that batch fails; the others' unsettled slices
                // (sent again from the first unsettled one) go on another connection.
                let (mine, others): (Vec<Job>, Vec<Job>) = jobs
                    .into_iter()
                    .partition(|j| matches!(j, Job::Data(d) if Arc::ptr_eq(&d.plan.batch, &batch)));
                for job in &mine {
                    lane.fail(job, &own);
                }
                lane.hand_over(others, err);
            }
            None => {
                for job in &jobs {
                    lane.fail(job, &err);
                }
            }
        }
        if let Some(w) = lane.watchdog.lock().take() {
            w.abort();
        }
    }
}

impl Lane {
    /// Starts the lane's tasks on the current runtime over an established, greeted connection.
    pub fn start(peer: String, token: u64, stream: TcpStream, timeout: Duration, target_idle: Duration) -> Arc<Lane> {
        let lane = Arc::new(Lane {
            peer,
            token,
            queues: Mutex::new(Queues::default()),
            wake: Notify::new(),
            progress: AtomicU64::new(0),
            alive: AtomicBool::new(true),
            closing: AtomicBool::new(false),
            socket: socket2::SockRef::from(&stream).try_clone().ok(),
            relief: OnceLock::new(),
            running: AtomicUsize::new(2),
            watchdog: Mutex::new(None),
            ping_every: (!target_idle.is_zero()).then(|| (target_idle / 3).max(Duration::from_millis(1))),
        });
        let (r, w) = stream.into_split();
        let sending = TaskExit(lane.clone());
        tokio::spawn(async move {
            send_loop(&sending.0, w).await;
            drop(sending);
        });
        let receiving = TaskExit(lane.clone());
        tokio::spawn(async move {
            receive_loop(&receiving.0, r).await;
            drop(receiving);
        });
        let dog = tokio::spawn(watchdog(Arc::downgrade(&lane), timeout));
        *lane.watchdog.lock() = Some(dog.abort_handle());
        lane
    }

    /// Tells each lane of one connection about the others, and how to open one more.
    pub fn join(lanes: &[Arc<Lane>], open: LaneOpener) {
        for lane in lanes {
            let siblings = lanes
                .iter()
                .filter(|l| !Arc::ptr_eq(l, lane))
                .map(Arc::downgrade)
                .collect();
            let _ = lane.relief.set(Relief {
                siblings,
                open: open.clone(),
            });
        }
    }

    /// Queues `jobs` (in order) unless the lane is dead; gives them back if it is.
    fn adopt(&self, jobs: Vec<Job>) -> std::result::Result<(), Vec<Job>> {
        let mut q = self.queues.lock();
        if q.dead.is_some() {
            return Err(jobs);
        }
        q.queued.extend(jobs);
        drop(q);
        self.wake.notify_one();
        Ok(())
    }

    /// Another batch's work this lane carried when it was cut for a deadline: to the first
    /// sibling alive, else to a fresh connection that closes once it carried it; failed (`err`,
    /// naming the cut) only when neither can take it.
    fn hand_over(self: &Arc<Self>, jobs: Vec<Job>, err: Error) {
        if jobs.is_empty() {
            return;
        }
        let Some(relief) = self.relief.get() else {
            return jobs.iter().for_each(|j| self.fail(j, &err));
        };
        let mut jobs = jobs;
        for sibling in relief.siblings.iter().filter_map(Weak::upgrade) {
            match sibling.adopt(jobs) {
                Ok(()) => return,
                Err(back) => jobs = back,
            }
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return jobs.iter().for_each(|j| self.fail(j, &err));
        };
        let (lane, open) = (self.clone(), relief.open.clone());
        runtime.spawn(async move {
            let fresh = match open().await {
                Ok(fresh) => fresh,
                Err(e) => {
                    let err = lane.gone(format!("{err}; a fresh connection to carry the rest failed: {e}"));
                    return jobs.iter().for_each(|j| lane.fail(j, &err));
                }
            };
            if let Err(back) = fresh.adopt(jobs) {
                back.iter().for_each(|j| lane.fail(j, &err));
            }
            fresh.close_when_idle();
        });
    }

    /// True until the lane died.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Asks the lane to close its connection once it has no work left (its peer was dropped).
    pub fn close_when_idle(&self) {
        self.closing.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Queues a job. If the lane is dead the job's requests fail at once.
    pub fn push(&self, job: LaneJob) {
        self.enqueue(Job::Data(job));
    }

    /// Queues a notification behind every job queued before it. If the lane is dead it fails
    /// at once.
    pub fn push_note(&self, note: Arc<NoteJob>) {
        self.enqueue(Job::Note(note));
    }

    fn enqueue(&self, job: Job) {
        let mut q = self.queues.lock();
        if let Some(err) = q.dead.clone() {
            drop(q);
            self.fail(&job, &err);
            return;
        }
        q.queued.push_back(job);
        drop(q);
        self.wake.notify_one();
    }

    /// A deadline passed for `batch`: its jobs that have not started fail now with `err` (no byte
    /// of them was sent, so none will land); if one of its jobs is on the wire, the lane is cut
    /// and, once both I/O tasks stopped, that batch's requests fail with `err` while the other
    /// batches' unsettled slices go on a sibling lane (they fail, naming the cut, only when no
    /// sibling is alive). True if anything of the batch was here.
    pub fn abort_batch(&self, batch: &Arc<BatchState>, err: &Error) -> bool {
        let (removed, on_wire) = {
            let mut q = self.queues.lock();
            if q.dead.is_some() {
                return false;
            }
            let mut removed = Vec::new();
            q.queued.retain(|j| match j {
                Job::Data(d) if Arc::ptr_eq(&d.plan.batch, batch) => {
                    removed.push(j.clone());
                    false
                }
                _ => true,
            });
            let on_wire = q
                .in_flight
                .iter()
                .any(|j| matches!(j, Job::Data(d) if Arc::ptr_eq(&d.plan.batch, batch)));
            if on_wire {
                q.cut_for = Some((batch.clone(), err.clone()));
            }
            (removed, on_wire)
        };
        for job in &removed {
            self.fail(job, err);
        }
        if on_wire {
            self.kill(self.gone(format!(
                "the connection was cut to stop another batch whose deadline passed while it was on the wire ({err})"
            )));
        }
        on_wire || !removed.is_empty()
    }

    fn fail(&self, job: &Job, err: &Error) {
        match job {
            Job::Data(job) => self.fail_job(job, err),
            Job::Note(note) => note.fail(err),
        }
    }

    /// Kills the lane: new jobs fail at once, the socket is shut down so both I/O tasks stop,
    /// and the last of them fails every outstanding request with `err`.
    pub fn kill(&self, err: Error) {
        {
            let mut q = self.queues.lock();
            if q.dead.is_some() {
                return;
            }
            q.dead = Some(err);
            self.alive.store(false, Ordering::Release);
        }
        if let Some(s) = &self.socket {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.wake.notify_one();
    }

    fn fail_job(&self, job: &LaneJob, err: &Error) {
        let plan = &job.plan;
        let mut cursor = job.cursor.clone();
        let indices = std::iter::from_fn(|| cursor.next(&plan.requests, plan.slice, plan.lanes))
            .take(job.slices as usize)
            .map(|s| plan.requests[s.pos].index as usize);
        plan.batch.fail_many(indices, err);
    }

    /// The error a failed socket call ends the lane with: `EFAULT` means the kernel found our
    /// own memory unmapped (a region freed while still registered, e.g. under `register_raw`),
    /// which is this process's fault, not the peer's; anything else means the peer is gone.
    fn io_failed(&self, what: &str, e: io::Error) -> Error {
        if e.raw_os_error() == Some(libc::EFAULT) {
            return Error::io(
                format!(
                    "{what} to/from '{}': local memory of a registered region is not mapped (freed while still registered?)",
                    self.peer
                ),
                e,
            );
        }
        self.gone(format!("{what} failed: {e}"))
    }

    fn gone(&self, reason: impl Into<String>) -> Error {
        Error::PeerGone {
            peer: self.peer.clone(),
            reason: reason.into(),
        }
    }

    fn has_outstanding(&self) -> bool {
        let q = self.queues.lock();
        !q.queued.is_empty() || !q.in_flight.is_empty()
    }
}

/// What the sending task does next.
enum Next {
    /// Send a job's slices.
    Job(LaneJob),
    /// Send a notification.
    Note(Arc<NoteJob>),
    /// Nothing happened for a ping interval: keep the connection open.
    Ping,
}

/// Waits for the next queued job and moves it to the in-flight queue; `None` when the lane is
/// dead or closing.
async fn next_job(lane: &Lane) -> Option<Next> {
    loop {
        {
            let mut q = lane.queues.lock();
            if q.dead.is_some() {
                return None;
            }
            while let Some(job) = q.queued.pop_front() {
                let job = match job {
                    Job::Note(note) => {
                        q.in_flight.push_back(Job::Note(note.clone()));
                        return Some(Next::Note(note));
                    }
                    Job::Data(job) => job,
                };
                if job.plan.batch.cancel_requested() {
                    let plan = &job.plan;
                    let mut cursor = job.cursor.clone();
                    for _ in 0..job.slices {
                        let Some(s) = cursor.next(&plan.requests, plan.slice, plan.lanes) else {
                            break;
                        };
                        plan.batch.cancel(plan.requests[s.pos].index as usize);
                    }
                    continue;
                }
                q.in_flight.push_back(Job::Data(job.clone()));
                return Some(Next::Job(job));
            }
            if lane.closing.load(Ordering::Acquire) {
                return None;
            }
        }
        match lane.ping_every {
            Some(every) => {
                if tokio::time::timeout(every, lane.wake.notified()).await.is_err() {
                    return Some(Next::Ping);
                }
            }
            None => lane.wake.notified().await,
        }
    }
}

/// The sending task: writes each job the lane takes, in order, until the lane dies or closes.
async fn send_loop(lane: &Lane, mut w: OwnedWriteHalf) {
    let mut group = SendGroup {
        headers: Vec::with_capacity(SEND_GROUP),
        parts: Vec::with_capacity(2 * SEND_GROUP),
    };
    let mut request_id = 0u64;
    while let Some(next) = next_job(lane).await {
        let sent = match next {
            Next::Job(job) => send_job(lane, &mut w, &job, &mut group, &mut request_id).await,
            Next::Ping => send_ping(lane, &mut w).await,
            Next::Note(note) => send_note(lane, &mut w, &note, &mut request_id).await,
        };
        if let Err(err) = sent {
            lane.kill(err);
            return;
        }
    }
}

/// Keeps an idle connection open: one PING frame (not progress: nothing was outstanding).
async fn send_ping(lane: &Lane, w: &mut OwnedWriteHalf) -> Result<()> {
    let ping = Header::new(Opcode::Ping).to_bytes();
    crate::frame_io::write_all(w, &ping)
        .await
        .map_err(|e| lane.gone(format!("send failed: {e}")))
}

/// Sends a notification as one frame, with the next request id.
async fn send_note(lane: &Lane, w: &mut OwnedWriteHalf, note: &NoteJob, request_id: &mut u64) -> Result<()> {
    let mut frame = note.header(*request_id, lane.token).to_bytes().to_vec();
    frame.extend_from_slice(&note.body);
    *request_id += 1;
    crate::frame_io::write_all(w, &frame)
        .await
        .map_err(|e| lane.gone(format!("send failed: {e}")))?;
    lane.progress.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Streams a job's slices, a group of frames per vectored write.
async fn send_job(
    lane: &Lane,
    w: &mut OwnedWriteHalf,
    job: &LaneJob,
    group: &mut SendGroup,
    request_id: &mut u64,
) -> Result<()> {
    let plan = &job.plan;
    let mut cursor = job.cursor.clone();
    let mut left = job.slices;
    loop {
        let more = group.fill(plan, lane.token, &mut cursor, &mut left, request_id);
        if !group.parts.is_empty() {
            // SAFETY: headers live in `group.headers` (not modified until the write completes);
            // write payloads lie in local memory the engine keeps registered and pinned until the
            // batch completes, which cannot happen before these bytes are acknowledged.
            if let Err(e) = unsafe { write_all_raw(w, &group.parts).await } {
                return Err(lane.io_failed("send", e));
            }
            lane.progress.fetch_add(1, Ordering::Relaxed);
        }
        if !more {
            return Ok(());
        }
    }
}

/// The frames of one vectored write: up to [`SEND_GROUP`] slices' headers and their write
/// payloads (at most [`SEND_GROUP_BYTES`]). The vectors are the sending task's, reused.
struct SendGroup {
    headers: Vec<[u8; HEADER_LEN]>,
    parts: Vec<RawPart>,
}

impl SendGroup {
    /// Takes the next slices of a job (from `cursor`, `left` of them) into the group, numbering
    /// them from `*request_id`. False once the job has no slice left.
    fn fill(&mut self, plan: &Plan, token: u64, cursor: &mut LaneCursor, left: &mut u64, request_id: &mut u64) -> bool {
        self.headers.clear();
        self.parts.clear();
        let mut more = true;
        let mut payload_bytes = 0u64;
        // Headers first, so their addresses are stable before parts point at them.
        let mut payloads: [RawPart; SEND_GROUP] = [RawPart { addr: 0, len: 0 }; SEND_GROUP];
        while self.headers.len() < SEND_GROUP && payload_bytes < SEND_GROUP_BYTES {
            let next = if *left == 0 {
                None
            } else {
                cursor.next(&plan.requests, plan.slice, plan.lanes)
            };
            let Some(s) = next else {
                more = false;
                break;
            };
            *left -= 1;
            let req = &plan.requests[s.pos];
            let opcode = match req.op {
                TransferOp::Write => Opcode::Write,
                TransferOp::Read => Opcode::Read,
            };
            let h = Header {
                request_id: *request_id,
                token,
                addr: req.remote_addr + s.offset,
                len: s.len,
                ..Header::new(opcode)
            };
            *request_id += 1;
            if req.op == TransferOp::Write {
                payloads[self.headers.len()] = RawPart {
                    addr: (req.local_addr + s.offset) as usize,
                    len: s.len as usize,
                };
                payload_bytes += s.len;
            }
            self.headers.push(h.to_bytes());
        }
        for (h, p) in self.headers.iter().zip(payloads.iter()) {
            self.parts.push(RawPart::of(h));
            if p.len > 0 {
                self.parts.push(*p);
            }
        }
        more
    }
}

async fn receive_loop(lane: &Lane, r: OwnedReadHalf) {
    let mut reader = FrameReader::new(r);
    let mut current: Option<Current> = None;
    let err = match receive_frames(lane, &mut reader, &mut current).await {
        Ok(()) => lane.gone("connection closed by the peer"),
        Err(e) => lane.io_failed("receive", e),
    };
    lane.kill(err);
    if let Some(cur) = current {
        lane.queues.lock().resume_front = Some((cur.cursor, cur.left));
    }
}

struct Current {
    job: LaneJob,
    cursor: LaneCursor,
    left: u64,
}

/// Matches replies to the in-flight jobs' slices, in order; `current` is the front job being
/// answered (left for the caller to see where it stopped).
async fn receive_frames(
    lane: &Lane,
    reader: &mut FrameReader<OwnedReadHalf>,
    current: &mut Option<Current>,
) -> io::Result<()> {
    let mut expected_id = 0u64;
    let mut message = [0u8; crate::wire::MAX_ERROR_LEN as usize];
    loop {
        let h = match reader.header().await? {
            None => return Ok(()),
            Some(Ok(h)) => h,
            Some(Err(e)) => return Err(protocol(format!("bad frame from the peer: {e}"))),
        };
        if current.is_none() {
            match in_flight_front(lane, &h)? {
                Job::Data(job) => {
                    *current = Some(Current {
                        cursor: job.cursor.clone(),
                        left: job.slices,
                        job,
                    })
                }
                Job::Note(note) => {
                    expect_id(&h, &mut expected_id)?;
                    answer_note(lane, reader, &note, &h, &mut message).await?;
                    continue;
                }
            }
        }
        let Some(cur) = current.as_mut() else {
            return Err(protocol("no job to match the reply against".into()));
        };
        expect_id(&h, &mut expected_id)?;
        // Advanced only once the slice is settled, so a hand-over resumes at an unsettled one.
        let after = settle_slice(lane, reader, cur, &h, &mut message).await?;
        lane.progress.fetch_add(1, Ordering::Relaxed);
        cur.cursor = after;
        cur.left -= 1;
        if cur.left == 0 {
            lane.queues.lock().in_flight.pop_front();
            *current = None;
        }
    }
}

/// A protocol error of the peer's: ends the lane.
fn protocol(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The job a reply with header `h` answers when none is being answered: the front in-flight one.
fn in_flight_front(lane: &Lane, h: &Header) -> io::Result<Job> {
    let front = lane.queues.lock().in_flight.front().cloned();
    front.ok_or_else(|| protocol(format!("unsolicited {:?} frame", h.opcode)))
}

/// Replies come in request order: `h` must answer request `*expected_id`, which then advances.
fn expect_id(h: &Header, expected_id: &mut u64) -> io::Result<()> {
    if h.request_id != *expected_id {
        return Err(protocol(format!(
            "reply for request {} while {} was expected",
            h.request_id, expected_id
        )));
    }
    *expected_id += 1;
    Ok(())
}

/// Hands a notification its answer (the reply's text in `message`) and retires it.
async fn answer_note(
    lane: &Lane,
    reader: &mut FrameReader<OwnedReadHalf>,
    note: &NoteJob,
    h: &Header,
    message: &mut [u8],
) -> io::Result<()> {
    let n = h.payload_len() as usize;
    if n > message.len() {
        return Err(protocol(format!(
            "{:?} frame of {n} bytes answers a notification",
            h.opcode
        )));
    }
    reader.payload_into(&mut message[..n]).await?;
    let text = String::from_utf8_lossy(&message[..n]);
    note.answer(&lane.peer, h, &text).map_err(protocol)?;
    lane.progress.fetch_add(1, Ordering::Relaxed);
    lane.queues.lock().in_flight.pop_front();
    Ok(())
}

/// Settles the current job's next slice with the reply `h`: an acknowledged write, a read's
/// payload received straight into local memory, or the target's refusal of that request.
/// Returns the cursor past the slice.
async fn settle_slice(
    lane: &Lane,
    reader: &mut FrameReader<OwnedReadHalf>,
    cur: &Current,
    h: &Header,
    message: &mut [u8],
) -> io::Result<LaneCursor> {
    let plan = &cur.job.plan;
    let mut after = cur.cursor.clone();
    let Some(slice) = after.next(&plan.requests, plan.slice, plan.lanes) else {
        return Err(protocol("reply beyond the lane's slices".into()));
    };
    let req = &plan.requests[slice.pos];
    match (h.opcode, req.op) {
        (Opcode::WriteAck, TransferOp::Write) if h.len == slice.len => plan.slice_done(slice.pos),
        (Opcode::ReadData, TransferOp::Read) if h.len == slice.len => {
            // SAFETY: the local range lies in memory the engine registered and keeps pinned
            // until this request completes, which happens only below.
            let dst = unsafe {
                std::slice::from_raw_parts_mut((req.local_addr + slice.offset) as usize as *mut u8, slice.len as usize)
            };
            reader.payload_into(dst).await?;
            plan.slice_done(slice.pos);
        }
        (Opcode::Error, _) => {
            let n = h.len as usize;
            reader.payload_into(&mut message[..n]).await?;
            let text = String::from_utf8_lossy(&message[..n]).into_owned();
            refused(lane, plan, req.index as usize, h.code, text)?;
        }
        (op, _) => {
            return Err(protocol(format!(
                "{op:?} frame of {} bytes answers a {} slice of {} bytes",
                h.len, req.op, slice.len
            )))
        }
    }
    Ok(after)
}

/// The target refused request `index` with `code`: a refusal of that request fails it alone;
/// any other code ends the lane.
fn refused(lane: &Lane, plan: &Plan, index: usize, code: u16, text: String) -> io::Result<()> {
    match RefusalCode::from_u16(code) {
        RefusalCode::OutOfBounds | RefusalCode::ZeroLength => {
            plan.batch.fail(
                index,
                Error::Refused {
                    peer: lane.peer.clone(),
                    reason: text,
                },
            );
            Ok(())
        }
        RefusalCode::WrongInstance => Err(protocol(format!("the peer restarted: {text}"))),
        RefusalCode::Unauthenticated => Err(protocol(format!("the peer refused this connection: {text}"))),
        RefusalCode::Protocol | RefusalCode::QueueFull | RefusalCode::TooLarge => {
            Err(protocol(format!("the peer reports a protocol error: {text}")))
        }
    }
}

/// Kills the lane when work is outstanding and nothing moved for `timeout`.
async fn watchdog(lane: std::sync::Weak<Lane>, timeout: Duration) {
    let tick = (timeout / 4).max(Duration::from_millis(1));
    let mut last = u64::MAX;
    let mut stalled = Duration::ZERO;
    loop {
        tokio::time::sleep(tick).await;
        let Some(lane) = lane.upgrade() else { return };
        let now = lane.progress.load(Ordering::Relaxed);
        if now != last || !lane.has_outstanding() {
            last = now;
            stalled = Duration::ZERO;
            continue;
        }
        stalled += tick;
        if stalled >= timeout {
            let ms = timeout.as_millis() as u64;
            lane.kill(lane.gone(format!("no progress for {ms} ms with requests outstanding")));
            return;
        }
    }
}
