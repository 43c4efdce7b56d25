use super::*;

/// MessagePack bytes of `value` (what the engine's msgspec writes).
fn encode(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Nil => out.push(0xc0),
        Value::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Value::Int(i) if (0..=0x7f).contains(i) => out.push(*i as u8),
        Value::Int(i) if *i >= 0 => {
            out.push(0xcf);
            out.extend_from_slice(&(*i as u64).to_be_bytes());
        }
        Value::Int(i) => {
            out.push(0xd3);
            out.extend_from_slice(&(*i as i64).to_be_bytes());
        }
        Value::Float(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_bits().to_be_bytes());
        }
        Value::Str(s) => {
            out.push(0xdb);
            out.extend_from_slice(&(s.len() as u32).to_be_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Value::Bin(b) => {
            out.push(0xc6);
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
        Value::Array(items) => {
            out.push(0xdd);
            out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            items.iter().for_each(|item| encode(item, out));
        }
        Value::Map(entries) => {
            out.push(0xdf);
            out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
            for (k, v) in entries {
                encode(k, out);
                encode(v, out);
            }
        }
        Value::Ext(..) => unreachable!(),
    }
}

fn s(text: &str) -> Value {
    Value::Str(text.into())
}

fn ints(values: impl IntoIterator<Item = i128>) -> Value {
    Value::Array(values.into_iter().map(Value::Int).collect())
}

fn stored(hashes: &[i128], parent: Option<i128>, tokens: &[u32], extra: Option<&str>) -> Value {
    let extra_keys = match extra {
        Some(salt) => Value::Array(std::iter::once(Value::Array(vec![s(salt)])).chain((1..hashes.len()).map(|_| Value::Nil)).collect()),
        None => Value::Nil,
    };
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), ints(hashes.iter().copied())),
        (s("parent_block_hash"), parent.map_or(Value::Nil, Value::Int)),
        (s("token_ids"), ints(tokens.iter().map(|&t| i128::from(t)))),
        (s("block_size"), Value::Int(4)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (s("extra_keys"), extra_keys),
    ])
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    let mut bytes = Vec::new();
    encode(&Value::Array(vec![Value::Float(1.0), Value::Array(events), Value::Int(0)]), &mut bytes);
    bytes
}

fn apply(mirror: &mut KvMirror, events: Vec<Value>) {
    for event in decode_batch(&batch(events)).unwrap() {
        mirror.apply(event);
    }
}

fn drain(events: &mut broadcast::Receiver<NumberedEvent>) -> Vec<NumberedEvent> {
    std::iter::from_fn(|| events.try_recv().ok()).collect()
}

const TOKENS: [u32; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

#[test]
fn stored_chains_get_turbines_hashes_from_their_tokens() {
    let mut mirror = KvMirror::new("w", 4);
    let mut events = mirror.subscribe();
    let expected = BlockHasher::default().hash_blocks(&TOKENS, 4);
    // Two blocks at the root, then a third after them (a later step).
    apply(&mut mirror, vec![stored(&[100, 101], None, &TOKENS[..8], None), stored(&[102], Some(101), &TOKENS[8..], None)]);
    let got = drain(&mut events);
    assert_eq!(got.iter().map(|e| e.event_id).collect::<Vec<_>>(), [0, 1], "numbered from 0");
    let KvEvent::Stored { parent: None, blocks, tier: Tier::Device } = &got[0].event else { panic!("{got:?}") };
    assert_eq!(blocks.iter().map(|b| b.sequence_hash).collect::<Vec<_>>(), [expected[0].sequence, expected[1].sequence]);
    assert_eq!(blocks[0].local_hash, expected[0].local);
    assert_eq!(
        got[1].event,
        KvEvent::Stored {
            parent: Some(expected[1].sequence),
            blocks: vec![StoredBlock { sequence_hash: expected[2].sequence, local_hash: expected[2].local }],
            tier: Tier::Device
        }
    );
    let dump = mirror.dump();
    assert_eq!((dump.next_event_id, dump.blocks.len()), (2, 3));

    // Evicted: removed by Turbine's hash; the dump follows.
    apply(&mut mirror, vec![Value::Map(vec![(s("type"), s("BlockRemoved")), (s("block_hashes"), ints([102, 999])), (s("medium"), s("GPU"))])]);
    assert_eq!(drain(&mut events)[0].event, KvEvent::Removed { sequence_hashes: vec![expected[2].sequence], tier: Tier::Device }, "an unknown hash is skipped");
    assert_eq!(mirror.dump().blocks.len(), 2);
    apply(&mut mirror, vec![Value::Map(vec![(s("type"), s("AllBlocksCleared"))]), Value::Map(vec![(s("type"), s("SomethingNew"))])]);
    assert_eq!(drain(&mut events)[0].event, KvEvent::Cleared);
    assert_eq!(mirror.dump(), Dump { next_event_id: 4, blocks: vec![] });
}

#[test]
fn a_tenants_blocks_are_hashed_in_its_namespace_and_foreign_ones_are_left_out() {
    let mut mirror = KvMirror::new("w", 4);
    let mut events = mirror.subscribe();
    let salt = CacheSalt::of(&["tenant-a"]);
    let salted = BlockHasher::salted(turbine_kv::DEFAULT_SEED, salt).hash_blocks(&TOKENS, 4);
    apply(&mut mirror, vec![stored(&[1, 2], None, &TOKENS[..8], Some(&salt_text(salt).unwrap())), stored(&[3], Some(2), &TOKENS[8..], None)]);
    let got = drain(&mut events);
    let KvEvent::Stored { blocks, .. } = &got[0].event else { panic!() };
    assert_eq!(blocks[1].sequence_hash, salted[1].sequence);
    let KvEvent::Stored { blocks, .. } = &got[1].event else { panic!() };
    assert_eq!(blocks[0].sequence_hash, salted[2].sequence, "a child inherits its chain's namespace");
    assert_ne!(salted[0].sequence, BlockHasher::default().hash_blocks(&TOKENS, 4)[0].sequence);

    // A salt someone else sent the engine, a LoRA chain, an unknown parent,
    // another block size: nothing credited.
    let mut lora = stored(&[20], None, &TOKENS[..4], None);
    if let Value::Map(entries) = &mut lora {
        entries.retain(|(k, _)| k != &s("lora_name"));
        entries.push((s("lora_name"), s("adapter")));
    }
    let mut other_size = stored(&[30], None, &TOKENS[..4], None);
    if let Value::Map(entries) = &mut other_size {
        entries.retain(|(k, _)| k != &s("block_size"));
        entries.push((s("block_size"), Value::Int(8)));
    }
    apply(&mut mirror, vec![stored(&[10], None, &TOKENS[..4], Some("their-salt")), lora, stored(&[40], Some(777), &TOKENS[..4], None), other_size]);
    assert!(drain(&mut events).is_empty());
    assert_eq!(mirror.dump().blocks.len(), 3);
}

#[test]
fn clearing_an_empty_mirror_says_nothing_and_a_full_one_is_told() {
    let mut mirror = KvMirror::new("w", 4);
    let mut events = mirror.subscribe();
    mirror.clear("start");
    assert!(drain(&mut events).is_empty());
    apply(&mut mirror, vec![stored(&[1], None, &TOKENS[..4], None)]);
    mirror.clear("gap");
    assert_eq!(drain(&mut events).last().unwrap().event, KvEvent::Cleared);
    assert!(decode_batch(b"\x93").is_err(), "a truncated batch");
    assert!(decode_batch(&batch(vec![Value::Map(vec![(s("type"), s("BlockStored"))])])).is_err(), "a BlockStored without its fields");
}

#[tokio::test]
async fn events_arrive_over_zmtp_and_a_gap_clears_the_mirror() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let mirror = Arc::new(Mutex::new(KvMirror::new("w", 4)));
    let mut events = mirror.lock().subscribe();
    let shutdown = CancellationToken::new();
    let receiving = tokio::spawn(receive(listener, mirror.clone(), None, shutdown.clone()));

    // A publisher as libzmq speaks ZMTP 3.1.
    let mut publisher = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut greeting = super::super::zmtp::greeting();
    greeting[11] = 1;
    publisher.write_all(&greeting).await.unwrap();
    let mut theirs = [0u8; 64];
    publisher.read_exact(&mut theirs).await.unwrap();
    let ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
    publisher.write_all(&[0x04, ready.len() as u8]).await.unwrap();
    publisher.write_all(ready).await.unwrap();
    let send = async |publisher: &mut tokio::net::TcpStream, sequence: u64, payload: Vec<u8>| {
        let mut bytes = vec![0x01, 0];
        bytes.extend_from_slice(&[0x01, 8]);
        bytes.extend_from_slice(&sequence.to_be_bytes());
        bytes.push(0x02);
        bytes.extend_from_slice(&(payload.len() as u64).to_be_bytes());
        bytes.extend_from_slice(&payload);
        publisher.write_all(&bytes).await.unwrap();
    };
    send(&mut publisher, 5, batch(vec![stored(&[1], None, &TOKENS[..4], None)])).await;
    send(&mut publisher, 6, batch(vec![stored(&[2], Some(1), &TOKENS[4..8], None)])).await;
    // Messages 7 and 8 were lost.
    send(&mut publisher, 9, batch(vec![stored(&[3], None, &TOKENS[..4], None)])).await;
    let mut got = Vec::new();
    while got.len() < 4 {
        got.push(tokio::time::timeout(std::time::Duration::from_secs(10), events.recv()).await.expect("the events arrive").unwrap().event);
    }
    assert!(matches!(&got[0], KvEvent::Stored { parent: None, .. }));
    assert!(matches!(&got[1], KvEvent::Stored { parent: Some(_), .. }));
    assert_eq!(got[2], KvEvent::Cleared, "the gap cleared the mirror");
    assert!(matches!(&got[3], KvEvent::Stored { parent: None, .. }));
    assert_eq!(mirror.lock().dump().blocks.len(), 1);
    shutdown.cancel();
    receiving.await.unwrap();
}

#[test]
fn a_replay_is_applied_only_where_it_continues_the_batches_applied() {
    let mut mirror = KvMirror::new("w", 4);
    let (first, second, third) = (
        batch(vec![stored(&[1], None, &TOKENS[..4], None)]),
        batch(vec![stored(&[2], Some(1), &TOKENS[4..8], None)]),
        batch(vec![stored(&[3], Some(2), &TOKENS[8..12], None)]),
    );
    assert!(!mirror.resume(&[(0, first.clone())]), "nothing applied yet: nothing to continue");
    mirror.apply_batch(4, &first);
    assert_eq!(mirror.expected(), Some(5));
    assert!(!mirror.resume(&[(4, second.clone()), (5, third.clone())]), "another batch numbered 4: a restarted engine");
    assert!(!mirror.resume(&[(5, second.clone())]), "the buffer moved past the last applied");
    assert!(!mirror.resume(&[(4, first.clone()), (6, third.clone())]), "a hole in the replay");
    assert_eq!((mirror.expected(), mirror.dump().blocks.len()), (Some(5), 1), "nothing applied from a refused replay");
    assert!(mirror.resume(&[(4, first), (5, second), (6, third)]));
    assert_eq!((mirror.expected(), mirror.dump().blocks.len()), (Some(7), 3), "the chain continues from the replay");
    mirror.start_over("test");
    assert_eq!((mirror.expected(), mirror.dump().blocks.len()), (None, 0));
}
