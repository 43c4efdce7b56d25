//! `turbine.kvstore.v1`'s blocks to and from the store's own types, and
//! the contract's limits: what the gRPC shell, the client and the data
//! path share, so that none of them reaches into another.

use turbine_engine::HostBlock;
use turbine_kv::{LocalBlockHash, SequenceHash};
use turbine_proto::kvstore::v1 as pb;

use crate::store::MemoryBlock;

/// Most bytes one PutFrom may stage (the store reads them into one buffer).
/// (Counted beyond the memory tier: keep it small next to it.)
pub const MAX_PUT_FROM_BYTES: u64 = 16 << 20;

/// A block off the wire, as the store keeps it.
pub(crate) fn from_pb(block: pb::Block) -> (SequenceHash, HostBlock) {
    let pb::Block { sequence_hash, local_hash, parent_hash, checksum, data } = block;
    (
        SequenceHash(sequence_hash),
        HostBlock { local: LocalBlockHash(local_hash), parent: parent_hash.map(SequenceHash), checksum, bytes: data.into_boxed_slice() },
    )
}

/// A block for the wire.
pub(crate) fn to_pb(sequence: SequenceHash, block: &HostBlock) -> pb::Block {
    pb::Block {
        sequence_hash: sequence.0,
        local_hash: block.local.0,
        parent_hash: block.parent.map(|p| p.0),
        checksum: block.checksum,
        data: block.bytes.to_vec(),
    }
}

/// A held block for the wire (its bytes copied off the arena).
pub(crate) fn held_to_pb(sequence: SequenceHash, block: &MemoryBlock) -> pb::Block {
    pb::Block {
        sequence_hash: sequence.0,
        local_hash: block.local.0,
        parent_hash: block.parent.map(|p| p.0),
        checksum: block.checksum,
        data: block.slots.to_vec(),
    }
}
