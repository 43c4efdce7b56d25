//! What a block is keyed by in the store, and why the store refuses
//! blocks: the words the store, its disk tier, its data path, its gRPC
//! shell and its client share.

use turbine_kv::SequenceHash;

pub use turbine_api::kv_store::Fingerprint;

/// Where a block lives in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// Its model and layout.
    pub fingerprint: Fingerprint,
    /// The prefix it ends.
    pub sequence: SequenceHash,
}

/// Why blocks were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// A block's bytes do not match its checksum.
    #[error("block {0:016x}: its bytes do not match its checksum")]
    Corrupt(u64),
    /// A fingerprint that declares no block size.
    #[error("fingerprint {0:016x} declares no block size (its top 32 bits are the bytes of each block)")]
    Undeclared(u64),
    /// A block's size differs from the one its fingerprint declares.
    #[error("block {sequence:016x} is {got} bytes; fingerprint {fingerprint:016x} declares blocks of {expected}")]
    WrongSize {
        /// The block.
        sequence: u64,
        /// Its fingerprint.
        fingerprint: u64,
        /// The size the fingerprint declares.
        expected: usize,
        /// This block's.
        got: usize,
    },
    /// A block larger than the whole store.
    #[error("a block of {0} bytes does not fit the store's memory ({1} bytes)")]
    TooLarge(usize, u64),
}
