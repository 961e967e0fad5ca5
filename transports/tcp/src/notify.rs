//! Notifications over TCP: a NOTIFY frame on the peer's first lane, sent only after the batch it
//! follows was acknowledged (every WRITE_ACK comes after the bytes are in the target's memory),
//! answered by NOTIFY_ACK or an ERROR naming the refusal.
//!
//! Target side: [`deliver`] decodes the body and queues it in the engine's bounded inbox.
//! Initiator side: a [`NoteJob`] rides the lane's job queue, so notifications to one peer leave
//! in the order they were handed over, and [`answer`] settles it from the reply.

use std::sync::Arc;

use te_base::notify::{decode_body, Refusal};
use te_base::{BatchState, Error, NotifyInbox};

use crate::wire::{Header, Opcode, RefusalCode};

/// Why a NOTIFY was not queued, as the target answers it.
pub(crate) struct Refused {
    pub code: RefusalCode,
    /// For `TooLarge`: the largest payload the target accepts.
    pub max: u64,
    pub message: String,
}

/// The connection's body buffer, grown to `len` (at most the wire bound the header decoder
/// enforces) and cut to it.
pub(crate) fn body_buffer(buf: &mut Vec<u8>, len: u64) -> &mut [u8] {
    let len = len as usize;
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

/// Decodes a NOTIFY body and queues it in `inbox`.
pub(crate) fn deliver(inbox: &NotifyInbox, body: &[u8]) -> Result<(), Refused> {
    let note = decode_body(body).map_err(|e| Refused {
        code: RefusalCode::Protocol,
        max: 0,
        message: format!("notification body: {e}"),
    })?;
    let max = inbox.limits().max_bytes as u64;
    inbox.deliver(note).map_err(|r| match r {
        Refusal::QueueFull => Refused {
            code: RefusalCode::QueueFull,
            max: 0,
            message: "notification inbox full".into(),
        },
        Refusal::TooLarge => Refused {
            code: RefusalCode::TooLarge,
            max,
            message: format!("notification payload above {max} bytes"),
        },
    })
}

/// One notification queued on a lane, and where its outcome goes.
pub(crate) struct NoteJob {
    /// The encoded body (sender name and message).
    pub body: Vec<u8>,
    /// Payload length, for the error a `TooLarge` refusal turns into.
    pub payload_len: usize,
    pub done: Arc<BatchState>,
    pub index: usize,
}

impl NoteJob {
    /// The NOTIFY header of this job.
    pub fn header(&self, request_id: u64, token: u64) -> Header {
        Header {
            request_id,
            token,
            len: self.body.len() as u64,
            ..Header::new(Opcode::Notify)
        }
    }

    /// Settles the job from the target's reply `h` (`text`: an ERROR's message). `Err`: the reply
    /// breaks the protocol, and the lane must die.
    pub fn answer(&self, peer: &str, h: &Header, text: &str) -> Result<(), String> {
        match (h.opcode, RefusalCode::from_u16(h.code)) {
            (Opcode::NotifyAck, _) => self.done.complete(self.index),
            (Opcode::Error, RefusalCode::QueueFull) => self
                .done
                .fail(self.index, Error::NotificationQueueFull { peer: peer.to_string() }),
            (Opcode::Error, RefusalCode::TooLarge) => self.done.fail(
                self.index,
                Error::NotificationTooLarge {
                    peer: peer.to_string(),
                    len: self.payload_len,
                    max: h.addr.min(usize::MAX as u64) as usize,
                },
            ),
            (Opcode::Error, code) => return Err(format!("the peer refused a notification ({code:?}): {text}")),
            (op, _) => return Err(format!("{op:?} frame answers a notification")),
        }
        Ok(())
    }

    /// Fails the job (its lane died).
    pub fn fail(&self, err: &Error) {
        self.done.fail(self.index, err.clone());
    }
}
