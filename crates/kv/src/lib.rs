//! KV block identity shared by every engine, the router and the index.
//!
//! A prompt is cut into blocks of `block_size` tokens; only complete blocks
//! are hashed. Each block has a *local* hash (its tokens alone) and a
//! *sequence* hash chained over every block before it, so two prompts share a
//! sequence hash exactly when they share that whole prefix. The scheme is
//! Dynamo's (XXH3-64, seed 1337, tokens as little-endian `u32`), so traces
//! and tools interoperate. A LoRA adapter or tenant salt changes the seed.

mod block;
pub mod block_file;
pub mod events;
pub mod fair;
pub mod index;
mod layout;
pub mod memory;
pub mod unregistered;
mod worker_id;

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use block::{HostBlock, block_checksum};
pub use events::{CachedBlock, Dump, EventBatch, KvEvent, NumberedEvent, StoredBlock, Tier, TierSet, WorkerDump};
pub use index::{FindMatches, KvIndex, WorkerMatch};
pub use layout::{KvLayout, UcxKeys, UcxNetwork, UcxRangeKey, UcxRegion};
pub use memory::{DeviceKv, DeviceMemory, DeviceReadError, KvAllocator, KvBuffer, KvMemory};
pub use unregistered::Unregistered;
pub use worker_id::{STORE_PREFIX, WorkerId};

/// Seed of the block hash when no salt is in use.
pub const DEFAULT_SEED: u64 = 1337;

/// Hash of one block's tokens alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalBlockHash(pub u64);

/// Hash of a block chained over every block before it: the block's identity
/// in a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// Both hashes of one complete block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHashes {
    /// The block's tokens alone.
    pub local: LocalBlockHash,
    /// The block chained over its prefix.
    pub sequence: SequenceHash,
}

/// A namespace of KV blocks: requests of different salts never share a
/// block in any cache (their block hashes differ), so none can hit, or time,
/// another's. [`CacheSalt::SHARED`] is the deployment's common namespace
/// (the hashes of an unsalted hasher).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CacheSalt(u64);

impl CacheSalt {
    /// The shared namespace.
    pub const SHARED: CacheSalt = CacheSalt(0);

    /// The salt of this wire value (0: shared).
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The salt named by `parts` (a tenant, a client's `cache_salt`), never
    /// the shared one: each part is hashed with its length, so no two
    /// lists of parts run together.
    pub fn of(parts: &[&str]) -> Self {
        let mut bytes = Vec::new();
        for part in parts {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part.as_bytes());
        }
        match xxh3_64_with_seed(&bytes, DEFAULT_SEED) {
            0 => Self(1),
            value => Self(value),
        }
    }

    /// The wire value.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Whether this is the shared namespace.
    pub const fn is_shared(self) -> bool {
        self.0 == 0
    }
}

/// Whose blocks these are, for the shared store's quotas: a tenant's name
/// hashed ([`KvTenant::of`]), or [`KvTenant::SHARED`] for blocks of the
/// deployment's shared namespace (every block of an open deployment). A
/// tenant's blocks may span many cache namespaces (its clients'
/// `cache_salt`s); its quota counts them all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KvTenant(u64);

impl KvTenant {
    /// The shared namespace's blocks.
    pub const SHARED: KvTenant = KvTenant(0);

    /// The tenant of this wire value (0: shared).
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The party named by `parts` (a tenant's name, a shared cache's),
    /// never the shared namespace; parts never run together.
    pub fn of(parts: &[&str]) -> Self {
        let mut named = vec!["kv-tenant"];
        named.extend_from_slice(parts);
        Self(CacheSalt::of(&named).get())
    }

    /// The tenant an API key names (the gateway's requests of its keys).
    pub fn of_tenant(name: &str) -> Self {
        Self::of(&["tenant", name])
    }

    /// A shared prefix namespace's own (keys that opt into sharing it).
    pub fn of_shared(name: &str) -> Self {
        Self::of(&["shared", name])
    }

    /// The wire value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// A tenant as an operator names it: `open` (the shared namespace of a
/// deployment without keys), `tenant:NAME` (an API key's tenant) or
/// `shared:NAME` (a shared prefix namespace).
impl std::str::FromStr for KvTenant {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.split_once(':') {
            _ if text == "open" => Ok(Self::SHARED),
            Some(("tenant", name)) if !name.is_empty() => Ok(Self::of_tenant(name)),
            Some(("shared", name)) if !name.is_empty() => Ok(Self::of_shared(name)),
            _ => Err(format!("{text:?}: a KV tenant is open, tenant:NAME or shared:NAME")),
        }
    }
}

/// Computes block hashes for one salt (seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    seed: u64,
}

impl Default for BlockHasher {
    fn default() -> Self {
        Self { seed: DEFAULT_SEED }
    }
}

impl BlockHasher {
    /// A hasher whose hashes differ from every other salt's: different
    /// adapters or tenants never share KV blocks.
    pub fn with_seed(seed: u64) -> Self {
        Self { seed }
    }

    /// The hasher of `salt`'s namespace over base seed `seed` (the shared
    /// namespace: `seed` itself).
    pub fn salted(seed: u64, salt: CacheSalt) -> Self {
        if salt.is_shared() { Self::with_seed(seed) } else { Self { seed: xxh3_64_with_seed(&salt.0.to_le_bytes(), seed) } }
    }

    /// Local hash of one block of tokens.
    pub fn local(&self, tokens: &[u32]) -> LocalBlockHash {
        LocalBlockHash(xxh3_64_with_seed(&le_bytes(tokens), self.seed))
    }

    /// Sequence hash of a block given its parent's sequence hash (`None` for
    /// the first block, whose sequence hash is its local hash).
    pub fn chain(&self, parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
        match parent {
            None => SequenceHash(local.0),
            Some(parent) => {
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
                bytes[8..].copy_from_slice(&local.0.to_le_bytes());
                SequenceHash(xxh3_64_with_seed(&bytes, self.seed))
            }
        }
    }

    /// Hashes of every complete block of `tokens`; a trailing partial block
    /// is ignored.
    pub fn hash_blocks(&self, tokens: &[u32], block_size: usize) -> Vec<BlockHashes> {
        assert!(block_size > 0, "block size must be positive");
        let mut parent = None;
        tokens
            .chunks_exact(block_size)
            .map(|block| {
                let local = self.local(block);
                let sequence = self.chain(parent, local);
                parent = Some(sequence);
                BlockHashes { local, sequence }
            })
            .collect()
    }

    /// Sequence hashes of every complete block of `tokens`.
    pub fn sequence_hashes(&self, tokens: &[u32], block_size: usize) -> Vec<SequenceHash> {
        assert!(block_size > 0, "block size must be positive");
        let mut parent = None;
        tokens
            .chunks_exact(block_size)
            .map(|block| {
                let sequence = self.chain(parent, self.local(block));
                parent = Some(sequence);
                sequence
            })
            .collect()
    }
}

/// Tokens as little-endian bytes: borrowed as they are on little-endian
/// machines, copied elsewhere.
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
    } else {
        std::borrow::Cow::Owned(tokens.iter().flat_map(|token| token.to_le_bytes()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counting_tokens_match_the_reference_vectors() {
        let tokens: Vec<u32> = (1..=34).collect();
        let blocks = BlockHasher::default().hash_blocks(&tokens, 16);
        assert_eq!(blocks.len(), 2, "the last two tokens form no complete block");
        assert_eq!(blocks[0].local.0, 0xea06fc71a5ee6e88);
        assert_eq!(blocks[0].sequence.0, 0xea06fc71a5ee6e88);
        assert_eq!(blocks[1].local.0, 0x1fbf39bd106be0b5);
        assert_eq!(blocks[1].sequence.0, 0xad01835a37dd294c);
    }

    #[test]
    fn extreme_tokens_match_the_reference_vectors() {
        let mut tokens = vec![0u32; 16];
        tokens.extend(std::iter::repeat_n(u32::MAX, 16));
        let blocks = BlockHasher::default().hash_blocks(&tokens, 16);
        assert_eq!(blocks[0].local.0, 0x4ca6490661395090);
        assert_eq!(blocks[0].sequence.0, 0x4ca6490661395090);
        assert_eq!(blocks[1].local.0, 0x7d8b6f9b721bb4ad);
        assert_eq!(blocks[1].sequence.0, 0xe9ed5b2665b2b029);
    }

    #[test]
    fn operators_name_tenants_as_the_gateway_charges_them() {
        assert_eq!("open".parse(), Ok(KvTenant::SHARED));
        assert_eq!("tenant:acme".parse(), Ok(KvTenant::of_tenant("acme")));
        assert_eq!("shared:system:v2".parse(), Ok(KvTenant::of_shared("system:v2")), "a name may hold a colon");
        assert_ne!(KvTenant::of_tenant("acme"), KvTenant::of_shared("acme"));
        for bad in ["acme", "tenant:", "shared:", "user:acme", ""] {
            assert!(bad.parse::<KvTenant>().unwrap_err().contains("tenant:NAME"), "{bad:?}");
        }
    }

    #[test]
    fn salted_namespaces_share_no_block() {
        let tokens: Vec<u32> = (0..64).collect();
        let hashes = |salt| BlockHasher::salted(DEFAULT_SEED, salt).sequence_hashes(&tokens, 16);
        assert_eq!(hashes(CacheSalt::SHARED), BlockHasher::default().sequence_hashes(&tokens, 16), "the shared namespace is the unsalted one");
        let (a, b) = (CacheSalt::of(&["tenant-a"]), CacheSalt::of(&["tenant-b"]));
        assert_ne!(a, b);
        assert!(!a.is_shared() && !CacheSalt::of(&[]).is_shared());
        assert_ne!(CacheSalt::of(&["ab", "c"]), CacheSalt::of(&["a", "bc"]), "parts never run together");
        for (x, y) in [(CacheSalt::SHARED, a), (a, b)] {
            assert!(hashes(x).iter().all(|hash| !hashes(y).contains(hash)), "{x:?} and {y:?} share a block");
        }
        assert_eq!(hashes(a), hashes(CacheSalt::of(&["tenant-a"])), "a salt is stable");
    }

    #[test]
    fn a_salt_changes_every_hash() {
        let tokens: Vec<u32> = (1..=32).collect();
        let plain = BlockHasher::default().hash_blocks(&tokens, 16);
        let salted = BlockHasher::with_seed(7).hash_blocks(&tokens, 16);
        for (a, b) in plain.iter().zip(&salted) {
            assert_ne!(a, b);
        }
    }

    #[test]
    fn shared_prefixes_share_sequence_hashes_and_diverge_after() {
        let hasher = BlockHasher::default();
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[20] = 9999;
        let (ha, hb) = (hasher.hash_blocks(&a, 16), hasher.hash_blocks(&b, 16));
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1].sequence, hb[1].sequence);
        // Block 2 has identical tokens but a different prefix.
        assert_eq!(ha[2].local, hb[2].local);
        assert_ne!(ha[2].sequence, hb[2].sequence);
    }
}
