//! The floor of the proxies bench: the least a reverse proxy on hyper 1.x and tokio can do.
//! One current-thread runtime (as dsv4d's); per client connection, a hyper HTTP/1.1 server
//! connection and one hyper client connection to the engine, opened on the first request and
//! driven in the same task; the request goes on with its headers as they came, the answer
//! comes back as it came. No checks, no statistics, no lifecycle: what dsv4d adds on top of
//! this is what dsv4d costs.
//!
//! Usage: `bare-proxy LISTEN ENGINE` (both `IP:PORT`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

type Sender = hyper::client::conn::http1::SendRequest<Incoming>;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parse = |s: Option<&String>| s.and_then(|s| s.parse::<SocketAddr>().ok());
    let (Some(listen), Some(engine)) = (parse(args.first()), parse(args.get(1))) else {
        eprintln!("usage: bare-proxy LISTEN ENGINE (both IP:PORT)");
        std::process::exit(2);
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bare-proxy: runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(serve(listen, engine)) {
        eprintln!("bare-proxy: {e}");
        std::process::exit(1);
    }
}

async fn serve(listen: SocketAddr, engine: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(stream, engine));
    }
}

async fn connection(stream: TcpStream, engine: SocketAddr) {
    // The engine connection of this client connection, made on its first request.
    let upstream: Arc<Mutex<Option<Sender>>> = Arc::new(Mutex::new(None));
    let service = service_fn(move |req: Request<Incoming>| {
        let upstream = upstream.clone();
        async move { Ok::<_, Infallible>(forward(req, engine, &upstream).await) }
    });
    let _ = http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

async fn forward(
    req: Request<Incoming>,
    engine: SocketAddr,
    upstream: &Mutex<Option<Sender>>,
) -> Response<http_body_util::Either<Incoming, http_body_util::Full<bytes::Bytes>>> {
    let mut slot = upstream.lock().await;
    if slot.as_ref().is_none_or(|s| s.is_closed()) {
        match open(engine).await {
            Ok(s) => *slot = Some(s),
            Err(e) => return bad_gateway(e),
        }
    }
    let Some(sender) = slot.as_mut() else {
        return bad_gateway("no engine connection".into());
    };
    if let Err(e) = sender.ready().await {
        return bad_gateway(e.to_string());
    }
    let answer = sender.send_request(req);
    drop(slot);
    match answer.await {
        Ok(resp) => resp.map(http_body_util::Either::Left),
        Err(e) => bad_gateway(e.to_string()),
    }
}

async fn open(engine: SocketAddr) -> Result<Sender, String> {
    let stream = TcpStream::connect(engine)
        .await
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(sender)
}

fn bad_gateway(
    why: String,
) -> Response<http_body_util::Either<Incoming, http_body_util::Full<bytes::Bytes>>> {
    let mut r = Response::new(http_body_util::Either::Right(http_body_util::Full::new(
        bytes::Bytes::from(why),
    )));
    *r.status_mut() = hyper::StatusCode::BAD_GATEWAY;
    r
}
