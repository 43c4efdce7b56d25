//! JSON Schema output: a byte-level recognizer of the values valid against
//! a schema of the core subset ([`Schema::compile`]), beside
//! [`crate::json`]'s recognizer of any object. The sampler masks every
//! token that would leave the output no prefix of such a value.
//!
//! The subset: `type` (one or a list: object, array, string, number,
//! integer, boolean, null), `properties`, `required`,
//! `additionalProperties`, `items`, `minItems`, `maxItems`, `enum` and
//! `const`; `minLength` and `maxLength` (characters); `minimum`,
//! `maximum`, `exclusiveMinimum` and `exclusiveMaximum` on integers (each
//! digit taken only if some integer in bounds continues it; on a number
//! they are refused); `pattern` on a string ([`crate::pattern`]); `$ref`
//! to a part of the same schema (`#/$defs/...`,
//! `#/definitions/...`, not recursive); `anyOf` and `oneOf` of
//! alternatives told apart by their first byte (a string or null, an
//! object or an array: what a library's optional field compiles to);
//! an `enum` or `const` keeps only its values the other keywords allow;
//! annotations (`title`, `description`, `default`, `examples`, `format`,
//! `$schema`, `$id`, `$comment`) are read past. Any other keyword is
//! refused by name rather than held to loosely. The root must be an object
//! (as OpenAI asks of a schema), so the output ends where it closes.
//!
//! Every value produced is valid against the schema, though not every
//! valid value can be produced: an object with `properties` holds only
//! those (each once, any order, every `required` one before it closes),
//! whatever `additionalProperties` allows, and no whitespace is taken
//! outside strings but inside a part that says nothing of its value (read
//! as any JSON value, [`JsonState`]).

use std::sync::Arc;

use serde_json::Value;

use crate::json::JsonState;
use crate::pattern::{Pattern, PatternState};

/// A compiled schema: its parts in an arena (each after its own parts).
#[derive(Debug, Clone, PartialEq)]
pub struct Schema {
    shapes: Vec<Shape>,
    root: usize,
    /// The patterns its strings are held to ([`Shape::Text`]).
    patterns: Vec<Pattern>,
}

/// One part of a schema: what value it takes.
#[derive(Debug, Clone, PartialEq)]
enum Shape {
    /// Any JSON value.
    Any,
    /// One of several kinds, told apart by the value's first byte.
    OneOf(Vec<usize>),
    /// An object of exactly these properties (each key as the bytes of its
    /// JSON string, the part its value takes), at least the required ones.
    Object {
        keys: Vec<Vec<u8>>,
        values: Vec<usize>,
        required: Vec<bool>,
    },
    /// Any object (a schema naming no properties).
    AnyObject,
    /// An object of any keys (`key`, a string part), each value of
    /// `values` (a schema naming no properties, `additionalProperties` a
    /// schema).
    Map {
        key: usize,
        values: usize,
    },
    /// An array of `items`, `min..=max` of them.
    Array {
        items: usize,
        min: u32,
        max: u32,
    },
    String,
    /// A string of `min..=max` characters (code points), or one matching
    /// a pattern (of `patterns`).
    Text {
        min: u32,
        max: u32,
        pattern: Option<usize>,
    },
    Number,
    Integer,
    /// An integer in `min..=max`.
    Bounded {
        min: i128,
        max: i128,
    },
    Boolean,
    Null,
    /// One of these values, each as its compact JSON text.
    Literals(Vec<Vec<u8>>),
}

/// Why a schema is not held to here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SchemaError(pub String);

/// Keywords read past: they say nothing of which values are valid.
const ANNOTATIONS: &[&str] = &["title", "description", "default", "examples", "format", "$schema", "$id", "$comment"];

/// Longest number, in bytes: a model cannot run one on until
/// `max_tokens`.
pub const MAX_NUMBER_BYTES: u8 = 24;

/// Most parts a schema may compile to.
const MAX_SHAPES: usize = 1024;

/// Most properties of one object, and most values of one enum: the
/// sampler tries a token against every key or value still matching, so
/// one request's schema cannot slow every step of its batch.
pub const MAX_CHOICES: usize = 256;

/// Where definitions are kept, read past where they stand: a part is
/// compiled where a `$ref` names it.
const DEFINITIONS: &[&str] = &["$defs", "definitions"];

impl Schema {
    /// Compiles `schema`, or names what is outside the subset.
    pub fn compile(schema: &Value) -> Result<Self, SchemaError> {
        let mut compiler = Compiler { document: schema, schema: Schema { shapes: Vec::new(), root: 0, patterns: Vec::new() }, refs: Default::default() };
        let root = compiler.part(schema, 0)?;
        let mut compiled = compiler.schema;
        compiled.root = root;
        if !matches!(compiled.shapes[root], Shape::Object { .. } | Shape::AnyObject | Shape::Map { .. }) {
            return Err(SchemaError("the schema's root must be an object (\"type\": \"object\")".into()));
        }
        Ok(compiled)
    }

    /// Compiles the schema text `text` (one JSON object).
    pub fn compile_text(text: &str) -> Result<Self, SchemaError> {
        let value: Value = serde_json::from_str(text).map_err(|error| SchemaError(format!("the schema is not JSON: {error}")))?;
        Self::compile(&value)
    }

    /// [`compile_text`](Self::compile_text), kept for the process's
    /// lately seen texts (refusals too): the worker compiles a request's
    /// schema as it takes the request, so the engine's thread, which
    /// samples every sequence of a batch, finds it compiled rather than
    /// compile a costly one (a pattern's DFA) between steps.
    pub fn cached(text: &str) -> Result<Arc<Self>, SchemaError> {
        static KEPT: parking_lot::Mutex<Vec<Kept>> = parking_lot::Mutex::new(Vec::new());
        if let Some((_, compiled)) = KEPT.lock().iter().find(|(kept, _)| **kept == *text) {
            return compiled.clone();
        }
        // Compiled outside the lock: another thread's lookup does not wait.
        let compiled = Self::compile_text(text).map(Arc::new);
        let mut kept = KEPT.lock();
        if !kept.iter().any(|(kept, _)| **kept == *text) {
            if kept.len() >= SCHEMAS_KEPT {
                drop(kept.remove(0));
            }
            kept.push((Arc::from(text), compiled.clone()));
        }
        compiled
    }
}

/// A schema being compiled: the whole document (what `$ref`s point into),
/// the parts so far, and each `$ref` met (`None` while its part is being
/// compiled: met again then, it is recursive).
struct Compiler<'a> {
    document: &'a Value,
    schema: Schema,
    refs: std::collections::HashMap<String, Option<usize>>,
}

impl Compiler<'_> {
    fn push(&mut self, shape: Shape) -> Result<usize, SchemaError> {
        if self.schema.shapes.len() >= MAX_SHAPES {
            return Err(SchemaError(format!("the schema has more than {MAX_SHAPES} parts")));
        }
        self.schema.shapes.push(shape);
        Ok(self.schema.shapes.len() - 1)
    }

    /// The part a `$ref` names, compiled once however often it is named.
    fn reference(&mut self, reference: &str, depth: usize) -> Result<usize, SchemaError> {
        match self.refs.get(reference) {
            Some(Some(part)) => return Ok(*part),
            Some(None) => return Err(SchemaError(format!("the $ref {reference:?} is recursive: the native engine holds to schemas of bounded depth"))),
            None => {}
        }
        let Some(pointer) = reference.strip_prefix('#') else {
            return Err(SchemaError(format!("the $ref {reference:?} is not to a part of this schema (\"#/$defs/...\")")));
        };
        let document = self.document;
        let Some(target) = document.pointer(pointer) else { return Err(SchemaError(format!("the $ref {reference:?} names no part of the schema"))) };
        self.refs.insert(reference.to_owned(), None);
        let part = self.part(target, depth + 1)?;
        self.refs.insert(reference.to_owned(), Some(part));
        Ok(part)
    }

    /// The alternatives of an `anyOf` or `oneOf`: each value's first byte
    /// must tell which it is, so that the output is read one way only (for
    /// `oneOf`, that also makes a value valid against exactly one).
    fn alternatives(&mut self, keyword: &str, alternatives: &Value, depth: usize) -> Result<usize, SchemaError> {
        let Value::Array(alternatives) = alternatives else { return Err(SchemaError(format!("{keyword} must be an array of schemas"))) };
        if alternatives.is_empty() || alternatives.len() > MAX_CHOICES {
            return Err(SchemaError(format!("{keyword} must have 1 to {MAX_CHOICES} schemas, got {}", alternatives.len())));
        }
        let mut parts = Vec::new();
        for alternative in alternatives {
            let part = self.part(alternative, depth + 1)?;
            match &self.schema.shapes[part] {
                Shape::OneOf(inner) => parts.extend(inner.iter().copied()),
                _ => parts.push(part),
            }
        }
        if let [only] = parts[..] {
            return Ok(only);
        }
        for byte in 0..=u8::MAX {
            if parts.iter().filter(|&&part| self.schema.starts(part, byte)).count() > 1 {
                let shown = if byte.is_ascii_graphic() { format!("{:?}", byte as char) } else { format!("byte {byte}") };
                return Err(SchemaError(format!(
                    "two of {keyword}'s schemas take a value beginning with {shown}: the native engine holds to alternatives told apart by their first byte (an object or null, a string or a number)"
                )));
            }
        }
        self.push(Shape::OneOf(parts))
    }

    fn part(&mut self, schema: &Value, depth: usize) -> Result<usize, SchemaError> {
        if depth > 32 {
            return Err(SchemaError("the schema nests deeper than 32".into()));
        }
        let schema = match schema {
            Value::Bool(true) => return self.push(Shape::Any),
            Value::Object(schema) => schema,
            other => return Err(SchemaError(format!("a schema must be an object or true, got {other}"))),
        };
        const KNOWN: &[&str] = &[
            "type",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "minItems",
            "maxItems",
            "enum",
            "const",
            "$ref",
            "anyOf",
            "oneOf",
            "minLength",
            "maxLength",
            "pattern",
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
        ];
        let said = |key: &&String| !ANNOTATIONS.contains(&key.as_str()) && !DEFINITIONS.contains(&key.as_str());
        if let Some(keyword) = schema.keys().find(|key| !KNOWN.contains(&key.as_str()) && said(key)) {
            return Err(SchemaError(format!("the keyword {keyword:?} is not held to by the native engine")));
        }
        // A reference or alternatives stand alone (beside annotations).
        for keyword in ["$ref", "anyOf", "oneOf"] {
            let Some(value) = schema.get(keyword) else { continue };
            if let Some(beside) = schema.keys().filter(said).find(|key| key.as_str() != keyword) {
                return Err(SchemaError(format!("{keyword} beside {beside:?} is not held to by the native engine (put {beside:?} in its schemas)")));
            }
            if keyword == "$ref" {
                let Value::String(reference) = value else { return Err(SchemaError("$ref must be a string".into())) };
                return self.reference(reference, depth);
            }
            return self.alternatives(keyword, value, depth);
        }
        // A value out of a fixed list: its text is all there is to match.
        let literals = match (schema.get("enum"), schema.get("const")) {
            (Some(_), Some(_)) => return Err(SchemaError("a schema may have enum or const, not both".into())),
            (Some(Value::Array(values)), None) if values.len() > MAX_CHOICES => {
                return Err(SchemaError(format!("an enum may have at most {MAX_CHOICES} values, got {}", values.len())));
            }
            (Some(Value::Array(values)), None) if !values.is_empty() => Some(values.clone()),
            (Some(_), None) => return Err(SchemaError("enum must be a non-empty array".into())),
            (None, Some(value)) => Some(vec![value.clone()]),
            (None, None) => None,
        };
        let types: Vec<&str> = match schema.get("type") {
            None => Vec::new(),
            Some(Value::String(kind)) => vec![kind],
            Some(Value::Array(kinds)) if !kinds.is_empty() => {
                kinds.iter().map(|kind| kind.as_str().ok_or_else(|| SchemaError("type must name kinds".into()))).collect::<Result<_, _>>()?
            }
            Some(other) => return Err(SchemaError(format!("type must be a kind or a list of kinds, got {other}"))),
        };
        if let Some(values) = literals {
            // Only the values the schema's other keywords allow.
            let lengths = lengths(schema)?;
            // The bounds as given (not an integer's): a value may be a fraction.
            let mut limits = Vec::new();
            for keyword in BOUNDS {
                if let Some(limit) = schema.get(*keyword) {
                    limits.push((*keyword, limit.as_f64().filter(|n| n.is_finite()).ok_or_else(|| SchemaError(format!("{keyword} must be a number")))?));
                }
            }
            let allowed = |value: &&Value| {
                let typed = types.is_empty() || types.iter().any(|kind| of_kind(value, kind));
                let long = value.as_str().is_none_or(|text| (lengths.0..=lengths.1).contains(&(text.chars().count().min(u32::MAX as usize) as u32)));
                let within = value.as_f64().is_none_or(|n| {
                    limits.iter().all(|&(keyword, limit)| match keyword {
                        "minimum" => n >= limit,
                        "exclusiveMinimum" => n > limit,
                        "maximum" => n <= limit,
                        _ => n < limit,
                    })
                });
                typed && long && within
            };
            let texts: Vec<Vec<u8>> = values.iter().filter(allowed).map(|value| serde_json::to_vec(value).expect("a value serializes")).collect();
            if texts.is_empty() {
                return Err(SchemaError("no value of its enum or const is valid against the schema's other keywords".into()));
            }
            return self.push(Shape::Literals(texts));
        }
        if types.is_empty() {
            // No type: only an object's or an array's keywords say more.
            return match (schema.contains_key("properties"), schema.contains_key("items")) {
                (false, false) => self.push(Shape::Any),
                (true, false) => self.kind("object", schema, depth),
                (false, true) => self.kind("array", schema, depth),
                (true, true) => Err(SchemaError("a schema without a type may not have both properties and items".into())),
            };
        }
        if types.len() == 1 {
            return self.kind(types[0], schema, depth);
        }
        let mut parts = Vec::new();
        for kind in types {
            parts.push(self.kind(kind, schema, depth)?);
        }
        self.push(Shape::OneOf(parts))
    }

    fn kind(&mut self, kind: &str, schema: &serde_json::Map<String, Value>, depth: usize) -> Result<usize, SchemaError> {
        match kind {
            "object" => {
                let Some(properties) = schema.get("properties") else {
                    if schema.contains_key("required") {
                        return Err(SchemaError("required names properties the schema does not give".into()));
                    }
                    return match schema.get("additionalProperties") {
                        None | Some(Value::Bool(true)) => self.push(Shape::AnyObject),
                        // No property at all: `{}` only.
                        Some(Value::Bool(false)) => self.push(Shape::Object { keys: Vec::new(), values: Vec::new(), required: Vec::new() }),
                        Some(values @ Value::Object(_)) => {
                            let values = self.part(values, depth + 1)?;
                            let key = self.push(Shape::String)?;
                            self.push(Shape::Map { key, values })
                        }
                        Some(_) => Err(SchemaError("additionalProperties must be a boolean or a schema".into())),
                    };
                };
                let Value::Object(properties) = properties else { return Err(SchemaError("properties must be an object".into())) };
                if properties.len() > MAX_CHOICES {
                    return Err(SchemaError(format!("an object may have at most {MAX_CHOICES} properties, got {}", properties.len())));
                }
                let required: Vec<&str> = match schema.get("required") {
                    None => Vec::new(),
                    Some(Value::Array(names)) => {
                        names.iter().map(|name| name.as_str().ok_or_else(|| SchemaError("required must list names".into()))).collect::<Result<_, _>>()?
                    }
                    Some(_) => return Err(SchemaError("required must be an array".into())),
                };
                if let Some(missing) = required.iter().find(|name| !properties.contains_key(**name)) {
                    return Err(SchemaError(format!("required names {missing:?}, which properties does not give")));
                }
                match schema.get("additionalProperties") {
                    None | Some(Value::Bool(_)) | Some(Value::Object(_)) => {}
                    Some(_) => return Err(SchemaError("additionalProperties must be a boolean or a schema".into())),
                }
                let (mut keys, mut values) = (Vec::new(), Vec::new());
                for (name, part) in properties {
                    keys.push(serde_json::to_vec(name).expect("a string serializes"));
                    values.push(self.part(part, depth + 1)?);
                }
                let required = properties.keys().map(|name| required.contains(&name.as_str())).collect();
                self.push(Shape::Object { keys, values, required })
            }
            "array" => {
                let items = match schema.get("items") {
                    None => self.push(Shape::Any)?,
                    Some(items) => self.part(items, depth + 1)?,
                };
                let bound = |keyword: &str, default: u32| match schema.get(keyword) {
                    None => Ok(default),
                    Some(value) => value.as_u64().map(|n| n.min(u64::from(u32::MAX)) as u32).ok_or_else(|| SchemaError(format!("{keyword} must be a count"))),
                };
                let (min, max) = (bound("minItems", 0)?, bound("maxItems", u32::MAX)?);
                if min > max {
                    return Err(SchemaError("minItems is above maxItems: no array is valid".into()));
                }
                self.push(Shape::Array { items, min, max })
            }
            "string" => match (lengths(schema)?, schema.get("pattern")) {
                ((0, u32::MAX), None) => self.push(Shape::String),
                ((min, max), None) => self.push(Shape::Text { min, max, pattern: None }),
                ((0, u32::MAX), Some(Value::String(source))) => {
                    let pattern = Pattern::compile(source)?;
                    let used: usize = self.schema.patterns.iter().map(Pattern::memory_usage).sum();
                    if used + pattern.memory_usage() > MAX_SCHEMA_DFA_BYTES {
                        return Err(SchemaError(format!("the schema's patterns compile to more than {} MiB", MAX_SCHEMA_DFA_BYTES >> 20)));
                    }
                    self.schema.patterns.push(pattern);
                    let pattern = Some(self.schema.patterns.len() - 1);
                    self.push(Shape::Text { min: 0, max: u32::MAX, pattern })
                }
                (_, Some(Value::String(_))) => {
                    Err(SchemaError("minLength or maxLength beside pattern is not held to by the native engine (put the length in the pattern)".into()))
                }
                (_, Some(_)) => Err(SchemaError("pattern must be a string".into())),
            },
            "number" => {
                if let Some(keyword) = BOUNDS.iter().find(|keyword| schema.contains_key(**keyword)) {
                    return Err(SchemaError(format!("{keyword:?} on a number is not held to by the native engine (it is on an integer)")));
                }
                self.push(Shape::Number)
            }
            "integer" => match bounds(schema)? {
                None => self.push(Shape::Integer),
                Some((min, max)) => self.push(Shape::Bounded { min, max }),
            },
            "boolean" => self.push(Shape::Boolean),
            "null" => self.push(Shape::Null),
            other => Err(SchemaError(format!("{other:?} is not a JSON Schema type"))),
        }
    }
}

/// A schema text and what it compiled to.
type Kept = (Arc<str>, Result<Arc<Schema>, SchemaError>);

/// Schema texts whose compiled schemas (or refusals) a process keeps.
const SCHEMAS_KEPT: usize = 64;

/// Most bytes of DFA all of a schema's patterns may compile to (it is
/// kept per schema text, [`crate::sampling`]).
pub const MAX_SCHEMA_DFA_BYTES: usize = 4 << 20;

/// Keywords bounding a number.
const BOUNDS: &[&str] = &["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];

/// Largest magnitude of a bounded integer, in digits: far past any bound
/// a schema gives (an `i64`'s), inside [`MAX_NUMBER_BYTES`].
const BOUNDED_DIGITS: u32 = 19;

/// Whether `value` is of the JSON Schema type `kind`.
fn of_kind(value: &Value, kind: &str) -> bool {
    match (kind, value) {
        ("object", Value::Object(_)) | ("array", Value::Array(_)) | ("string", Value::String(_)) | ("number", Value::Number(_)) => true,
        ("boolean", Value::Bool(_)) | ("null", Value::Null) => true,
        ("integer", Value::Number(number)) => number.is_i64() || number.is_u64() || number.as_f64().is_some_and(|n| n.fract() == 0.0),
        _ => false,
    }
}

/// A string's `minLength..=maxLength`, in characters.
fn lengths(schema: &serde_json::Map<String, Value>) -> Result<(u32, u32), SchemaError> {
    let length = |keyword: &str, default: u32| match schema.get(keyword) {
        None => Ok(default),
        Some(value) => value.as_u64().map(|n| n.min(u64::from(u32::MAX)) as u32).ok_or_else(|| SchemaError(format!("{keyword} must be a count"))),
    };
    let (min, max) = (length("minLength", 0)?, length("maxLength", u32::MAX)?);
    if min > max {
        return Err(SchemaError("minLength is above maxLength: no string is valid".into()));
    }
    Ok((min, max))
}

/// An integer's bounds, inclusive, from `minimum`, `maximum` and their
/// exclusive forms (numbers, as JSON Schema since draft 6 writes them);
/// none where none is given.
fn bounds(schema: &serde_json::Map<String, Value>) -> Result<Option<(i128, i128)>, SchemaError> {
    if !BOUNDS.iter().any(|keyword| schema.contains_key(*keyword)) {
        return Ok(None);
    }
    let widest = 10i128.pow(BOUNDED_DIGITS) - 1;
    let bound = |keyword: &str| -> Result<Option<f64>, SchemaError> {
        match schema.get(keyword) {
            None => Ok(None),
            Some(value) => value.as_f64().filter(|n| n.is_finite()).map(Some).ok_or_else(|| SchemaError(format!("{keyword} must be a number"))),
        }
    };
    let clamp = |n: f64| (n.clamp(-(widest as f64), widest as f64)) as i128;
    let mut min = -widest;
    let mut max = widest;
    if let Some(n) = bound("minimum")? {
        min = min.max(clamp(n.ceil()));
    }
    if let Some(n) = bound("exclusiveMinimum")? {
        min = min.max(clamp(n.floor()) + 1);
    }
    if let Some(n) = bound("maximum")? {
        max = max.min(clamp(n.floor()));
    }
    if let Some(n) = bound("exclusiveMaximum")? {
        max = max.min(clamp(n.ceil()) - 1);
    }
    if min > max {
        return Err(SchemaError("the bounds leave no integer valid".into()));
    }
    Ok(Some((min, max)))
}

/// Whether some integer in `min..=max` is written beginning with `-` (if
/// `negative`) and the `digits` digits of `magnitude`.
fn bounded_prefix(min: i128, max: i128, negative: bool, magnitude: i128, digits: u32) -> bool {
    if digits == 0 {
        // Only the sign so far: any negative number.
        return !negative || min <= max.min(-1);
    }
    let span = |low: i128, high: i128| if negative { (-high, -low) } else { (low, high) };
    for length in digits..=BOUNDED_DIGITS {
        // A leading zero is a whole number.
        if magnitude == 0 && length > digits {
            break;
        }
        let scale = 10i128.pow(length - digits);
        let (low, high) = span(magnitude * scale, magnitude * scale + scale - 1);
        if low <= max && min <= high {
            return true;
        }
    }
    false
}

/// Where in a value of the schema the recognizer is.
#[derive(Debug, Clone, PartialEq)]
pub struct SchemaState {
    schema: Arc<Schema>,
    /// Open parts, innermost last.
    stack: Vec<Frame>,
    /// Whether the root began, and whether it ended.
    started: bool,
    done: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Frame {
    /// A value read as plain JSON; `integer` refuses a fraction or
    /// exponent; `number` counts a number's bytes.
    Json { json: JsonState, integer: bool, number: u8 },
    /// One of `shape`'s literals (or keys): those still matching, and how
    /// many bytes of them were read.
    Literal { shape: usize, alive: Vec<u32>, at: usize },
    /// An object of fixed properties: which were given, and what comes.
    Object { shape: usize, seen: Vec<bool>, next: ObjectNext },
    /// An object of any keys: what comes.
    Map { shape: usize, next: MapNext },
    /// An array: how many items so far, and what comes.
    Array { shape: usize, count: u32, next: ArrayNext },
    /// A value of this part comes next (after a key's `:`).
    Pending(usize),
    /// A string of bounded length ([`Shape::Text`]), after its `"`: the
    /// characters so far, the escape being read (0 none, 1 after `\`, 2
    /// to 5 after `\u`, one more than the hex digits to come), and
    /// whether its first hex digit was `d` (a surrogate may follow).
    Text { shape: usize, chars: u32, escape: u8, high: bool, pattern: Option<PatternState> },
    /// An integer within bounds ([`Shape::Bounded`]): its sign, and the
    /// digits so far.
    Bounded { shape: usize, negative: bool, magnitude: i128, digits: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjectNext {
    /// After `{`: a key, or `}`.
    First,
    /// After `,`: a key.
    Key,
    /// After a key (the property's index): `:`.
    Colon(usize),
    /// After a value: `,` or `}`.
    Next,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MapNext {
    /// After `{`: a key, or `}`.
    First,
    /// After `,`: a key.
    Key,
    /// Inside a key (a string frame above).
    InKey,
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or `}`.
    Next,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrayNext {
    First,
    Item,
    Next,
}

impl SchemaState {
    /// Nothing read yet.
    pub fn new(schema: Arc<Schema>) -> Self {
        Self { schema, stack: Vec::new(), started: false, done: false }
    }

    /// Whether the value is whole: nothing may follow it.
    pub fn is_complete(&self) -> bool {
        self.done
    }

    /// Whether it reads values of `schema` (the same compiled schema).
    pub fn is_of(&self, schema: &Arc<Schema>) -> bool {
        Arc::ptr_eq(&self.schema, schema)
    }

    /// Reads `bytes`; `false` (the state partly advanced) if they cannot
    /// continue a valid value.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&byte| self.push(byte))
    }

    /// Whether `bytes` (one token's, non-empty) would continue the value;
    /// the state is left as it was.
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        // Text inside a string, decided without a copy of the state (the
        // common case of checking every token).
        match self.stack.last() {
            Some(Frame::Json { json, .. }) if json.in_plain_string() && crate::json::plain(bytes) => return true,
            Some(&Frame::Text { shape, chars, escape: 0, pattern: None, .. }) if crate::json::plain(bytes) => {
                let Shape::Text { max, .. } = self.schema.shapes[shape] else { unreachable!("a text frame's shape is a bounded string") };
                let begun = bytes.iter().filter(|byte| !(0x80..=0xbf).contains(*byte)).count();
                return u64::from(chars) + begun as u64 <= u64::from(max);
            }
            _ => {}
        }
        !bytes.is_empty() && self.clone().feed(bytes)
    }

    fn push(&mut self, byte: u8) -> bool {
        if self.done {
            return false;
        }
        let Some(frame) = self.stack.last_mut() else {
            if self.started {
                return false;
            }
            self.started = true;
            return self.begin(self.schema.root, byte);
        };
        match frame {
            Frame::Json { json, integer, number } => {
                if *integer && json.in_number() && matches!(byte, b'.' | b'e' | b'E') {
                    return false;
                }
                let mut next = json.clone();
                if next.push(byte) {
                    if next.in_number() && *number >= MAX_NUMBER_BYTES {
                        return false;
                    }
                    let whole = next.is_complete();
                    *number = if next.in_number() { number.saturating_add(1) } else { 0 };
                    *json = next;
                    if whole {
                        self.end();
                    }
                    true
                } else if json.may_end() {
                    // A number ends at the byte after it: the part around
                    // it reads that byte.
                    self.end();
                    self.push(byte)
                } else {
                    false
                }
            }
            Frame::Literal { shape, alive, at } => {
                let texts = self.schema.literals(*shape);
                let next: Vec<u32> = alive.iter().copied().filter(|&i| texts[i as usize].get(*at) == Some(&byte)).collect();
                if next.is_empty() {
                    // One ended before this byte (a number that another
                    // continues): the part around it reads the byte.
                    if alive.iter().any(|&i| texts[i as usize].len() == *at) {
                        self.end();
                        return self.push(byte);
                    }
                    return false;
                }
                *at += 1;
                let at = *at;
                let whole = next.iter().all(|&i| texts[i as usize].len() == at);
                *alive = next;
                if whole {
                    self.end();
                }
                true
            }
            Frame::Object { shape, seen, next } => {
                let (shape, state) = (*shape, *next);
                let Shape::Object { keys, values, required } = &self.schema.shapes[shape] else { unreachable!("an object frame's shape is an object") };
                match (state, byte) {
                    (ObjectNext::First | ObjectNext::Key, b'"') => {
                        let alive: Vec<u32> = (0..keys.len() as u32).filter(|&i| !seen[i as usize]).collect();
                        if alive.is_empty() {
                            return false;
                        }
                        // The key is read as a literal, then its index told.
                        self.stack.push(Frame::Literal { shape, alive, at: 1 });
                        true
                    }
                    (ObjectNext::First | ObjectNext::Next, b'}') if required.iter().zip(seen.iter()).all(|(required, seen)| *seen || !required) => {
                        self.end();
                        true
                    }
                    (ObjectNext::Next, b',') if seen.iter().any(|seen| !seen) => {
                        *next = ObjectNext::Key;
                        true
                    }
                    (ObjectNext::Colon(index), b':') => {
                        let value = values[index];
                        *next = ObjectNext::Next;
                        self.stack.push(Frame::Pending(value));
                        true
                    }
                    _ => false,
                }
            }
            Frame::Pending(part) => {
                let part = *part;
                self.stack.pop();
                self.begin(part, byte)
            }
            Frame::Map { shape, next } => {
                let Shape::Map { key, values } = self.schema.shapes[*shape] else { unreachable!("a map frame's shape is a map") };
                match (*next, byte) {
                    (MapNext::First | MapNext::Key, b'"') => {
                        *next = MapNext::InKey;
                        self.begin(key, byte)
                    }
                    (MapNext::First | MapNext::Next, b'}') => {
                        self.end();
                        true
                    }
                    (MapNext::Next, b',') => {
                        *next = MapNext::Key;
                        true
                    }
                    (MapNext::Colon, b':') => {
                        *next = MapNext::Next;
                        self.stack.push(Frame::Pending(values));
                        true
                    }
                    _ => false,
                }
            }
            Frame::Text { shape, chars, escape, high, pattern } => {
                let Shape::Text { min, max, pattern: source } = self.schema.shapes[*shape] else { unreachable!("a text frame's shape is a bounded string") };
                // Under a pattern, the content byte goes through it too (an
                // escape's once read: only `\"`, `\\` and `\/` are taken).
                let schema = self.schema.clone();
                let may_close = *chars >= min && source.is_none_or(|source| pattern.is_some_and(|at| schema.patterns[source].may_end(at)));
                let mut matched = |byte: u8| match (source, pattern.as_mut()) {
                    (Some(source), Some(at)) => schema.patterns[source].step(*at, byte).map(|next| *at = next).is_some(),
                    _ => true,
                };
                *escape = match (*escape, byte) {
                    (0, b'"') if may_close => {
                        self.end();
                        return true;
                    }
                    (0, b'"' | 0x00..=0x1f) => return false,
                    // A character begins (a UTF-8 sequence's lead byte, or an escape).
                    (0, _) if !(0x80..=0xbf).contains(&byte) => {
                        if *chars >= max || byte != b'\\' && !matched(byte) {
                            return false;
                        }
                        *chars += 1;
                        u8::from(byte == b'\\')
                    }
                    (0, _) if source.is_none() => 0,
                    (1, b'"' | b'\\' | b'/') if matched(byte) => 0,
                    (1, b'b' | b'f' | b'n' | b'r' | b't') if source.is_none() => 0,
                    (1, b'u') if source.is_none() => 5,
                    (5, _) if byte.is_ascii_hexdigit() => {
                        *high = matches!(byte, b'd' | b'D');
                        4
                    }
                    // No surrogate halves (\ud800 to \udfff): a pair is one
                    // character, so counting escapes would miscount.
                    (4, b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F') if *high => return false,
                    (2, _) if byte.is_ascii_hexdigit() => 0,
                    (3..=4, _) if byte.is_ascii_hexdigit() => *escape - 1,
                    _ => return false,
                };
                true
            }
            Frame::Bounded { shape, negative, magnitude, digits } => {
                let Shape::Bounded { min, max } = self.schema.shapes[*shape] else { unreachable!("a bounded frame's shape is a bounded integer") };
                if byte.is_ascii_digit() {
                    // No digit after a leading zero.
                    if *digits > 0 && *magnitude == 0 || *digits >= BOUNDED_DIGITS {
                        return false;
                    }
                    let next = *magnitude * 10 + i128::from(byte - b'0');
                    if !bounded_prefix(min, max, *negative, next, *digits + 1) {
                        return false;
                    }
                    (*magnitude, *digits) = (next, *digits + 1);
                    return true;
                }
                // It ends at the byte after it, which the part around it reads.
                let value = if *negative { -*magnitude } else { *magnitude };
                if *digits == 0 || !(min..=max).contains(&value) {
                    return false;
                }
                self.end();
                self.push(byte)
            }
            Frame::Array { shape, count, next } => {
                let Shape::Array { items, min, max } = self.schema.shapes[*shape] else { unreachable!("an array frame's shape is an array") };
                match (*next, byte) {
                    (ArrayNext::First, b']') if min == 0 => {
                        self.end();
                        true
                    }
                    (ArrayNext::Next, b']') if *count >= min => {
                        self.end();
                        true
                    }
                    (ArrayNext::Next, b',') if *count < max => {
                        *next = ArrayNext::Item;
                        true
                    }
                    (ArrayNext::First | ArrayNext::Item, _) if *count < max => {
                        *count += 1;
                        *next = ArrayNext::Next;
                        self.begin(items, byte)
                    }
                    _ => false,
                }
            }
        }
    }

    /// Begins a value of part `part` with its first byte.
    fn begin(&mut self, part: usize, byte: u8) -> bool {
        let schema = self.schema.clone();
        let integer = match (&schema.shapes[part], byte) {
            (Shape::OneOf(parts), _) => {
                // The kinds' first bytes tell them apart (the first listed
                // of number and integer takes a digit).
                let Some(&chosen) = parts.iter().find(|&&kind| schema.starts(kind, byte)) else { return false };
                return self.begin(chosen, byte);
            }
            (Shape::Any, _)
            | (Shape::AnyObject, b'{')
            | (Shape::String, b'"')
            | (Shape::Number, b'-' | b'0'..=b'9')
            | (Shape::Boolean, b't' | b'f')
            | (Shape::Null, b'n') => false,
            (Shape::Integer, b'-' | b'0'..=b'9') => true,
            (Shape::Object { keys, .. }, b'{') => {
                self.stack.push(Frame::Object { shape: part, seen: vec![false; keys.len()], next: ObjectNext::First });
                return true;
            }
            (Shape::Array { .. }, b'[') => {
                self.stack.push(Frame::Array { shape: part, count: 0, next: ArrayNext::First });
                return true;
            }
            (Shape::Map { .. }, b'{') => {
                self.stack.push(Frame::Map { shape: part, next: MapNext::First });
                return true;
            }
            (Shape::Text { .. }, b'"') => {
                let Shape::Text { pattern, .. } = &schema.shapes[part] else { unreachable!("matched as text") };
                let pattern = pattern.map(|pattern| schema.patterns[pattern].begin());
                self.stack.push(Frame::Text { shape: part, chars: 0, escape: 0, high: false, pattern });
                return true;
            }
            (Shape::Bounded { .. }, b'-' | b'0'..=b'9') if schema.starts(part, byte) => {
                let (negative, magnitude, digits) = if byte == b'-' { (true, 0, 0) } else { (false, i128::from(byte - b'0'), 1) };
                self.stack.push(Frame::Bounded { shape: part, negative, magnitude, digits });
                return true;
            }
            (Shape::Literals(texts), _) => {
                let alive: Vec<u32> = (0..texts.len() as u32).filter(|&i| texts[i as usize].first() == Some(&byte)).collect();
                if alive.is_empty() {
                    return false;
                }
                if alive.iter().all(|&i| texts[i as usize].len() == 1) {
                    self.ended_part();
                } else {
                    self.stack.push(Frame::Literal { shape: part, alive, at: 1 });
                }
                return true;
            }
            _ => return false,
        };
        let mut json = JsonState::any_value();
        if !json.push(byte) {
            return false;
        }
        if json.is_complete() {
            self.ended_part();
        } else {
            let number = u8::from(json.in_number());
            self.stack.push(Frame::Json { json, integer, number });
        }
        true
    }

    /// The innermost frame's value ended.
    fn end(&mut self) {
        let ended = self.stack.pop();
        // A key matched: its parent object now waits for `:`.
        if let (Some(Frame::Literal { shape, alive, .. }), Some(Frame::Object { shape: object, seen, next })) = (&ended, self.stack.last_mut())
            && *shape == *object
        {
            let index = alive[0] as usize;
            seen[index] = true;
            *next = ObjectNext::Colon(index);
            return;
        }
        // A map's key ended: `:` comes.
        if let Some(Frame::Map { next: next @ MapNext::InKey, .. }) = self.stack.last_mut() {
            *next = MapNext::Colon;
            return;
        }
        self.ended_part();
    }

    /// A value ended with nothing more to pop: the root, if none is open.
    fn ended_part(&mut self) {
        if self.stack.is_empty() {
            self.done = true;
        }
    }
}

impl Schema {
    fn literals(&self, shape: usize) -> &[Vec<u8>] {
        match &self.shapes[shape] {
            Shape::Literals(texts) => texts,
            Shape::Object { keys, .. } => keys,
            _ => unreachable!("a literal frame's shape has literals"),
        }
    }

    /// Whether a value of part `part` may begin with `byte`.
    fn starts(&self, part: usize, byte: u8) -> bool {
        match (&self.shapes[part], byte) {
            (Shape::Any, _) => JsonState::any_value().push(byte) && byte != b' ',
            (Shape::OneOf(parts), _) => parts.iter().any(|&kind| self.starts(kind, byte)),
            (Shape::Object { .. } | Shape::AnyObject | Shape::Map { .. }, b'{') | (Shape::Array { .. }, b'[') | (Shape::String | Shape::Text { .. }, b'"') => {
                true
            }
            (&Shape::Bounded { min, max }, b'-') => bounded_prefix(min, max, true, 0, 0),
            (&Shape::Bounded { min, max }, b'0'..=b'9') => bounded_prefix(min, max, false, i128::from(byte - b'0'), 1),
            (Shape::Number | Shape::Integer, b'-' | b'0'..=b'9') | (Shape::Boolean, b't' | b'f') | (Shape::Null, b'n') => true,
            (Shape::Literals(texts), _) => texts.iter().any(|text| text.first() == Some(&byte)),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn state(schema: Value) -> SchemaState {
        SchemaState::new(Arc::new(Schema::compile(&schema).unwrap()))
    }

    fn whole(schema: &Value, text: &str) -> bool {
        let mut state = state(schema.clone());
        state.feed(text.as_bytes()) && state.is_complete()
    }

    fn prefix(schema: &Value, text: &str) -> bool {
        state(schema.clone()).feed(text.as_bytes())
    }

    #[test]
    fn values_of_the_schema_are_read_whole_and_by_prefix() {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "who"},
                "age": {"type": "integer"},
                "score": {"type": "number"},
                "tags": {"type": "array", "items": {"enum": ["a", "b", 7, null]}, "minItems": 1, "maxItems": 2},
                "ok": {"type": "boolean"},
                "note": {"type": ["string", "null"]},
                "extra": {},
                "inner": {"type": "object", "properties": {"x": {"const": 12}}, "required": ["x"], "additionalProperties": false}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        });
        for text in [
            r#"{"name":"Ada","age":36}"#,
            r#"{"age":-3,"name":"x \" y"}"#,
            r#"{"name":"","age":0,"score":-1.5e3,"tags":["a",7],"ok":false,"note":null,"extra":{"any": [1, 2]},"inner":{"x":12}}"#,
            r#"{"name":"n","age":1,"tags":[null],"note":"s","extra":3.25}"#,
        ] {
            assert!(whole(&schema, text), "{text}");
            for end in 0..text.len() {
                assert!(prefix(&schema, &text[..end]), "prefix {:?}", &text[..end]);
            }
        }
        for text in [
            r#"{"name":"Ada"}"#,                    // age required
            r#"{"name":"Ada","age":1.5}"#,          // an integer
            r#"{"name":"Ada","age":1e3}"#,          // nor an exponent
            r#"{"name":"Ada","name":"B","age":1}"#, // each key once
            r#"{"nam":"Ada","age":1}"#,             // only its keys
            r#"{"other":1}"#,
            r#"{"name":1,"age":1}"#,                        // a string's place
            r#"{"name":"a","age":1,"tags":[]}"#,            // minItems
            r#"{"name":"a","age":1,"tags":["a","b","a"]}"#, // maxItems
            r#"{"name":"a","age":1,"tags":["c"]}"#,         // its enum
            r#"{"name":"a","age":1,"inner":{"x":1}}"#,      // its const
            r#"{"name":"a","age":1,"inner":{"x":123}}"#,
            r#"{"name":"a","age":1,"note":true}"#,
            r#"{"name": "a","age":1}"#, // no blanks outside any value
            r#"{"name":"a","age":1}}"#,
            r#"[]"#,
        ] {
            let mut state = state(schema.clone());
            assert!(!(state.feed(text.as_bytes()) && state.is_complete()), "{text} taken");
        }
        assert!(!whole(&schema, r#"{"name":"a","age":12"#) && prefix(&schema, r#"{"name":"a","age":12"#));
        let long = "1".repeat(MAX_NUMBER_BYTES as usize);
        assert!(whole(&schema, &format!(r#"{{"name":"a","age":{long}}}"#)), "a number of the longest");
        assert!(!prefix(&schema, &format!(r#"{{"name":"a","age":{long}1"#)), "and no longer");
        assert!(!prefix(&schema, &format!(r#"{{"name":"a","age":1,"extra":{long}1"#)), "any value's too");
    }

    #[test]
    fn what_is_produced_parses_and_validates() {
        // Everything the state takes whole parses, as an object.
        let schema = json!({"type": "object", "properties": {"n": {"enum": [1, 12, 123]}, "s": {"enum": ["x", "xy"]}}, "required": ["n"]});
        for text in [r#"{"n":1}"#, r#"{"n":12,"s":"xy"}"#, r#"{"s":"x","n":123}"#] {
            assert!(whole(&schema, text), "{text}");
            assert!(serde_json::from_str::<serde_json::Map<String, Value>>(text).is_ok());
        }
        assert!(!whole(&schema, r#"{"n":1234}"#) && !whole(&schema, r#"{"n":2}"#) && !whole(&schema, r#"{"s":"xyz","n":1}"#));
    }

    #[test]
    fn a_schema_outside_the_subset_is_refused_by_name() {
        for (schema, says) in [
            (json!({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 3}}}), "multipleOf"),
            (json!({"$ref": "#/$defs/a"}), "$ref"),
            (json!({"type": "object", "anyOf": []}), "anyOf"),
            (json!({"type": "string"}), "root must be an object"),
            (json!({"type": "object", "properties": {"a": {"type": "text"}}}), "not a JSON Schema type"),
            (json!({"type": "object", "properties": {}, "required": ["b"]}), "\"b\""),
            (json!({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}), "minItems"),
            (json!({"type": "object", "properties": {"a": {"enum": []}}}), "enum"),
            (json!({"type": "object", "properties": {"a": {"enum": (0..=MAX_CHOICES).collect::<Vec<_>>()}}}), "at most 256 values"),
            (
                json!({"type": "object", "properties": (0..=MAX_CHOICES).map(|i| (format!("k{i}"), json!({}))).collect::<serde_json::Map<_, _>>()}),
                "at most 256 properties",
            ),
        ] {
            let refused = Schema::compile(&schema).unwrap_err().0;
            assert!(refused.contains(says), "{schema}: {refused}");
        }
        assert!(Schema::compile(&json!({})).is_err(), "the root says nothing of an object");
        assert!(Schema::compile(&json!({"type": "object"})).is_ok());
        assert!(whole(&json!({"type": "object"}), r#"{"any": [1, {"k": null}]}"#), "an object of any properties");
    }

    /// A schema as a typed model's library writes it: definitions named by
    /// `$ref` (one named twice), an optional field as `anyOf` a kind or
    /// null.
    #[test]
    fn references_and_alternatives_compile_as_libraries_write_them() {
        let schema = json!({
            "$defs": {
                "Address": {
                    "properties": {"city": {"title": "City", "type": "string"}, "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null, "title": "Zip"}},
                    "required": ["city"], "title": "Address", "type": "object"
                },
                "Role": {"enum": ["admin", "user"], "title": "Role", "type": "string"},
                "Unused": {"type": "string", "pattern": "^x"}
            },
            "properties": {
                "name": {"title": "Name", "type": "string"},
                "home": {"$ref": "#/$defs/Address"},
                "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": null},
                "role": {"$ref": "#/$defs/Role", "description": "what they may do"},
                "scores": {"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "integer"}, {"anyOf": [{"type": "boolean"}]}]}
            },
            "required": ["name", "home", "role"],
            "title": "Person",
            "type": "object"
        });
        let compiled = Schema::compile(&schema).unwrap();
        let addresses = compiled.shapes.iter().filter(|shape| matches!(shape, Shape::Object { keys, .. } if keys.len() == 2)).count();
        assert_eq!(addresses, 1, "a definition named twice is compiled once");
        for text in [
            r#"{"name":"Ada","home":{"city":"London"},"role":"admin"}"#,
            r#"{"name":"A","home":{"city":"x","zip":null},"work":{"zip":"N1","city":"y"},"role":"user","scores":[1,2]}"#,
            r#"{"role":"user","scores":3,"name":"A","home":{"city":"x"},"work":null}"#,
            r#"{"name":"A","home":{"city":"x"},"role":"user","scores":true}"#,
        ] {
            assert!(whole(&schema, text), "{text}");
            for end in 0..text.len() {
                assert!(prefix(&schema, &text[..end]), "prefix {:?}", &text[..end]);
            }
        }
        for text in [
            r#"{"name":"A","home":{"city":"x"},"role":"guest"}"#,
            r#"{"name":"A","home":{"city":"x"},"role":"user","work":"office"}"#,
            r#"{"name":"A","home":{"zip":null},"role":"user"}"#,
            r#"{"name":"A","home":{"city":"x","zip":5},"role":"user"}"#,
            r#"{"name":"A","home":{"city":"x"},"role":"user","scores":"x"}"#,
            r#"{"name":"A","home":{"city":"x"},"role":"user","scores":[1.5]}"#,
        ] {
            let mut state = state(schema.clone());
            assert!(!(state.feed(text.as_bytes()) && state.is_complete()), "{text} taken");
        }
        let at_root = json!({"$defs": {"P": {"type": "object", "properties": {"n": {"type": "integer"}}}}, "$ref": "#/$defs/P"});
        assert!(whole(&at_root, r#"{"n":1}"#));
    }

    #[test]
    fn references_and_alternatives_outside_the_subset_are_refused_by_name() {
        let object = |value: Value| json!({"type": "object", "properties": {"a": value}});
        for (schema, says) in [
            (object(json!({"anyOf": [{"$ref": "#"}, {"type": "null"}]})), "recursive"),
            (json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}), "recursive"),
            (object(json!({"$ref": "other.json#/a"})), "not to a part of this schema"),
            (object(json!({"$ref": "#/$defs/missing"})), "names no part"),
            (object(json!({"$ref": 3})), "$ref must be a string"),
            (object(json!({"anyOf": [{"type": "object"}, {"type": "object", "properties": {}}]})), "'{'"),
            (object(json!({"oneOf": [{"type": "number"}, {"type": "integer"}]})), "'-'"),
            (object(json!({"anyOf": [{"type": "string"}, {"enum": ["x"]}]})), "told apart by their first byte"),
            (object(json!({"anyOf": [{}, {"type": "null"}]})), "told apart"),
            (object(json!({"anyOf": []})), "1 to 256"),
            (object(json!({"anyOf": {"type": "null"}})), "an array of schemas"),
            (object(json!({"type": "string", "$ref": "#/$defs/x"})), "beside \"type\""),
            (object(json!({"anyOf": [{"type": "null"}], "minItems": 1})), "beside \"minItems\""),
            (object(json!({"allOf": [{"type": "null"}]})), "\"allOf\""),
        ] {
            let refused = Schema::compile(&schema).unwrap_err().0;
            assert!(refused.contains(says), "{schema}: {refused}");
        }
    }

    /// Strings of bounded length (counted in characters, escapes and
    /// multi-byte ones too) and integers within bounds, each only as far
    /// as some valid value continues it.
    #[test]
    fn lengths_and_bounds_hold_by_prefix() {
        let schema = json!({
            "type": "object",
            "properties": {
                "code": {"type": "string", "minLength": 2, "maxLength": 3},
                "age": {"type": ["integer", "null"], "minimum": -5, "maximum": 120},
                "teen": {"type": "integer", "minimum": 13, "exclusiveMaximum": 20},
                "count": {"type": "integer", "exclusiveMinimum": 0},
                "tag": {"enum": ["a", "bb", 3, "ccc"], "type": "string", "maxLength": 2},
                "pick": {"enum": [1, 5, 9], "minimum": 4, "maximum": 6},
                "part": {"enum": [0.25, 0.5, 0.75], "exclusiveMinimum": 0.25, "maximum": 0.5}
            },
            "additionalProperties": false
        });
        let valid = [
            r#"{"code":"ab"}"#,
            r#"{"code":"a\"c"}"#,
            "{\"code\":\"\u{e9}\\u00e9\"}",
            "{\"code\":\"\u{1f600}\u{1f600}\u{1f600}\"}",
            r#"{"age":0,"teen":13,"count":1}"#,
            r#"{"age":-5}"#,
            r#"{"age":120,"teen":19}"#,
            r#"{"age":-0}"#,
            r#"{"age":null,"count":123456789012}"#,
            r#"{"tag":"bb","pick":5,"part":0.5}"#,
            r#"{"tag":"a"}"#,
        ];
        for text in valid {
            assert!(whole(&schema, text), "{text}");
            // By bytes: a token may end inside a character.
            for end in 0..text.len() {
                assert!(state(schema.clone()).feed(&text.as_bytes()[..end]), "prefix {:?}", &text.as_bytes()[..end]);
            }
        }
        for text in [
            r#"{"code":"a"}"#,
            r#"{"code":"abcd"}"#,
            "{\"code\":\"\u{1f600}\u{1f600}\u{1f600}\u{1f600}\"}",
            r#"{"code":"\ud83d\ude00x"}"#,
            r#"{"age":121}"#,
            r#"{"age":-6}"#,
            r#"{"age":1000}"#,
            r#"{"age":01}"#,
            r#"{"age":-}"#,
            r#"{"age":1.5}"#,
            r#"{"teen":12}"#,
            r#"{"teen":20}"#,
            r#"{"teen":1}"#,
            r#"{"count":0}"#,
            r#"{"count":-1}"#,
            r#"{"tag":"ccc"}"#,
            r#"{"tag":3}"#,
            r#"{"pick":1}"#,
            r#"{"pick":9}"#,
            r#"{"part":0.25}"#,
            r#"{"part":0.75}"#,
        ] {
            let mut state = state(schema.clone());
            assert!(!(state.feed(text.as_bytes()) && state.is_complete()), "{text} taken");
        }
        // Only what some valid value continues: "13" may become 130, not "14" of 140.
        assert!(prefix(&schema, r#"{"age":12"#) && prefix(&schema, r#"{"age":13"#) && !prefix(&schema, r#"{"age":130"#));
        assert!(!prefix(&schema, r#"{"teen":2"#) && !prefix(&schema, r#"{"count":-"#) && !prefix(&schema, r#"{"code":"abcd"#));
        for (schema, says) in [
            (json!({"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}}), "\"minimum\" on a number"),
            (json!({"type": "object", "properties": {"x": {"type": "integer", "minimum": 3, "maximum": 2}}}), "no integer"),
            (json!({"type": "object", "properties": {"x": {"type": "integer", "exclusiveMinimum": true}}}), "must be a number"),
            (json!({"type": "object", "properties": {"x": {"type": "string", "minLength": 3, "maxLength": 2}}}), "minLength"),
            (json!({"type": "object", "properties": {"x": {"enum": ["abc"], "maxLength": 2}}}), "no value of its enum"),
        ] {
            let refused = Schema::compile(&schema).unwrap_err().0;
            assert!(refused.contains(says), "{schema}: {refused}");
        }
    }

    /// A string's pattern, anywhere in it unless anchored, read through
    /// the string's escapes.
    #[test]
    fn patterns_hold_strings_by_prefix() {
        let schema = json!({
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}\\d$"}, "quote": {"type": "string", "pattern": "a\"b"}},
            "additionalProperties": false
        });
        let valid = [r#"{"code":"AB1"}"#, r#"{"quote":"xa\"by"}"#, r#"{"code":"ZZ9","quote":"a\"b"}"#, r#"{"quote":"\/a\"b\\"}"#];
        for text in valid {
            assert!(whole(&schema, text), "{text}");
            for end in 0..text.len() {
                assert!(prefix(&schema, &text[..end]), "prefix {:?}", &text[..end]);
            }
        }
        for text in [
            r#"{"code":"AB12"}"#,
            r#"{"code":"ab1"}"#,
            r#"{"code":"A"}"#,
            r#"{"quote":"ab"}"#,
            r#"{"code":"A\u0042"}"#,
            r#"{"quote":"a\"b\n"}"#,
            "{\"quote\":\"\u{e9}a\\\"b\"}",
        ] {
            let mut state = state(schema.clone());
            assert!(!(state.feed(text.as_bytes()) && state.is_complete()), "{text} taken");
        }
        assert!(!prefix(&schema, r#"{"code":"A1"#), "a digit where a letter must be is refused at once");
        for (pattern, says) in [
            (json!({"type": "string", "pattern": "^a+$", "maxLength": 3}), "beside pattern"),
            (json!({"type": "string", "pattern": 3}), "must be a string"),
            (json!({"type": "string", "pattern": "(?=a)"}), "not held to"),
        ] {
            let refused = Schema::compile(&json!({"type": "object", "properties": {"a": pattern}})).unwrap_err().0;
            assert!(refused.contains(says), "{pattern}: {refused}");
        }
    }

    /// An object naming no properties holds its values to
    /// `additionalProperties` (a map), or is empty where it is false.
    #[test]
    fn additional_properties_hold_an_objects_values() {
        let schema = json!({
            "type": "object",
            "properties": {
                "counts": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
                "none": {"type": "object", "additionalProperties": false},
                "nested": {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": {"enum": ["x"]}}}
            }
        });
        for text in [r#"{"counts":{}}"#, r#"{"counts":{"a":1,"b \" c":0}}"#, r#"{"none":{}}"#, r#"{"nested":{"k":{"j":"x","i":"x"},"l":{}},"counts":{"z":12}}"#]
        {
            assert!(whole(&schema, text), "{text}");
            for end in 0..text.len() {
                assert!(prefix(&schema, &text[..end]), "prefix {:?}", &text[..end]);
            }
        }
        for text in [
            r#"{"counts":{"a":-1}}"#,
            r#"{"counts":{"a":"1"}}"#,
            r#"{"counts":{"a"}}"#,
            r#"{"counts":{"a":1,}}"#,
            r#"{"counts":{1:1}}"#,
            r#"{"none":{"a":1}}"#,
            r#"{"nested":{"k":{"j":"y"}}}"#,
        ] {
            let mut state = state(schema.clone());
            assert!(!(state.feed(text.as_bytes()) && state.is_complete()), "{text} taken");
        }
        assert!(whole(&json!({"type": "object", "additionalProperties": {"type": "boolean"}}), r#"{"a":true}"#), "a map at the root");
    }

    /// The shortcut for text inside a string decides as reading the bytes
    /// would, at every point of a value (and for any object's state).
    #[test]
    fn accepting_text_in_a_string_decides_as_reading_it() {
        let schema = json!({"type": "object", "properties": {
            "a": {"type": "string"}, "b": {"type": "string", "maxLength": 4}, "c": {"type": "object"}
        }});
        let text = r#"{"a":"x y","b":"abc","c":{"k":"v w"}}"#;
        let tokens: [&[u8]; 9] = [b"hello", b" world", "\u{e9}t\u{e9}".as_bytes(), b"ab", b"abcde", b"a\"", b"\\n", b"\n", b"x\x01"];
        for end in 0..text.len() {
            let mut at = state(schema.clone());
            assert!(at.feed(&text.as_bytes()[..end]));
            let mut object = JsonState::default();
            assert!(object.feed(&text.as_bytes()[..end]));
            for token in tokens {
                assert_eq!(at.accepts(token), at.clone().feed(token), "schema at {:?}, {:?}", &text[..end], String::from_utf8_lossy(token));
                assert_eq!(object.accepts(token), object.clone().feed(token), "object at {:?}, {:?}", &text[..end], String::from_utf8_lossy(token));
            }
        }
    }

    #[test]
    fn accepting_leaves_the_state_as_it_was() {
        let mut state = state(json!({"type": "object", "properties": {"n": {"type": "integer"}}}));
        assert!(state.feed(br#"{"n":"#));
        let before = state.clone();
        assert!(state.accepts(b"12}") && !state.accepts(b"1.5}") && !state.accepts(b"\"") && !state.accepts(b""));
        assert_eq!(state, before);
        assert!(state.feed(b"12}") && state.is_complete());
        assert!(!state.accepts(b" ") && !state.accepts(b"}"));
    }
}
