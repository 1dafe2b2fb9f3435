//! A GGUF model file's header: its version, tensor count, architecture and the few metadata
//! figures that size its KV cache, read without its tensor data.
//!
//! Follows: ggml's `docs/gguf.md`: little-endian; `GGUF`, version (u32), tensor count and
//! metadata count (u64), then the metadata as key (a u64-length string), value type (u32) and
//! value; then each tensor's name, dimensions, type and offset. Versions 2 and 3 are read.
//! Owns: reading that much through a buffer, skipping what it does not need (a tokenizer's
//! vocabulary of 129,280 strings is skipped, not stored), with every length bounded. Must
//! not: read the tensor data, allocate what a length field claims, or panic on any input.

use std::fmt;
use std::io::{BufReader, Read};
use std::path::Path;

/// The longest string read (a key or a value).
const MAX_STRING: u64 = 1 << 20;
/// The most elements of one array.
const MAX_ARRAY: u64 = 1 << 31;
/// The most metadata entries or tensors.
const MAX_COUNT: u64 = 1 << 24;
/// The most dimensions of one tensor.
const MAX_DIMS: u32 = 8;

/// The figures of the header the doctor and the memory estimate use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    pub block_count: Option<u64>,
    pub context_length: Option<u64>,
    pub embedding_length: Option<u64>,
    pub head_count: Option<u64>,
    /// The largest per-layer value when the file gives one per layer.
    pub head_count_kv: Option<u64>,
    pub key_length: Option<u64>,
    pub value_length: Option<u64>,
    pub kv_lora_rank: Option<u64>,
    pub rope_dimension_count: Option<u64>,
    /// `tokenizer.ggml.tokens`' length, else `{arch}.vocab_size`.
    pub vocab_size: Option<u64>,
    pub file_type: Option<u32>,
}

/// A header as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub tensor_count: u64,
    pub kv_count: u64,
    /// `general.architecture`.
    pub architecture: Option<String>,
    pub meta: Meta,
    /// Bytes from the start to the end of the tensor descriptions.
    pub header_bytes: u64,
    /// `split.no` (from 0) and `split.count`, for a model in shards.
    pub split: Option<(u16, u16)>,
}

/// Why a header could not be read: what was being read, and at which byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GgufError {
    Io(String),
    NotGguf([u8; 4]),
    Version(u32),
    Truncated { at: u64, what: String },
    Bad { at: u64, what: String },
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufError::Io(e) => write!(f, "cannot read: {e}"),
            GgufError::NotGguf(m) => write!(
                f,
                "not a GGUF file: it starts with 0x{} (a GGUF file starts with \"GGUF\")",
                m.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
            GgufError::Version(v) => {
                write!(f, "GGUF version {v} is not supported (2 and 3 are)")
            }
            GgufError::Truncated { at, what } => {
                write!(f, "truncated at byte {at}, in {what}")
            }
            GgufError::Bad { at, what } => write!(f, "at byte {at}: {what}"),
        }
    }
}

/// Reads the header of the file at `path`.
pub fn read(path: &Path) -> Result<Header, GgufError> {
    let file = std::fs::File::open(path).map_err(|e| GgufError::Io(e.to_string()))?;
    parse(BufReader::with_capacity(1 << 16, file))
}

/// A value, as far as it is kept.
enum Value {
    Int(u64),
    Str(String),
    /// An array: its element count, and its largest integer element if any.
    Array(u64, Option<u64>),
    Other,
}

struct Reader<R> {
    inner: R,
    at: u64,
    /// What is being read, for the error.
    what: String,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                GgufError::Truncated {
                    at: self.at,
                    what: self.what.clone(),
                }
            } else {
                GgufError::Io(e.to_string())
            }
        })?;
        self.at += N as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn bad(&self, what: String) -> GgufError {
        GgufError::Bad { at: self.at, what }
    }

    /// Skips `n` bytes.
    fn skip(&mut self, n: u64) -> Result<(), GgufError> {
        let copied = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())
            .map_err(|e| GgufError::Io(e.to_string()))?;
        self.at += copied;
        if copied < n {
            return Err(GgufError::Truncated {
                at: self.at,
                what: self.what.clone(),
            });
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.bad(format!("a string of {len} bytes in {}", self.what)));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| GgufError::Truncated {
                at: self.at,
                what: self.what.clone(),
            })?;
        self.at += len;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// The size of a fixed-size value type, or `None` for a string or an array.
    fn fixed_size(kind: u32) -> Option<u64> {
        match kind {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    /// An integer of `kind`, when it is one (negative values are `None`).
    fn int(&mut self, kind: u32) -> Result<Option<u64>, GgufError> {
        Ok(match kind {
            0 => Some(u64::from(self.bytes::<1>()?[0])),
            1 => u64::try_from(i8::from_le_bytes(self.bytes()?)).ok(),
            2 => Some(u64::from(u16::from_le_bytes(self.bytes()?))),
            3 => u64::try_from(i16::from_le_bytes(self.bytes()?)).ok(),
            4 => Some(u64::from(self.u32()?)),
            5 => u64::try_from(i32::from_le_bytes(self.bytes()?)).ok(),
            10 => Some(self.u64()?),
            11 => u64::try_from(i64::from_le_bytes(self.bytes()?)).ok(),
            _ => None,
        })
    }

    fn value(&mut self, kind: u32) -> Result<Value, GgufError> {
        match kind {
            8 => Ok(Value::Str(self.string()?)),
            9 => {
                let elem = self.u32()?;
                let count = self.u64()?;
                if count > MAX_ARRAY {
                    return Err(self.bad(format!("an array of {count} elements in {}", self.what)));
                }
                match (elem, Self::fixed_size(elem)) {
                    // Integers are looked at (a per-layer head count); other arrays skipped.
                    (0..=5 | 10 | 11, Some(_)) => {
                        let mut max = None;
                        for _ in 0..count {
                            if let Some(v) = self.int(elem)? {
                                max = Some(max.map_or(v, |m: u64| m.max(v)));
                            }
                        }
                        Ok(Value::Array(count, max))
                    }
                    (_, Some(size)) => {
                        self.skip(size.saturating_mul(count))?;
                        Ok(Value::Array(count, None))
                    }
                    (8, None) => {
                        for _ in 0..count {
                            let len = self.u64()?;
                            if len > MAX_STRING {
                                return Err(
                                    self.bad(format!("a string of {len} bytes in {}", self.what))
                                );
                            }
                            self.skip(len)?;
                        }
                        Ok(Value::Array(count, None))
                    }
                    _ => Err(self.bad(format!(
                        "an array of value type {elem} in {} (not a GGUF type, or nested)",
                        self.what
                    ))),
                }
            }
            k => match Self::fixed_size(k) {
                Some(_) if matches!(k, 0..=5 | 10 | 11) => {
                    Ok(self.int(k)?.map_or(Value::Other, Value::Int))
                }
                Some(size) => {
                    self.skip(size)?;
                    Ok(Value::Other)
                }
                None => Err(self.bad(format!(
                    "value type {k} in {} is not a GGUF type",
                    self.what
                ))),
            },
        }
    }
}

/// Reads a header from `input`.
pub fn parse(input: impl Read) -> Result<Header, GgufError> {
    let mut r = Reader {
        inner: input,
        at: 0,
        what: "the magic".into(),
    };
    let magic: [u8; 4] = r.bytes()?;
    if &magic != b"GGUF" {
        return Err(GgufError::NotGguf(magic));
    }
    r.what = "the version".into();
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    r.what = "the tensor count".into();
    let tensor_count = r.u64()?;
    r.what = "the metadata count".into();
    let kv_count = r.u64()?;
    for (n, what) in [(tensor_count, "tensors"), (kv_count, "metadata entries")] {
        if n > MAX_COUNT {
            return Err(r.bad(format!("{n} {what} (more than any model has)")));
        }
    }
    let mut values: Vec<(String, Value)> = Vec::new();
    for i in 0..kv_count {
        r.what = format!("the key of metadata entry {i}");
        let key = r.string()?;
        r.what = format!("the value of key `{key}`");
        let kind = r.u32()?;
        let value = r.value(kind)?;
        if !matches!(value, Value::Other) {
            values.push((key, value));
        }
    }
    for i in 0..tensor_count {
        r.what = format!("the description of tensor {i}");
        let _name = r.string()?;
        let dims = r.u32()?;
        if dims > MAX_DIMS {
            return Err(r.bad(format!("tensor {i} has {dims} dimensions")));
        }
        r.skip(8 * u64::from(dims) + 4 + 8)?;
    }
    let text = |key: &str| {
        values.iter().find_map(|(k, v)| match v {
            Value::Str(s) if k == key => Some(s.clone()),
            _ => None,
        })
    };
    let architecture = text("general.architecture");
    let arch = architecture.clone().unwrap_or_default();
    let number = |key: &str| {
        values.iter().find_map(|(k, v)| match v {
            Value::Int(n) if k == key => Some(*n),
            Value::Array(_, max) if k == key => *max,
            _ => None,
        })
    };
    let of = |suffix: &str| number(&format!("{arch}.{suffix}"));
    let vocab = values.iter().find_map(|(k, v)| match v {
        Value::Array(count, _) if k == "tokenizer.ggml.tokens" => Some(*count),
        _ => None,
    });
    let meta = Meta {
        block_count: of("block_count"),
        context_length: of("context_length"),
        embedding_length: of("embedding_length"),
        head_count: of("attention.head_count"),
        head_count_kv: of("attention.head_count_kv"),
        key_length: of("attention.key_length"),
        value_length: of("attention.value_length"),
        kv_lora_rank: of("attention.kv_lora_rank"),
        rope_dimension_count: of("rope.dimension_count"),
        vocab_size: vocab.or_else(|| of("vocab_size")),
        file_type: number("general.file_type").and_then(|t| u32::try_from(t).ok()),
    };
    let split = match (number("split.no"), number("split.count")) {
        (Some(no), Some(count)) => u16::try_from(no).ok().zip(u16::try_from(count).ok()),
        _ => None,
    };
    Ok(Header {
        version,
        tensor_count,
        kv_count,
        architecture,
        meta,
        header_bytes: r.at,
        split,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes GGUF headers.
    #[derive(Default)]
    struct Builder {
        kvs: Vec<u8>,
        kv_count: u64,
        tensors: Vec<u8>,
        tensor_count: u64,
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    impl Builder {
        fn key(&mut self, k: &str, kind: u32) -> &mut Vec<u8> {
            self.kv_count += 1;
            string(&mut self.kvs, k);
            self.kvs.extend(kind.to_le_bytes());
            &mut self.kvs
        }
        fn u32(mut self, k: &str, v: u32) -> Self {
            self.key(k, 4).extend(v.to_le_bytes());
            self
        }
        fn u64(mut self, k: &str, v: u64) -> Self {
            self.key(k, 10).extend(v.to_le_bytes());
            self
        }
        fn str(mut self, k: &str, v: &str) -> Self {
            let out = self.key(k, 8);
            string(out, v);
            self
        }
        fn f32(mut self, k: &str, v: f32) -> Self {
            self.key(k, 6).extend(v.to_le_bytes());
            self
        }
        fn u32s(mut self, k: &str, v: &[u32]) -> Self {
            let out = self.key(k, 9);
            out.extend(4u32.to_le_bytes());
            out.extend((v.len() as u64).to_le_bytes());
            for x in v {
                out.extend(x.to_le_bytes());
            }
            self
        }
        fn strs(mut self, k: &str, v: &[&str]) -> Self {
            let out = self.key(k, 9);
            out.extend(8u32.to_le_bytes());
            out.extend((v.len() as u64).to_le_bytes());
            for s in v {
                string(out, s);
            }
            self
        }
        fn tensor(mut self, name: &str, dims: &[u64]) -> Self {
            self.tensor_count += 1;
            string(&mut self.tensors, name);
            self.tensors.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                self.tensors.extend(d.to_le_bytes());
            }
            self.tensors.extend(1u32.to_le_bytes());
            self.tensors.extend(0u64.to_le_bytes());
            self
        }
        fn bytes(&self, version: u32) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend(version.to_le_bytes());
            out.extend(self.tensor_count.to_le_bytes());
            out.extend(self.kv_count.to_le_bytes());
            out.extend(&self.kvs);
            out.extend(&self.tensors);
            out
        }
    }

    fn sample() -> Builder {
        Builder::default()
            .str("general.architecture", "llama")
            .u32("general.file_type", 15)
            .u32("llama.block_count", 32)
            .u64("llama.context_length", 131072)
            .u32("llama.embedding_length", 4096)
            .u32("llama.attention.head_count", 32)
            .u32s("llama.attention.head_count_kv", &[8, 8, 4, 8])
            .f32("llama.rope.freq_base", 500000.0)
            .strs("tokenizer.ggml.tokens", &["a", "b", "c"])
            .tensor("token_embd.weight", &[4096, 3])
            .tensor("output.weight", &[4096, 3])
    }

    #[test]
    fn a_header_and_its_figures() {
        let bytes = sample().bytes(3);
        let h = parse(&bytes[..]).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.tensor_count, 2);
        assert_eq!(h.kv_count, 9);
        assert_eq!(h.architecture.as_deref(), Some("llama"));
        assert_eq!(h.header_bytes, bytes.len() as u64);
        assert_eq!(
            h.meta,
            Meta {
                block_count: Some(32),
                context_length: Some(131072),
                embedding_length: Some(4096),
                head_count: Some(32),
                head_count_kv: Some(8),
                vocab_size: Some(3),
                file_type: Some(15),
                ..Meta::default()
            }
        );
        assert_eq!(h.split, None);
        let split = Builder::default()
            .str("general.architecture", "x")
            .u32("split.no", 1)
            .u32("split.count", 4);
        assert_eq!(parse(&split.bytes(3)[..]).unwrap().split, Some((1, 4)));
    }

    #[test]
    fn every_cut_of_a_header_is_an_error_naming_its_place() {
        let bytes = sample().bytes(3);
        for len in 0..bytes.len() {
            match parse(&bytes[..len]) {
                Err(GgufError::Truncated { at, what }) => {
                    assert!(at <= len as u64, "{len}: {at}");
                    assert!(!what.is_empty());
                }
                other => panic!("cut at {len}: {other:?}"),
            }
        }
        let e = parse(&bytes[..60]).unwrap_err().to_string();
        assert!(e.starts_with("truncated at byte"), "{e}");
        assert!(
            e.contains("general.architecture") || e.contains("key"),
            "{e}"
        );
    }

    #[test]
    fn what_is_not_a_readable_header() {
        assert_eq!(
            parse(&b"PK\x03\x04rest"[..]).unwrap_err().to_string(),
            "not a GGUF file: it starts with 0x504b0304 (a GGUF file starts with \"GGUF\")"
        );
        let mut v1 = b"GGUF".to_vec();
        v1.extend(1u32.to_le_bytes());
        assert_eq!(parse(&v1[..]).unwrap_err(), GgufError::Version(1));
        // A length no file has is refused before anything is allocated.
        let mut huge = b"GGUF".to_vec();
        huge.extend(3u32.to_le_bytes());
        huge.extend(0u64.to_le_bytes());
        huge.extend(1u64.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        let e = parse(&huge[..]).unwrap_err();
        assert!(matches!(e, GgufError::Bad { .. }), "{e:?}");
        let mut many = b"GGUF".to_vec();
        many.extend(3u32.to_le_bytes());
        many.extend(u64::MAX.to_le_bytes());
        many.extend(0u64.to_le_bytes());
        assert!(matches!(
            parse(&many[..]).unwrap_err(),
            GgufError::Bad { .. }
        ));
        let bad_type = {
            let mut b = Builder::default();
            b.key("x", 99);
            b.bytes(3)
        };
        let e = parse(&bad_type[..]).unwrap_err().to_string();
        assert!(e.contains("value type 99 in the value of key `x`"), "{e}");
    }

    /// The tiny model the tests run, as `tests/engine/prepare` makes it, when it is there.
    #[test]
    fn the_tiny_model_reads() {
        let Some(home) = std::env::var_os("HOME") else {
            return;
        };
        let model = Path::new(&home).join(".cache/dsv4/engine/models/tiny.gguf");
        if !model.is_file() {
            eprintln!("no {}: tests/engine/prepare makes it", model.display());
            return;
        }
        let h = read(&model).unwrap();
        // As gguf-py 0.19 (GGUFReader) reads tests/engine/make_tiny_gguf.py's output.
        assert_eq!((h.version, h.tensor_count, h.kv_count), (3, 21, 25));
        assert_eq!(h.architecture.as_deref(), Some("llama"));
        assert_eq!(
            h.meta,
            Meta {
                block_count: Some(2),
                context_length: Some(4096),
                embedding_length: Some(128),
                head_count: Some(4),
                head_count_kv: Some(2),
                rope_dimension_count: Some(32),
                vocab_size: Some(356),
                file_type: Some(0),
                ..Meta::default()
            }
        );
        let len = std::fs::metadata(&model).unwrap().len();
        assert!(h.header_bytes < len, "{h:?}");
    }
}
