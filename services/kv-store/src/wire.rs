//! `turbine.kvstore.v1`'s blocks to and from the store's own types, and
//! the contract's limits: what the gRPC shell and the data path share, so
//! that neither reaches into the other (the client's side converts in
//! `turbine_api::kv_store`).

use turbine_kv::SequenceHash;
use turbine_proto::kvstore::v1 as pb;

use turbine_api::kv_store::block_message;
pub use turbine_api::kv_store::{MAX_PUT_FROM_BYTES, block_from_pb as from_pb};

use crate::store::MemoryBlock;

/// A held block for the wire (its bytes copied off the arena).
pub(crate) fn held_to_pb(sequence: SequenceHash, block: &MemoryBlock) -> pb::Block {
    block_message(sequence, block.local, block.parent, block.checksum, block.slots.to_vec())
}
