//! Notifications through the engine's public API: a notified batch tells its target only after
//! every request completed, a failed batch tells nobody, bare notifications, and the typed errors
//! of a full inbox and an oversized payload.

use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::{Error, HostBufferOptions, RequestStatus, SubmitOptions, TransferEngine, TransferRequest};

#[allow(dead_code)] // the shared manual transport has helpers other test files use
mod common;
use common::{local_engine as engine, manual_engine, ManualTransport};

#[tokio::test]
async fn a_notified_batch_reaches_its_target_with_the_data_in_place() {
    let a = engine("nb-a", &[]).await;
    let b = engine("nb-b", &[]).await;
    let src = a.allocate(1 << 20, HostBufferOptions::default()).await.unwrap();
    let dst = b.allocate(1 << 20, HostBufferOptions::default()).await.unwrap();
    src.write_at(0, &[7u8; 1 << 20]).unwrap();
    let seg = a.open_segment("nb-b").await.unwrap();
    for k in 0..8u64 {
        let w = TransferRequest::write(src.addr() + k * 4096, seg.id(), dst.addr() + k * 4096, 4096);
        let nb = a
            .submit_notified(&[w], vec![k as u8], &SubmitOptions::default())
            .unwrap();
        nb.wait().await.unwrap();
    }
    let inbox = b.notifications();
    for k in 0..8u64 {
        let n = tokio::time::timeout(Duration::from_secs(10), inbox.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!((n.from.as_str(), n.payload.as_slice()), ("nb-a", &[k as u8][..]));
        let mut got = vec![0u8; 4096];
        dst.read_at(k * 4096, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 7), "batch {k}'s data is not in place");
    }
    assert!(inbox.try_recv().is_none());
    // A bare notification.
    a.notify(&seg, b"bare".to_vec()).await.unwrap();
    assert_eq!(inbox.try_recv().unwrap().payload, b"bare");
}

#[tokio::test]
async fn the_notification_waits_for_the_last_request_and_a_failed_batch_sends_none() {
    let manual = ManualTransport::new();
    let a = manual_engine("nb-manual", &manual).await;
    let src = a.allocate(8192, HostBufferOptions::default()).await.unwrap();
    let dst = a.allocate(8192, HostBufferOptions::default()).await.unwrap();
    let me = a.open_segment("nb-manual").await.unwrap();
    let reqs: Vec<TransferRequest> = (0..4u64)
        .map(|i| TransferRequest::write(src.addr() + i * 1024, me.id(), dst.addr() + i * 1024, 1024))
        .collect();
    let nb = a
        .submit_notified(&reqs, b"one".to_vec(), &SubmitOptions::default())
        .unwrap();
    assert!(manual.notes().is_empty(), "notified before any request completed");
    assert!(!nb.notification.is_complete());
    manual.complete_all();
    nb.wait().await.unwrap();
    assert_eq!(manual.notes(), vec![b"one".to_vec()]);

    // One failed request: the data reports it, the notification is never sent.
    let nb = a
        .submit_notified(&reqs, b"two".to_vec(), &SubmitOptions::default())
        .unwrap();
    manual.fail_index(1);
    manual.complete_all();
    assert!(matches!(nb.wait().await, Err(Error::BatchFailed(_))));
    assert!(matches!(nb.notification.status(0), Some(RequestStatus::Cancelled)));
    assert_eq!(
        manual.notes(),
        vec![b"one".to_vec()],
        "a failed batch sent its notification"
    );
}

#[tokio::test]
async fn a_full_inbox_and_a_large_payload_are_typed_errors_at_the_sender() {
    let a = engine("nq-a", &[]).await;
    let b = engine("nq-b", &[("TE_NOTIFY_QUEUE_DEPTH", "2"), ("TE_NOTIFY_MAX_BYTES", "16")]).await;
    let _dst = b.allocate(4096, HostBufferOptions::default()).await.unwrap();
    let src = a.allocate(4096, HostBufferOptions::default()).await.unwrap();
    let seg = a.open_segment("nq-b").await.unwrap();
    a.notify(&seg, vec![1]).await.unwrap();
    a.notify(&seg, vec![2]).await.unwrap();
    match a.notify(&seg, vec![3]).await {
        Err(Error::NotificationQueueFull { peer }) => assert_eq!(peer, "nq-b"),
        other => panic!("{other:?}"),
    }
    // A notified batch to the full inbox: the data lands, the notification is refused.
    let w = TransferRequest::write(src.addr(), seg.id(), seg.buffers()[0].base, 64);
    let nb = a.submit_notified(&[w], vec![4], &SubmitOptions::default()).unwrap();
    match nb.wait().await {
        Err(Error::NotificationQueueFull { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(nb.data.wait().await.is_ok());
    let inbox = b.notifications();
    assert_eq!(inbox.try_recv().unwrap().payload, vec![1]);
    assert_eq!(inbox.try_recv().unwrap().payload, vec![2]);
    assert!(inbox.try_recv().is_none());
    match a.notify(&seg, vec![0; 17]).await {
        Err(Error::NotificationTooLarge { len: 17, max: 16, .. }) => {}
        other => panic!("{other:?}"),
    }
    // Above what any wire carries: refused before anything is sent.
    let huge = vec![0; te_core::notify::MAX_PAYLOAD_LIMIT + 1];
    assert!(matches!(
        a.submit_notified(&[w], huge, &SubmitOptions::default()),
        Err(Error::NotificationTooLarge { .. })
    ));
}

#[tokio::test]
async fn malformed_notification_limits_name_the_variable() {
    for (var, value) in [("TE_NOTIFY_QUEUE_DEPTH", "0"), ("TE_NOTIFY_MAX_BYTES", "1M")] {
        let env = MapEnv::new([(var, value)]);
        let err = TransferEngine::builder()
            .segment_name("nq-bad")
            .transports(["local"])
            .env(Arc::new(env))
            .build()
            .await
            .unwrap_err();
        assert!(matches!(&err, Error::Config { var: v, .. } if v == var), "{err}");
    }
}

#[tokio::test]
async fn notifications_are_a_stream() {
    use std::future::poll_fn;
    use std::pin::Pin;

    use futures_core::Stream;

    let a = engine("st-a", &[]).await;
    let b = engine("st-b", &[]).await;
    let _dst = b.allocate(4096, HostBufferOptions::default()).await.unwrap();
    let seg = a.open_segment("st-b").await.unwrap();
    let mut stream = b.notifications();
    // Nothing yet: pending, then woken by the arrival (sent from another task).
    let sender = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.notify(&seg, b"s1".to_vec()).await.unwrap();
        a.notify(&seg, b"s2".to_vec()).await.unwrap();
        a
    });
    async fn next(s: &mut te_core::Notifications) -> Option<te_core::notify::Notification> {
        poll_fn(|cx| Pin::new(&mut *s).poll_next(cx)).await
    }
    let first = tokio::time::timeout(Duration::from_secs(10), next(&mut stream))
        .await
        .unwrap();
    assert_eq!(first.unwrap().payload, b"s1");
    let second = tokio::time::timeout(Duration::from_secs(10), next(&mut stream))
        .await
        .unwrap();
    assert_eq!(second.unwrap().payload, b"s2");
    let _a = sender.await.unwrap();
    b.shutdown().await.unwrap();
    assert!(next(&mut stream).await.is_none(), "the stream ends at shutdown");
}

#[tokio::test]
async fn shutdown_ends_the_receivers() {
    let b = engine("ns-b", &[]).await;
    let inbox = b.notifications();
    let waiting = tokio::spawn(async move { inbox.recv().await });
    b.shutdown().await.unwrap();
    assert!(tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap()
        .is_none());
}
