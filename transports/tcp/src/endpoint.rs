//! What a segment descriptor says about reaching its TCP transport, and which local addresses to
//! advertise.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};
use te_base::{Error, Result, SegmentDescriptor};

/// Most addresses one endpoint may list (bounds a hostile descriptor).
const MAX_ADDRS: usize = 64;

/// The `tcp` entry of a segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpEndpoint {
    /// Addresses to try, in order.
    pub addrs: Vec<SocketAddr>,
    /// Random per transport start; connections and requests name it, so a restarted target
    /// refuses what was meant for its previous instance.
    pub token: u64,
}

impl TcpEndpoint {
    /// Reads and checks the `tcp` endpoint of `peer`.
    pub fn of(peer: &SegmentDescriptor) -> Result<TcpEndpoint> {
        let bad = |why: String| Error::InvalidDescriptor(format!("segment '{}': tcp endpoint {why}", peer.name));
        let info = peer.endpoint("tcp").ok_or_else(|| Error::NoTransport {
            segment: peer.name.clone(),
            reason: "the segment does not advertise tcp".into(),
        })?;
        let ep: TcpEndpoint = serde_json::from_value(info.clone()).map_err(|e| bad(format!("is malformed: {e}")))?;
        if ep.addrs.is_empty() || ep.addrs.len() > MAX_ADDRS {
            return Err(bad(format!(
                "lists {} addresses (must be 1..={MAX_ADDRS})",
                ep.addrs.len()
            )));
        }
        if ep.addrs.iter().any(|a| a.port() == 0 || a.ip().is_unspecified()) {
            return Err(bad("lists an unspecified address or port 0".into()));
        }
        Ok(ep)
    }
}

/// The addresses to advertise for a listener bound to `bound`: the configured ones, the bound
/// address itself, or (for a wildcard bind) every interface address, loopback last.
pub(crate) fn advertised(bound: SocketAddr, configured: Option<&[IpAddr]>) -> Result<Vec<SocketAddr>> {
    let port = bound.port();
    if let Some(ips) = configured {
        return Ok(ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect());
    }
    if !bound.ip().is_unspecified() {
        return Ok(vec![bound]);
    }
    let want_v6 = bound.is_ipv6();
    let ifaces = if_addrs::get_if_addrs().map_err(|e| Error::io("tcp: listing interface addresses", e))?;
    let mut ips: Vec<IpAddr> = ifaces
        .iter()
        .map(|i| i.ip())
        .filter(|ip| ip.is_ipv4() || want_v6)
        .filter(|ip| !matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80))
        .collect();
    ips.sort_by_key(|ip| ip.is_loopback());
    ips.dedup();
    if ips.is_empty() {
        return Err(Error::not_available("tcp", "no network interface has an address"));
    }
    Ok(ips.into_iter().map(|ip| SocketAddr::new(ip, port)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::TransportEndpoint;

    fn desc(info: serde_json::Value) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new("peer", 1);
        d.transports.push(TransportEndpoint {
            transport: "tcp".into(),
            info,
        });
        d
    }

    #[test]
    fn parses_and_rejects() {
        let ok = desc(serde_json::json!({"addrs": ["127.0.0.1:5"], "token": 9}));
        assert_eq!(TcpEndpoint::of(&ok).unwrap().token, 9);
        for bad in [
            serde_json::json!({"addrs": [], "token": 9}),
            serde_json::json!({"addrs": ["0.0.0.0:5"], "token": 9}),
            serde_json::json!({"addrs": ["127.0.0.1:0"], "token": 9}),
            serde_json::json!({"addrs": ["nonsense"], "token": 9}),
            serde_json::json!({"token": 9}),
            serde_json::json!("x"),
        ] {
            assert!(matches!(TcpEndpoint::of(&desc(bad)), Err(Error::InvalidDescriptor(_))));
        }
        let none = SegmentDescriptor::new("peer", 1);
        assert!(matches!(TcpEndpoint::of(&none), Err(Error::NoTransport { .. })));
    }

    #[test]
    fn wildcard_lists_loopback_last() {
        let addrs = advertised("0.0.0.0:7".parse().unwrap(), None).unwrap();
        assert!(!addrs.is_empty());
        assert!(addrs.iter().all(|a| a.port() == 7 && a.is_ipv4()));
        let first_loopback = addrs.iter().position(|a| a.ip().is_loopback()).unwrap_or(addrs.len());
        assert!(addrs[first_loopback..].iter().all(|a| a.ip().is_loopback()));
    }
}
