//! The HTTP side: listener, routes, limits, and graceful shutdown.

mod admin;
pub mod response;
mod routes;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use routes::{App, Plane, VERSION_HEADER};

/// Longest a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Most open client connections; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 4096;

/// How long in-flight requests get to finish after a shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `plane` of `app` on `listener` (over TLS when `tls` is given)
/// until `shutdown` resolves, then drains connections.
pub async fn serve(
    app: Arc<App>,
    plane: Plane,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Without a timer hyper enforces no header timeout: slow clients could
    // hold connections forever.
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    builder.http2().timer(TokioTimer::new()).keep_alive_interval(Some(HEADER_READ_TIMEOUT));
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match Arc::clone(&connections).try_acquire_owned() {
                    Ok(permit) => accept(&app, plane, &builder, &graceful, tls.clone(), stream, peer, permit),
                    // Over the cap: close at once rather than queue sockets.
                    Err(_) => drop(stream),
                },
                // Out of file descriptors and the like: back off, keep serving.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!("shutting down; waiting for in-flight requests");
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::warn!("grace period over; dropping remaining connections");
    }
    Ok(())
}

/// Starts serving one accepted connection, after a TLS handshake when configured.
#[allow(clippy::too_many_arguments, reason = "one call site; the connection's parts")]
fn accept(
    app: &Arc<App>,
    plane: Plane,
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    tls: Option<TlsAcceptor>,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    // Responses are small and latency-bound; don't let Nagle hold them back.
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        return serve_connection(app, plane, builder, graceful, stream, peer, permit);
    };
    let (app, builder, watcher) = (Arc::clone(app), builder.clone(), graceful.watcher());
    tokio::spawn(async move {
        // The handshake runs off the accept loop, bounded like a header read.
        match tokio::time::timeout(HEADER_READ_TIMEOUT, tls.accept(stream)).await {
            Ok(Ok(stream)) => {
                let service = service(&app, plane);
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let _permit = permit;
                if let Err(e) = watcher.watch(conn).await {
                    tracing::debug!(%peer, error = %e, "TLS connection ended with an error");
                }
            }
            Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
        }
    });
}

fn service(app: &Arc<App>, plane: Plane) -> impl hyper::service::Service<hyper::Request<Incoming>, Response = hyper::Response<response::Body>, Error = std::convert::Infallible, Future: Send> + Clone + Send + 'static {
    let app = Arc::clone(app);
    service_fn(move |req: hyper::Request<Incoming>| {
        let app = Arc::clone(&app);
        async move { Ok::<_, std::convert::Infallible>(app.route(req, plane).await) }
    })
}

fn serve_connection(
    app: &Arc<App>,
    plane: Plane,
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service(app, plane)).into_owned();
    let conn = graceful.watch(conn);
    tokio::spawn(async move {
        let _permit = permit;
        if let Err(e) = conn.await {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
    });
}
