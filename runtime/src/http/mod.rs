//! The HTTP side: the listener loop and graceful shutdown (here), and
//! `conn` (connections: caps, eviction, stalls), `open_files` (the
//! open-file limit), `tls` (HTTPS), `app` (the [`App`] and its [`Plane`]s),
//! `routes` (the routing table and small routes), `call` (a tenant's call
//! of its handler), `body` (request bodies under their limits), `auth`
//! (tokens, client addresses), `mount` (a handler's mount and the path
//! its guest sees), `admin` (the admin API), `usage` (its usage
//! report), `console` (the web console), `logs` (a tenant's log, from
//! every live node through `peers`), `client` (HTTP requests out: the CLI's
//! and to other nodes) and `response` (host-generated responses).

mod admin;
mod app;
mod auth;
pub(crate) mod body;
mod call;
pub mod client;
mod conn;
pub mod console;
mod kv;
mod logs;
pub mod mount;
pub mod oci;
pub use logs::Cursor as LogCursor;
pub mod open_files;
mod peers;
pub mod response;
mod routes;
mod tenant;
pub mod tls;
mod usage;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

pub use app::{App, Plane, VERSION_HEADER};
pub use auth::TOKEN_FAILURE_DELAY;
pub use conn::{ADMIN_RESERVE_CONNECTIONS, EVICTION_BACKLOG, MAX_HEAD_BYTES, REFUSALS_BEFORE_CLOSE, RESERVE_TIMEOUT};

/// How long in-flight requests get to finish after a shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `plane` of `app` on `listener` (over TLS when `tls` is given)
/// until `shutdown` resolves, then drains connections. Connection limits
/// (caps, eviction, head and idle timeouts, age) come from `app`'s configuration.
pub async fn serve(
    app: Arc<App>,
    plane: Plane,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let connections = Arc::new(conn::Listener::new(app, plane, tls));
    let (drain, draining) = tokio::sync::watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                // Over a cap the stream is dropped: closed at once rather than queued.
                Ok((stream, peer)) => if let Some(slot) = connections.admit(peer) {
                    // Responses are small and latency-bound; don't let Nagle hold them back.
                    let _ = stream.set_nodelay(true);
                    tasks.spawn(Arc::clone(&connections).serve(stream, peer, slot, draining.clone()));
                },
                // Out of file descriptors and the like: back off, keep serving.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            // Reaps ended connections' tasks.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!("shutting down; waiting for in-flight requests");
    // Every connection shuts down gracefully; idle ones close at once.
    let _ = drain.send(true);
    let drained = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        tracing::warn!("grace period over; dropping remaining connections");
        tasks.shutdown().await;
    }
    Ok(())
}
