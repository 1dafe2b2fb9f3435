//! The keys a configuration type reads, learnt from the type itself.
//!
//! serde hands every struct's field list to `deserialize_struct`. A deserializer that only
//! listens ([`Route`]) follows one path of fields down a type and records what it finds
//! there: a struct and its keys, a map (any key), or a value. Walking every path gives the
//! [`Shape`] of the type, so the loader can name an unknown key, with the keys that were
//! possible, from the parsed document alone, without serde having to fail on it first, and
//! without reading any error text.

use std::fmt;

use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor};

/// What a document may hold at one place.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    /// A struct: its keys in serde's order, with what each holds.
    Struct(Vec<(&'static str, Shape)>),
    /// A map (any key), a list, or something read another way: keys are not checked there.
    Open,
    /// A single value.
    Value,
}

impl Shape {
    /// The shape of `T`.
    pub fn of<T: DeserializeOwned>() -> Shape {
        Shape::at::<T>(&mut Vec::new())
    }

    fn at<T: DeserializeOwned>(route: &mut Vec<&'static str>) -> Shape {
        let found = follow::<T>(route);
        let Found::Struct(fields) = found else {
            return match found {
                Found::Open => Shape::Open,
                _ => Shape::Value,
            };
        };
        // No setting nests more than a few deep; a type that refers to itself would not end.
        if route.len() > 8 {
            return Shape::Open;
        }
        let children = fields
            .iter()
            .map(|f| {
                route.push(f);
                let child = Shape::at::<T>(route);
                route.pop();
                (*f, child)
            })
            .collect();
        Shape::Struct(children)
    }

    /// The keys of a struct, in serde's order.
    pub fn keys(&self) -> Vec<&'static str> {
        match self {
            Shape::Struct(fields) => fields.iter().map(|(k, _)| *k).collect(),
            _ => Vec::new(),
        }
    }

    /// What `key` holds in this struct: `None` when this is a struct without that key.
    pub fn get(&self, key: &str) -> Option<&Shape> {
        match self {
            Shape::Struct(fields) => fields.iter().find(|(k, _)| *k == key).map(|(_, s)| s),
            _ => Some(&Shape::Open),
        }
    }
}

/// serde's own wording for a key it does not know, from the keys there are.
pub fn unknown_key(key: &str, keys: &[&str]) -> String {
    let quoted: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
    match quoted.as_slice() {
        [] => format!("unknown key `{key}`, there are no keys"),
        [one] => format!("unknown key `{key}`, expected {one}"),
        [a, b] => format!("unknown key `{key}`, expected {a} or {b}"),
        all => format!("unknown key `{key}`, expected one of {}", all.join(", ")),
    }
}

/// The nearest of `keys` to `key` by edit distance, when near enough to be a typo.
pub fn meant<'a>(key: &str, keys: &[&'a str]) -> Option<&'a str> {
    let limit = (key.chars().count() / 3).max(1);
    keys.iter()
        .map(|k| (strsim::osa_distance(key, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// What was found at the end of a route.
enum Found {
    Struct(&'static [&'static str]),
    Open,
    Value,
}

/// Runs `T`'s deserialization along `route` and says what stands at its end.
fn follow<T: DeserializeOwned>(route: &[&'static str]) -> Found {
    let mut found = Found::Value;
    let _ = T::deserialize(Route {
        route,
        found: &mut found,
    });
    found
}

/// The listening deserializer: at each struct on the way, it offers the route's next key
/// alone; at the end of the route it records what is asked for, and stops.
struct Route<'r> {
    route: &'r [&'static str],
    found: &'r mut Found,
}

#[derive(Debug)]
struct Stop;

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("stop")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Stop
    }
}

/// The single-value methods of [`Route`]: each records a value and stops.
macro_rules! single_values {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
                self.value()
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for Route<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        // Read some other way (an untagged enum, say): whatever it takes is not checked.
        *self.found = Found::Open;
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Stop> {
        match self.route.split_first() {
            None => {
                *self.found = Found::Struct(fields);
                Err(Stop)
            }
            Some((key, rest)) => visitor.visit_map(OneKey {
                key: Some(key),
                rest,
                found: self.found,
            }),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, Stop> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_map<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        *self.found = Found::Open;
        Err(Stop)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        *self.found = Found::Open;
        Err(Stop)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        *self.found = Found::Open;
        Err(Stop)
    }

    // Everything else is a single value.
    single_values! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf deserialize_unit
        deserialize_identifier
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: V,
    ) -> Result<V::Value, Stop> {
        self.value()
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, Stop> {
        self.value()
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        _: V,
    ) -> Result<V::Value, Stop> {
        self.value()
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        self.value()
    }
}

impl Route<'_> {
    fn value<T>(self) -> Result<T, Stop> {
        *self.found = Found::Value;
        Err(Stop)
    }
}

/// A map of one entry: the route's next key, whose value is followed further.
struct OneKey<'r> {
    key: Option<&'static str>,
    rest: &'r [&'static str],
    found: &'r mut Found,
}

impl<'de> MapAccess<'de> for OneKey<'_> {
    type Error = Stop;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Stop> {
        match self.key.take() {
            Some(key) => seed
                .deserialize(de::value::BorrowedStrDeserializer::new(key))
                .map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Stop> {
        seed.deserialize(Route {
            route: self.rest,
            found: self.found,
        })
    }
}

/// A path as the loader writes it (`engine.idle_timeout`, `extra_args[2]`, `env.HOME`):
/// its keys, a list index ending the walk (items are not checked).
pub fn keys_of_path(path: &str) -> impl Iterator<Item = &str> {
    path.split('.')
        .map_while(|k| (!k.contains('[')).then_some(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(dead_code)]
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        dir: String,
        max_size: Option<u64>,
    }

    #[allow(dead_code)]
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        name: String,
        inner: Option<Inner>,
        env: std::collections::BTreeMap<String, String>,
        args: Vec<String>,
    }

    /// The shape comes from the types: nested structs (behind `Option` too) with their keys,
    /// maps and lists open, everything else a value.
    #[test]
    fn the_shape_of_a_type_is_read_from_the_type() {
        let inner = Shape::Struct(vec![("dir", Shape::Value), ("max_size", Shape::Value)]);
        assert_eq!(
            Shape::of::<Outer>(),
            Shape::Struct(vec![
                ("name", Shape::Value),
                ("inner", inner),
                ("env", Shape::Open),
                ("args", Shape::Open),
            ])
        );
        let shape = Shape::of::<Outer>();
        assert!(shape.get("inner").unwrap().get("dirr").is_none());
        assert!(shape.get("env").unwrap().get("ANY_NAME").is_some());
    }

    #[test]
    fn unknown_keys_are_said_as_serde_says_them() {
        assert_eq!(unknown_key("x", &[]), "unknown key `x`, there are no keys");
        assert_eq!(unknown_key("x", &["a"]), "unknown key `x`, expected `a`");
        assert_eq!(
            unknown_key("x", &["a", "b"]),
            "unknown key `x`, expected `a` or `b`"
        );
        assert_eq!(
            unknown_key("x", &["a", "b", "c"]),
            "unknown key `x`, expected one of `a`, `b`, `c`"
        );
        assert_eq!(
            meant("idle_timout", &["idle_timeout", "stop_timeout"]),
            Some("idle_timeout")
        );
        assert_eq!(meant("zzz", &["idle_timeout"]), None);
    }
}
