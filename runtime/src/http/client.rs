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
    send_with(uri, request, Options { ca, ..Options::default() }).await
}

/// How [`send_with`] connects.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options<'a> {
    /// CA certificates (PEM) an `https://` server is verified with, else
    /// the system's roots.
    pub ca: Option<&'a Path>,
    /// The name the server's certificate is verified for, else the URL's host.
    pub server_name: Option<&'a str>,
    /// The most the connection buffers of the answer at once (hyper's read
    /// buffer, at least 8 KiB), else hyper's default (about 400 KiB).
    pub read_buffer: Option<usize>,
    /// The addresses to connect to (the first that accepts), checked
    /// already, else the URL's host resolved.
    pub addresses: Option<&'a [std::net::SocketAddr]>,
}

/// [`send`] with `options`.
pub async fn send_with(uri: &Uri, request: Request<Full<Bytes>>, options: Options<'_>) -> anyhow::Result<Response<Incoming>> {
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        other => bail!("unsupported URL scheme {:?}: use http:// or https://", other.unwrap_or("")),
    };
    // An IPv6 address comes bracketed in a URL, bare everywhere else.
    let host = uri.host().context("no host")?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let tcp = match options.addresses {
        Some(addresses) => tokio::net::TcpStream::connect(addresses).await?,
        None => tokio::net::TcpStream::connect((host, port)).await?,
    };
    if !https {
        return exchange(TokioIo::new(tcp), request, options.read_buffer).await;
    }
    let name = options.server_name.unwrap_or(host);
    let name = ServerName::try_from(name.to_owned()).with_context(|| format!("{name:?} is not a server name"))?;
    let tls = super::tls::connector(options.ca)?.connect(name, tcp).await.context("TLS handshake")?;
    exchange(TokioIo::new(tls), request, options.read_buffer).await
}

/// One HTTP/1.1 exchange on a fresh connection.
async fn exchange<T>(io: T, request: Request<Full<Bytes>>, read_buffer: Option<usize>) -> anyhow::Result<Response<Incoming>>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut builder = hyper::client::conn::http1::Builder::new();
    if let Some(bytes) = read_buffer {
        // hyper's floor: a head must fit.
        builder.max_buf_size(bytes.max(8 << 10));
    }
    let (mut sender, connection) = builder.handshake(io).await?;
    // The connection is driven on its own task until the answer has been read.
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "client connection ended");
        }
    });
    Ok(sender.send_request(request).await?)
}
