//! A coordinator's workers: the profiles of other boxes whose engines lend this box's engine
//! their devices (`workers:`), held for as long as this box's engine runs.
//!
//! Owns: the holds (one connection to each worker box's dsv4d, proved with that box's key,
//! kept alive both ways), the relays (a loopback port per worker, given to the engine in its
//! place: each connection the engine opens there is carried to the worker's engine through
//! that box's dsv4d, and only for connections of dsv4d's own user), and waking a box that
//! does not answer. Must not: outlive the engine
//! generation it serves (dropping [`Holds`] lets every worker go), or put a key on the link.
//!
//! The protocol is `crate::lifecycle::peer_wire`'s.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::task::JoinSet;
use tokio::time::{timeout, Instant};

use super::peer_wire::{self, Said, Verb, ALIVE_EVERY, HANDSHAKE, NONCE_BYTES, SILENCE_LIMIT};
use crate::config::{Wake, Worker};
use crate::host::keys::ApiKeys;
use crate::lifecycle::alert::Alerts;
use dsv4_client::AlertKind;

/// How long one connection attempt to a worker box may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The bytes a relay reads from a worker at a time (tensors and activations).
const RELAY_BUFFER: usize = 64 << 10;
/// Between attempts to reach a box that was sent a Wake-on-LAN packet.
const WAKE_RETRY: Duration = Duration::from_secs(2);
/// Where the shipped `dsv4-link@AT.socket` puts its way out to worker box `AT`, for a dsv4d
/// that runs in a network namespace of its own (`PrivateNetwork=yes`).
pub const LINK_DIR: &str = "/run/dsv4-link";

/// A connection to a worker box's dsv4d: TCP, or the Unix socket of its link unit.
pub trait PeerIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> PeerIo for T {}
type Conn = BufReader<Box<dyn PeerIo>>;

/// Every worker of one engine generation, held; each with the loopback address its relay
/// listens on. Dropped, it lets every worker go (their connections close) and ends every relay.
#[derive(Debug)]
pub struct Holds {
    relays: Vec<SocketAddr>,
    /// The output of the engine the relays serve, where a relay says that a worker box ended
    /// its side (the answer's error event quotes the engine's last lines).
    output: EngineOutput,
    /// The holds kept and the relays: ended (aborted) when this is dropped.
    _tasks: JoinSet<()>,
    book: WorkerBook,
}

impl Drop for Holds {
    fn drop(&mut self) {
        self.book.clear();
    }
}

/// The worker boxes of the engine that starts or runs, as their holds go, for the status:
/// set at each start, cleared when the holds are let go (a start that failed keeps what it
/// came to, until the next).
#[derive(Debug, Clone, Default)]
pub struct WorkerBook(Arc<Mutex<Vec<dsv4_client::WorkerStatus>>>);

impl WorkerBook {
    pub fn list(&self) -> Vec<dsv4_client::WorkerStatus> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<dsv4_client::WorkerStatus>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begin(&self, workers: &[Worker]) {
        let now = dsv4_client::clock::unix_now();
        *self.lock() = workers
            .iter()
            .map(|w| dsv4_client::WorkerStatus {
                host: w.host().to_string(),
                at: w.at.clone(),
                profile: w.profile.clone(),
                state: "connecting".to_string(),
                since: now,
                load_seconds: None,
                error: None,
                telemetry: None,
                thermal: None,
            })
            .collect();
    }

    /// What worker `at` said of its box.
    fn report(&self, at: &str, report: peer_wire::Report) {
        if let Some(w) = self.lock().iter_mut().find(|w| w.at == at) {
            w.telemetry = report.telemetry;
            w.thermal = report.thermal;
        }
    }

    /// Worker `at` is in `state` now.
    fn set(&self, at: &str, state: &str, load_seconds: Option<f64>, error: Option<String>) {
        let mut list = self.lock();
        if let Some(w) = list.iter_mut().find(|w| w.at == at) {
            w.state = state.to_string();
            w.since = dsv4_client::clock::unix_now();
            w.load_seconds = load_seconds.or(w.load_seconds);
            w.error = error;
        }
    }

    fn clear(&self) {
        self.lock().clear();
    }
}

impl Holds {
    /// Where the engine reaches each worker, in the order of `workers:`.
    pub fn addresses(&self) -> Vec<String> {
        self.relays.iter().map(SocketAddr::to_string).collect()
    }

    /// The engine spawned with these holds: its output, where the relays say what the
    /// worker boxes did to it.
    pub fn attach(&self, output: dsv4_engine::OutputTail) {
        *self.output.lock().unwrap_or_else(|p| p.into_inner()) = Some(output);
    }
}

/// The output of the engine the relays serve, once it is spawned.
type EngineOutput = Arc<Mutex<Option<dsv4_engine::OutputTail>>>;

/// Says `line` in the engine's output, as dsv4d (after the engine's own lines).
fn say_to_engine_output(output: &EngineOutput, line: String) {
    if let Some(out) = output.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        out.push(format!("dsv4d: {line}").into());
    }
}

/// What a hold says while it is made: the box it waits for, and what it waits for.
pub type Progress = Arc<dyn Fn(&str) + Send + Sync>;

/// What a hold says when a worker goes away after it was held: why, naming the box.
pub type Lost = Arc<dyn Fn(String) + Send + Sync>;

/// Holds every worker (all at once), each ready when this returns; the reason, naming the box,
/// when one cannot be held.
pub async fn hold(
    workers: &[Worker],
    progress: Progress,
    lost: Lost,
    book: WorkerBook,
    alerts: Alerts,
) -> Result<Holds, String> {
    book.begin(workers);
    let held = futures_util::future::join_all(
        workers
            .iter()
            .map(|w| hold_one(w.clone(), progress.clone(), book.clone())),
    )
    .await;
    // What a start that failed came to stays in the book (Holds clears it when dropped).
    let mut relays = Vec::new();
    let mut tasks = JoinSet::new();
    let output = EngineOutput::default();
    for (w, held) in workers.iter().zip(held) {
        let (conn, key) = held.map_err(|why| {
            book.set(&w.at, "lost", None, Some(why.clone()));
            format!("worker box {}: {why}", w.host())
        })?;
        tracing::info!(
            "worker box {} held: its engine serves ({})",
            w.host(),
            w.profile
        );
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(|e| format!("cannot open a loopback port for the relay to {}: {e}", w.at))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("the relay's port for {}: {e}", w.at))?;
        relays.push(addr);
        let told = Told {
            lost: lost.clone(),
            book: book.clone(),
            alerts: alerts.clone(),
        };
        tasks.spawn(keep(conn, w.clone(), told));
        // The key the hold was proved with serves every relayed connection of this
        // generation (a changed key file applies at the next start).
        tasks.spawn(relay(listener, w.clone(), key, output.clone()));
    }
    Ok(Holds {
        relays,
        output,
        _tasks: tasks,
        book,
    })
}

/// Holds one worker: connects (waking the box when it does not answer and `wake` says how),
/// asks for the hold, and waits for its engine to be ready.
async fn hold_one(
    w: Worker,
    progress: Progress,
    book: WorkerBook,
) -> Result<(Conn, Arc<[u8]>), String> {
    let key: Arc<[u8]> = worker_key(&w)?.into();
    let (mut conn, nonce) = reach(&w, &progress, &book).await?;
    book.set(&w.at, "loading", None, None);
    asked(&mut conn, &key, &nonce, Verb::Hold, &w.profile).await?;
    let since = Instant::now();
    loop {
        // The worker says how its load goes at least every ALIVE_EVERY.
        match said(&mut conn, SILENCE_LIMIT).await? {
            Said::Serving => {
                let took = since.elapsed().as_secs_f64();
                book.set(&w.at, "serving", Some(took), None);
                return Ok((conn, key));
            }
            Said::Loading(_) | Said::Alive(_) | Said::Thermal { .. } => progress(&format!(
                "waiting for {} ({})",
                w.host(),
                dsv4_client::duration::brief(dsv4_client::duration::whole_seconds(since.elapsed()))
            )),
            Said::Refused(why) => return Err(format!("refused the hold: {why}")),
            Said::Failed(why) => return Err(format!("its engine did not start: {why}")),
            other @ (Said::Relaying | Said::Checked(_)) => {
                return Err(format!("answered out of turn ({})", other.word()))
            }
        }
    }
}

/// Why a `check` of a worker got no answer: where it stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckFailed {
    /// This box's key for it could not be read.
    Key(String),
    /// The box's dsv4d could not be reached (or did not greet).
    Reach(String),
    /// It refused: the key, or the request.
    Refused(String),
    /// It answered, but not as it should.
    Answer(String),
}

/// How worker `w` stands for its profile, as it says (its own doctor included). Never wakes
/// a box: a sleeping one is unreachable.
pub async fn check(w: &Worker) -> Result<peer_wire::Checked, CheckFailed> {
    let key = worker_key(w).map_err(CheckFailed::Key)?;
    let mut conn = opened(w, &key, Verb::Check)
        .await
        .map_err(CheckFailed::Reach)?;
    // It runs its own doctor first.
    let within = peer_wire::DOCTOR_LIMIT + HANDSHAKE;
    match said(&mut conn, within).await.map_err(CheckFailed::Answer)? {
        Said::Checked(checked) => Ok(*checked),
        Said::Refused(why) => Err(CheckFailed::Refused(why)),
        other => Err(CheckFailed::Answer(format!(
            "answered out of turn ({})",
            other.word()
        ))),
    }
}

/// A connection to worker `w`'s dsv4d on which `verb` is asked, proved with `key` (no
/// wake: for a box held already, or a check).
async fn opened(w: &Worker, key: &[u8], verb: Verb) -> Result<Conn, String> {
    let mut conn = dial(w).await?;
    let nonce = greeted(&mut conn).await?;
    asked(&mut conn, key, &nonce, verb, &w.profile).await?;
    Ok(conn)
}

/// Asks `verb` on `profile` over `conn`, whose greeting carried `nonce`, proved with `key`.
async fn asked(
    conn: &mut Conn,
    key: &[u8],
    nonce: &[u8; NONCE_BYTES],
    verb: Verb,
    profile: &str,
) -> Result<(), String> {
    let ask = peer_wire::ask(key, nonce, verb, profile);
    peer_wire::write_line(conn, &ask)
        .await
        .map_err(|e| format!("the {} could not be asked: {e}", verb.as_str()))
}

/// The key `w.key_file` holds (its first), read under the key files' rules.
fn worker_key(w: &Worker) -> Result<Vec<u8>, String> {
    let keys = ApiKeys::load_as(&w.key_file, "worker key")?;
    let key = keys
        .texts()
        .next()
        .ok_or("the worker key file holds no key")?;
    Ok(key.into_bytes())
}

/// A connection to the worker box's dsv4d, and the nonce of its greeting; with `wake`, a box
/// that does not answer (no connection, or one closed before the greeting: a link unit whose
/// far end is down) is sent a Wake-on-LAN packet and tried again until it does (the start's
/// own timeout bounds it).
async fn reach(
    w: &Worker,
    progress: &Progress,
    book: &WorkerBook,
) -> Result<(Conn, [u8; NONCE_BYTES]), String> {
    let mut woken = false;
    loop {
        let why = match dial(w).await {
            Ok(mut conn) => match greeting_of(&mut conn).await {
                Ok(nonce) => return Ok((conn, nonce)),
                Err(NoGreeting::Silent(why)) => why,
                // Something else answers there: no wake makes it this protocol.
                Err(NoGreeting::Wrong(why)) => return Err(why),
            },
            Err(why) => why,
        };
        let Some(wake) = w.wake else {
            return Err(why);
        };
        if !woken {
            send_wake(&wake)
                .await
                .map_err(|e| format!("{why}; its Wake-on-LAN packet could not be sent: {e}"))?;
            tracing::info!(
                "worker box {} does not answer ({why}): Wake-on-LAN packet sent to {}",
                w.host(),
                wake.broadcast
            );
            woken = true;
            book.set(&w.at, "waking", None, None);
        }
        progress(&format!("waking {}", w.host()));
        tokio::time::sleep(WAKE_RETRY).await;
    }
}

/// The worker box's dsv4d, through its link unit's socket (`LINK_DIR/AT`) when there is
/// one, else over TCP; the reason, naming the way tried, when it does not answer.
async fn dial(w: &Worker) -> Result<Conn, String> {
    let link = std::path::Path::new(LINK_DIR).join(&w.at);
    if link.exists() {
        return match timeout(CONNECT_TIMEOUT, UnixStream::connect(&link)).await {
            Ok(Ok(stream)) => Ok(BufReader::new(Box::new(stream))),
            Ok(Err(e)) => Err(format!(
                "cannot connect to {} through {}: {e}",
                w.at,
                link.display()
            )),
            Err(_) => Err(format!(
                "{} did not take the connection within {}",
                link.display(),
                duration(CONNECT_TIMEOUT)
            )),
        };
    }
    match timeout(CONNECT_TIMEOUT, TcpStream::connect(&w.at)).await {
        Ok(Ok(stream)) => {
            let _ = stream.set_nodelay(true);
            Ok(BufReader::new(Box::new(stream)))
        }
        Ok(Err(e)) if e.raw_os_error() == Some(nix::libc::ENETUNREACH) => Err(format!(
            "cannot connect to {}: {e}; if dsv4d runs in a network of its own (the shipped \
             dsv4.service), enable its way out: systemctl enable --now 'dsv4-link@{}.socket'",
            w.at,
            unit_escaped(&w.at)
        )),
        Ok(Err(e)) => Err(format!("cannot connect to {}: {e}", w.at)),
        Err(_) => Err(format!(
            "{} did not answer within {}",
            w.at,
            duration(CONNECT_TIMEOUT)
        )),
    }
}

fn duration(d: Duration) -> String {
    dsv4_client::duration::format(d)
}

/// The magic packet for `mac`: six 0xff bytes, then the MAC sixteen times.
pub fn magic_packet(mac: &[u8; 6]) -> [u8; 102] {
    let mut packet = [0xff; 102];
    for chunk in packet[6..].chunks_mut(6) {
        chunk.copy_from_slice(mac);
    }
    packet
}

/// Sends the Wake-on-LAN packet of `wake`, broadcast allowed.
pub fn send_wake_here(wake: &Wake) -> std::io::Result<()> {
    let any: SocketAddr = match wake.broadcast {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = std::net::UdpSocket::bind(any)?;
    socket.set_broadcast(true)?;
    socket.send_to(&magic_packet(&wake.mac), wake.broadcast)?;
    Ok(())
}

/// The unit that sends `wake`'s packet from the host's network, for a dsv4d that has a
/// network of its own (`dsv4-wake@MAC-BROADCAST.service`, its instance escaped as systemd
/// escapes a path: `/` is `-`, and `-` and other bytes `\xNN`).
pub fn wake_unit(wake: &Wake) -> String {
    format!(
        "{WAKE_UNIT_PREFIX}{}.service",
        unit_escaped(&wake.instance())
    )
}

/// `text` as a unit's instance, escaped as `systemd-escape` does a path's: `/` is `-`, and
/// `-` and any byte but letters, digits, `:`, `_` and `.` are `\xNN` (`%I` in the unit
/// gives the text back).
pub fn unit_escaped(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        match b {
            b'/' => out.push('-'),
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b':' | b'_' | b'.' => out.push(b as char),
            other => out.push_str(&format!("\\x{other:02x}")),
        }
    }
    out
}

/// The Wake-on-LAN helper's template unit.
pub const WAKE_UNIT_PREFIX: &str = "dsv4-wake@";

/// Sends the Wake-on-LAN packet of `wake`: from here, or, where this network reaches no box
/// (the shipped unit's `PrivateNetwork=yes`), through `dsv4-wake@.service` on the host's.
pub async fn send_wake(wake: &Wake) -> Result<(), String> {
    let here = match send_wake_here(wake) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let unreachable = here.raw_os_error() == Some(nix::libc::ENETUNREACH);
    if !unreachable {
        return Err(here.to_string());
    }
    let unit = wake_unit(wake);
    let bus = zbus::Connection::system()
        .await
        .map_err(|e| format!("{here}, and no system bus to start {unit} ({e})"))?;
    crate::host::units::start_and_wait(&bus, &unit, CONNECT_TIMEOUT)
        .await
        .map_err(|e| {
            let allowed = format!("{WAKE_UNIT_PREFIX}*.service");
            format!(
                "{here}; through {unit}: {}",
                e.describe(&unit, &allowed, |_| None)
            )
        })
}

/// Why a connection brought no greeting: nothing came (the box may be coming up), or what
/// came is not this protocol (trying again would not help).
enum NoGreeting {
    Silent(String),
    Wrong(String),
}

/// The nonce of the worker's greeting.
async fn greeting_of(conn: &mut Conn) -> Result<[u8; NONCE_BYTES], NoGreeting> {
    match timeout(HANDSHAKE, peer_wire::read_line(conn)).await {
        Ok(Ok(Some(line))) => peer_wire::read_greeting(&line).map_err(NoGreeting::Wrong),
        Ok(Ok(None)) => Err(NoGreeting::Silent(
            "closed the connection before its greeting".to_string(),
        )),
        Ok(Err(e)) => Err(NoGreeting::Wrong(format!(
            "its greeting could not be read: {e}"
        ))),
        Err(_) => Err(NoGreeting::Silent(format!(
            "sent no greeting within {}",
            duration(HANDSHAKE)
        ))),
    }
}

/// The nonce of the worker's greeting, or why there is none.
async fn greeted(conn: &mut Conn) -> Result<[u8; NONCE_BYTES], String> {
    greeting_of(conn).await.map_err(|e| match e {
        NoGreeting::Silent(why) | NoGreeting::Wrong(why) => why,
    })
}

/// The worker's next line, within `within`.
async fn said(conn: &mut Conn, within: Duration) -> Result<Said, String> {
    match timeout(within, peer_wire::read_line(conn)).await {
        Ok(Ok(Some(line))) => Said::read(&line),
        Ok(Ok(None)) => Err("closed the connection".to_string()),
        Ok(Err(e)) => Err(format!("the connection broke: {e}")),
        Err(_) => Err(format!("said nothing for {}", duration(within))),
    }
}

/// Whom a kept hold tells what the worker says.
struct Told {
    /// That the worker went away.
    lost: Lost,
    /// What it says of its box.
    book: WorkerBook,
    /// Its thermal events, named by box.
    alerts: Alerts,
}

impl Told {
    fn thermal(&self, w: &Worker, level: &str, message: &str) {
        let message = format!("worker box {}: {message}", w.host());
        match level {
            "normal" | "throttling-ended" => tracing::info!("thermal: {message}"),
            _ => tracing::warn!("thermal: {message}"),
        }
        self.alerts.raise(AlertKind::Worker, message);
    }
}

/// Keeps a hold: says `alive` every [`ALIVE_EVERY`] and hears the worker's, with what it says
/// of its box; tells `lost` when the worker goes away. Ends (letting the worker go) when
/// dropped.
async fn keep(conn: Conn, w: Worker, told: Told) {
    let (read, mut write) = tokio::io::split(conn);
    let mut lines = peer_wire::lines(BufReader::new(read));
    let mut beat = tokio::time::interval(ALIVE_EVERY);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heard_at = Instant::now();
    let why = loop {
        tokio::select! {
            _ = beat.tick() => {
                let line = Said::Alive(None).line();
                if let Err(e) = peer_wire::write_line(&mut write, &line).await {
                    break format!("the connection broke: {e}");
                }
            }
            _ = tokio::time::sleep_until(heard_at + SILENCE_LIMIT) => {
                break format!("said nothing for {}", duration(SILENCE_LIMIT));
            }
            heard = futures_util::StreamExt::next(&mut lines) => {
                heard_at = Instant::now();
                match heard.map(|l| l.map(|l| Said::read(&l))) {
                    Some(Ok(Ok(Said::Alive(report)))) => {
                        if let Some(report) = report {
                            told.book.report(&w.at, *report);
                        }
                    }
                    Some(Ok(Ok(Said::Thermal { level, message }))) => {
                        told.thermal(&w, &level, &message);
                    }
                    Some(Ok(Ok(Said::Failed(why)))) => break format!("its engine ended: {why}"),
                    Some(Ok(Ok(other))) => {
                        break format!("answered out of turn ({})", other.word());
                    }
                    Some(Ok(Err(why))) => break why,
                    Some(Err(e)) => break format!("the connection broke: {e}"),
                    None => break "closed the connection".to_string(),
                }
            }
        }
    };
    told.book.set(&w.at, "lost", None, Some(why.clone()));
    (told.lost)(format!("worker box {} went away: {why}", w.host()));
}

/// Carries each connection the engine opens on `listener` to the worker's engine, through
/// the worker box's dsv4d. The connections end with this task.
async fn relay(listener: TcpListener, w: Worker, key: Arc<[u8]>, output: EngineOutput) {
    let mut carried = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((local, from)) => {
                    if let Err(why) = ours(&listener, from) {
                        tracing::warn!("relay to worker box {}: refused {from}: {why}", w.host());
                        continue;
                    }
                    let (w, key, output) = (w.clone(), key.clone(), output.clone());
                    carried.spawn(async move {
                        if let Err(why) = carry(local, &w, &key, &output).await {
                            tracing::warn!("relay to worker box {}: {why}", w.host());
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("the relay to {} cannot take a connection: {e}", w.at);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = carried.join_next(), if !carried.is_empty() => {}
        }
    }
}

/// Whether the connection from `from` is dsv4d's user's (the engine's): the relay listens
/// on loopback, where every local user could connect when dsv4d runs without a network
/// namespace of its own, and a worker's engine runs anything it is sent.
fn ours(listener: &TcpListener, from: SocketAddr) -> Result<(), String> {
    let to = listener.local_addr().map_err(|e| e.to_string())?;
    let me = nix::unistd::geteuid().as_raw();
    match dsv4_engine::procs::connection_uid(std::path::Path::new("/proc"), from, to) {
        Ok(Some(uid)) if uid == me => Ok(()),
        Ok(Some(uid)) => Err(format!("it is uid {uid}'s, not dsv4d's user's (uid {me})")),
        Ok(None) => Err("its owner is not in /proc/net/tcp".to_string()),
        Err(e) => Err(format!("cannot read /proc/net/tcp: {e}")),
    }
}

/// One of the engine's connections, carried to the worker's engine; a worker side that ends
/// first (the engine ends its own at its stop) is said in the engine's output, naming the box.
async fn carry(
    mut local: TcpStream,
    w: &Worker,
    key: &[u8],
    output: &EngineOutput,
) -> Result<(), String> {
    let _ = local.set_nodelay(true);
    let mut remote = opened(w, key, Verb::Relay).await?;
    match said(&mut remote, HANDSHAKE).await? {
        Said::Relaying => {}
        Said::Refused(why) => return Err(format!("refused the relay: {why}")),
        other => return Err(format!("answered out of turn ({})", other.word())),
    }
    let (mut from_engine, mut to_engine) = local.split();
    let (mut from_worker, mut to_worker) = tokio::io::split(remote);
    let up = async {
        let _ = tokio::io::copy(&mut from_engine, &mut to_worker).await;
        let _ = to_worker.shutdown().await;
    };
    // How the worker's side ended, if it ended first: only a read from the worker that ends
    // blames the box; a write to the engine that fails is the engine's own end.
    let down = async {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; RELAY_BUFFER];
        let worker_ended = loop {
            match from_worker.read(&mut buf).await {
                Ok(0) => break Some("closed".to_string()),
                Err(e) => break Some(format!("broke ({e})")),
                Ok(n) => {
                    if to_engine.write_all(&buf[..n]).await.is_err() {
                        break None;
                    }
                }
            }
        };
        (worker_ended, to_engine)
    };
    tokio::pin!(up, down);
    tokio::select! {
        biased;
        () = &mut up => {
            let (_, mut to_engine) = down.await;
            let _ = to_engine.shutdown().await;
        }
        (worker_ended, mut to_engine) = &mut down => {
            if let Some(how) = worker_ended {
                // Said before the engine can see it: its answer's error event quotes it.
                let line = format!(
                    "worker box {}: the connection to its engine {how}: its engine or the box \
                     went away",
                    w.host()
                );
                tracing::warn!("{line}");
                say_to_engine_output(output, line);
            }
            let _ = to_engine.shutdown().await;
            up.await;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_is_named_as_its_unit_and_read_back_by_its_helper() {
        let wake = Wake::from_instance("AA:bb:cc:dd:ee:01/10.77.0.255:9").unwrap();
        assert_eq!(wake.mac, [0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x01]);
        assert_eq!(wake.instance(), "aa:bb:cc:dd:ee:01/10.77.0.255:9");
        assert_eq!(
            wake_unit(&wake),
            "dsv4-wake@aa:bb:cc:dd:ee:01-10.77.0.255:9.service"
        );
        assert_eq!(Wake::from_instance(&wake.instance()).unwrap(), wake);
        let v6 = Wake::from_instance("aa:bb:cc:dd:ee:01/[ff02::1]:9").unwrap();
        assert_eq!(
            wake_unit(&v6),
            r"dsv4-wake@aa:bb:cc:dd:ee:01-\x5bff02::1\x5d:9.service"
        );
        assert_eq!(unit_escaped("10.77.0.2:8090"), "10.77.0.2:8090");
        assert_eq!(unit_escaped("box-2:8090"), r"box\x2d2:8090");
        for bad in [
            "aa:bb:cc:dd:ee:01",
            "aa:bb/10.77.0.255:9",
            "aa:bb:cc:dd:ee:01/x:9",
            "",
        ] {
            assert!(Wake::from_instance(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_magic_packet_is_six_ff_then_the_mac_sixteen_times() {
        let mac = [0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0x01];
        let p = magic_packet(&mac);
        assert_eq!(&p[..6], &[0xff; 6]);
        for i in 0..16 {
            assert_eq!(&p[6 + i * 6..12 + i * 6], &mac, "copy {i}");
        }
    }
}
