//! What the dsv4d of two boxes say to each other on `peers.listen`: a coordinator (a box
//! whose profile has `workers:`) holds a profile of a worker box, and relays its engine's
//! connections to that profile's engine.
//!
//! Owns: the protocol's lines, the proof that a coordinator holds a key, and reading and
//! writing lines on a connection. Must not: put a key on the link (only a proof made with
//! it, good for one connection), or read a line without a bound.
//!
//! A connection, in lines of ASCII ended by `\n`, none longer than [`MAX_LINE`]:
//!
//! ```text
//! worker:      dsv4-peer 2 <nonce: 32 random bytes, hex>
//! coordinator: hold <profile> <proof>   or   relay <profile> <proof>   or   check <profile> <proof>
//! worker:      refused <why>               (then closes)
//! ```
//!
//! The proof is HMAC-SHA256 over the nonce, the verb and the profile, keyed with the
//! coordinator's key: the worker checks it against each key of its `peers.keys_file`. A
//! nonce is used once, so a proof seen on the link opens nothing. After `hold`, the worker
//! starts the profile's engine as a request would, and says `loading <seconds>` while it
//! loads, then `serving`, or `failed <why>` and closes. Both sides then say `alive` every
//! [`ALIVE_EVERY`]; a side that hears nothing for [`SILENCE_LIMIT`] (a box that lost power
//! sends no FIN) ends the hold. The coordinator lets go by saying `release` or by closing.
//! While held, the worker's `alive` carries a report of its box (`alive {json}`: its
//! latest sample and thermal levels), and each thermal event of its own goes as
//! `thermal <level> <message>`. After `relay`, the worker says `relaying` and the connection
//! carries the engine's bytes both ways, unread. After `check`, the worker runs its own
//! doctor and says `checked {json}` (its version, its active profile, whether the profile
//! could be held, the doctor's findings), then closes.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWrite, AsyncWriteExt};

/// The first words of the worker's greeting: the protocol and its version. Version 2 added
/// the reports of `alive`, `thermal` and `check`: boxes of two versions refuse each other,
/// by name, rather than misread each other's lines.
pub const GREETING: &str = "dsv4-peer 2";
/// The protocol's name, before its version.
const PROTOCOL: &str = "dsv4-peer ";
/// Random bytes in a greeting's nonce.
pub const NONCE_BYTES: usize = 32;
/// The longest line either side sends (a reason, or a worker's report, included).
pub const MAX_LINE: usize = 8192;
/// How often each side of a hold says it is alive.
pub const ALIVE_EVERY: Duration = Duration::from_secs(10);
/// A hold whose other side said nothing for this long is over.
pub const SILENCE_LIMIT: Duration = Duration::from_secs(35);
/// How long a worker box's own doctor may take, for a `check`.
pub const DOCTOR_LIMIT: Duration = Duration::from_secs(60);
/// How long a worker waits for a coordinator's first line, and a coordinator for the
/// worker's greeting and answer: a connection that says nothing is cut.
pub const HANDSHAKE: Duration = Duration::from_secs(10);

/// What a coordinator asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// Start the profile's engine and keep it while the connection lasts.
    Hold,
    /// Carry a connection to the held profile's engine.
    Relay,
    /// Say how this box stands for the profile (`dsv4ctl doctor` on the coordinator).
    Check,
}

impl Verb {
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Hold => "hold",
            Verb::Relay => "relay",
            Verb::Check => "check",
        }
    }
}

/// A coordinator's first line, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub verb: Verb,
    pub profile: String,
    pub proof: [u8; 32],
}

/// What a worker says after the first line.
#[derive(Debug, Clone, PartialEq)]
pub enum Said {
    /// Not served: the reason, for the coordinator's error.
    Refused(String),
    /// The engine loads, for this many seconds so far.
    Loading(u64),
    /// The engine serves: the hold is in force.
    Serving,
    /// The engine could not start, or ended: the hold is over.
    Failed(String),
    /// Still there; from a worker, with what it says of its box (a report too long for a
    /// line, or one this side cannot read, is left out).
    Alive(Option<Box<Report>>),
    /// A worker's thermal event (its level's word, and the event in words), as its own
    /// thermal policy announced it.
    Thermal { level: String, message: String },
    /// What follows is the engine's connection.
    Relaying,
    /// How this box stands for the profile asked about, for a `check`.
    Checked(Box<Checked>),
}

/// A worker box's answer to `check`: what the coordinator's doctor reports of it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Checked {
    /// Its dsv4d's version.
    pub version: String,
    /// Its active profile.
    pub active: String,
    /// Why the profile asked about could not be held, if it could not.
    #[serde(default)]
    pub not_lendable: Option<String>,
    /// Its own doctor's findings, or why they could not be had.
    pub doctor: Result<DoctorSummary, String>,
}

impl Checked {
    /// The answer cut to fit a line: the named findings dropped from the last, then its
    /// doctor's error cut, until its line is at most [`MAX_LINE`].
    pub fn fitted(mut self) -> Checked {
        let fits = |c: &Checked| {
            serde_json::to_string(c).is_ok_and(|j| j.len() + "checked ".len() <= MAX_LINE)
        };
        while !fits(&self) {
            match &mut self.doctor {
                Ok(d) if !d.warn.is_empty() => drop(d.warn.pop()),
                Ok(d) if !d.fail.is_empty() => drop(d.fail.pop()),
                Err(why) if why.len() > 200 => {
                    let cut: String = why.chars().take(200).collect();
                    *why = cut;
                }
                _ => {
                    self.not_lendable = self.not_lendable.map(|w| w.chars().take(200).collect());
                    if fits(&self) {
                        break;
                    }
                    self.doctor = Err("its doctor's findings do not fit a line".to_string());
                    break;
                }
            }
        }
        self
    }
}

/// A doctor's findings, counted, with the warnings and failures named (`id: found`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DoctorSummary {
    pub ok: usize,
    pub warn: Vec<String>,
    pub fail: Vec<String>,
}

/// What a worker box says of itself with each `alive` of a hold: its latest sample (GTT,
/// temperatures, power) and its thermal levels, for the coordinator's status.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Report {
    #[serde(default)]
    pub telemetry: Option<dsv4_client::telemetry::Sample>,
    #[serde(default)]
    pub thermal: Option<dsv4_client::ThermalStatus>,
}

/// The worker's greeting with `nonce`.
pub fn greeting(nonce: &[u8; NONCE_BYTES]) -> String {
    format!("{GREETING} {}", hex::encode(nonce))
}

/// The nonce of a worker's greeting.
pub fn read_greeting(line: &str) -> Result<[u8; NONCE_BYTES], String> {
    let not = || format!("not a dsv4 peer (it said {:?})", shown(line));
    if let Some(version) = line
        .strip_prefix(PROTOCOL)
        .and_then(|r| r.split(' ').next())
        .filter(|v| !GREETING.ends_with(&format!(" {v}")))
    {
        return Err(format!(
            "it speaks {PROTOCOL}{version}, this box {GREETING}: install the same dsv4 on both \
             boxes"
        ));
    }
    let hex_nonce = line
        .strip_prefix(GREETING)
        .and_then(|r| r.strip_prefix(' '))
        .ok_or_else(not)?;
    let mut nonce = [0; NONCE_BYTES];
    hex::decode_to_slice(hex_nonce, &mut nonce).map_err(|_| not())?;
    Ok(nonce)
}

/// The proof that the sender holds `key`, for `verb` on `profile`, in the connection whose
/// greeting carried `nonce`.
pub fn proof(key: &[u8], nonce: &[u8; NONCE_BYTES], verb: Verb, profile: &str) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(GREETING.as_bytes());
    mac.update(b"\n");
    mac.update(nonce);
    mac.update(b"\n");
    mac.update(verb.as_str().as_bytes());
    mac.update(b"\n");
    mac.update(profile.as_bytes());
    mac.finalize().into_bytes().into()
}

/// A coordinator's first line: `verb` on `profile`, proved with `key`.
pub fn ask(key: &[u8], nonce: &[u8; NONCE_BYTES], verb: Verb, profile: &str) -> String {
    let proof = proof(key, nonce, verb, profile);
    format!("{} {profile} {}", verb.as_str(), hex::encode(proof))
}

/// Reads a coordinator's first line.
pub fn read_ask(line: &str) -> Result<Ask, String> {
    let mut words = line.split(' ');
    let bad = || format!("not a request of this protocol: {:?}", shown(line));
    let verb = match words.next() {
        Some("hold") => Verb::Hold,
        Some("relay") => Verb::Relay,
        Some("check") => Verb::Check,
        _ => return Err(bad()),
    };
    let profile = words.next().filter(|p| !p.is_empty()).ok_or_else(bad)?;
    let mut proof = [0; 32];
    let hex_proof = words.next().ok_or_else(bad)?;
    hex::decode_to_slice(hex_proof, &mut proof).map_err(|_| bad())?;
    if words.next().is_some() {
        return Err(bad());
    }
    Ok(Ask {
        verb,
        profile: profile.to_string(),
        proof,
    })
}

/// Whether `ask` was proved with one of `keys` for the connection of `nonce`: every key is
/// tried, each compared in constant time, so the time taken tells nothing of which matched.
pub fn proved<'k>(
    ask: &Ask,
    nonce: &[u8; NONCE_BYTES],
    keys: impl Iterator<Item = &'k [u8]>,
) -> bool {
    use subtle::ConstantTimeEq;
    let mut ok = subtle::Choice::from(0);
    for key in keys {
        ok |= proof(key, nonce, ask.verb, &ask.profile).ct_eq(&ask.proof);
    }
    ok.into()
}

impl Said {
    /// Its first word on the line, for a message about a line said out of turn.
    pub fn word(&self) -> &'static str {
        match self {
            Said::Refused(_) => "refused",
            Said::Loading(_) => "loading",
            Said::Serving => "serving",
            Said::Failed(_) => "failed",
            Said::Alive(_) => "alive",
            Said::Thermal { .. } => "thermal",
            Said::Relaying => "relaying",
            Said::Checked(_) => "checked",
        }
    }

    /// The line for it (a reason's line ends and control characters made spaces).
    pub fn line(&self) -> String {
        let clean = |why: &str| -> String {
            let text: String = why
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            text.chars().take(MAX_LINE - 16).collect()
        };
        let rest = match self {
            Said::Refused(why) | Said::Failed(why) => Some(clean(why)),
            Said::Loading(s) => Some(s.to_string()),
            Said::Serving | Said::Relaying | Said::Alive(None) => None,
            Said::Alive(Some(report)) => serde_json::to_string(report)
                .ok()
                .filter(|json| json.len() + "alive ".len() <= MAX_LINE),
            Said::Thermal { level, message } => Some(format!(
                "{} {}",
                clean(level).replace(' ', "-"),
                clean(message)
            )),
            Said::Checked(checked) => serde_json::to_string(checked).ok(),
        };
        match rest {
            Some(rest) => format!("{} {rest}", self.word()),
            None => self.word().to_string(),
        }
    }

    /// Reads a worker's line.
    pub fn read(line: &str) -> Result<Said, String> {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        Ok(match (word, rest) {
            ("refused", why) => Said::Refused(why.to_string()),
            ("loading", s) => Said::Loading(s.parse().map_err(|_| unknown(line))?),
            ("serving", "") => Said::Serving,
            ("failed", why) => Said::Failed(why.to_string()),
            ("alive", "") => Said::Alive(None),
            ("alive", report) => Said::Alive(serde_json::from_str(report).ok().map(Box::new)),
            ("thermal", said) => {
                let (level, message) = said.split_once(' ').ok_or_else(|| unknown(line))?;
                Said::Thermal {
                    level: level.to_string(),
                    message: message.to_string(),
                }
            }
            ("relaying", "") => Said::Relaying,
            ("checked", json) => Said::Checked(Box::new(
                serde_json::from_str(json).map_err(|_| unknown(line))?,
            )),
            _ => return Err(unknown(line)),
        })
    }
}

fn unknown(line: &str) -> String {
    format!("an answer not of this protocol: {:?}", shown(line))
}

/// At most 80 characters of a line, for a message.
fn shown(line: &str) -> String {
    line.chars().take(80).collect()
}

/// Reads one line (without its `\n`); `Ok(None)` at the end of the connection. A line longer
/// than [`MAX_LINE`], or not UTF-8, is an error.
pub async fn read_line<R: AsyncBufRead + Unpin>(r: &mut R) -> std::io::Result<Option<String>> {
    use tokio::io::AsyncReadExt;
    let mut bytes = Vec::new();
    let n = (&mut *r)
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut bytes)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    let too_long = || std::io::Error::new(std::io::ErrorKind::InvalidData, "a line too long");
    match bytes.pop() {
        Some(b'\n') => {}
        _ if bytes.len() >= MAX_LINE => return Err(too_long()),
        _ => return Ok(None),
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a line not UTF-8"))
}

/// The lines of `r`, as a stream, until the connection ends. Reading them is cancel-safe: a
/// line half read when a `select!` takes another branch is kept for the next `next()`.
pub fn lines<'a, R: AsyncBufRead + Unpin + Send + 'a>(
    r: R,
) -> std::pin::Pin<Box<dyn futures_util::Stream<Item = std::io::Result<String>> + Send + 'a>> {
    Box::pin(futures_util::stream::unfold(Some(r), |r| async move {
        let mut r = r?;
        match read_line(&mut r).await {
            Ok(Some(line)) => Some((Ok(line), Some(r))),
            Ok(None) => None,
            // Nothing more is read after a broken line.
            Err(e) => Some((Err(e), None)),
        }
    }))
}

/// Writes `line` and its `\n`, flushed.
pub async fn write_line<W: AsyncWrite + Unpin>(w: &mut W, line: &str) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    w.write_all(&bytes).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONCE: [u8; NONCE_BYTES] = [7; NONCE_BYTES];

    #[test]
    fn a_proof_opens_only_its_own_connection_verb_and_profile() {
        let line = ask(b"the key", &NONCE, Verb::Hold, "rpc");
        let asked = read_ask(&line).unwrap();
        assert_eq!((asked.verb, asked.profile.as_str()), (Verb::Hold, "rpc"));
        let keys = |k: &'static [&'static [u8]]| k.iter().copied();
        assert!(proved(&asked, &NONCE, keys(&[b"other", b"the key"])));
        assert!(!proved(&asked, &NONCE, keys(&[b"other"])));
        assert!(!proved(&asked, &[8; NONCE_BYTES], keys(&[b"the key"])));
        for (verb, profile) in [(Verb::Relay, "rpc"), (Verb::Hold, "rpc2")] {
            let moved = Ask {
                verb,
                profile: profile.to_string(),
                ..asked.clone()
            };
            assert!(
                !proved(&moved, &NONCE, keys(&[b"the key"])),
                "{verb:?} {profile}"
            );
        }
        // The key itself is nowhere in the line.
        assert!(!line.contains("the key") && !line.contains(&hex::encode(b"the key")));
    }

    #[test]
    fn lines_that_are_not_the_protocol_are_named() {
        assert_eq!(read_greeting(&greeting(&NONCE)), Ok(NONCE));
        for bad in [
            "HTTP/1.1 400 Bad Request",
            "dsv4-peer 2 zz",
            "dsv4-peer 2 00",
        ] {
            assert!(
                read_greeting(bad).unwrap_err().contains("not a dsv4 peer"),
                "{bad}"
            );
        }
        // Another version of the protocol: named, with what to do.
        let older = format!("dsv4-peer 1 {}", hex::encode(NONCE));
        assert_eq!(
            read_greeting(&older).unwrap_err(),
            "it speaks dsv4-peer 1, this box dsv4-peer 2: install the same dsv4 on both boxes"
        );
        // A check's answer too long for a line is cut to fit, never refused.
        let long = Checked {
            version: "0.1.0".into(),
            active: "rpc".into(),
            not_lendable: None,
            doctor: Ok(DoctorSummary {
                ok: 1,
                warn: vec!["é".repeat(300); 40],
                fail: vec!["ü".repeat(300); 40],
            }),
        };
        let line = Said::Checked(Box::new(long.fitted())).line();
        assert!(line.len() <= MAX_LINE, "{}", line.len());
        match Said::read(&line) {
            Ok(Said::Checked(c)) => assert!(!c.doctor.unwrap().fail.is_empty()),
            other => panic!("{other:?}"),
        }
        for bad in [
            "GET / HTTP/1.1",
            "hold",
            "hold rpc",
            "hold  00",
            "hold rpc 00",
            &format!("hold rpc {} more", hex::encode([0u8; 32])),
        ] {
            assert!(read_ask(bad).is_err(), "{bad}");
        }
        for said in [
            Said::Refused("no such profile".into()),
            Said::Loading(12),
            Said::Serving,
            Said::Failed("exit 1".into()),
            Said::Alive(None),
            Said::Alive(Some(Box::new(Report {
                telemetry: None,
                thermal: Some(dsv4_client::ThermalStatus::default()),
            }))),
            Said::Thermal {
                level: "warn".into(),
                message: "edge at 91.0 C (warn at 90 C)".into(),
            },
            Said::Relaying,
        ] {
            assert_eq!(Said::read(&said.line()), Ok(said));
        }
        // A report this side cannot read leaves the hold alive, without the report.
        assert_eq!(Said::read("alive {\"thermal\": 7}"), Ok(Said::Alive(None)));
        assert!(Said::read("thermal warn").is_err());
        assert_eq!(Said::Failed("two\nlines".into()).line(), "failed two lines");
        assert!(Said::read("serving now").is_err());
        assert!(Said::read("loading soon").is_err());
    }

    #[tokio::test]
    async fn a_line_is_read_whole_within_its_bound() {
        let mut input: &[u8] = b"alive\nserving\npartial";
        let mut r = tokio::io::BufReader::new(&mut input);
        assert_eq!(read_line(&mut r).await.unwrap().as_deref(), Some("alive"));
        assert_eq!(read_line(&mut r).await.unwrap().as_deref(), Some("serving"));
        // Cut before its end: the connection ended.
        assert_eq!(read_line(&mut r).await.unwrap(), None);
        let long = vec![b'a'; MAX_LINE + 10];
        let mut r = tokio::io::BufReader::new(&long[..]);
        assert!(read_line(&mut r).await.is_err());
        let mut r = tokio::io::BufReader::new(&b"\xff\xfe\n"[..]);
        assert!(read_line(&mut r).await.is_err());
    }
}
