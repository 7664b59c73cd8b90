//! A client that sends requests and never reads the answers costs the broker
//! bounded memory, and other clients are served meanwhile.

use felix_client::{Client, ClientConfig, RecordIn, StreamOptions};
use felix_tests::BrokerOptions;
use felix_wire::{Request, Response, StartPosition, StreamRef};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_answers_costs_bounded_memory() {
    let b = felix_tests::start_broker!(BrokerOptions::default().cores(1));
    let c = Client::connect(b.addr.as_str(), ClientConfig::default())
        .await
        .unwrap();
    c.create_stream("t", "ns", "big", 1, StreamOptions::default())
        .await
        .unwrap();
    // 8 MiB of records: every read below answers about 4 MiB.
    for _ in 0..8 {
        let records = (0..16)
            .map(|_| RecordIn {
                payload: vec![9u8; 64 << 10].into(),
                ..Default::default()
            })
            .collect();
        c.publish_batch("t", "ns", "big", 0, records).await.unwrap();
    }
    let pid = b.pid();
    let base = rss_bytes(pid);

    // 1,000 reads of ~4 MiB each (4 GB of answers) on a connection that
    // never reads a byte back.
    let s = tokio::net::TcpStream::connect(&b.addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let mut out = bytes::BytesMut::new();
    felix_wire::encode_request(
        0,
        &Request::Hello {
            version: felix_wire::PROTOCOL_VERSION,
            features: felix_wire::FEATURES_ALL,
            want_core: None,
            client_name: "never-reads".into(),
            token: None,
        },
        &mut out,
    );
    for id in 1..=1000u64 {
        felix_wire::encode_request(
            id,
            &Request::Read {
                stream: StreamRef {
                    tenant: "t".into(),
                    namespace: "ns".into(),
                    stream: "big".into(),
                },
                shard: 0,
                from: StartPosition::Offset(0),
                max_records: 1000,
                max_bytes: 4 << 20,
                wait_ms: 0,
            },
            &mut out,
        );
    }
    // The broker stops reading this connection once enough is in flight,
    // so this write finishes only after the answers are read below.
    let writer = tokio::spawn(async move {
        wr.write_all(&out).await.unwrap();
        wr
    });
    // Let the broker take in and answer what it will.
    let mut last = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = rss_bytes(pid);
        if now == last {
            break;
        }
        last = now;
    }

    // Others are served meanwhile.
    let r = c
        .read("t", "ns", "big", 0, StartPosition::Earliest, 10, None)
        .await
        .unwrap();
    assert_eq!(r.records.len(), 10);

    // The unsent answers are bounded by max_pending_response_bytes (64 MiB
    // by default) plus one answer, not 1,000 answers.
    let grown = rss_bytes(pid).saturating_sub(base);
    assert!(
        grown < 400 << 20,
        "broker grew by {} MiB for a client that does not read",
        grown >> 20
    );

    // Reading now drains everything: every request is answered.
    let mut got = 0u64;
    let mut buf = bytes::BytesMut::new();
    let mut chunk = vec![0u8; 1 << 20];
    while got < 1001 {
        while let Some((_, resp)) = felix_wire::decode_response(&mut buf, 64 << 20).unwrap() {
            match resp {
                Response::HelloOk { .. } | Response::Records { .. } => got += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        if got == 1001 {
            break;
        }
        let n = tokio::time::timeout(Duration::from_secs(30), rd.read(&mut chunk))
            .await
            .expect("answers keep coming")
            .unwrap();
        assert!(n > 0, "broker closed the connection after {got} answers");
        buf.extend_from_slice(&chunk[..n]);
    }
    writer.await.unwrap();
}
