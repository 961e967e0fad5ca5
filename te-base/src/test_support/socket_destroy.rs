//! Killing live TCP connections from outside the process that owns them, as a failed link or a
//! reset peer would: the kernel's socket destroy (`ss -K`, iproute2; needs root and
//! `CONFIG_INET_DIAG_DESTROY`). The failover tests and `te-bench failover` kill a libfabric
//! socket provider's connections with it.

use std::io::ErrorKind::{ConnectionAborted, ConnectionReset};
use std::io::Read;
use std::time::Duration;

/// Destroys every TCP socket to or from `port` on this host, both ends of each connection.
pub fn destroy_port(port: u16) -> Result<(), String> {
    let filter = format!("( dport = :{port} or sport = :{port} )");
    let out = std::process::Command::new("ss")
        .args(["-K", "-t", &filter])
        .output()
        .map_err(|e| format!("running ss (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ss -K: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// `Ok` if this host destroys sockets on request: a loopback connection is destroyed and its
/// client's next read fails (aborted here, or reset by the other end, destroyed first).
pub fn available() -> Result<(), String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let port = l.local_addr().map_err(|e| e.to_string())?.port();
    let c = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    let (_server, _) = l.accept().map_err(|e| e.to_string())?;
    destroy_port(port)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    match (&c).read(&mut [0u8; 1]) {
        Err(e) if matches!(e.kind(), ConnectionAborted | ConnectionReset) => Ok(()),
        other => Err(format!("a destroyed socket still reads: {other:?}")),
    }
}

/// The port of an IPv4 `sockaddr_in` written as hex (as the efa transport's descriptor carries a
/// socket provider's rail address): the family (2, host order), then the port in network order.
pub fn sockaddr_in_port(hex: &str) -> Option<u16> {
    let byte = |i: usize| hex.get(2 * i..2 * i + 2).and_then(|h| u8::from_str_radix(h, 16).ok());
    match (byte(0), byte(1), byte(2), byte(3)) {
        (Some(2), Some(0), Some(hi), Some(lo)) => Some(u16::from_be_bytes([hi, lo])),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::sockaddr_in_port;

    #[test]
    fn the_port_of_a_hex_sockaddr_in_and_nothing_else() {
        assert_eq!(sockaddr_in_port("0200a3127f000001"), Some(0xa312));
        assert_eq!(sockaddr_in_port("0a00a312"), None, "AF_INET6");
        assert_eq!(sockaddr_in_port("02"), None, "too short");
        assert_eq!(sockaddr_in_port("02zz0000"), None, "not hex");
    }
}
