//! KV events and dumps between the domain types and `turbine.kvindex.v1`.

use turbine_kv::{CachedBlock, Dump, KvEvent, LocalBlockHash, NumberedEvent, SequenceHash, StoredBlock, Tier, TierSet};
use turbine_proto::kvindex::v1 as pb;

fn tier_to_proto(tier: Tier) -> pb::Tier {
    match tier {
        Tier::Device => pb::Tier::Device,
        Tier::Host => pb::Tier::Host,
        Tier::Disk => pb::Tier::Disk,
        Tier::Remote => pb::Tier::Remote,
    }
}

fn tier_from_proto(tier: i32) -> Result<Tier, String> {
    match pb::Tier::try_from(tier) {
        Ok(pb::Tier::Unspecified | pb::Tier::Device) => Ok(Tier::Device),
        Ok(pb::Tier::Host) => Ok(Tier::Host),
        Ok(pb::Tier::Disk) => Ok(Tier::Disk),
        Ok(pb::Tier::Remote) => Ok(Tier::Remote),
        Err(_) => Err(format!("unknown tier {tier}")),
    }
}

/// One worker's events as a stream entry.
pub fn batch_to_proto(worker_id: &str, instance: u64, events: &[NumberedEvent]) -> pb::EventBatch {
    let events = events
        .iter()
        .map(|numbered| {
            let kind = match &numbered.event {
                KvEvent::Stored { parent, blocks, tier } => pb::kv_event::Kind::Stored(pb::Stored {
                    parent: parent.map(|p| p.0),
                    blocks: blocks.iter().map(|b| pb::StoredBlock { sequence_hash: b.sequence_hash.0, local_hash: b.local_hash.0 }).collect(),
                    tier: tier_to_proto(*tier) as i32,
                }),
                KvEvent::Removed { sequence_hashes, tier } => pb::kv_event::Kind::Removed(pb::Removed {
                    sequence_hashes: sequence_hashes.iter().map(|h| h.0).collect(),
                    tier: tier_to_proto(*tier) as i32,
                }),
                KvEvent::Cleared => pb::kv_event::Kind::Cleared(pb::Cleared {}),
            };
            pb::KvEvent { event_id: numbered.event_id, kind: Some(kind) }
        })
        .collect();
    pb::EventBatch { worker_id: worker_id.to_owned(), instance, events }
}

/// A decoded stream entry: worker, instance and events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The worker.
    pub worker_id: String,
    /// Its incarnation.
    pub instance: u64,
    /// Its events, in order.
    pub events: Vec<NumberedEvent>,
}

/// Validates and converts a stream entry.
pub fn batch_from_proto(batch: pb::EventBatch) -> Result<Batch, String> {
    if batch.worker_id.is_empty() {
        return Err("event batch without worker_id".into());
    }
    let events = batch
        .events
        .into_iter()
        .map(|event| {
            let converted = match event.kind {
                Some(pb::kv_event::Kind::Stored(stored)) => KvEvent::Stored {
                    parent: stored.parent.map(SequenceHash),
                    blocks: stored
                        .blocks
                        .iter()
                        .map(|b| StoredBlock { sequence_hash: SequenceHash(b.sequence_hash), local_hash: LocalBlockHash(b.local_hash) })
                        .collect(),
                    tier: tier_from_proto(stored.tier)?,
                },
                Some(pb::kv_event::Kind::Removed(removed)) => KvEvent::Removed {
                    sequence_hashes: removed.sequence_hashes.into_iter().map(SequenceHash).collect(),
                    tier: tier_from_proto(removed.tier)?,
                },
                Some(pb::kv_event::Kind::Cleared(_)) => KvEvent::Cleared,
                None => return Err(format!("event {} has no kind", event.event_id)),
            };
            Ok(NumberedEvent { event_id: event.event_id, event: converted })
        })
        .collect::<Result<_, String>>()?;
    Ok(Batch { worker_id: batch.worker_id, instance: batch.instance, events })
}

/// A worker's cache dump for the wire.
pub fn dump_to_proto(worker_id: &str, instance: u64, dump: &Dump) -> pb::WorkerDump {
    pb::WorkerDump {
        worker_id: worker_id.to_owned(),
        instance,
        next_event_id: dump.next_event_id,
        blocks: dump
            .blocks
            .iter()
            .map(|block| pb::CachedBlock {
                sequence_hash: block.sequence_hash.0,
                local_hash: block.local_hash.0,
                tiers: Tier::ALL.into_iter().filter(|&t| block.tiers.contains(t)).map(|t| tier_to_proto(t) as i32).collect(),
            })
            .collect(),
    }
}

/// A dump from the wire: (instance, dump).
pub fn dump_from_proto(dump: pb::WorkerDump) -> Result<(u64, Dump), String> {
    let blocks = dump
        .blocks
        .into_iter()
        .map(|block| {
            let mut tiers = TierSet::default();
            for tier in block.tiers {
                tiers.insert(tier_from_proto(tier)?);
            }
            if tiers.is_empty() {
                tiers.insert(Tier::Device);
            }
            Ok(CachedBlock { sequence_hash: SequenceHash(block.sequence_hash), local_hash: LocalBlockHash(block.local_hash), tiers })
        })
        .collect::<Result<_, String>>()?;
    Ok((dump.instance, Dump { next_event_id: dump.next_event_id, blocks }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_and_dumps_round_trip() {
        let events = vec![
            NumberedEvent {
                event_id: 0,
                event: KvEvent::Stored {
                    parent: None,
                    blocks: vec![StoredBlock { sequence_hash: SequenceHash(u64::MAX), local_hash: LocalBlockHash(7) }],
                    tier: Tier::Host,
                },
            },
            NumberedEvent { event_id: 1, event: KvEvent::Removed { sequence_hashes: vec![SequenceHash(3)], tier: Tier::Device } },
            NumberedEvent { event_id: 2, event: KvEvent::Cleared },
        ];
        let batch = batch_from_proto(batch_to_proto("w", 42, &events)).unwrap();
        assert_eq!(batch, Batch { worker_id: "w".into(), instance: 42, events });

        let mut tiers = TierSet::default();
        tiers.insert(Tier::Device);
        tiers.insert(Tier::Disk);
        let dump = Dump { next_event_id: 9, blocks: vec![CachedBlock { sequence_hash: SequenceHash(1), local_hash: LocalBlockHash(2), tiers }] };
        assert_eq!(dump_from_proto(dump_to_proto("w", 5, &dump)).unwrap(), (5, dump));
    }

    #[test]
    fn malformed_entries_are_refused() {
        let mut batch = batch_to_proto("w", 1, &[NumberedEvent { event_id: 0, event: KvEvent::Cleared }]);
        batch.events[0].kind = None;
        assert!(batch_from_proto(batch).unwrap_err().contains("no kind"));
        assert!(batch_from_proto(pb::EventBatch::default()).is_err());
        let mut bad_tier = batch_to_proto("w", 1, &[NumberedEvent { event_id: 0, event: KvEvent::Removed { sequence_hashes: vec![], tier: Tier::Device } }]);
        if let Some(pb::kv_event::Kind::Removed(removed)) = &mut bad_tier.events[0].kind {
            removed.tier = 99;
        }
        assert!(batch_from_proto(bad_tier).unwrap_err().contains("unknown tier"));
    }
}
