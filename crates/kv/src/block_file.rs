//! One KV block in one file: the format the disk tier (G3) and the
//! kv-store's disk tier share.
//!
//! A file is a 72-byte header (magic, version, the layout fingerprint, the
//! block's sequence, local and parent hashes, the payload's length and
//! XXH3-64, the block's tenant, and the header's own XXH3-64) followed by
//! the block's bytes (version 1 files, still read, have a 64-byte header
//! without the tenant: their blocks are the shared namespace's). It
//! is written to a `.tmp` file and renamed into place, so a reader never
//! sees half a block; after a crash a file may still be torn or empty, so
//! every read checks the header, the length and the payload's checksum and
//! refuses a block that fails.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use crate::{HostBlock, KvTenant, LocalBlockHash, SequenceHash, block_checksum};

const MAGIC: [u8; 4] = *b"TKVB";
const VERSION: u32 = 2;
/// Bytes of a block file's header (as written now).
pub const HEADER_BYTES: usize = 72;
/// Bytes of a version 1 header.
const V1_HEADER_BYTES: usize = 64;
/// The extension of a block file (`.tmp` while it is being written).
pub const EXTENSION: &str = "kvb";

/// The header of a block file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// The layout the bytes are in.
    pub fingerprint: u64,
    /// The prefix the block ends.
    pub sequence: SequenceHash,
    /// The block's own tokens.
    pub local: LocalBlockHash,
    /// The block before it, if any.
    pub parent: Option<SequenceHash>,
    /// Payload bytes.
    pub len: u64,
    /// XXH3-64 of the payload.
    pub checksum: u64,
    /// Whose block it is.
    pub tenant: KvTenant,
    /// Bytes of the header in its file (64 for a version 1 file).
    header_bytes: u8,
}

impl BlockHeader {
    /// The header of a file written now.
    pub fn new(fingerprint: u64, sequence: SequenceHash, block: &HostBlock) -> Self {
        Self {
            fingerprint,
            sequence,
            local: block.local,
            parent: block.parent,
            len: block.bytes.len() as u64,
            checksum: block.checksum,
            tenant: block.tenant,
            header_bytes: HEADER_BYTES as u8,
        }
    }

    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..8].copy_from_slice(&VERSION.to_le_bytes());
        out[8..16].copy_from_slice(&self.fingerprint.to_le_bytes());
        out[16..24].copy_from_slice(&self.sequence.0.to_le_bytes());
        out[24..32].copy_from_slice(&self.local.0.to_le_bytes());
        if let Some(parent) = self.parent {
            out[32..40].copy_from_slice(&parent.0.to_le_bytes());
            out[40] = 1;
        }
        out[41..48].copy_from_slice(&self.len.to_le_bytes()[..7]);
        out[48..56].copy_from_slice(&self.checksum.to_le_bytes());
        out[56..64].copy_from_slice(&self.tenant.get().to_le_bytes());
        let own = xxh3_64(&out[..64]);
        out[64..72].copy_from_slice(&own.to_le_bytes());
        out
    }

    /// The header at the start of `bytes` (at least [`HEADER_BYTES`], or
    /// [`V1_HEADER_BYTES`] of a version 1 file), if it is sound.
    fn decode(bytes: &[u8]) -> Option<Self> {
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        if bytes.len() < V1_HEADER_BYTES || bytes[0..4] != MAGIC {
            return None;
        }
        let (tenant, header_bytes) = match u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) {
            1 if xxh3_64(&bytes[..56]) == u64_at(56) => (KvTenant::SHARED, V1_HEADER_BYTES),
            VERSION if bytes.len() >= HEADER_BYTES && xxh3_64(&bytes[..64]) == u64_at(64) => (KvTenant::new(u64_at(56)), HEADER_BYTES),
            _ => return None,
        };
        let mut len = [0u8; 8];
        len[..7].copy_from_slice(&bytes[41..48]);
        Some(Self {
            fingerprint: u64_at(8),
            sequence: SequenceHash(u64_at(16)),
            local: LocalBlockHash(u64_at(24)),
            parent: (bytes[40] == 1).then(|| SequenceHash(u64_at(32))),
            len: u64::from_le_bytes(len),
            checksum: u64_at(48),
            tenant,
            header_bytes: header_bytes as u8,
        })
    }

    /// Reads the header at the start of `file` (which is left just past it).
    fn read_from(file: &mut File) -> Option<Self> {
        let mut bytes = [0u8; HEADER_BYTES];
        file.read_exact(&mut bytes[..V1_HEADER_BYTES]).ok()?;
        if bytes[4..8] != VERSION.to_le_bytes() {
            return Self::decode(&bytes[..V1_HEADER_BYTES]);
        }
        file.read_exact(&mut bytes[V1_HEADER_BYTES..]).ok()?;
        Self::decode(&bytes)
    }

    /// The whole file's length.
    pub fn file_bytes(&self) -> u64 {
        u64::from(self.header_bytes) + self.len
    }
}

/// The file of block `sequence` in `dir`: `<16 hex digits>.kvb`.
pub fn block_path(dir: &Path, sequence: SequenceHash) -> PathBuf {
    dir.join(format!("{:016x}.{EXTENSION}", sequence.0))
}

/// Writes `block` (of layout `fingerprint`) to `path`, through a `.tmp`
/// file renamed into place; returns the file's length. A failed write
/// leaves no file behind.
pub fn write_block(path: &Path, fingerprint: u64, sequence: SequenceHash, block: &HostBlock) -> std::io::Result<u64> {
    let header = BlockHeader::new(fingerprint, sequence, block);
    let partial = path.with_extension("tmp");
    let written = File::create(&partial).and_then(|mut file| {
        file.write_all(&header.encode())?;
        file.write_all(&block.bytes)
    });
    match written.and_then(|()| std::fs::rename(&partial, path)) {
        Ok(()) => Ok(header.file_bytes()),
        Err(error) => {
            let _ = std::fs::remove_file(&partial);
            Err(error)
        }
    }
}

/// Reads the block in `path`, which must be block `sequence` of layout
/// `fingerprint`; None if the file is missing, torn, corrupt or another
/// block's.
pub fn read_block(path: &Path, fingerprint: u64, sequence: SequenceHash) -> Option<HostBlock> {
    let mut file = File::open(path).ok()?;
    let header = BlockHeader::read_from(&mut file)?;
    if header.fingerprint != fingerprint || header.sequence != sequence {
        return None;
    }
    let mut bytes = Vec::with_capacity(usize::try_from(header.len).ok()?);
    file.read_to_end(&mut bytes).ok()?;
    (bytes.len() as u64 == header.len && block_checksum(&bytes) == header.checksum).then(|| HostBlock {
        local: header.local,
        parent: header.parent,
        checksum: header.checksum,
        bytes: bytes.into_boxed_slice(),
        tenant: header.tenant,
    })
}

/// The header of the block file at `path`, if it is sound and the file's
/// length matches it (the payload is not read: a rebuild at start trusts
/// it until the block is read).
pub fn read_header(path: &Path) -> Option<BlockHeader> {
    let mut file = File::open(path).ok()?;
    let file_len = file.metadata().ok()?.len();
    let header = BlockHeader::read_from(&mut file)?;
    (header.file_bytes() == file_len).then_some(header)
}

/// What a directory of block files holds at start: the sound files (by
/// header), after deleting leftover `.tmp` files and files that are torn
/// or not named after their block.
pub fn scan_dir(dir: &Path) -> std::io::Result<Vec<BlockHeader>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("tmp") => {
                let _ = std::fs::remove_file(&path);
            }
            Some(EXTENSION) => match read_header(&path) {
                Some(header) if path == block_path(dir, header.sequence) => found.push(header),
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            },
            _ => {}
        }
    }
    Ok(found)
}

/// Takes `dir` for this process alone (an exclusive lock on `<dir>/.lock`,
/// held while the returned file is open), creating it if needed; `user`
/// names the kind of process in the error when another holds it.
pub fn lock_dir(dir: &Path, user: &str) -> std::io::Result<File> {
    std::fs::create_dir_all(dir)?;
    let lock = File::create(dir.join(".lock"))?;
    lock.try_lock().map_err(|_| std::io::Error::other(format!("{} is in use by another {user} (its .lock is held)", dir.display())))?;
    Ok(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_a_flipped_bit_is_refused() {
        let header = BlockHeader {
            fingerprint: 7,
            sequence: SequenceHash(u64::MAX),
            local: LocalBlockHash(3),
            parent: Some(SequenceHash(0)),
            len: 368_640,
            checksum: 42,
            tenant: KvTenant::of(&["t"]),
            header_bytes: HEADER_BYTES as u8,
        };
        let mut encoded = header.encode();
        assert_eq!(BlockHeader::decode(&encoded), Some(header));
        let first = BlockHeader { parent: None, ..header };
        assert_eq!(BlockHeader::decode(&first.encode()), Some(first));
        for at in [20, 60] {
            let mut flipped = encoded;
            flipped[at] ^= 1;
            assert_eq!(BlockHeader::decode(&flipped), None, "a flipped bit at {at}");
        }

        // A version 1 header (64 bytes, no tenant) still reads: the shared
        // namespace's block.
        encoded[4..8].copy_from_slice(&1u32.to_le_bytes());
        let own = xxh3_64(&encoded[..56]);
        encoded[56..64].copy_from_slice(&own.to_le_bytes());
        let v1 = BlockHeader::decode(&encoded[..64]).expect("a version 1 header");
        assert_eq!((v1.tenant, v1.file_bytes(), v1.checksum), (KvTenant::SHARED, 64 + 368_640, 42));
    }

    #[test]
    fn a_block_reads_back_only_as_itself() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Box<[u8]> = (0..1000u32).map(|i| i as u8).collect();
        let block =
            HostBlock { local: LocalBlockHash(5), parent: Some(SequenceHash(4)), checksum: block_checksum(&bytes), bytes, tenant: KvTenant::of(&["t"]) };
        let path = block_path(dir.path(), SequenceHash(9));
        assert_eq!(write_block(&path, 3, SequenceHash(9), &block).unwrap(), 1000 + HEADER_BYTES as u64);
        let read = read_block(&path, 3, SequenceHash(9)).expect("sound");
        assert_eq!((read.local, read.parent, &read.bytes, read.tenant), (block.local, block.parent, &block.bytes, block.tenant));
        assert!(read_block(&path, 4, SequenceHash(9)).is_none(), "another layout");
        assert!(read_block(&path, 3, SequenceHash(8)).is_none(), "another block");
        let mut torn = std::fs::read(&path).unwrap();
        torn.truncate(500);
        std::fs::write(&path, &torn).unwrap();
        assert!(read_block(&path, 3, SequenceHash(9)).is_none() && read_header(&path).is_none());
        assert!(scan_dir(dir.path()).unwrap().is_empty() && !path.exists(), "a torn file is deleted at a scan");
    }
}
