//! Bodies that wrap the answers dsv4d sends: one that tells how it ended, one polled only
//! when woken.
//!
//! [`OnEnd`] wraps any [`Body`] and calls a callback exactly once, with an [`End`]: when the
//! body completes, when it fails, or when it is dropped before either (the client went away).
//! Work that must follow a body to its end (release a hold, record what went by, log how it
//! went) goes in that callback, and the body itself stays a plain body.
//!
//! hyper stops polling a body as soon as it reports [`Body::is_end_stream`], so the end is
//! not always a `None` from `poll_frame`: a body that says it has ended after a frame has
//! completed there, and one that was empty from the start completes when it is dropped.
//!
//! [`Parked`] wraps the whole answer hyper writes. hyper polls a body three times for each
//! wake-up of its connection (the frame, then twice more to find it pending, see
//! `Dispatcher::poll_loop`), and a streamed answer's pending poll went down five layers to
//! the engine's socket and the keep-alive's timer: about 1,000 instructions, for each event
//! of a stream. Its inner body is polled again only once something it waits on has woken it.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};

/// How a body ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The whole body went by: its last frame, or the end of the stream.
    Completed,
    /// The body failed; its error went to whoever was reading it.
    Errored,
    /// The body was dropped before its end.
    Dropped,
}

/// What runs once when a body ends: any `FnOnce(End)` closure, or a type of one's own when it
/// must be named (a closure's type cannot be, short of boxing it) or must look at the body
/// one last time (what it counted, what it kept).
pub trait Settle<B> {
    fn settle(self, how: End, body: &mut B);
}

impl<B, F: FnOnce(End)> Settle<B> for F {
    fn settle(self, how: End, _: &mut B) {
        self(how)
    }
}

/// `inner`, calling `on_end` once when it ends (see the module docs).
///
/// The inner body must be `Unpin`; pin one that is not with `Box::pin`.
pub struct OnEnd<B: Body, F: Settle<B>> {
    inner: B,
    on_end: Option<F>,
}

impl<B: Body + Unpin, F: Settle<B>> OnEnd<B, F> {
    pub fn new(inner: B, on_end: F) -> Self {
        OnEnd {
            inner,
            on_end: Some(on_end),
        }
    }

    /// The wrapped body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The wrapped body, to change before it is sent (not to read frames from: those would
    /// go by unseen).
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    fn end(&mut self, how: End) {
        if let Some(f) = self.on_end.take() {
            f.settle(how, &mut self.inner);
        }
    }
}

// The callback is never pinned: only the inner body is polled in place.
impl<B: Body + Unpin, F: Settle<B>> Unpin for OnEnd<B, F> {}

impl<B: Body + Unpin, F: Settle<B>> Body for OnEnd<B, F> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.end(End::Completed),
            Poll::Ready(Some(Err(_))) => this.end(End::Errored),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.end(End::Completed),
            Poll::Ready(Some(Ok(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B: Body, F: Settle<B>> Drop for OnEnd<B, F> {
    fn drop(&mut self) {
        if let Some(f) = self.on_end.take() {
            // A body that has nothing left was complete even if nobody polled it to the end.
            let how = if self.inner.is_end_stream() {
                End::Completed
            } else {
                End::Dropped
            };
            f.settle(how, &mut self.inner);
        }
    }
}

/// `inner`, polled again after a `Pending` only once a waker it was given has been woken
/// (see the module docs). Between, a poll registers the caller's waker and returns
/// `Pending`, as the inner body would have.
pub struct Parked<B> {
    inner: B,
    bell: Arc<Bell>,
    /// The waker the inner body is polled with: it rings the bell.
    waker: Waker,
    /// The inner body's last poll was `Pending`.
    asleep: bool,
}

/// What the inner body's wakers ring: a mark that one was woken, and the waker of the task
/// that polls the [`Parked`].
#[derive(Default)]
struct Bell {
    rung: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Bell {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.rung.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<B> Parked<B> {
    pub fn new(inner: B) -> Self {
        let bell = Arc::new(Bell::default());
        Parked {
            inner,
            waker: Waker::from(bell.clone()),
            bell,
            asleep: false,
        }
    }
}

impl<B: Body + Unpin> Body for Parked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        // Registered before the bell is read: a wake in between finds this task's waker.
        this.bell.task.register(cx.waker());
        let rung = this.bell.rung.swap(false, Ordering::AcqRel);
        if this.asleep && !rung {
            return Poll::Pending;
        }
        let polled = Pin::new(&mut this.inner).poll_frame(&mut Context::from_waker(&this.waker));
        this.asleep = polled.is_pending();
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::Full;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};
    use std::task::Waker;

    /// A body that hands out `items` one per poll (`None` for a `Pending`), never saying it
    /// has ended before its last `None`.
    struct Script {
        items: VecDeque<Option<Result<&'static str, &'static str>>>,
        hint: SizeHint,
    }

    fn script(items: &[Option<Result<&'static str, &'static str>>]) -> Script {
        Script {
            items: items.iter().copied().collect(),
            hint: SizeHint::default(),
        }
    }

    impl Body for Script {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            match self.items.pop_front() {
                None => Poll::Ready(None),
                Some(None) => Poll::Pending,
                Some(Some(Ok(s))) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(s))))),
                Some(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            }
        }

        fn size_hint(&self) -> SizeHint {
            self.hint
        }
    }

    type Ends = Arc<Mutex<Vec<End>>>;

    fn watched<B: Body + Unpin>(body: B) -> (OnEnd<B, impl FnOnce(End)>, Ends) {
        let ends = Ends::default();
        let sink = ends.clone();
        (
            OnEnd::new(body, move |e| sink.lock().unwrap().push(e)),
            ends,
        )
    }

    /// One poll: `Some(Ok(data))`, `Some(Err(e))`, `None` at the end; panics on `Pending`.
    fn poll<B: Body<Data = Bytes> + Unpin>(b: &mut B) -> Option<Result<Bytes, B::Error>> {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(b).poll_frame(&mut cx) {
            Poll::Ready(f) => f.map(|r| r.map(|f| f.into_data().unwrap_or_default())),
            Poll::Pending => panic!("pending"),
        }
    }

    fn pending<B: Body + Unpin>(b: &mut B) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        Pin::new(b).poll_frame(&mut cx).is_pending()
    }

    fn seen(ends: &Ends) -> Vec<End> {
        ends.lock().unwrap().clone()
    }

    #[test]
    fn a_stream_read_to_its_end_completes_once() {
        let (mut b, ends) = watched(script(&[Some(Ok("a")), None, Some(Ok("b"))]));
        assert_eq!(poll(&mut b), Some(Ok(Bytes::from("a"))));
        assert!(pending(&mut b));
        assert_eq!(poll(&mut b), Some(Ok(Bytes::from("b"))));
        assert_eq!(seen(&ends), []);
        assert_eq!(poll(&mut b), None);
        assert_eq!(seen(&ends), [End::Completed]);
        // Polled past its end, then dropped: nothing more.
        assert_eq!(poll(&mut b), None);
        drop(b);
        assert_eq!(seen(&ends), [End::Completed]);
    }

    #[test]
    fn a_body_that_says_it_has_ended_completes_with_its_last_frame() {
        // hyper polls a full body once and never again: it has ended.
        let (mut b, ends) = watched(Full::new(Bytes::from("abc")));
        assert_eq!(poll(&mut b), Some(Ok(Bytes::from("abc"))));
        assert!(b.is_end_stream());
        assert_eq!(seen(&ends), [End::Completed]);
        drop(b);
        assert_eq!(seen(&ends), [End::Completed]);
    }

    #[test]
    fn an_empty_body_never_polled_completes_when_dropped() {
        let (b, ends) = watched(Full::new(Bytes::new()));
        assert!(b.is_end_stream());
        assert_eq!(seen(&ends), []);
        drop(b);
        assert_eq!(seen(&ends), [End::Completed]);
    }

    #[test]
    fn a_body_dropped_before_its_end_is_dropped_once() {
        let (mut b, ends) = watched(script(&[Some(Ok("a")), Some(Ok("b"))]));
        assert_eq!(poll(&mut b), Some(Ok(Bytes::from("a"))));
        assert_eq!(seen(&ends), []);
        drop(b);
        assert_eq!(seen(&ends), [End::Dropped]);

        // Not polled at all.
        let (b, ends) = watched(Full::new(Bytes::from("abc")));
        drop(b);
        assert_eq!(seen(&ends), [End::Dropped]);
    }

    #[test]
    fn a_failing_body_errors_once() {
        let (mut b, ends) = watched(script(&[Some(Ok("a")), Some(Err("broken")), Some(Ok("b"))]));
        assert_eq!(poll(&mut b), Some(Ok(Bytes::from("a"))));
        assert_eq!(poll(&mut b), Some(Err("broken")));
        assert_eq!(seen(&ends), [End::Errored]);
        // Whatever comes after, and the drop, change nothing.
        assert_eq!(poll(&mut b), Some(Ok(Bytes::from("b"))));
        assert_eq!(poll(&mut b), None);
        drop(b);
        assert_eq!(seen(&ends), [End::Errored]);
    }

    #[test]
    fn size_hint_and_is_end_stream_are_the_inner_bodys() {
        let mut s = script(&[Some(Ok("abcd"))]);
        s.hint = SizeHint::with_exact(4);
        let (b, _) = watched(s);
        assert_eq!(b.size_hint().exact(), Some(4));
        assert!(!b.is_end_stream());

        let mut s = script(&[]);
        s.hint.set_lower(2);
        s.hint.set_upper(9);
        let (b, _) = watched(s);
        assert_eq!((b.size_hint().lower(), b.size_hint().upper()), (2, Some(9)));

        let (mut b, _) = watched(Full::new(Bytes::from("abcd")));
        assert_eq!(b.size_hint().exact(), Some(4));
        assert!(!b.is_end_stream());
        poll(&mut b);
        assert_eq!(b.size_hint().exact(), Some(0));
        assert!(b.is_end_stream());
    }

    /// A body fed through a channel, counting its polls: its waker is kept by the channel,
    /// as a socket's is by the runtime.
    struct Fed {
        rx: tokio::sync::mpsc::UnboundedReceiver<&'static str>,
        polls: usize,
    }

    impl Body for Fed {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            self.polls += 1;
            self.rx
                .poll_recv(cx)
                .map(|s| s.map(|s| Ok(Frame::data(Bytes::from(s)))))
        }
    }

    /// A task's waker that counts its wakes.
    #[derive(Default)]
    struct Task(std::sync::atomic::AtomicUsize);

    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn fed() -> (
        Parked<Fed>,
        tokio::sync::mpsc::UnboundedSender<&'static str>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Parked::new(Fed { rx, polls: 0 }), tx)
    }

    fn poll_with<B: Body<Data = Bytes> + Unpin>(
        b: &mut B,
        task: &Arc<Task>,
    ) -> Poll<Option<Result<Bytes, B::Error>>> {
        let waker = Waker::from(task.clone());
        Pin::new(b)
            .poll_frame(&mut Context::from_waker(&waker))
            .map(|f| f.map(|r| r.map(|f| f.into_data().unwrap_or_default())))
    }

    #[test]
    fn a_parked_body_is_polled_again_only_once_woken() {
        let task = Arc::new(Task::default());
        let (mut b, tx) = fed();
        assert!(poll_with(&mut b, &task).is_pending());
        assert_eq!(b.inner.polls, 1);
        for _ in 0..5 {
            assert!(poll_with(&mut b, &task).is_pending());
        }
        assert_eq!(b.inner.polls, 1, "polled again though nothing woke it");
        tx.send("a").unwrap();
        assert_eq!(
            task.0.load(Ordering::SeqCst),
            1,
            "the wake did not reach the task"
        );
        assert_eq!(
            poll_with(&mut b, &task),
            Poll::Ready(Some(Ok(Bytes::from("a"))))
        );
        assert_eq!(b.inner.polls, 2);
        // After a frame the next poll goes in: there may be more.
        tx.send("b").unwrap();
        assert_eq!(
            poll_with(&mut b, &task),
            Poll::Ready(Some(Ok(Bytes::from("b"))))
        );
        assert!(poll_with(&mut b, &task).is_pending());
        assert_eq!(b.inner.polls, 4);
        drop(tx);
        assert_eq!(poll_with(&mut b, &task), Poll::Ready(None));
    }

    #[test]
    fn a_parked_body_wakes_the_task_that_polled_it_last() {
        let (first, last) = (Arc::new(Task::default()), Arc::new(Task::default()));
        let (mut b, tx) = fed();
        assert!(poll_with(&mut b, &first).is_pending());
        assert!(poll_with(&mut b, &last).is_pending());
        tx.send("a").unwrap();
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(last.0.load(Ordering::SeqCst), 1);
        assert_eq!(
            poll_with(&mut b, &last),
            Poll::Ready(Some(Ok(Bytes::from("a"))))
        );
    }

    /// A body that wakes itself before it says `Pending` (as one does to be polled once more
    /// after hyper has flushed), then gives `a`.
    struct Again(bool);

    impl Body for Again {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            if std::mem::replace(&mut self.0, true) {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from("a")))));
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[test]
    fn a_body_that_wakes_itself_while_polled_is_polled_again() {
        let task = Arc::new(Task::default());
        let mut b = Parked::new(Again(false));
        assert!(poll_with(&mut b, &task).is_pending());
        assert_eq!(task.0.load(Ordering::SeqCst), 1);
        assert_eq!(
            poll_with(&mut b, &task),
            Poll::Ready(Some(Ok(Bytes::from("a"))))
        );
    }
}
