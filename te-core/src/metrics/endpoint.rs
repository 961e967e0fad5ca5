//! The Prometheus endpoint (`TE_METRICS_LISTEN`): `GET /metrics` answers the text exposition
//! format. It faces whoever can reach it, so it is a listener like the others: connections capped
//! (total and per source), the request head bounded in size ([`MAX_REQUEST_HEAD`]) and time
//! (`TE_METRICS_HANDSHAKE_TIMEOUT_MS`), the whole scrape bounded by `TE_METRICS_TIMEOUT_MS`, accept
//! errors backed off. With a shared key configured a scrape must carry `Authorization: Bearer
//! <token>` where the token ([`scrape_token`]) is derived from the key, so it grants reading
//! metrics and nothing else; refusals say only the status. The answer holds counters and label
//! values (transport and segment names), never keys, tokens or addresses.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use te_base::auth::{warn_unauthenticated, AuthKey, Role, NONCE_LEN};
use te_base::listener::{accept_admitted, deadline, AcceptBackoff, ConnectionGate};
use te_base::{Error, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::http::{head_len, parse_request, response, HttpError, MAX_REQUEST_HEAD};
use super::MetricsConfig;

/// The context the scrape token is derived under: useless as a proof on any other listener.
const TOKEN_CONTEXT: &str = "metrics-scrape";
/// How often histogram samples are folded into buckets when nobody scrapes (bounds their memory).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The bearer token a scraper presents when the engine has a shared key: hex of an HMAC of the
/// key, so it can be put in a Prometheus config without handing out the key itself.
pub fn scrape_token(key: &AuthKey) -> String {
    let zero = [0u8; NONCE_LEN];
    key.prove(Role::Initiator, TOKEN_CONTEXT, &zero, &zero)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn token_ok(key: &AuthKey, presented: &str) -> bool {
    let Some(bytes) = decode_hex(presented) else {
        return false;
    };
    let zero = [0u8; NONCE_LEN];
    key.verify(Role::Initiator, TOKEN_CONTEXT, &zero, &zero, &bytes)
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 128 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

/// What renders one scrape: refreshes gauges and collectors, then encodes every metric.
pub(crate) type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A running endpoint; dropping it stops the listener and the upkeep task.
pub(crate) struct Endpoint {
    pub local_addr: SocketAddr,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Endpoint {
    /// Stops the listener and the upkeep task (idempotent): the engine's shutdown closes the
    /// endpoint, not only its drop.
    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }

    /// Binds `config.listen` and serves from tasks of the current runtime.
    pub async fn start(
        config: &MetricsConfig,
        listen: SocketAddr,
        handle: PrometheusHandle,
        render: Render,
        auth: Option<AuthKey>,
    ) -> Result<Endpoint> {
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| Error::io(format!("metrics endpoint: listening on {listen}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("metrics endpoint: reading the listening address", e))?;
        if auth.is_none() && !local_addr.ip().is_loopback() {
            warn_unauthenticated("metrics endpoint", &local_addr.to_string(), "this engine's metrics");
        }
        let serve = tokio::spawn(serve(listener, config.clone(), render, auth));
        let upkeep = tokio::spawn(async move {
            let mut tick = tokio::time::interval(UPKEEP_EVERY);
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        });
        Ok(Endpoint {
            local_addr,
            tasks: [serve, upkeep],
        })
    }
}

async fn serve(listener: TcpListener, config: MetricsConfig, render: Render, auth: Option<AuthKey>) {
    let gate = ConnectionGate::new(&config.limits);
    let mut backoff = AcceptBackoff::default();
    let shared = Arc::new((config, render, auth));
    loop {
        let (stream, from, permit) =
            accept_admitted(&listener, &gate, &mut backoff, "metrics endpoint", shared.0.timeout).await;
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            let (config, render, auth) = &*shared;
            let scrape = answer(&mut stream, config, render, auth.as_ref());
            if let Err(e) = deadline(config.timeout, "metrics scrape", scrape).await {
                tracing::debug!("metrics endpoint: connection from {from}: {e}");
            }
            // The place frees before the client can see the close: one that saw it can connect
            // again at once. (Shutting the write side down is a syscall; it does not wait.)
            drop(permit);
            let _ = stream.shutdown().await;
        });
    }
}

/// Reads one request head (within the handshake timeout and [`MAX_REQUEST_HEAD`]) and answers it;
/// the caller closes the connection.
async fn answer(
    stream: &mut TcpStream,
    config: &MetricsConfig,
    render: &Render,
    auth: Option<&AuthKey>,
) -> std::io::Result<()> {
    let head = deadline(
        config.limits.handshake_timeout,
        "metrics request head",
        read_head(stream),
    )
    .await?;
    let reply = match head {
        Err(e) => plain(e.status(), true),
        Ok(head) => route(&head, render, auth).await,
    };
    stream.write_all(&reply).await
}

async fn read_head(stream: &mut TcpStream) -> std::io::Result<std::result::Result<Vec<u8>, HttpError>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(len) = head_len(&buf) {
            buf.truncate(len);
            return Ok(Ok(buf));
        }
        if buf.len() > MAX_REQUEST_HEAD {
            return Ok(Err(HttpError::TooLarge));
        }
    }
}

async fn route(head: &[u8], render: &Render, auth: Option<&AuthKey>) -> Vec<u8> {
    let req = match parse_request(head) {
        Ok(r) => r,
        Err(e) => return plain(e.status(), true),
    };
    let with_body = head.starts_with(b"GET ");
    if let Some(key) = auth {
        if !req.bearer.is_some_and(|t| token_ok(key, t)) {
            return plain((401, "Unauthorized"), with_body);
        }
    }
    if req.path != "/metrics" {
        return plain((404, "Not Found"), with_body);
    }
    // Collectors may read a store's stats over a socket: off the async workers.
    let render = render.clone();
    match tokio::task::spawn_blocking(move || render()).await {
        Ok(body) => response(
            (200, "OK"),
            "text/plain; version=0.0.4; charset=utf-8",
            body.as_bytes(),
            with_body,
        ),
        Err(_) => plain((500, "Internal Server Error"), with_body),
    }
}

/// An answer with no body: refusals say only their status.
fn plain(status: (u16, &str), with_body: bool) -> Vec<u8> {
    response(status, "text/plain; charset=utf-8", b"", with_body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_the_keys_and_checked_exactly() {
        let key = AuthKey::from_bytes(&[7u8; 32]).unwrap();
        let other = AuthKey::from_bytes(&[8u8; 32]).unwrap();
        let t = scrape_token(&key);
        assert_eq!(t.len(), 64);
        assert!(token_ok(&key, &t));
        assert!(!token_ok(&other, &t));
        assert!(!token_ok(&key, &t[..62]));
        assert!(!token_ok(&key, "zz"));
        assert!(!token_ok(&key, "é"));
    }
}
