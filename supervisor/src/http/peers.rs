//! The peers port (`peers.listen`): where a coordinator on another box, proving a key of
//! `peers.keys_file`, holds this box's active profile (its engine started and kept as for a
//! request, with the same lifecycle, power policy, admission and telemetry) and reaches that
//! engine through relayed connections.
//!
//! Owns: the peers listener's connections and the holds they carry ([`Holders`]). Must not:
//! answer anything before the key is proved, put an engine port on the link (the engine
//! listens on loopback; a relay is a connection of this dsv4d's), or keep a hold past its
//! connection (a coordinator that dies lets go by itself: its connection closes, or falls
//! silent for [`SILENCE_LIMIT`]).
//!
//! The protocol is `crate::lifecycle::peer_wire`'s.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::BufReader;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

use crate::config::Config;
use crate::http::auth::KeyCache;
use crate::lifecycle::holders::Holders;
use crate::lifecycle::peer_wire::{
    self, Ask, Said, Verb, ALIVE_EVERY, HANDSHAKE, NONCE_BYTES, SILENCE_LIMIT,
};
use crate::lifecycle::{Handle, Lease};

/// How often a hold whose engine loads says so.
const LOADING_EVERY: Duration = Duration::from_secs(5);
/// Peer connections at once; more are closed unanswered.
const MAX_PEER_CONNECTIONS: usize = 256;

/// What a peer connection needs of the daemon.
#[derive(Clone)]
pub struct Peers {
    pub lifecycle: Handle,
    pub config: tokio::sync::watch::Receiver<Arc<Config>>,
    pub holders: Holders,
    /// The keys of `peers.keys_file`, read at the start and at each reload.
    pub keys: Arc<KeyCache>,
    /// This box's samples and thermal events, said to the coordinators that hold it.
    pub telemetry: crate::observe::monitor::Telemetry,
    pub thermal: crate::policy::thermal::ThermalPolicy,
    /// How this box runs its own doctor, for a coordinator's `check`.
    pub doctor: SelfDoctor,
}

/// This dsv4d's own doctor: its program, configuration and sysroot.
#[derive(Clone)]
pub struct SelfDoctor {
    pub program: std::path::PathBuf,
    pub config: std::path::PathBuf,
    pub sysroot: std::path::PathBuf,
}

/// Warnings and failures named in a `check`'s answer, and the length of each.
const NAMED: usize = 8;
const NAMED_LEN: usize = 240;

/// Serves the peers port until the task is dropped.
pub async fn serve(listener: TcpListener, peers: Peers) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_PEER_CONNECTIONS));
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("the peers port cannot take a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::warn!("peer {from}: {MAX_PEER_CONNECTIONS} peer connections open already");
            continue;
        };
        let peers = peers.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _ = stream.set_nodelay(true);
            let mut conn = BufReader::new(stream);
            if let Err(why) = peer(&mut conn, from, &peers).await {
                tracing::warn!("peer {from}: {why}");
                let _ = peer_wire::write_line(&mut conn, &Said::Refused(why).line()).await;
            }
        });
    }
}

/// One peer connection: the greeting, the proved request, then the hold or the relay. The
/// reason to refuse it, if it is refused.
async fn peer(
    conn: &mut BufReader<TcpStream>,
    from: SocketAddr,
    peers: &Peers,
) -> Result<(), String> {
    let mut nonce = [0u8; NONCE_BYTES];
    crate::lifecycle::engine_key::random_bytes(&mut nonce)
        .map_err(|e| format!("cannot make a nonce: {e}"))?;
    peer_wire::write_line(conn, &peer_wire::greeting(&nonce))
        .await
        .map_err(|e| format!("the greeting could not be sent: {e}"))?;
    let line = match timeout(HANDSHAKE, peer_wire::read_line(conn)).await {
        Ok(Ok(Some(line))) => line,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return Err(format!("its request could not be read: {e}")),
        Err(_) => return Err("sent no request: closed".to_string()),
    };
    let ask = peer_wire::read_ask(&line)?;
    let config = peers.config.borrow().clone();
    let keys = match peers.keys.get(&config) {
        None => return Err("this box lends to no one: peers.keys_file is not set".to_string()),
        // The reason is in this box's log: the coordinator learns only that it was refused.
        Some(Err(_)) => {
            return Err("this box cannot read its peers.keys_file (its log says why)".to_string())
        }
        Some(Ok(keys)) => keys,
    };
    let texts: Vec<String> = keys.texts().collect();
    if !peer_wire::proved(&ask, &nonce, texts.iter().map(String::as_bytes)) {
        return Err("the key is not one of peers.keys_file".to_string());
    }
    let active = peers.lifecycle.profile();
    match ask.verb {
        Verb::Check => check(conn, from, &ask, &config, active, peers).await,
        Verb::Hold => {
            lendable(&config, &ask.profile, &active)?;
            hold(conn, from, &ask, peers).await
        }
        Verb::Relay => {
            lendable(&config, &ask.profile, &active)?;
            relay(conn, from, &ask, peers).await
        }
    }
}

/// A check: how this box stands for the profile (whether it could be held now, and its own
/// doctor's findings), said in one line. A coordinator that leaves meanwhile ends the
/// doctor's run (dropped, it is killed).
async fn check(
    conn: &mut BufReader<TcpStream>,
    from: SocketAddr,
    ask: &Ask,
    config: &Config,
    active: String,
    peers: &Peers,
) -> Result<(), String> {
    tracing::info!("peer {from} checks profile {}", ask.profile);
    let not_lendable = lendable(config, &ask.profile, &active).err();
    let doctor = tokio::select! {
        d = own_doctor(&peers.doctor) => d,
        _ = tokio::io::AsyncBufReadExt::fill_buf(conn) => {
            tracing::info!("peer {from} left before its check was done");
            return Ok(());
        }
    };
    let checked = peer_wire::Checked {
        version: env!("CARGO_PKG_VERSION").to_string(),
        active,
        not_lendable,
        doctor,
    };
    say(conn, Said::Checked(Box::new(checked.fitted())))
        .await
        .map_err(|e| e.to_string())
}

/// This box's own doctor (`dsv4d --doctor --part box`: the service's checks without this
/// box's own workers; run as this daemon runs, in its sandbox), summed up.
async fn own_doctor(d: &SelfDoctor) -> Result<peer_wire::DoctorSummary, String> {
    use dsv4_client::doctor::{Check, Verdict};
    let mut cmd = tokio::process::Command::new(&d.program);
    cmd.arg("--doctor")
        .args(["--part", "box", "--config"])
        .arg(&d.config)
        .arg("--sysroot")
        .arg(&d.sysroot);
    let ran = crate::host::run::run_bounded(cmd, peer_wire::DOCTOR_LIMIT)
        .await
        .map_err(|e| format!("its doctor did not run: {e:?}"))?;
    let checks: Vec<Check> = serde_json::from_str(&ran.stdout).map_err(|e| {
        let said = ran.stderr.lines().last().unwrap_or_default();
        let said: String = said.chars().take(NAMED_LEN).collect();
        format!("its doctor said no checks ({e}): {said}")
    })?;
    let named = |v: Verdict| -> Vec<String> {
        checks
            .iter()
            .filter(|c| c.verdict == v)
            .take(NAMED)
            .map(|c| {
                let profile = c.profile.as_deref().map(|p| format!(" [{p}]"));
                let line = format!("{}{}: {}", c.id, profile.unwrap_or_default(), c.found);
                line.chars().take(NAMED_LEN).collect()
            })
            .collect()
    };
    Ok(peer_wire::DoctorSummary {
        ok: checks.iter().filter(|c| c.verdict == Verdict::Ok).count(),
        warn: named(Verdict::Warn),
        fail: named(Verdict::Fail),
    })
}

/// Whether `profile` may be held: this box's active profile (a hold never switches a box
/// another user may be using), and one whose engine lends its devices.
fn lendable(config: &Config, profile: &str, active: &str) -> Result<(), String> {
    let p = config
        .profile(profile)
        .ok_or_else(|| format!("this box has no profile `{profile}`"))?;
    if profile != active {
        return Err(format!(
            "profile `{profile}` is not this box's active profile (`{active}`): run \
             `dsv4ctl profile {profile}` on it"
        ));
    }
    match p.engine.describe().validation {
        dsv4_engine::ValidationApi::Lends => Ok(()),
        _ => Err(format!(
            "profile `{profile}` runs {}, which lends no devices (a worker's profile runs \
             rpc-server)",
            p.engine
        )),
    }
}

/// A hold: the engine started as for a request (its lease kept while the hold lasts), said
/// to be loading, then ready; kept while the coordinator is alive.
async fn hold(
    conn: &mut BufReader<TcpStream>,
    from: SocketAddr,
    ask: &Ask,
    peers: &Peers,
) -> Result<(), String> {
    tracing::info!("peer {from} holds profile {}", ask.profile);
    let lease = leased(conn, peers).await?;
    let _listed = peers.holders.add(dsv4_client::Hold {
        from: from.ip().to_string(),
        profile: ask.profile.clone(),
        since: dsv4_client::clock::unix_now(),
    });
    say(conn, Said::Serving).await.map_err(|e| e.to_string())?;
    let ended = kept(conn, lease.engine.exit.clone(), peers).await;
    drop(lease);
    tracing::info!("peer {from} let go of profile {}: {ended}", ask.profile);
    Ok(())
}

/// What this box says of itself with each `alive`.
fn report(peers: &Peers) -> Said {
    Said::Alive(Some(Box::new(peer_wire::Report {
        telemetry: peers.telemetry.latest().map(|s| (*s).clone()),
        thermal: Some(peers.thermal.status()),
    })))
}

/// Keeps a hold until the coordinator lets go or falls silent, or the engine exits: says
/// `alive` (with this box's report) every [`ALIVE_EVERY`] and each thermal event as it comes,
/// hears the coordinator's `alive`. Why it ended.
async fn kept(
    conn: &mut BufReader<TcpStream>,
    mut exit: tokio::sync::watch::Receiver<Option<dsv4_engine::ExitReport>>,
    peers: &Peers,
) -> String {
    let (read, mut write) = tokio::io::split(conn);
    let mut lines = peer_wire::lines(BufReader::new(read));
    let mut beat = tokio::time::interval(ALIVE_EVERY);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (standing, mut events) = peers.thermal.subscribe();
    for s in standing {
        let _ = peer_wire::write_line(&mut write, &thermal_line(&s)).await;
    }
    let mut heard_at = Instant::now();
    loop {
        tokio::select! {
            _ = beat.tick() => {
                if let Err(e) = peer_wire::write_line(&mut write, &report(peers).line()).await {
                    break format!("the connection broke: {e}");
                }
            }
            Ok(event) = events.recv() => {
                if let Err(e) = peer_wire::write_line(&mut write, &thermal_line(&event)).await {
                    break format!("the connection broke: {e}");
                }
            }
            why = async {
                exit.wait_for(|e| e.is_some())
                    .await
                    .ok()
                    .and_then(|r| r.as_ref().map(ToString::to_string))
                    .unwrap_or_default()
            } => {
                let line = Said::Failed(format!("the engine exited ({why})")).line();
                let _ = peer_wire::write_line(&mut write, &line).await;
                break format!("its engine exited ({why})");
            }
            _ = tokio::time::sleep_until(heard_at + SILENCE_LIMIT) => break format!(
                "said nothing for {}",
                dsv4_client::duration::format(SILENCE_LIMIT)
            ),
            heard = futures_util::StreamExt::next(&mut lines) => {
                heard_at = Instant::now();
                match heard {
                    Some(Ok(line)) if line == "alive" => {}
                    Some(Ok(line)) if line == "release" => break "released".to_string(),
                    Some(Ok(line)) => break format!("said {line:?}, not of this protocol"),
                    Some(Err(e)) => break format!("the connection broke: {e}"),
                    None => break "closed the connection".to_string(),
                }
            }
        }
    }
}

/// A thermal event of this box, for the coordinator's alerts.
fn thermal_line(s: &crate::policy::thermal::Signal) -> String {
    Said::Thermal {
        level: s.level.as_str().to_string(),
        message: s.message.clone(),
    }
    .line()
}

async fn say(conn: &mut BufReader<TcpStream>, said: Said) -> std::io::Result<()> {
    peer_wire::write_line(conn, &said.line()).await
}

/// A lease on the engine, started if need be, telling the coordinator how long it has loaded
/// meanwhile; the refusal's words if it cannot be had.
async fn leased(conn: &mut BufReader<TcpStream>, peers: &Peers) -> Result<Lease, String> {
    let acquire = peers.lifecycle.acquire();
    tokio::pin!(acquire);
    let since = Instant::now();
    let mut tell = tokio::time::interval_at(since + LOADING_EVERY, LOADING_EVERY);
    loop {
        tokio::select! {
            got = &mut acquire => {
                return got.map_err(|refused| refused.message());
            }
            _ = tell.tick() => {
                let line = Said::Loading(since.elapsed().as_secs()).line();
                peer_wire::write_line(conn, &line)
                    .await
                    .map_err(|e| format!("the connection broke while the engine loaded: {e}"))?;
            }
        }
    }
}

/// A relay: the connection, once proved, carries the engine's bytes both ways. Only while
/// the profile is held (its engine started and kept by a hold).
async fn relay(
    conn: &mut BufReader<TcpStream>,
    from: SocketAddr,
    ask: &Ask,
    peers: &Peers,
) -> Result<(), String> {
    let held = peers
        .holders
        .list()
        .iter()
        .any(|h| h.profile == ask.profile);
    if !held {
        return Err(format!(
            "profile `{}` is not held: hold it first",
            ask.profile
        ));
    }
    let lease = peers
        .lifecycle
        .acquire()
        .await
        .map_err(|refused| refused.message())?;
    let mut engine = TcpStream::connect(lease.engine.upstream)
        .await
        .map_err(|e| format!("cannot reach its engine: {e}"))?;
    let _ = engine.set_nodelay(true);
    peer_wire::write_line(conn, &Said::Relaying.line())
        .await
        .map_err(|e| e.to_string())?;
    tracing::debug!("peer {from}: relaying to the engine of {}", ask.profile);
    let _ = tokio::io::copy_bidirectional(conn, &mut engine).await;
    drop(lease);
    Ok(())
}
