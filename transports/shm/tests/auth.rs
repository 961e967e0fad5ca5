//! The shared key on the shm control socket (docs/security.md): with one key on both sides the
//! route opens and carries bytes; a target or an initiator without the key, or with another
//! one, is refused, and the initiator says which of these it was.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use te_base::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{HostBufferOptions, TransferEngine, TransferRequest};

fn key_file(dir: &Path, name: &str, byte: u8) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, [byte; 32]).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    path
}

async fn engine(name: &str, store: &Arc<InProcessStore>, key: Option<&Path>) -> TransferEngine {
    let mut env = MapEnv::default();
    if let Some(k) = key {
        env.0.insert("TE_AUTH_KEY_FILE".into(), k.to_str().unwrap().into());
    }
    TransferEngine::builder()
        .segment_name(name)
        .metadata(store.clone())
        .env(Arc::new(env))
        .transports(["shm"])
        .build()
        .await
        .unwrap()
}

/// Opens `target` from `initiator` over shm and writes 64 KiB, verified; or says why not.
async fn write_over_shm(target: &TransferEngine, initiator: &TransferEngine) -> Result<(), String> {
    let dst = target.allocate(64 << 10, HostBufferOptions::default()).await.unwrap();
    let src = initiator
        .allocate(64 << 10, HostBufferOptions::default())
        .await
        .unwrap();
    let data: Vec<u8> = (0..64u32 << 10).map(|i| (i * 13 + 1) as u8).collect();
    src.write_at(0, &data).unwrap();
    let seg = initiator
        .open_segment(target.segment_name())
        .await
        .map_err(|e| e.to_string())?;
    let unreached = initiator.unreached_routes(&seg).unwrap();
    if let Some(u) = unreached.first() {
        return Err(u.reason.clone());
    }
    initiator
        .transfer(&[TransferRequest::write(src.addr(), seg.id(), dst.addr(), 64 << 10)])
        .await
        .map_err(|e| e.to_string())?;
    let mut back = vec![0u8; 64 << 10];
    dst.read_at(0, &mut back).unwrap();
    assert!(back == data, "the bytes arrived");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_peers_that_hold_the_key_connect() {
    let dir = tempfile::tempdir().unwrap();
    let (one, other) = (key_file(dir.path(), "one", 1), key_file(dir.path(), "other", 2));
    let (one, other) = (Some(one.as_path()), Some(other.as_path()));
    let store = Arc::new(InProcessStore::new());
    // (case, the target's key, the initiator's key, the refusal the initiator reports)
    let cases = [
        ("same-key", one, one, None),
        ("other-key", one, other, Some("does not hold this engine's key")),
        ("target-without", None, one, Some("does not authenticate")),
        ("initiator-without", one, None, Some("authentication required")),
    ];
    for (case, target_key, initiator_key, refusal) in cases {
        let target = engine(&format!("shm-auth-target-{case}"), &store, target_key).await;
        let initiator = engine(&format!("shm-auth-initiator-{case}"), &store, initiator_key).await;
        let got = write_over_shm(&target, &initiator).await;
        match refusal {
            None => assert_eq!(got, Ok(()), "{case}"),
            Some(why) => {
                let e = got.expect_err(case);
                assert!(e.contains(why), "{case}: {e}");
            }
        }
    }
}
