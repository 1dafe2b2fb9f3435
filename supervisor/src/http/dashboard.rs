//! The dashboard: `GET /ui`, a page built into dsv4d, and `GET /events`, what it shows as
//! server-sent events.
//!
//! The page and its script are compiled in (nothing is fetched from anywhere at run time)
//! and need no key: they hold no data. `/events` is an API path like any other (it needs a
//! key when keys are configured). It starts with the last hour of the monitor's samples, the
//! thermal thresholds, the latest alerts, the thermal events that stand and the saved
//! validation runs (`hello`), then sends the whole status document when anything in it
//! moved (state, requests, a new sample), at most twice a second, and every second while
//! requests are in flight (their phases and prefill figures), new engine output lines
//! (`log`), each alert (`alert`) and thermal event (`thermal`) as it comes, and the
//! validation runs again when one ends (`validations`). Neither ever starts the engine.
//!
//! A stream holds little whatever its client does: the `hello`'s history is read from the
//! monitor's ring a page at a time ([`HELLO_PAGE`] samples), each page written as it is
//! serialised, so a client that never reads holds at most a few pieces queued here
//! ([`QUEUED`]) and hyper's write buffer (16 KiB), never the whole document (2.5 MB
//! with a full hour of the Strix Halo fixture's samples). At most `api.max_event_streams` streams are open at once
//! ([`Watchers`]); one more gets 503 `too_many_event_streams`. When the last one goes, the
//! allocator is asked to give its free pages back (see `watchers`).
//!
//! Owns: the page's assets, the event streams and their count. Must not: act on anything
//! (the actions are `ui_actions`'; without admin keys the page says which `dsv4ctl` command
//! does each).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body::Frame;
use serde_json::json;
use tokio::sync::{broadcast, mpsc};

use crate::validate::ValidationEvent;

use super::ctx::Ctx;
use super::http_error::{ApiError, ErrorCode, ErrorType};
use super::watchers::Watcher;

/// The page, its script and its style, as served.
const PAGE: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

/// The most status documents sent a second.
const STATUS_GAP: Duration = Duration::from_millis(500);
/// While requests are in flight, the status goes out this often even when nothing else in
/// it moved: their phases and prefill figures change without a word from the lifecycle.
const IN_FLIGHT_TICK: Duration = Duration::from_secs(1);
/// The history the page starts with.
const HISTORY_SECONDS: f64 = 3600.0;
/// Engine output lines sent at once, at most.
const LOG_LINES: usize = 200;
/// Validation runs sent, at most (newest first).
const VALIDATIONS: usize = 20;
/// Samples read from the ring and written at once while the `hello` goes out (a sample is
/// about 700 bytes of JSON).
const HELLO_PAGE: usize = 16;
/// Events (or pieces of the `hello`) a stream holds queued for its connection, at most.
const QUEUED: usize = 4;

/// The page's own files (`/ui`, `/ui/app.js`, `/ui/app.css`), when `path` is one.
pub fn asset<B: From<Bytes>>(path: &str) -> Option<Response<B>> {
    let (body, kind) = match path {
        "/ui" | "/ui/" => (PAGE, "text/html; charset=utf-8"),
        "/ui/app.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/ui/app.css" => (STYLE, "text/css; charset=utf-8"),
        _ => return None,
    };
    let mut r = Response::new(B::from(Bytes::from_static(body.as_bytes())));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    // Its own files and its own API only; no frame may hold it.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Some(r)
}

/// `GET /events`: the stream, fed by a task that ends when the client goes or dsv4d stops;
/// 503 when `api.max_event_streams` are open already.
pub fn events(ctx: &Arc<Ctx>) -> Result<Response<Events>, ApiError> {
    let cap = ctx.parts.config.borrow().supervisor.api.max_event_streams;
    let Some(watcher) = ctx.watchers.admit(cap) else {
        return Err(too_many(cap));
    };
    let (tx, rx) = mpsc::channel(QUEUED);
    tokio::spawn(feed(ctx.clone(), tx, watcher));
    let mut r = Response::new(Events(rx));
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(r)
}

/// The answer to one stream more than `cap`.
fn too_many(cap: usize) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::Unavailable,
        ErrorCode::TooManyEventStreams,
        format!("too many dashboard event streams: api.max_event_streams is {cap}; retry shortly"),
    )
    .retry_after(Duration::from_secs(1))
}

/// One server-sent event.
fn event(name: &str, data: &serde_json::Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The saved validation runs, newest first, without what the page does not show.
fn validations(ctx: &Ctx) -> serde_json::Value {
    let runs = ctx.parts.validator.saved(None);
    let runs: Vec<_> = runs
        .iter()
        .take(VALIDATIONS)
        .map(|r| {
            let tests: Vec<_> = r
                .tests
                .iter()
                .map(|t| json!({ "name": t.name, "unit": t.unit, "mean": t.mean, "sd": t.sd }))
                .collect();
            json!({
                "profile": r.profile,
                "started": r.started,
                "finished": r.finished,
                "error": r.error,
                "tests": tests,
                "matrix": r.matrix.as_ref().map(matrix_summary),
            })
        })
        .collect();
    json!(runs)
}

/// A matrix run as the page shows it: a row per cell, the verdict and the snippet.
fn matrix_summary(m: &dsv4_client::validate::Matrix) -> serde_json::Value {
    let cells: Vec<_> = m
        .cells
        .iter()
        .map(|c| {
            let decode = c.test("decode");
            json!({
                "index": c.index,
                "settings": c.settings.label(),
                "decode": decode.map(|t| json!({ "mean": t.mean, "sd": t.sd })),
                "prefill": c.test("prefill").map(|t| json!({ "mean": t.mean, "sd": t.sd })),
                "soc_w": c.host.soc_power_mean_w,
                "joules_per_token": decode.and_then(|t| t.telemetry.joules_per_token),
                "error": c.error,
            })
        })
        .collect();
    json!({
        "planned": m.planned,
        "cells": cells,
        "verdict": m.verdict.as_ref().map(|v| json!({ "pick": v.pick, "reason": v.reason })),
        "snippet": m.snippet,
    })
}

/// Whether the page may act: admin keys are configured and readable, or why they cannot be
/// read (read off the runtime's threads: it may be the first read of the file).
async fn actions_allowed(ctx: &std::sync::Arc<Ctx>) -> (bool, Option<String>) {
    let ctx = ctx.clone();
    tokio::task::spawn_blocking(move || {
        let config = ctx.parts.config.borrow().clone();
        match ctx.admin_keys.get(&config) {
            None => (false, None),
            Some(Ok(_)) => (true, None),
            Some(Err(e)) => (false, Some(e)),
        }
    })
    .await
    .unwrap_or((false, None))
}

/// [`validations`], read off the runtime's threads (it reads the saved runs' files).
async fn saved_validations(ctx: &std::sync::Arc<Ctx>) -> serde_json::Value {
    let ctx = ctx.clone();
    tokio::task::spawn_blocking(move || validations(&ctx))
        .await
        .unwrap_or_default()
}

/// Sends the `hello`: `head` (an object) with the history added as it is read, a page at a
/// time. Err when the stream is gone.
async fn hello(
    ctx: &Ctx,
    tx: &mpsc::Sender<Bytes>,
    head: serde_json::Value,
) -> Result<(), mpsc::error::SendError<Bytes>> {
    let head = head.to_string();
    let head = head.strip_suffix('}').unwrap_or(&head);
    let comma = if head.len() > 1 { "," } else { "" };
    tx.send(Bytes::from(format!(
        "event: hello\ndata: {head}{comma}\"history\":["
    )))
    .await?;
    let mut after = dsv4_client::clock::unix_now() - HISTORY_SECONDS;
    let until = ctx.parts.telemetry.latest().map_or(after, |s| s.at);
    let mut first = true;
    loop {
        let page = ctx.parts.telemetry.page(after, until, HELLO_PAGE);
        let Some(last) = page.last() else { break };
        after = last.at;
        let mut piece = Vec::with_capacity(HELLO_PAGE * 1024);
        for s in &page {
            if !std::mem::take(&mut first) {
                piece.push(b',');
            }
            // A sample is plain data: it always serialises.
            let _ = serde_json::to_writer(&mut piece, &**s);
        }
        drop(page);
        tx.send(Bytes::from(piece)).await?;
    }
    tx.send(Bytes::from_static(b"]}\n\n")).await
}

/// The stream's first event's document: what does not change while it is open (the
/// thresholds, the profiles, which actions this caller may take) and what stands now
/// (recent alerts, thermal events, saved validations).
async fn head(
    ctx: &Arc<Ctx>,
    recent_alerts: impl serde::Serialize,
    standing: impl serde::Serialize,
) -> serde_json::Value {
    let config = ctx.parts.config.borrow().clone();
    let thermal = &config.supervisor.thermal;
    let (actions, actions_error) = actions_allowed(ctx).await;
    json!({
        "thresholds": {
            "warn_c": thermal.warn,
            "critical_c": thermal.critical,
        },
        "alerts": recent_alerts,
        "thermal": standing,
        "validations": saved_validations(ctx).await,
        "actions": actions,
        "actions_error": actions_error,
        "profiles": config.profile_names(),
        "validation_profile": crate::validate::DEFAULT_PROFILE,
    })
}

/// The status event and the engine's new log lines (from `next_line` on, moved past them);
/// whether requests are in flight. `Err` when the client has gone.
async fn send_status(
    ctx: &Ctx,
    tx: &mpsc::Sender<Bytes>,
    next_line: &mut u64,
) -> Result<bool, mpsc::error::SendError<Bytes>> {
    // The document as bytes only: nothing else of it is held while the client reads.
    let (doc, busy) = {
        let doc = ctx.parts.status_document().await;
        let busy = !doc.in_progress.is_empty();
        let doc = serde_json::to_value(doc).unwrap_or_default();
        (event("status", &doc), busy)
    };
    tx.send(doc).await?;
    let (next, lines) = ctx.parts.lifecycle.logs(*next_line, LOG_LINES);
    *next_line = next;
    if !lines.is_empty() {
        tx.send(event("log", &json!(lines))).await?;
    }
    Ok(busy)
}

/// Feeds one stream until its client goes or dsv4d stops; `_watcher` is its place among
/// the open streams, given back when this ends.
async fn feed(ctx: Arc<Ctx>, tx: mpsc::Sender<Bytes>, _watcher: Watcher) {
    let (recent_alerts, mut alerts) = ctx.alerts.recent_and_subscribe();
    let (standing, mut thermal_events) = ctx.parts.thermal.subscribe();
    let mut validation_events = ctx.parts.validator.subscribe();
    let head = head(&ctx, recent_alerts, standing).await;
    if hello(&ctx, &tx, head).await.is_err() {
        return;
    }
    let mut status = ctx.parts.lifecycle.watch_status();
    let mut figures = ctx.parts.lifecycle.watch_figures();
    let mut samples = ctx.parts.telemetry.watch();
    let mut canary = ctx.parts.validator.checks().watch();
    let mut closing = ctx.closing.subscribe();
    let (mut next_line, _) = ctx.parts.lifecycle.logs(0, 0);
    next_line = next_line.saturating_sub(LOG_LINES as u64);
    loop {
        status.borrow_and_update();
        figures.borrow_and_update();
        samples.borrow_and_update();
        canary.borrow_and_update();
        let Ok(busy) = send_status(&ctx, &tx, &mut next_line).await else {
            return;
        };
        let gap = tokio::time::sleep(STATUS_GAP);
        tokio::pin!(gap);
        // Requests in flight: the next status goes out within the tick whatever moves. An
        // idle page is not woken: the status that shows the last request gone ends it.
        let tick = tokio::time::sleep(IN_FLIGHT_TICK);
        tokio::pin!(tick);
        let mut moved = false;
        let mut runs_ended = false;
        // Alerts, thermal and validation events go out as they come; the status once it
        // moved, and the gap since the last has passed.
        loop {
            let news = tokio::select! {
                r = status.changed(), if !moved => { moved = true; r.is_ok().then_some(None) }
                r = figures.changed(), if !moved => { moved = true; r.is_ok().then_some(None) }
                r = samples.changed(), if !moved => { moved = true; r.is_ok().then_some(None) }
                r = canary.changed(), if !moved => { moved = true; r.is_ok().then_some(None) }
                () = &mut tick, if busy && !moved => { moved = true; Some(None) }
                () = &mut gap, if moved => break,
                a = alerts.recv() => match a {
                    Ok(a) => Some(Some(event("alert", &json!(a)))),
                    Err(broadcast::error::RecvError::Lagged(_)) => Some(None),
                    Err(broadcast::error::RecvError::Closed) => None,
                },
                t = thermal_events.recv() => match t {
                    Ok(t) => Some(Some(event("thermal", &json!(t)))),
                    Err(broadcast::error::RecvError::Lagged(_)) => Some(None),
                    Err(broadcast::error::RecvError::Closed) => None,
                },
                v = validation_events.recv() => match v {
                    Ok(ValidationEvent::Done(_)) => {
                        // Read below, out of the select (its waits hold borrows).
                        runs_ended = true;
                        Some(None)
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => Some(None),
                    Err(broadcast::error::RecvError::Closed) => None,
                },
                _ = tx.closed() => return,
                _ = closing.wait_for(|c| *c) => return,
            };
            match news {
                None => return,
                Some(Some(bytes)) => {
                    if tx.send(bytes).await.is_err() {
                        return;
                    }
                }
                Some(None) => {}
            }
            if std::mem::take(&mut runs_ended) {
                let runs = event("validations", &saved_validations(&ctx).await);
                if tx.send(runs).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// The body of an event stream: what the feeding task sends, until it ends.
pub struct Events(mpsc::Receiver<Bytes>);

impl Events {
    pub fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.get_mut()
            .0
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_stream_too_many_is_told_the_cap() {
        let e = too_many(32);
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, ErrorCode::TooManyEventStreams);
        assert!(
            e.message.contains("api.max_event_streams is 32"),
            "{}",
            e.message
        );
        assert!(e.retry_after.is_some());
    }
}
