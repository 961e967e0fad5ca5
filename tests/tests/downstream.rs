//! What a downstream crate gets with `te-core = { features = ["local"] }` and nothing else:
//! register memory, open a segment, move bytes.

use te_core::{HostBufferOptions, TransferEngine, TransferRequest};

#[tokio::test]
async fn a_downstream_crate_can_register_open_and_move_bytes() {
    let engine = TransferEngine::builder()
        .segment_name("downstream")
        .build()
        .await
        .expect("engine");
    let src = engine
        .allocate(64 << 10, HostBufferOptions::default())
        .await
        .expect("allocate src");
    let dst = engine
        .allocate(64 << 10, HostBufferOptions::default())
        .await
        .expect("allocate dst");
    let message = b"bytes moved by te-core";
    src.write_at(100, message).unwrap();
    let seg = engine.open_segment("downstream").await.expect("open own segment");
    engine
        .transfer(&[TransferRequest::write(
            src.addr() + 100,
            seg.id(),
            dst.addr() + 7,
            message.len() as u64,
        )])
        .await
        .expect("transfer");
    let mut out = vec![0u8; message.len()];
    dst.read_at(7, &mut out).unwrap();
    assert_eq!(&out, message);
}
