//! Peer authentication: a shared secret proved by a mutual HMAC-SHA256 challenge-response.
//!
//! Every listener of the engine (TCP transport, p2p metadata, the rdma handshake, the UMBP
//! standalone server and cluster peers) uses this one mechanism (efa has no listener: its
//! addresses and keys travel in the descriptor), so there is one thing to review. With a key configured
//! (`TE_AUTH_KEY_FILE`), connection set-up runs:
//!
//! ```text
//! initiator                                   responder
//!   nonce_i (32 random bytes)        ->
//!                                    <-       nonce_r, mac_r = proof("te-auth-v1 responder")
//!   checks mac_r
//!   mac_i = proof("te-auth-v1 initiator")  ->
//!                                             checks mac_i, then serves
//!
//! proof(label) = HMAC-SHA256(key, label | u32_le(len(ctx)) | ctx | nonce_i | nonce_r)
//! ```
//!
//! `docs/security.md` states the same bytes with a test vector, which a test here checks.
//!
//! Both sides contribute a fresh nonce, so neither proof can be replayed on another connection;
//! the role label keeps a responder's proof from being reflected back as an initiator's; `ctx`
//! names the protocol (`"tcp"`, `"p2p"`...) so a proof for one listener is useless on another;
//! a protocol may bind more into it at run time (the UMBP cluster binds the member name the
//! initiator speaks for).
//! Proofs are compared in constant time (`Mac::verify_slice`). The key never crosses the wire.
//!
//! The protocols carry the nonces and proofs in their own frames. The exchange itself is written
//! once: [`initiate`] and [`respond`] run it over any framed stream that implements
//! [`HandshakeFrames`] (each protocol maps the three [`Step`]s to its own frames, and may add its
//! own fields to its hello). [`InitiatorHandshake`] and [`ResponderHandshake`] are the pure
//! (no I/O) halves they are built from, tested without sockets.

use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::Env;
use crate::error::{Error, Result};

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;
/// Shortest key accepted: 16 bytes (128 bits).
pub const MIN_KEY_LEN: usize = 16;
/// Longest key file read (a key is a secret, not a document).
pub const MAX_KEY_LEN: usize = 4096;

/// The variable naming the key file.
pub const KEY_FILE_VAR: &str = "TE_AUTH_KEY_FILE";

/// A random nonce.
pub type Nonce = [u8; NONCE_LEN];
/// A proof of holding the key.
pub type Proof = [u8; PROOF_LEN];

/// The shared secret. Cheap to clone; its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct AuthKey(Arc<[u8]>);

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKey(<{} bytes>)", self.0.len())
    }
}

/// Which side of a handshake a proof comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Initiator,
    /// The side that accepted.
    Responder,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Initiator => b"te-auth-v1 initiator",
            Role::Responder => b"te-auth-v1 responder",
        }
    }
}

impl AuthKey {
    /// A key from raw bytes (at least [`MIN_KEY_LEN`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<AuthKey> {
        if bytes.len() < MIN_KEY_LEN || bytes.len() > MAX_KEY_LEN {
            return Err(Error::config(
                KEY_FILE_VAR,
                "<key>",
                format!(
                    "a key must be {MIN_KEY_LEN}..={MAX_KEY_LEN} bytes, this one is {}",
                    bytes.len()
                ),
            ));
        }
        Ok(AuthKey(Arc::from(bytes)))
    }

    /// Reads a key file. Trailing newlines are not part of the key (keys are often written with
    /// `echo`). A file readable by group or others is accepted with a warning.
    pub fn from_file(path: &Path) -> Result<AuthKey> {
        let shown = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| Error::config(KEY_FILE_VAR, &shown, e.to_string()))?;
        if meta.len() > MAX_KEY_LEN as u64 + 2 {
            return Err(Error::config(
                KEY_FILE_VAR,
                &shown,
                format!("{} bytes: a key file holds at most {MAX_KEY_LEN}", meta.len()),
            ));
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!("{KEY_FILE_VAR}={shown} is readable by group or others; chmod 600 it");
            }
        }
        let raw = std::fs::read(path).map_err(|e| Error::config(KEY_FILE_VAR, &shown, e.to_string()))?;
        let mut key: &[u8] = &raw;
        while let [rest @ .., b'\n' | b'\r'] = key {
            key = rest;
        }
        AuthKey::from_bytes(key).map_err(|e| match e {
            Error::Config { reason, .. } => Error::config(KEY_FILE_VAR, shown, reason),
            other => other,
        })
    }

    /// The key named by `TE_AUTH_KEY_FILE`, or `None` when it is unset.
    pub fn from_env(env: &dyn Env) -> Result<Option<AuthKey>> {
        match env.get(KEY_FILE_VAR) {
            None => Ok(None),
            Some(p) if p.is_empty() => Err(Error::config(KEY_FILE_VAR, "", "empty value")),
            Some(p) => AuthKey::from_file(Path::new(&p)).map(Some),
        }
    }

    fn mac(&self, role: Role, context: &str, initiator: &Nonce, responder: &Nonce) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(role.label());
        mac.update(&(context.len() as u32).to_le_bytes());
        mac.update(context.as_bytes());
        mac.update(initiator);
        mac.update(responder);
        mac
    }

    /// The proof `role` gives for the handshake of `context` with these nonces.
    pub fn prove(&self, role: Role, context: &str, initiator: &Nonce, responder: &Nonce) -> Proof {
        self.mac(role, context, initiator, responder)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a proof from `role`, in constant time.
    pub fn verify(&self, role: Role, context: &str, initiator: &Nonce, responder: &Nonce, proof: &[u8]) -> bool {
        self.mac(role, context, initiator, responder)
            .verify_slice(proof)
            .is_ok()
    }
}

/// A fresh nonce from the operating system's random source.
pub fn nonce() -> Nonce {
    random_bytes()
}

/// `N` bytes from the operating system's random source: for secrets (session tokens) and for
/// seeds a peer must not guess.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut n = [0u8; N];
    getrandom::fill(&mut n).expect("the OS random source failed");
    n
}

/// A `u64` from the operating system's random source.
pub fn random_u64() -> u64 {
    u64::from_le_bytes(random_bytes())
}

/// The initiator's side of one handshake.
#[derive(Debug)]
pub struct InitiatorHandshake {
    key: AuthKey,
    context: Box<str>,
    nonce: Nonce,
}

impl InitiatorHandshake {
    /// Starts a handshake; send the returned nonce.
    pub fn start(key: &AuthKey, context: &str) -> (InitiatorHandshake, Nonce) {
        let n = nonce();
        (
            InitiatorHandshake {
                key: key.clone(),
                context: context.into(),
                nonce: n,
            },
            n,
        )
    }

    /// Checks the responder's answer; on success returns the proof to send back.
    pub fn finish(self, responder_nonce: &Nonce, responder_proof: &[u8], peer: &str) -> Result<Proof> {
        if !self.key.verify(
            Role::Responder,
            &self.context,
            &self.nonce,
            responder_nonce,
            responder_proof,
        ) {
            return Err(Error::Unauthenticated {
                peer: peer.to_string(),
                reason: "the peer does not hold this engine's key".into(),
            });
        }
        Ok(self
            .key
            .prove(Role::Initiator, &self.context, &self.nonce, responder_nonce))
    }
}

/// The responder's side of one handshake.
#[derive(Debug)]
pub struct ResponderHandshake {
    key: AuthKey,
    context: Box<str>,
    initiator: Nonce,
    nonce: Nonce,
}

impl ResponderHandshake {
    /// Answers an initiator's nonce; send the returned nonce and proof.
    pub fn answer(key: &AuthKey, context: &str, initiator: &Nonce) -> (ResponderHandshake, Nonce, Proof) {
        let n = nonce();
        let proof = key.prove(Role::Responder, context, initiator, &n);
        (
            ResponderHandshake {
                key: key.clone(),
                context: context.into(),
                initiator: *initiator,
                nonce: n,
            },
            n,
            proof,
        )
    }

    /// Checks the initiator's proof. The error says nothing about why beyond "refused".
    pub fn check(self, initiator_proof: &[u8], peer: &str) -> Result<()> {
        if self.key.verify(
            Role::Initiator,
            &self.context,
            &self.initiator,
            &self.nonce,
            initiator_proof,
        ) {
            Ok(())
        } else {
            Err(Error::Unauthenticated {
                peer: peer.to_string(),
                reason: "wrong key".into(),
            })
        }
    }
}

/// Bytes of a challenge: the responder's nonce, then its proof.
pub const CHALLENGE_LEN: usize = NONCE_LEN + PROOF_LEN;

/// The three messages of a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Initiator -> responder: the initiator's nonce (a protocol may send more in this frame).
    Hello,
    /// Responder -> initiator: its nonce and proof ([`CHALLENGE_LEN`] bytes).
    Challenge,
    /// Initiator -> responder: its proof ([`PROOF_LEN`] bytes).
    Proof,
}

/// A framed stream a handshake runs over: a protocol maps each [`Step`] to one of its frames.
/// The bodies are the handshake's bytes only; a frame of another kind than the step expected,
/// a refusal the peer sent instead, or an I/O failure is the protocol's own error.
///
/// Frames over a blocking socket implement this with bodies that never wait on anything but the
/// socket; [`block_on`] then drives [`initiate`] or [`respond`] on the calling thread.
pub trait HandshakeFrames {
    /// The protocol's error.
    type Error;
    /// Sends (or stages, for a protocol whose next receive sends it) `step`'s frame with `body`.
    fn send(
        &mut self,
        step: Step,
        body: &[u8],
    ) -> impl std::future::Future<Output = std::result::Result<(), Self::Error>> + Send;
    /// Receives `step`'s frame and returns its body.
    fn recv(
        &mut self,
        step: Step,
    ) -> impl std::future::Future<Output = std::result::Result<Vec<u8>, Self::Error>> + Send;
}

/// Why a handshake did not complete.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError<E> {
    /// The frames failed: I/O, another frame than the step's, or the peer's refusal.
    #[error("{0}")]
    Frames(E),
    /// A step's body has the wrong length.
    #[error("a {step:?} of {len} bytes (expected {expected})")]
    Malformed {
        /// The step.
        step: Step,
        /// Bytes received.
        len: usize,
        /// Bytes it must have.
        expected: usize,
    },
    /// The peer's proof is wrong: it does not hold the key ([`Error::Unauthenticated`]).
    #[error("{0}")]
    Unauthenticated(Error),
}

/// The initiator's side of the handshake over `frames`: sends its nonce, checks the responder's
/// proof, sends its own. What follows (the protocol's welcome) is the caller's.
pub async fn initiate<F: HandshakeFrames + Send>(
    frames: &mut F,
    key: &AuthKey,
    context: &str,
    peer: &str,
) -> std::result::Result<(), HandshakeError<F::Error>> {
    let (hs, nonce) = InitiatorHandshake::start(key, context);
    frames.send(Step::Hello, &nonce).await.map_err(HandshakeError::Frames)?;
    let body = frames.recv(Step::Challenge).await.map_err(HandshakeError::Frames)?;
    if body.len() != CHALLENGE_LEN {
        return Err(HandshakeError::Malformed {
            step: Step::Challenge,
            len: body.len(),
            expected: CHALLENGE_LEN,
        });
    }
    let (theirs, proof) = body.split_at(NONCE_LEN);
    let theirs: &Nonce = theirs.try_into().expect("split at NONCE_LEN");
    let ours = hs
        .finish(theirs, proof, peer)
        .map_err(HandshakeError::Unauthenticated)?;
    frames.send(Step::Proof, &ours).await.map_err(HandshakeError::Frames)
}

/// The responder's side over `frames`, once the protocol has read the initiator's hello and
/// taken `initiator_nonce` from it: sends the challenge, checks the initiator's proof.
pub async fn respond<F: HandshakeFrames + Send>(
    frames: &mut F,
    key: &AuthKey,
    context: &str,
    initiator_nonce: &[u8],
    peer: &str,
) -> std::result::Result<(), HandshakeError<F::Error>> {
    let nonce: &Nonce = initiator_nonce.try_into().map_err(|_| HandshakeError::Malformed {
        step: Step::Hello,
        len: initiator_nonce.len(),
        expected: NONCE_LEN,
    })?;
    let (hs, ours, proof) = ResponderHandshake::answer(key, context, nonce);
    let mut challenge = [0u8; CHALLENGE_LEN];
    challenge[..NONCE_LEN].copy_from_slice(&ours);
    challenge[NONCE_LEN..].copy_from_slice(&proof);
    frames
        .send(Step::Challenge, &challenge)
        .await
        .map_err(HandshakeError::Frames)?;
    let theirs = frames.recv(Step::Proof).await.map_err(HandshakeError::Frames)?;
    if theirs.len() != PROOF_LEN {
        return Err(HandshakeError::Malformed {
            step: Step::Proof,
            len: theirs.len(),
            expected: PROOF_LEN,
        });
    }
    hs.check(&theirs, peer).map_err(HandshakeError::Unauthenticated)
}

/// Runs a future whose awaits never wait on anything but blocking calls (a handshake over
/// [`HandshakeFrames`] of a blocking socket) on the calling thread: it is ready at its first
/// poll. A future that does return pending is polled again after yielding the thread.
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}

/// Logs, once per process and listener kind, that a listener is open to anyone who reaches it;
/// `exposes` says what such a peer gets ("exported memory", "segment descriptors"...).
pub fn warn_unauthenticated(listener: &str, addrs: &str, exposes: &str) {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    if warned.get_or_insert_with(HashSet::new).insert(listener.to_string()) {
        tracing::warn!(
            "{listener} listens on {addrs} without authentication: anyone who can reach it gets \
             {exposes}; set {KEY_FILE_VAR} (see docs/security.md)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The vector of docs/security.md (computed there with an independent HMAC): the code and
    /// the document agree on every byte of the proof's input.
    #[test]
    fn the_documented_test_vector_holds() {
        let key: Vec<u8> = (0u8..32).collect();
        let key = AuthKey::from_bytes(&key).unwrap();
        let (ni, nr) = ([0xaa; NONCE_LEN], [0xbb; NONCE_LEN]);
        let responder = hex(&key.prove(Role::Responder, "tcp", &ni, &nr));
        let initiator = hex(&key.prove(Role::Initiator, "tcp", &ni, &nr));
        assert_eq!(
            responder,
            "38a599627a2e6eedc05eb674a8a02e68898a76df941ef66c225bc025f809a6b5"
        );
        assert_eq!(
            initiator,
            "a613a4cbf95006117ff1472220d88934c8e7a6ec07643ee4d7dbe8c125cf7744"
        );
        // The vector above is checked in every build; the document beside it only in the
        // repository (a packaged crate carries no docs/).
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md");
        let doc = match std::fs::read_to_string(path) {
            Ok(doc) => doc,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && !std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.git")).exists() =>
            {
                println!("skipped: {path} is not here (not a checkout of the repository)");
                return;
            }
            Err(e) => panic!("reading {path}: {e}"),
        };
        for (what, value) in [
            ("key", hex(&(0u8..32).collect::<Vec<u8>>())),
            ("responder proof", responder),
            ("initiator proof", initiator),
        ] {
            assert!(
                doc.contains(&format!("| {what} ")) && doc.contains(&format!("`{value}`")),
                "docs/security.md lacks the {what} {value}"
            );
        }
        assert!(
            doc.contains("u32_le(len(ctx))"),
            "docs/security.md does not state the context length"
        );
    }

    fn key(b: u8) -> AuthKey {
        AuthKey::from_bytes(&[b; 32]).unwrap()
    }

    #[test]
    fn matching_keys_complete_both_ways() {
        let (k1, k2) = (key(1), key(1));
        let (init, ni) = InitiatorHandshake::start(&k1, "tcp");
        let (resp, nr, pr) = ResponderHandshake::answer(&k2, "tcp", &ni);
        let pi = init.finish(&nr, &pr, "p").unwrap();
        resp.check(&pi, "p").unwrap();
    }

    #[test]
    fn wrong_key_context_or_reflection_is_refused() {
        let (init, ni) = InitiatorHandshake::start(&key(1), "tcp");
        let (_, nr, pr) = ResponderHandshake::answer(&key(2), "tcp", &ni);
        assert!(matches!(init.finish(&nr, &pr, "p"), Err(Error::Unauthenticated { .. })));

        let (init, ni) = InitiatorHandshake::start(&key(1), "tcp");
        let (_, nr, pr) = ResponderHandshake::answer(&key(1), "p2p", &ni);
        assert!(init.finish(&nr, &pr, "p").is_err(), "a proof for another protocol");

        // A responder's proof sent back as the initiator's is refused (role labels differ).
        let (_, ni) = InitiatorHandshake::start(&key(1), "tcp");
        let (resp, _, pr) = ResponderHandshake::answer(&key(1), "tcp", &ni);
        assert!(resp.check(&pr, "p").is_err());
        // A proof from another connection (other nonces) is refused.
        let (_, ni2) = InitiatorHandshake::start(&key(1), "tcp");
        let (resp2, nr2, _) = ResponderHandshake::answer(&key(1), "tcp", &ni2);
        let stale = key(1).prove(Role::Initiator, "tcp", &ni, &nr2);
        assert!(resp2.check(&stale, "p").is_err());
        assert!(resp_check_truncated(&key(1)));
    }

    fn resp_check_truncated(k: &AuthKey) -> bool {
        let (init, ni) = InitiatorHandshake::start(k, "tcp");
        let (resp, nr, pr) = ResponderHandshake::answer(k, "tcp", &ni);
        let pi = init.finish(&nr, &pr, "p").unwrap();
        resp.check(&pi[..16], "p").is_err()
    }

    /// Two ends of an in-memory framed stream: each frame is (step, body).
    struct Pipe {
        out: std::sync::mpsc::Sender<(Step, Vec<u8>)>,
        inp: std::sync::mpsc::Receiver<(Step, Vec<u8>)>,
    }

    fn pipe() -> (Pipe, Pipe) {
        let (a_tx, a_rx) = std::sync::mpsc::channel();
        let (b_tx, b_rx) = std::sync::mpsc::channel();
        (Pipe { out: a_tx, inp: b_rx }, Pipe { out: b_tx, inp: a_rx })
    }

    impl HandshakeFrames for Pipe {
        type Error = String;
        async fn send(&mut self, step: Step, body: &[u8]) -> std::result::Result<(), String> {
            self.out.send((step, body.to_vec())).map_err(|e| e.to_string())
        }
        async fn recv(&mut self, step: Step) -> std::result::Result<Vec<u8>, String> {
            match self.inp.recv() {
                Ok((s, body)) if s == step => Ok(body),
                Ok((s, _)) => Err(format!("{s:?} instead of {step:?}")),
                Err(e) => Err(e.to_string()),
            }
        }
    }

    fn run_both(ki: &AuthKey, kr: &AuthKey) -> (std::result::Result<(), String>, std::result::Result<(), String>) {
        let (mut i, mut r) = pipe();
        let kr = kr.clone();
        let responder = std::thread::spawn(move || {
            block_on(async {
                let hello = r.recv(Step::Hello).await.map_err(HandshakeError::Frames)?;
                respond(&mut r, &kr, "test", &hello, "initiator").await
            })
            .map_err(|e| e.to_string())
        });
        let init = block_on(initiate(&mut i, ki, "test", "responder")).map_err(|e| e.to_string());
        drop(i);
        (init, responder.join().unwrap())
    }

    #[test]
    fn the_framed_handshake_completes_with_one_key_and_refuses_another() {
        let (i, r) = run_both(&key(3), &key(3));
        assert_eq!((i, r), (Ok(()), Ok(())));
        // The initiator refuses a responder without the key before sending any proof; the
        // responder then sees the stream end.
        let (i, r) = run_both(&key(3), &key(4));
        assert!(i.unwrap_err().contains("does not hold"));
        assert!(r.is_err());
    }

    #[test]
    fn a_malformed_step_is_a_typed_error() {
        let (mut i, mut r) = pipe();
        let e = block_on(respond(&mut r, &key(1), "t", &[0u8; 5], "p")).unwrap_err();
        assert!(matches!(
            e,
            HandshakeError::Malformed {
                step: Step::Hello,
                len: 5,
                expected: NONCE_LEN
            }
        ));
        block_on(r.send(Step::Challenge, &[1, 2, 3])).unwrap();
        let e = block_on(initiate(&mut i, &key(1), "t", "p")).unwrap_err();
        assert!(
            matches!(
                e,
                HandshakeError::Malformed {
                    step: Step::Challenge,
                    len: 3,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn errors_and_debug_reveal_nothing() {
        let k = AuthKey::from_bytes(b"0123456789abcdef-secret").unwrap();
        assert!(!format!("{k:?}").contains("secret"));
        let (_, ni) = InitiatorHandshake::start(&k, "tcp");
        let (resp, _, _) = ResponderHandshake::answer(&k, "tcp", &ni);
        let e = resp.check(&[0u8; 32], "peer").unwrap_err().to_string();
        assert!(!e.contains("secret") && !e.contains("0123"), "{e}");
    }

    #[test]
    fn key_files_are_read_strictly() {
        let dir = std::env::temp_dir().join(format!("te-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, b"0123456789abcdef0123\n").unwrap();
        let short = dir.join("short");
        std::fs::write(&short, b"tiny\n").unwrap();
        let a = AuthKey::from_file(&good).unwrap();
        let b = AuthKey::from_bytes(b"0123456789abcdef0123").unwrap();
        let (n1, n2) = (nonce(), nonce());
        assert_ne!(n1, n2);
        assert_eq!(
            a.prove(Role::Initiator, "x", &n1, &n2),
            b.prove(Role::Initiator, "x", &n1, &n2),
            "the trailing newline is not part of the key"
        );
        let e = AuthKey::from_file(&short).unwrap_err();
        assert!(e.to_string().contains(KEY_FILE_VAR), "{e}");
        assert!(AuthKey::from_file(&dir.join("missing")).is_err());
        let env = crate::config::MapEnv::new([(KEY_FILE_VAR, good.to_str().unwrap())]);
        assert!(AuthKey::from_env(&env).unwrap().is_some());
        assert!(AuthKey::from_env(&crate::config::MapEnv::default()).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
