//! A reader for GGUF files (versions 2 and 3): header, metadata and tensor
//! descriptions. Tensor data is not read; the engine maps it separately.
//!
//! Every length read from the file is checked against the bytes that remain,
//! so a truncated or hostile file fails with an error instead of an
//! allocation of whatever size it claims.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::{Error, Result};

const MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array, if it is one.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(values) => Some(values),
            _ => None,
        }
    }
}

/// Description of one tensor stored in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first (GGUF order).
    pub dims: Vec<u64>,
    /// GGML type id (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K, ...).
    pub ggml_type: u32,
    /// Offset of the tensor's data relative to the start of the data section.
    pub offset: u64,
}

/// The parsed header of a GGUF file.
#[derive(Debug, Clone)]
pub struct Gguf {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key/value pairs, sorted by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor descriptions, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute file offset where tensor data begins.
    pub data_offset: u64,
}

impl Gguf {
    /// Reads the header, metadata and tensor descriptions of a GGUF file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        let len = file.metadata().map_err(|source| Error::Io { path: path.to_owned(), source })?.len();
        let mut reader = Reader { inner: BufReader::with_capacity(1 << 20, file), position: 0, len };
        Self::read(&mut reader).map_err(|error| match error {
            Error::Gguf(message) => Error::Gguf(format!("{}: {message}", path.display())),
            other => other,
        })
    }

    /// Parses a GGUF header from bytes (the whole file or at least its header).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut reader = Reader { inner: bytes, position: 0, len: bytes.len() as u64 };
        Self::read(&mut reader)
    }

    fn read<R: Read>(reader: &mut Reader<R>) -> Result<Self> {
        let mut magic = [0u8; 4];
        reader.read_exact(&mut magic)?;
        if magic != MAGIC {
            return Err(Error::Gguf("not a GGUF file (bad magic)".into()));
        }
        let version = reader.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::Gguf(format!("unsupported GGUF version {version} (2 and 3 are supported)")));
        }
        let tensor_count = reader.u64()?;
        let metadata_count = reader.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..metadata_count {
            let key = reader.string()?;
            let value_type = reader.u32()?;
            let value = reader.value(value_type, 0)?;
            metadata.insert(key, value);
        }
        // Each tensor description takes at least 24 bytes.
        reader.check_count(tensor_count, 24)?;
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = reader.string()?;
            let n_dims = reader.u32()?;
            if n_dims > 8 {
                return Err(Error::Gguf(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| reader.u64()).collect::<Result<Vec<_>>>()?;
            let ggml_type = reader.u32()?;
            let offset = reader.u64()?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset });
        }
        let alignment = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 {
            return Err(Error::Gguf("general.alignment is 0".into()));
        }
        let data_offset = reader.position.div_ceil(alignment) * alignment;
        Ok(Self { version, metadata, tensors, data_offset })
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A string metadata value by key.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// An unsigned integer metadata value by key.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    /// The model architecture (`general.architecture`), e.g. `llama`.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// The architecture-scoped value `<arch>.<suffix>`, e.g. `llama.context_length`.
    pub fn arch_u64(&self, suffix: &str) -> Option<u64> {
        let arch = self.architecture()?;
        self.get_u64(&format!("{arch}.{suffix}"))
    }
}

/// A byte reader that tracks its position and refuses lengths beyond the end.
struct Reader<R> {
    inner: R,
    position: u64,
    len: u64,
}

impl<R: Read> Reader<R> {
    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        self.inner.read_exact(buf).map_err(|_| Error::Gguf(format!("truncated at byte {}", self.position)))?;
        self.position += buf.len() as u64;
        Ok(())
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.position)
    }

    /// Refuses `count` items of at least `min_item_bytes` each if they cannot fit.
    fn check_count(&self, count: u64, min_item_bytes: u64) -> Result<()> {
        if count.saturating_mul(min_item_bytes) > self.remaining() {
            return Err(Error::Gguf(format!("count {count} at byte {} exceeds the file size", self.position)));
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.read_exact(&mut buf)?;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        self.check_count(len, 1)?;
        let mut bytes = vec![0u8; len as usize];
        self.read_exact(&mut bytes)?;
        // Some converters wrote invalid UTF-8 into token strings; keep going.
        Ok(String::from_utf8(bytes).unwrap_or_else(|error| String::from_utf8_lossy(error.as_bytes()).into_owned()))
    }

    fn value(&mut self, value_type: u32, depth: u32) -> Result<Value> {
        Ok(match value_type {
            0 => Value::U8(u8::from_le_bytes(self.array()?)),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(Error::Gguf("metadata arrays nested too deeply".into()));
                }
                let item_type = self.u32()?;
                let count = self.u64()?;
                self.check_count(count, 1)?;
                let mut items = Vec::with_capacity(count.min(1 << 20) as usize);
                for _ in 0..count {
                    items.push(self.value(item_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(Error::Gguf(format!("unknown metadata value type {other}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a minimal GGUF v3 header in memory.
    pub(crate) fn build(metadata: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value_type, value) in metadata {
            out.extend_from_slice(&(key.len() as u64).to_le_bytes());
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(&value_type.to_le_bytes());
            out.extend_from_slice(value);
        }
        for (name, dims, ggml_type, offset) in tensors {
            out.extend_from_slice(&(name.len() as u64).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for dim in *dims {
                out.extend_from_slice(&dim.to_le_bytes());
            }
            out.extend_from_slice(&ggml_type.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        out
    }

    fn string_value(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let mut array = 8u32.to_le_bytes().to_vec();
        array.extend_from_slice(&2u64.to_le_bytes());
        array.extend(string_value("a"));
        array.extend(string_value("b"));
        let bytes = build(
            &[
                ("general.architecture", 8, string_value("llama")),
                ("llama.context_length", 4, 8192u32.to_le_bytes().to_vec()),
                ("tokenizer.ggml.tokens", 9, array),
            ],
            &[("token_embd.weight", &[576, 49152], 8, 0)],
        );
        let gguf = Gguf::from_bytes(&bytes).unwrap();
        assert_eq!(gguf.architecture(), Some("llama"));
        assert_eq!(gguf.arch_u64("context_length"), Some(8192));
        let tokens = gguf.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
        assert_eq!(tokens, &[Value::String("a".into()), Value::String("b".into())]);
        assert_eq!(gguf.tensors[0].dims, vec![576, 49152]);
        assert_eq!(gguf.data_offset % 32, 0);
        assert!(gguf.data_offset >= bytes.len() as u64);
    }

    #[test]
    fn refuses_bad_magic_and_truncation_and_huge_counts() {
        assert!(matches!(Gguf::from_bytes(b"GGML\x03\0\0\0"), Err(Error::Gguf(_))));
        let bytes = build(&[("general.architecture", 8, string_value("llama"))], &[]);
        assert!(matches!(Gguf::from_bytes(&bytes[..bytes.len() - 2]), Err(Error::Gguf(_))));
        // An array claiming 2^40 strings in a file of a few bytes.
        let mut array = 8u32.to_le_bytes().to_vec();
        array.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let bytes = build(&[("tokenizer.ggml.tokens", 9, array)], &[]);
        let error = Gguf::from_bytes(&bytes).unwrap_err().to_string();
        assert!(error.contains("exceeds the file size"), "{error}");
    }
}
