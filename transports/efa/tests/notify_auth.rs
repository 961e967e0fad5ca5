//! Notifications over efa with an engine key, and against targets that cannot take them: a keyed
//! target accepts only messages that prove its key (a sender without it, or with another key,
//! gets no answer and times out; nothing reaches the inbox), a keyed pair delivers with the
//! sender's name intact, and a peer whose descriptor advertises no efa notifications is refused at
//! once.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use te_base::auth::AuthKey;
use te_base::{Batch, BatchState, Error, Notification, NotifyInbox, Peer, SegmentDescriptor, Transport};

fn key(b: u8) -> AuthKey {
    AuthKey::from_bytes(&[b; 32]).unwrap()
}

/// Sends one notification and returns the target's answer (or the error the sender settled with).
fn notify(peer: &Arc<dyn Peer>, from: &str, payload: &[u8]) -> Result<(), Error> {
    let state = BatchState::new(vec![0].into());
    peer.notify(
        Notification {
            from: from.into(),
            payload: payload.to_vec(),
        },
        &state,
        0,
    )?;
    match Batch::new(state).wait_blocking(Some(Duration::from_secs(30))) {
        None => panic!("notification not settled within 30 s"),
        Some(Ok(_)) => Ok(()),
        Some(Err(e)) => Err(e.into_first_error()),
    }
}

fn connect_to(initiator: &Arc<dyn Transport>, target: &SegmentDescriptor) -> Arc<dyn Peer> {
    block_on(initiator.connect(target)).unwrap()
}

#[test]
fn a_keyed_target_takes_only_messages_that_prove_its_key() {
    for p in providers() {
        if !provider_present(p) {
            continue;
        }
        let fast = [("TE_FABRIC_TIMEOUT_MS", "1000")];
        let inbox = NotifyInbox::new(Default::default());
        let target = install_into(p, &[], inbox.clone(), Some(key(1)));
        let keyed = install_into(p, &fast, NotifyInbox::new(Default::default()), Some(key(1)));
        let keyless = install_into(p, &fast, NotifyInbox::new(Default::default()), None);
        let other_key = install_into(p, &fast, NotifyInbox::new(Default::default()), Some(key(2)));
        let side = Side::new(&target, 1, 4096, true, 1);
        let d = descriptor("keyed-target", &target, &[&side]);

        notify(&connect_to(&keyed, &d), "engine-a", b"hello").unwrap_or_else(|e| panic!("{p}: {e}"));
        assert_eq!(
            inbox.try_recv(),
            Some(Notification {
                from: "engine-a".into(),
                payload: b"hello".to_vec()
            }),
            "{p}"
        );
        for (who, t) in [("keyless", &keyless), ("other key", &other_key)] {
            match notify(&connect_to(t, &d), "forged", b"x") {
                Err(Error::Timeout { .. }) => {}
                other => panic!("{p}: {who} sender got {other:?}, expected a timeout"),
            }
            assert_eq!(inbox.try_recv(), None, "{p}: {who} sender's message was delivered");
        }
        // The keyed sender is still served after the refused ones.
        notify(&connect_to(&keyed, &d), "engine-a", b"again").unwrap_or_else(|e| panic!("{p}: {e}"));
        assert_eq!(inbox.try_recv().map(|n| n.payload), Some(b"again".to_vec()), "{p}");
    }
}

#[test]
fn peers_without_efa_notifications_and_oversized_payloads_are_refused_at_once() {
    let p = providers()[0];
    if !provider_present(p) {
        return;
    }
    let inbox = NotifyInbox::new(te_base::NotifyLimits {
        queue_depth: 4,
        max_bytes: 100,
    });
    let target = install_into(p, &[], inbox, None);
    let initiator = install(p, &[]);
    let side = Side::new(&target, 1, 4096, true, 1);
    let mut d = descriptor("old-target", &target, &[&side]);
    let peer = block_on(initiator.connect(&d)).unwrap();
    match notify(&peer, "a", &[0; 101]) {
        Err(Error::NotificationTooLarge { len: 101, max: 100, .. }) => {}
        other => panic!("{other:?}"),
    }
    notify(&peer, "a", &[0; 100]).unwrap();
    // A descriptor without the notify field (an older build) gets NotAvailable, not a hang.
    d.transports[0].info.as_object_mut().unwrap().remove("notify");
    let old = block_on(initiator.connect(&d)).unwrap();
    match notify(&old, "a", b"x") {
        Err(Error::NotAvailable { .. }) => {}
        other => panic!("{other:?}"),
    }
}
