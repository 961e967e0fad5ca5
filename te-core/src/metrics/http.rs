//! The little HTTP/1.x the metrics endpoint speaks: parse one request head (no I/O, fuzzed) and
//! format one answer. One request per connection; the answer closes it.

/// Longest request head read (request line and headers); a scraper sends a few hundred bytes.
pub const MAX_REQUEST_HEAD: usize = 8 << 10;

/// The parts of a request the endpoint uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    /// The request target without its query string.
    pub path: &'a str,
    /// The token of an `Authorization: Bearer <token>` header.
    pub bearer: Option<&'a str>,
}

/// Why a request head was refused; each maps to a status code that reveals nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// Longer than [`MAX_REQUEST_HEAD`] without an end.
    #[error("request head too large")]
    TooLarge,
    /// Not an HTTP/1.x request head.
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    /// A method other than GET or HEAD.
    #[error("method not allowed")]
    Method,
}

impl HttpError {
    /// The status line's code and reason.
    pub fn status(self) -> (u16, &'static str) {
        match self {
            HttpError::TooLarge => (431, "Request Header Fields Too Large"),
            HttpError::Malformed(_) => (400, "Bad Request"),
            HttpError::Method => (405, "Method Not Allowed"),
        }
    }
}

/// The length of the head in `buf` (through the blank line), `None` while it is incomplete.
pub fn head_len(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

/// Parses a complete request head (as [`head_len`] delimits it).
pub fn parse_request(head: &[u8]) -> Result<Request<'_>, HttpError> {
    if head.len() > MAX_REQUEST_HEAD {
        return Err(HttpError::TooLarge);
    }
    let text = std::str::from_utf8(head).map_err(|_| HttpError::Malformed("not text"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed("request line"));
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(HttpError::Malformed("request line"));
    }
    if method != "GET" && method != "HEAD" {
        return Err(HttpError::Method);
    }
    let path = target.split('?').next().unwrap_or(target);
    let mut bearer = None;
    for line in lines.take_while(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or(HttpError::Malformed("header"))?;
        if name.eq_ignore_ascii_case("authorization") {
            let value = value.trim();
            bearer = value
                .get(..7)
                .filter(|scheme| scheme.eq_ignore_ascii_case("bearer "))
                .map(|_| value[7..].trim());
        }
    }
    Ok(Request { path, bearer })
}

/// A complete answer that closes the connection; `with_body` false for HEAD.
pub fn response(status: (u16, &str), content_type: &str, body: &[u8], with_body: bool) -> Vec<u8> {
    let (code, reason) = status;
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    )
    .into_bytes();
    if code == 401 {
        out.extend_from_slice(b"WWW-Authenticate: Bearer\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if with_body {
        out.extend_from_slice(body);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_a_scrape() {
        let head = b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nauthorization: Bearer  abc \r\n\r\n";
        assert_eq!(head_len(head), Some(head.len()));
        let r = parse_request(head).unwrap();
        assert_eq!(r.path, "/metrics");
        assert_eq!(r.bearer, Some("abc"));
        let r = parse_request(b"HEAD / HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!((r.path, r.bearer), ("/", None));
    }

    #[test]
    fn refuses_what_is_not_a_get() {
        assert_eq!(parse_request(b"POST /metrics HTTP/1.1\r\n\r\n"), Err(HttpError::Method));
        for bad in [
            &b"GET /metrics\r\n\r\n"[..],
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/2\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
            b"\xff\xfe / HTTP/1.1\r\n\r\n",
        ] {
            assert!(matches!(parse_request(bad), Err(HttpError::Malformed(_))), "{bad:?}");
        }
        assert_eq!(
            parse_request(&vec![b'a'; MAX_REQUEST_HEAD + 1]),
            Err(HttpError::TooLarge)
        );
        assert_eq!(head_len(b"GET / HTTP/1.1\r\n"), None);
    }

    #[test]
    fn answers_carry_their_length_and_close() {
        let r = String::from_utf8(response((200, "OK"), "text/plain", b"abc", true)).unwrap();
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(r.contains("Content-Length: 3\r\n") && r.contains("Connection: close\r\n"));
        assert!(r.ends_with("\r\n\r\nabc"));
        let r = String::from_utf8(response((401, "Unauthorized"), "text/plain", b"", false)).unwrap();
        assert!(r.contains("WWW-Authenticate: Bearer\r\n"));
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = head_len(&bytes);
            let _ = parse_request(&bytes);
        }

        #[test]
        fn never_panics_on_near_valid_heads(
            method in "(GET|HEAD|PUT|G)",
            path in "[ -~]{0,40}",
            header in "[ -~]{0,60}",
        ) {
            let head = format!("{method} {path} HTTP/1.1\r\n{header}\r\n\r\n");
            if let Ok(r) = parse_request(head.as_bytes()) {
                prop_assert!(r.path.starts_with('/'));
            }
        }
    }
}
