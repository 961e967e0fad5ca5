//! Metadata in an HTTP key-value server (cargo feature `http-metadata`): the protocol of
//! Mooncake's `mooncake_http_metadata_server` (`GET` / `PUT` / `DELETE` on `<url>?key=<key>`,
//! 404 for an absent key), so engines that agree only on that URL find each other, and a
//! deployment that runs Mooncake's server keeps it.
//!
//! - `TE_METADATA=http`, `TE_METADATA_URL=http://host:port/metadata` (plain HTTP; the server
//!   trusts whoever reaches it, as Mooncake's does: run it where only the cluster can).
//! - A descriptor lives under the key `transfer-engine/segments/<name>`; one connection per
//!   call, bounded by `TE_METADATA_TIMEOUT_MS` (default 5000) from connect to the last byte,
//!   answers bounded to 16 MiB.
//! - No watch (the server cannot push): the engine re-fetches a descriptor when its connection
//!   to the segment is lost, as with peer-to-peer metadata. No lease: a crashed engine's
//!   descriptor stays until it is replaced or removed.

use std::time::Duration;

use async_trait::async_trait;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use te_base::config::{parse_var, Env};
use te_base::{Error, MetadataStore, Result, SegmentDescriptor};

/// Default timeout of one call.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;
/// Key prefix of descriptors.
pub const KEY_PREFIX: &str = "transfer-engine/segments/";
/// Largest answer read.
const MAX_ANSWER: usize = 16 << 20;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpMetadataConfig {
    /// `host:port` to connect to.
    pub authority: String,
    /// The path of the metadata resource (`/metadata`).
    pub path: String,
    /// `TE_METADATA_TIMEOUT_MS`.
    pub timeout: Duration,
}

impl HttpMetadataConfig {
    /// Parses `http://host:port[/path]` (path default `/metadata`).
    pub fn from_url(url: &str) -> Result<Self> {
        let bad = |why: &str| Error::config("TE_METADATA_URL", url, why);
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("expected http://host:port/path (https is not supported)"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metadata"),
        };
        let port_ok = authority
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !port_ok {
            return Err(bad("expected host:port after http://"));
        }
        if path.contains(['?', '#', ' ']) {
            return Err(bad("the path may not carry a query or fragment"));
        }
        Ok(HttpMetadataConfig {
            authority: authority.to_string(),
            path: path.to_string(),
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
        })
    }

    /// Reads `TE_METADATA_URL` and `TE_METADATA_TIMEOUT_MS`.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let url = parse_var::<String>(env, "TE_METADATA_URL")?
            .ok_or_else(|| Error::config("TE_METADATA_URL", "", "not set (expected http://host:port/metadata)"))?;
        let mut c = Self::from_url(&url)?;
        if let Some(ms) = parse_var::<u64>(env, "TE_METADATA_TIMEOUT_MS")? {
            if ms == 0 {
                return Err(Error::config("TE_METADATA_TIMEOUT_MS", "0", "must be at least 1"));
            }
            c.timeout = Duration::from_millis(ms);
        }
        Ok(c)
    }
}

/// Descriptors in an HTTP key-value server.
pub struct HttpMetadataStore {
    config: HttpMetadataConfig,
}

impl HttpMetadataStore {
    /// A store for `config` (nothing is contacted until the first call).
    pub fn new(config: HttpMetadataConfig) -> Self {
        HttpMetadataStore { config }
    }

    /// One request, bounded by the timeout from connect to the last byte: the status and body.
    async fn call(&self, method: Method, name: &str, body: Bytes) -> Result<(StatusCode, Bytes)> {
        let what = format!("{method} {}", self.config.authority);
        let timeout = self.config.timeout;
        match tokio::time::timeout(timeout, self.exchange(method, name, body)).await {
            Ok(r) => r.map_err(|e| Error::Metadata(format!("http metadata: {what}: {e}"))),
            Err(_) => Err(Error::Timeout {
                what: format!("http metadata: {what}"),
                after_ms: timeout.as_millis() as u64,
            }),
        }
    }

    async fn exchange(
        &self,
        method: Method,
        name: &str,
        body: Bytes,
    ) -> std::result::Result<(StatusCode, Bytes), String> {
        let stream = tokio::net::TcpStream::connect(&self.config.authority)
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let driver = tokio::spawn(conn);
        let uri = format!("{}?key={}", self.config.path, encode(&format!("{KEY_PREFIX}{name}")));
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .header(hyper::header::HOST, &self.config.authority)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| format!("request: {e}"))?;
        let response = sender.send_request(request).await.map_err(|e| format!("{e}"))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        driver.abort();
        Ok((status, bytes))
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved characters pass).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The server's own text of a refusal, bounded, for an error.
fn said(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned()
}

#[async_trait]
impl MetadataStore for HttpMetadataStore {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        descriptor.validate()?;
        let body = Bytes::from(descriptor.to_json());
        match self.call(Method::PUT, &descriptor.name, body).await? {
            (s, _) if s.is_success() => Ok(()),
            (s, b) => Err(Error::Metadata(format!(
                "http metadata: publishing '{}': {s} {}",
                descriptor.name,
                said(&b)
            ))),
        }
    }

    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        match self.call(Method::GET, name, Bytes::new()).await? {
            (StatusCode::NOT_FOUND, _) => Err(Error::UnknownSegment(name.to_string())),
            (s, b) if s.is_success() => {
                let d = SegmentDescriptor::from_json(&b)?;
                if d.name != name {
                    return Err(Error::InvalidDescriptor(format!(
                        "the server answered '{name}' with the descriptor of '{}'",
                        d.name
                    )));
                }
                Ok(d)
            }
            (s, b) => Err(Error::Metadata(format!(
                "http metadata: fetching '{name}': {s} {}",
                said(&b)
            ))),
        }
    }

    async fn remove(&self, name: &str) -> Result<()> {
        match self.call(Method::DELETE, name, Bytes::new()).await? {
            (s, _) if s.is_success() || s == StatusCode::NOT_FOUND => Ok(()),
            (s, b) => Err(Error::Metadata(format!(
                "http metadata: removing '{name}': {s} {}",
                said(&b)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_read_strictly() {
        let c = HttpMetadataConfig::from_url("http://10.0.0.1:8080/metadata").unwrap();
        assert_eq!((c.authority.as_str(), c.path.as_str()), ("10.0.0.1:8080", "/metadata"));
        let c = HttpMetadataConfig::from_url("http://node-a:9000").unwrap();
        assert_eq!(c.path, "/metadata");
        for bad in [
            "https://h:1/metadata",
            "h:1/metadata",
            "http://h/metadata",
            "http://:1/m",
            "http://h:x/m",
            "http://h:1/m?key=1",
        ] {
            assert!(
                matches!(HttpMetadataConfig::from_url(bad), Err(Error::Config { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn keys_are_encoded_as_query_values() {
        assert_eq!(
            encode("transfer-engine/segments/a b&c"),
            "transfer-engine/segments/a%20b%26c"
        );
    }
}
