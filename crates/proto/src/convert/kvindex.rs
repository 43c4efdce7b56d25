//! `turbine.kvindex.v1` ⇄ `turbine-kv`: KV events, batches and dumps.

use turbine_kv::{CachedBlock, Dump, EventBatch, KvEvent, LocalBlockHash, NumberedEvent, SequenceHash, StoredBlock, Tier, TierSet, WorkerDump, WorkerId};

use super::{ConversionError, ConversionResult};
use crate::kvindex::v1 as pb;

impl From<Tier> for pb::Tier {
    fn from(tier: Tier) -> Self {
        match tier {
            Tier::Device => pb::Tier::Device,
            Tier::Host => pb::Tier::Host,
            Tier::Disk => pb::Tier::Disk,
            Tier::Remote => pb::Tier::Remote,
        }
    }
}

/// A tier from the wire; unspecified means device (the field was added
/// after the first events were published without it).
fn tier_from_wire(field: &'static str, value: i32) -> ConversionResult<Tier> {
    match pb::Tier::try_from(value) {
        Ok(pb::Tier::Unspecified | pb::Tier::Device) => Ok(Tier::Device),
        Ok(pb::Tier::Host) => Ok(Tier::Host),
        Ok(pb::Tier::Disk) => Ok(Tier::Disk),
        Ok(pb::Tier::Remote) => Ok(Tier::Remote),
        Err(_) => Err(ConversionError::UnknownEnum { field, value }),
    }
}

impl From<&NumberedEvent> for pb::KvEvent {
    fn from(numbered: &NumberedEvent) -> Self {
        let NumberedEvent { event_id, event } = numbered;
        let kind = match event {
            KvEvent::Stored { parent, blocks, tier } => pb::kv_event::Kind::Stored(pb::Stored {
                parent: parent.map(|p| p.0),
                blocks: blocks.iter().map(|b| pb::StoredBlock { sequence_hash: b.sequence_hash.0, local_hash: b.local_hash.0 }).collect(),
                tier: pb::Tier::from(*tier) as i32,
            }),
            KvEvent::Removed { sequence_hashes, tier } => {
                pb::kv_event::Kind::Removed(pb::Removed { sequence_hashes: sequence_hashes.iter().map(|h| h.0).collect(), tier: pb::Tier::from(*tier) as i32 })
            }
            KvEvent::Cleared => pb::kv_event::Kind::Cleared(pb::Cleared {}),
        };
        pb::KvEvent { event_id: *event_id, kind: Some(kind) }
    }
}

impl TryFrom<pb::KvEvent> for NumberedEvent {
    type Error = ConversionError;

    fn try_from(event: pb::KvEvent) -> ConversionResult<Self> {
        let pb::KvEvent { event_id, kind } = event;
        let event = match kind.ok_or(ConversionError::Missing("event.kind"))? {
            pb::kv_event::Kind::Stored(pb::Stored { parent, blocks, tier }) => KvEvent::Stored {
                parent: parent.map(SequenceHash),
                blocks: blocks
                    .into_iter()
                    .map(|pb::StoredBlock { sequence_hash, local_hash }| StoredBlock {
                        sequence_hash: SequenceHash(sequence_hash),
                        local_hash: LocalBlockHash(local_hash),
                    })
                    .collect(),
                tier: tier_from_wire("stored.tier", tier)?,
            },
            pb::kv_event::Kind::Removed(pb::Removed { sequence_hashes, tier }) => {
                KvEvent::Removed { sequence_hashes: sequence_hashes.into_iter().map(SequenceHash).collect(), tier: tier_from_wire("removed.tier", tier)? }
            }
            pb::kv_event::Kind::Cleared(pb::Cleared {}) => KvEvent::Cleared,
        };
        Ok(NumberedEvent { event_id, event })
    }
}

impl From<&EventBatch> for pb::EventBatch {
    fn from(batch: &EventBatch) -> Self {
        let EventBatch { worker_id, instance, events } = batch;
        pb::EventBatch { worker_id: worker_id.to_string(), instance: *instance, events: events.iter().map(pb::KvEvent::from).collect() }
    }
}

impl TryFrom<pb::EventBatch> for EventBatch {
    type Error = ConversionError;

    fn try_from(batch: pb::EventBatch) -> ConversionResult<Self> {
        let pb::EventBatch { worker_id, instance, events } = batch;
        if worker_id.is_empty() {
            return Err(ConversionError::Missing("batch.worker_id"));
        }
        let events = events
            .into_iter()
            .map(|event| {
                let event_id = event.event_id;
                NumberedEvent::try_from(event).map_err(|error| ConversionError::invalid("batch.events", format!("event {event_id}: {error}")))
            })
            .collect::<ConversionResult<_>>()?;
        Ok(EventBatch { worker_id: WorkerId::from(worker_id), instance, events })
    }
}

impl From<&CachedBlock> for pb::CachedBlock {
    fn from(block: &CachedBlock) -> Self {
        let CachedBlock { sequence_hash, local_hash, tiers } = block;
        pb::CachedBlock {
            sequence_hash: sequence_hash.0,
            local_hash: local_hash.0,
            tiers: Tier::ALL.into_iter().filter(|&tier| tiers.contains(tier)).map(|tier| pb::Tier::from(tier) as i32).collect(),
        }
    }
}

impl TryFrom<pb::CachedBlock> for CachedBlock {
    type Error = ConversionError;

    fn try_from(block: pb::CachedBlock) -> ConversionResult<Self> {
        let pb::CachedBlock { sequence_hash, local_hash, tiers: wire_tiers } = block;
        let mut tiers = TierSet::default();
        for tier in wire_tiers {
            tiers.insert(tier_from_wire("cached_block.tiers", tier)?);
        }
        // Dumps from before tiers were recorded list none: device.
        if tiers.is_empty() {
            tiers.insert(Tier::Device);
        }
        Ok(CachedBlock { sequence_hash: SequenceHash(sequence_hash), local_hash: LocalBlockHash(local_hash), tiers })
    }
}

impl From<&WorkerDump> for pb::WorkerDump {
    fn from(dump: &WorkerDump) -> Self {
        let WorkerDump { worker_id, instance, dump: Dump { next_event_id, blocks } } = dump;
        pb::WorkerDump {
            worker_id: worker_id.to_string(),
            instance: *instance,
            next_event_id: *next_event_id,
            blocks: blocks.iter().map(pb::CachedBlock::from).collect(),
        }
    }
}

impl TryFrom<pb::WorkerDump> for WorkerDump {
    type Error = ConversionError;

    fn try_from(dump: pb::WorkerDump) -> ConversionResult<Self> {
        let pb::WorkerDump { worker_id, instance, next_event_id, blocks } = dump;
        let blocks = blocks.into_iter().map(CachedBlock::try_from).collect::<ConversionResult<_>>()?;
        Ok(WorkerDump { worker_id: WorkerId::from(worker_id), instance, dump: Dump { next_event_id, blocks } })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events() -> Vec<NumberedEvent> {
        vec![
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
        ]
    }

    #[test]
    fn batches_and_dumps_round_trip() {
        let batch = EventBatch { worker_id: "w".into(), instance: 42, events: events() };
        assert_eq!(EventBatch::try_from(pb::EventBatch::from(&batch)).unwrap(), batch);

        let mut tiers = TierSet::default();
        tiers.insert(Tier::Device);
        tiers.insert(Tier::Disk);
        let dump = WorkerDump {
            worker_id: "w".into(),
            instance: 5,
            dump: Dump { next_event_id: 9, blocks: vec![CachedBlock { sequence_hash: SequenceHash(1), local_hash: LocalBlockHash(2), tiers }] },
        };
        assert_eq!(WorkerDump::try_from(pb::WorkerDump::from(&dump)).unwrap(), dump);
    }

    #[test]
    fn malformed_batches_are_refused_naming_the_problem() {
        let batch = EventBatch { worker_id: "w".into(), instance: 1, events: events() };
        let mut no_kind = pb::EventBatch::from(&batch);
        no_kind.events[2].kind = None;
        let error = EventBatch::try_from(no_kind).unwrap_err();
        assert_eq!(error.to_string(), "batch.events event 2: event.kind is required");

        assert_eq!(EventBatch::try_from(pb::EventBatch::default()).unwrap_err(), ConversionError::Missing("batch.worker_id"));

        let mut bad_tier = pb::EventBatch::from(&batch);
        if let Some(pb::kv_event::Kind::Removed(removed)) = &mut bad_tier.events[1].kind {
            removed.tier = 99;
        }
        assert!(EventBatch::try_from(bad_tier).unwrap_err().to_string().contains("removed.tier has the unknown value 99"));
    }
}
