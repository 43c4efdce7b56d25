//! A MessagePack reader (the format of engines' KV events): bytes into a
//! [`Value`] tree, bounded in depth and checked against the bytes left
//! before anything is allocated.

/// A decoded value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    /// Every integer MessagePack carries fits an i128.
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    /// An extension type and its bytes.
    Ext(i8, Vec<u8>),
}

impl Value {
    /// The value of `key` in a map with string keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| matches!(k, Value::Str(s) if s == key)).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Value::Nil)
    }
}

/// Deepest nesting read (engines' events nest four or five deep).
const MAX_DEPTH: usize = 32;

/// Why bytes are not MessagePack.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not MessagePack: {0}")]
pub struct MsgpackError(String);

/// Decodes one value that takes all of `bytes`.
pub fn decode(bytes: &[u8]) -> Result<Value, MsgpackError> {
    let mut reader = Reader { bytes, at: 0 };
    let value = reader.value(0)?;
    if reader.at != bytes.len() {
        return Err(MsgpackError(format!("{} bytes after the value", bytes.len() - reader.at)));
    }
    Ok(value)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or_else(|| MsgpackError(format!("{n} bytes wanted past the end")))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn uint(&mut self, n: usize) -> Result<u64, MsgpackError> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn int(&mut self, n: usize) -> Result<i64, MsgpackError> {
        let raw = self.uint(n)?;
        let shift = 64 - 8 * n as u32;
        Ok(((raw << shift) as i64) >> shift)
    }

    /// A count of items each taking at least `min_bytes`: refused when the
    /// bytes left cannot hold them.
    fn count(&mut self, n: usize, min_bytes: usize) -> Result<usize, MsgpackError> {
        let count = self.uint(n)? as usize;
        if count.saturating_mul(min_bytes) > self.bytes.len() - self.at {
            return Err(MsgpackError(format!("{count} items announced, fewer bytes left")));
        }
        Ok(count)
    }

    fn string(&mut self, len: usize) -> Result<Value, MsgpackError> {
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map(Value::Str).map_err(|_| MsgpackError("a string that is not UTF-8".into()))
    }

    fn array(&mut self, len: usize, depth: usize) -> Result<Value, MsgpackError> {
        (0..len).map(|_| self.value(depth + 1)).collect::<Result<_, _>>().map(Value::Array)
    }

    fn map(&mut self, len: usize, depth: usize) -> Result<Value, MsgpackError> {
        (0..len).map(|_| Ok((self.value(depth + 1)?, self.value(depth + 1)?))).collect::<Result<_, _>>().map(Value::Map)
    }

    fn ext(&mut self, len: usize) -> Result<Value, MsgpackError> {
        let kind = self.take(1)?[0] as i8;
        Ok(Value::Ext(kind, self.take(len)?.to_vec()))
    }

    fn value(&mut self, depth: usize) -> Result<Value, MsgpackError> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError(format!("nested over {MAX_DEPTH} deep")));
        }
        let marker = self.take(1)?[0];
        Ok(match marker {
            0x00..=0x7f => Value::Int(i128::from(marker)),
            0x80..=0x8f => return self.map(usize::from(marker & 0x0f), depth),
            0x90..=0x9f => return self.array(usize::from(marker & 0x0f), depth),
            0xa0..=0xbf => return self.string(usize::from(marker & 0x1f)),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let len = self.uint(1 << (marker - 0xc4))? as usize;
                Value::Bin(self.take(len)?.to_vec())
            }
            0xc7..=0xc9 => {
                let len = self.uint(1 << (marker - 0xc7))? as usize;
                return self.ext(len);
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.uint(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.uint(8)?)),
            0xcc..=0xcf => Value::Int(i128::from(self.uint(1 << (marker - 0xcc))?)),
            0xd0..=0xd3 => Value::Int(i128::from(self.int(1 << (marker - 0xd0))?)),
            0xd4..=0xd8 => return self.ext(1 << (marker - 0xd4)),
            0xd9..=0xdb => {
                let len = self.uint(1 << (marker - 0xd9))? as usize;
                return self.string(len);
            }
            0xdc | 0xdd => {
                let len = self.count(if marker == 0xdc { 2 } else { 4 }, 1)?;
                return self.array(len, depth);
            }
            0xde | 0xdf => {
                let len = self.count(if marker == 0xde { 2 } else { 4 }, 2)?;
                return self.map(len, depth);
            }
            0xe0..=0xff => Value::Int(i128::from(marker as i8)),
            0xc1 => return Err(MsgpackError("the reserved marker 0xc1".into())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_decodes() {
        // [1.5, {"type": "BlockStored", "block_hashes": [-1, 2**40], "x": nil, "b": bin(2), "t": true}, 0]
        let mut bytes = vec![0x93, 0xcb];
        bytes.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        bytes.push(0x85);
        bytes.extend_from_slice(b"\xa4type\xabBlockStored");
        bytes.extend_from_slice(b"\xacblock_hashes\x92\xff\xcf");
        bytes.extend_from_slice(&(1u64 << 40).to_be_bytes());
        bytes.extend_from_slice(b"\xa1x\xc0\xa1b\xc4\x02\x01\x02\xa1t\xc3");
        bytes.push(0x00);
        let value = decode(&bytes).unwrap();
        let items = value.as_array().unwrap();
        assert_eq!(items[0], Value::Float(1.5));
        assert_eq!(items[1].get("type").and_then(Value::as_str), Some("BlockStored"));
        assert_eq!(items[1].get("block_hashes").unwrap().as_array().unwrap(), &[Value::Int(-1), Value::Int(1 << 40)]);
        assert!(items[1].get("x").unwrap().is_nil());
        assert_eq!(items[1].get("b"), Some(&Value::Bin(vec![1, 2])));
        assert_eq!(items[1].get("t"), Some(&Value::Bool(true)));
        assert_eq!(decode(&[0xd1, 0xff, 0x38]).unwrap(), Value::Int(-200));
        assert_eq!(decode(&[0xd9, 0x02, b'h', b'i']).unwrap(), Value::Str("hi".into()));
    }

    #[test]
    fn hostile_bytes_are_refused_before_allocating() {
        assert!(decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err(), "four billion items announced in five bytes");
        assert!(decode(&[0xc6, 0xff, 0xff, 0xff, 0xff]).is_err(), "a 4 GiB binary announced");
        assert!(decode(&[0x91; 40]).is_err(), "nested too deep");
        assert!(decode(&[0x01, 0x02]).is_err(), "trailing bytes");
        assert!(decode(&[0xa2, 0xff, 0xfe]).is_err(), "not UTF-8");
        assert!(decode(&[]).is_err());
    }
}
