//! The closed sets of words dsv4 says on the wire: thermal levels and events, the power
//! method, the KV step, the GPU's performance level, and the API's error types and codes.
//!
//! Each is an enum that serde, `Display` and `FromStr` all spell the same way, so the daemon
//! writes and the clients read one type, and a word misspelled on either side does not
//! compile. A word from a newer daemon that this client does not know is an error to read
//! (`UnknownWord`), except for the GPU level, whose words come from the kernel.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A word that is not one of its set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownWord {
    /// What it should have been.
    pub what: &'static str,
    pub word: String,
    pub known: &'static [&'static str],
}

impl fmt::Display for UnknownWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?}; expected one of: {}",
            self.what,
            self.word,
            self.known.join(", ")
        )
    }
}

impl std::error::Error for UnknownWord {}

/// Declares one set: the enum, its spellings, and the traits that use them.
macro_rules! words {
    ($(#[$meta:meta])* $name:ident ($what:literal) {
        $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every word of the set, in order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];
            const WORDS: &'static [&'static str] = &[$($text,)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownWord {
                        what: $what,
                        word: s.to_string(),
                        known: $name::WORDS,
                    }),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let word = std::borrow::Cow::<str>::deserialize(d)?;
                word.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

words! {
    /// How hot a sensor is, against `thermal.warn_c` and `thermal.critical_c`; ordered.
    #[derive(Default)]
    ThermalLevel ("thermal level") {
        #[default]
        Normal = "normal",
        Warn = "warn",
        Critical = "critical",
    }
}

impl ThermalLevel {
    /// 0, 1, 2: as in the `dsv4_thermal_level` metric.
    pub fn number(self) -> u8 {
        self as u8
    }
}

words! {
    /// What a `ThermalEvent` signal is about: a sensor's new level (also `normal` when its
    /// readings are lost), or the hardware's throttling beginning or ending.
    ThermalSignal ("thermal event") {
        Normal = "normal",
        Warn = "warn",
        Critical = "critical",
        Throttling = "throttling",
        ThrottlingEnded = "throttling-ended",
    }
}

impl From<ThermalLevel> for ThermalSignal {
    fn from(level: ThermalLevel) -> Self {
        match level {
            ThermalLevel::Normal => ThermalSignal::Normal,
            ThermalLevel::Warn => ThermalSignal::Warn,
            ThermalLevel::Critical => ThermalSignal::Critical,
        }
    }
}

words! {
    /// Where a request in flight is ([`crate::InProgress`]).
    Phase ("request phase") {
        /// Waiting for its turn: a start, a drain, a validation, or a place at the engine.
        Waiting = "waiting",
        /// Waiting for an engine that loads.
        Loading = "loading",
        /// With the engine, its prompt being read (prefill).
        Prefill = "prefill",
        /// The engine writes its answer.
        Decoding = "decoding",
        /// The answer is complete, or nearly, on its way to the client.
        Ending = "ending",
    }
}
words! {
    /// What a waiting request waits for.
    WaitingFor ("wait") {
        /// An engine to start (a start refused for now, or one not yet begun).
        Start = "start",
        /// The running engine to drain and stop (a profile switch, a stop, a restart).
        Drain = "drain",
        /// A validation run that holds the engine.
        Validation = "validation",
        /// A place at the running engine (`engine.max_in_flight`).
        Turn = "turn",
    }
}
words! {
    /// How dsv4d sets the CPU's power profile (`power.method`, once decided).
    PowerMethod ("power method") {
        Ppd = "ppd",
        Cpufreq = "cpufreq",
        None = "none",
    }
}

words! {
    /// The KV checkpoint step under way: `restoring` (the last part of `starting`) or
    /// `saving` (the first part of `stopping`).
    KvActivity ("KV step") {
        Restoring = "restoring",
        Saving = "saving",
    }
}

words! {
    /// The `type` of an API error, in OpenAI's error shape.
    ErrorType ("error type") {
        InvalidRequest = "invalid_request_error",
        Server = "server_error",
        Timeout = "timeout_error",
        Unavailable = "unavailable_error",
    }
}

words! {
    /// The `code` of an API error dsv4d answers itself (docs/http-api.md lists each).
    ErrorCode ("error code") {
        // The front door.
        InvalidHost = "invalid_host",
        HostNotAllowed = "host_not_allowed",
        OriginNotAllowed = "origin_not_allowed",
        MethodNotAllowed = "method_not_allowed",
        BadPath = "bad_path",
        TooManyConnections = "too_many_connections",
        TooManyEventStreams = "too_many_event_streams",
        // Keys.
        InvalidApiKey = "invalid_api_key",
        SeveralCredentials = "several_credentials",
        ApiKeysUnavailable = "api_keys_unavailable",
        // Bodies.
        BodyTooLarge = "body_too_large",
        BodyTimeout = "body_timeout",
        BodyTooSlow = "body_too_slow",
        BodiesOverBudget = "bodies_over_budget",
        BadBody = "bad_body",
        // The engine and its lifecycle.
        SlotsManaged = "slots_managed",
        QueueFull = "queue_full",
        EngineStartFailed = "engine_start_failed",
        EngineStartTimeout = "engine_start_timeout",
        EngineBackoff = "engine_backoff",
        EngineStopped = "engine_stopped",
        InsufficientMemory = "insufficient_memory",
        TooHot = "too_hot",
        ShuttingDown = "shutting_down",
        ConfigInvalid = "config_invalid",
        EngineFailed = "engine_failed",
        EngineLends = "engine_lends",
        CanaryDrift = "canary_drift",
        // The dashboard's actions.
        NotFound = "not_found",
        ActionsOff = "actions_off",
        NotSameOrigin = "not_same_origin",
        InvalidAdminKey = "invalid_admin_key",
        UnknownProfile = "unknown_profile",
        Busy = "busy",
        ActionFailed = "action_failed",
        Internal = "internal",
    }
}

/// The GPU's performance level (amdgpu's `power_dpm_force_performance_level`): the kernel's
/// words, and any other it may come to write, kept as written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GpuLevel {
    Auto,
    Low,
    High,
    Manual,
    ProfileStandard,
    ProfileMinSclk,
    ProfileMinMclk,
    ProfilePeak,
    PerfDeterminism,
    Other(String),
}

impl GpuLevel {
    const KNOWN: [(GpuLevel, &'static str); 9] = [
        (GpuLevel::Auto, "auto"),
        (GpuLevel::Low, "low"),
        (GpuLevel::High, "high"),
        (GpuLevel::Manual, "manual"),
        (GpuLevel::ProfileStandard, "profile_standard"),
        (GpuLevel::ProfileMinSclk, "profile_min_sclk"),
        (GpuLevel::ProfileMinMclk, "profile_min_mclk"),
        (GpuLevel::ProfilePeak, "profile_peak"),
        (GpuLevel::PerfDeterminism, "perf_determinism"),
    ];

    pub fn as_str(&self) -> &str {
        match self {
            GpuLevel::Other(word) => word,
            known => {
                let found = GpuLevel::KNOWN.iter().find(|(level, _)| level == known);
                found.map_or("", |(_, word)| word)
            }
        }
    }

    /// Reads a level as the kernel writes it (surrounding white space ignored).
    pub fn read(text: &str) -> GpuLevel {
        let word = text.trim();
        GpuLevel::KNOWN
            .iter()
            .find(|(_, w)| *w == word)
            .map_or_else(|| GpuLevel::Other(word.to_string()), |(l, _)| l.clone())
    }
}

impl fmt::Display for GpuLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for GpuLevel {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for GpuLevel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(GpuLevel::read(&std::borrow::Cow::<str>::deserialize(d)?))
    }
}

/// `PowerStatus.method`: the method, or `""` before the first engine start decided it.
pub mod method_or_empty {
    use super::PowerMethod;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &Option<PowerMethod>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(m.map_or("", PowerMethod::as_str))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PowerMethod>, D::Error> {
        let word = std::borrow::Cow::<str>::deserialize(d)?;
        match &*word {
            "" => Ok(None),
            w => w.parse().map(Some).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each word reads back as itself, in JSON and as text; an unknown one is named.
    #[test]
    fn every_word_reads_back_as_itself() {
        fn check<T>(all: &[T])
        where
            T: Serialize + for<'de> Deserialize<'de> + FromStr + fmt::Display + PartialEq,
            T: fmt::Debug,
            T::Err: fmt::Debug,
        {
            for w in all {
                let json = serde_json::to_string(w).unwrap();
                assert_eq!(json, format!("\"{w}\""));
                assert_eq!(&serde_json::from_str::<T>(&json).unwrap(), w);
                assert_eq!(&w.to_string().parse::<T>().unwrap(), w);
            }
        }
        check(ThermalLevel::ALL);
        check(ThermalSignal::ALL);
        check(PowerMethod::ALL);
        check(KvActivity::ALL);
        check(ErrorType::ALL);
        check(ErrorCode::ALL);
        let e = "hot".parse::<ThermalLevel>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown thermal level \"hot\"; expected one of: normal, warn, critical"
        );
        assert!(serde_json::from_str::<KvActivity>("\"resting\"").is_err());
    }

    #[test]
    fn gpu_levels_keep_a_word_they_do_not_know() {
        for (level, word) in GpuLevel::KNOWN {
            assert_eq!(GpuLevel::read(&format!("{word}\n")), level);
            assert_eq!(level.as_str(), word);
        }
        let odd = GpuLevel::read("turbo");
        assert_eq!(odd, GpuLevel::Other("turbo".into()));
        assert_eq!(serde_json::to_string(&odd).unwrap(), "\"turbo\"");
    }

    #[test]
    fn an_undecided_power_method_is_an_empty_word() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct P {
            #[serde(with = "method_or_empty")]
            method: Option<PowerMethod>,
        }
        for (p, json) in [
            (P { method: None }, r#"{"method":""}"#),
            (
                P {
                    method: Some(PowerMethod::Ppd),
                },
                r#"{"method":"ppd"}"#,
            ),
        ] {
            assert_eq!(serde_json::to_string(&p).unwrap(), json);
            assert_eq!(serde_json::from_str::<P>(json).unwrap(), p);
        }
    }

    #[test]
    fn thermal_levels_are_ordered_and_numbered() {
        assert!(ThermalLevel::Normal < ThermalLevel::Warn);
        assert!(ThermalLevel::Warn < ThermalLevel::Critical);
        let numbers: Vec<u8> = ThermalLevel::ALL.iter().map(|l| l.number()).collect();
        assert_eq!(numbers, [0, 1, 2]);
    }
}
