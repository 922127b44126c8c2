//! A small HTTP/1.1 client: one request over a connection of its own,
//! over TLS for an `https://` URL. The CLI talks to a gateway with it, and
//! a node to the other nodes of its cluster (a tenant's log, see `logs`).

use std::path::Path;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, Uri};
use hyper_util::rt::TokioIo;
use tokio_rustls::rustls::pki_types::ServerName;

/// Sends one request over a connection of its own (HTTP/1.1; over TLS for
/// an `https://` URL, trusting `ca` or the system's roots).
pub async fn send(uri: &Uri, request: Request<Full<Bytes>>, ca: Option<&Path>) -> anyhow::Result<Response<Incoming>> {
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        other => bail!("unsupported URL scheme {:?}: use http:// or https://", other.unwrap_or("")),
    };
    // An IPv6 address comes bracketed in a URL, bare everywhere else.
    let host = uri.host().context("no host")?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host, port)).await?;
    if !https {
        return exchange(TokioIo::new(tcp), request).await;
    }
    let name = ServerName::try_from(host.to_owned()).with_context(|| format!("{host:?} is not a server name"))?;
    let tls = super::tls::connector(ca)?.connect(name, tcp).await.context("TLS handshake")?;
    exchange(TokioIo::new(tls), request).await
}

/// One HTTP/1.1 exchange on a fresh connection.
async fn exchange<T>(io: T, request: Request<Full<Bytes>>) -> anyhow::Result<Response<Incoming>>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
    // The connection is driven on its own task until the answer has been read.
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "client connection ended");
        }
    });
    Ok(sender.send_request(request).await?)
}
