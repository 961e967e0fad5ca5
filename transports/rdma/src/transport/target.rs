//! The target side of the handshake: accepts connection requests, creates and connects the
//! target's QPs, and answers with their numbers, PSNs and the negotiated MTU.

use std::sync::Weak;

use te_base::Result;
use tokio::net::{TcpListener, TcpStream};

use super::handshake_io::{read_message, write_message, HANDSHAKE_TIMEOUT};
use super::Shared;
use crate::protocol::handshake::{mtu_offer, negotiate_mtu, ConnectRequest, ConnectResponse, QpOffer};
use crate::protocol::qp_state::{connect_transitions, LocalQpEnd, QpMachine, RemoteQpEnd};
use crate::verbs::{QpCaps, Verbs};

/// Most QPs the target side keeps for peers (every peer's slots together).
pub(crate) const MAX_ACCEPTED_QPS: usize = 1 << 16;

/// A QP this side created for a peer's slot.
pub(crate) struct AcceptedQp<V: Verbs> {
    qp: V::Qp,
    instance: u64,
}

impl<V: Verbs> AcceptedQp<V> {
    pub(crate) fn destroy(self, verbs: &V) {
        if let Err(e) = verbs.destroy_qp(self.qp) {
            tracing::warn!("rdma: destroying an accepted QP: {e}");
        }
    }
}

/// Accepts handshake connections until the transport goes away.
pub(crate) async fn serve<V: Verbs>(shared: Weak<Shared<V>>, listener: TcpListener) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or similar: do not spin on it.
                tracing::warn!("rdma handshake listener: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        if shared.strong_count() == 0 {
            return;
        }
        tokio::spawn(handle(shared.clone(), stream));
    }
}

async fn handle<V: Verbs>(shared: Weak<Shared<V>>, mut stream: TcpStream) {
    // A client that connects and says nothing must not hold a task forever.
    let request = match tokio::time::timeout(HANDSHAKE_TIMEOUT, read_message::<ConnectRequest>(&mut stream)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::debug!("rdma handshake: unreadable request: {e}");
            return;
        }
        Err(_) => return,
    };
    let Some(shared) = shared.upgrade() else { return };
    let response = match accept(&shared, &request) {
        Ok(qps) => ConnectResponse::Accepted { qps },
        Err(e) => ConnectResponse::Refused { reason: e.to_string() },
    };
    drop(shared);
    if let Err(e) = write_message(&mut stream, &response).await {
        tracing::debug!("rdma handshake: answering {}: {e}", request.from_segment);
    }
}

/// Creates, connects and records a QP for every requested slot (replacing the QP a slot had, which
/// is how one failed QP is re-established). All or nothing.
fn accept<V: Verbs>(shared: &Shared<V>, req: &ConnectRequest) -> Result<Vec<QpOffer>> {
    let rails = &shared.rails().rails;
    req.validate(rails.len())?;
    if req.to_instance != shared.instance {
        return Err(te_base::Error::Refused {
            peer: shared.segment_name.clone(),
            reason: format!(
                "request for instance {:#x}, this is {:#x} (stale descriptor)",
                req.to_instance, shared.instance
            ),
        });
    }
    {
        // Bound what anyone who can reach the listener may make us allocate.
        let accepted = shared.accepted.lock();
        let replaced = req
            .qps
            .iter()
            .filter(|q| accepted.contains_key(&(req.from_segment.clone(), q.slot)))
            .count();
        if accepted.len() + req.qps.len() - replaced > MAX_ACCEPTED_QPS {
            return Err(te_base::Error::Refused {
                peer: shared.segment_name.clone(),
                reason: format!("already serving {} QPs (limit {MAX_ACCEPTED_QPS})", accepted.len()),
            });
        }
    }
    let mut created: Vec<(u32, V::Qp)> = Vec::with_capacity(req.qps.len());
    let mut answers = Vec::with_capacity(req.qps.len());
    let result = (|| -> Result<()> {
        for offer in &req.qps {
            let rail = &rails[usize::from(offer.target_rail)];
            let remote_rail = &req.rails[usize::from(offer.initiator_rail)];
            let (qp, qpn) = shared.verbs.create_qp(
                rail.pd(),
                rail.cq(),
                QpCaps {
                    max_send_wr: 1,
                    max_send_sge: 1,
                },
            )?;
            created.push((offer.slot, qp));
            let mine = mtu_offer(rail.port_attrs.active_mtu, shared.config.connect.mtu_cap);
            let mtu = negotiate_mtu(offer.mtu, mine);
            let psn = shared.next_psn();
            let local = LocalQpEnd {
                port: rail.port,
                link_layer: rail.port_attrs.link_layer,
                gid_index: rail.gid_index,
                psn,
                device_max_rd_atomic: rail.attrs.max_qp_rd_atom,
            };
            let remote = RemoteQpEnd {
                qpn: offer.qpn,
                psn: offer.psn,
                lid: remote_rail.lid,
                gid: remote_rail.gid()?,
                link_layer: remote_rail.link_layer,
            };
            let mut machine = QpMachine::default();
            let qp = &created.last().expect("just pushed").1;
            for t in connect_transitions(&local, &remote, mtu, &shared.config.connect)? {
                shared.verbs.modify_qp(qp, &t)?;
                machine.apply(&t)?;
            }
            answers.push(QpOffer {
                qpn,
                psn,
                mtu,
                ..*offer
            });
        }
        Ok(())
    })();
    if let Err(e) = result {
        for (_, qp) in created {
            let _ = shared.verbs.destroy_qp(qp);
        }
        return Err(e);
    }
    let mut accepted = shared.accepted.lock();
    // QPs of an earlier instance of the same peer are dead weight now.
    let stale: Vec<(String, u32)> = accepted
        .iter()
        .filter(|((seg, _), a)| *seg == req.from_segment && a.instance != req.from_instance)
        .map(|(k, _)| k.clone())
        .collect();
    for k in stale {
        if let Some(a) = accepted.remove(&k) {
            a.destroy(&*shared.verbs);
        }
    }
    for (slot, qp) in created {
        let key = (req.from_segment.clone(), slot);
        if let Some(old) = accepted.insert(
            key,
            AcceptedQp {
                qp,
                instance: req.from_instance,
            },
        ) {
            old.destroy(&*shared.verbs);
        }
    }
    Ok(answers)
}
