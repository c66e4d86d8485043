//! The transport settings every bapo gRPC server shares, and the guard in
//! front of its listening socket.
//!
//! A server must keep serving its real clients while anything that can
//! reach its port misbehaves: connections that never speak, peers that send
//! garbage, half-open sockets of a node that died, a client opening streams
//! without end. What each setting defends against:
//!
//! * a connection that sends nothing within [`HANDSHAKE_TIMEOUT`] is
//!   closed before HTTP/2 sees it, so idle sockets cannot pile up;
//! * at most [`MAX_CONNECTIONS`] connections are served at once; more are
//!   closed on accept (a file-descriptor budget, not a rate limit);
//! * garbage fails the HTTP/2 preface and hyper closes that connection;
//! * a peer that stops answering HTTP/2 pings for [`KEEPALIVE_TIMEOUT`] is
//!   dropped (a node that vanished leaves no half-open stream holding a
//!   batch or a weight transfer);
//! * one connection may open at most [`MAX_CONCURRENT_STREAMS`] streams and
//!   run [`MAX_CALLS_PER_CONNECTION`] calls at once; rapid stream resets
//!   are bounded too.
//!
//! There is no per-call deadline: a held push (backpressure) and a weight
//! subscription are meant to last.
//!
//! With mutual TLS ([`crate::tls`]) the TLS handshake happens here too,
//! inside the handshake timeout: a client without a certificate from the
//! server's CA never reaches HTTP/2. The authenticated [`Peer`] travels
//! with the connection ([`ConnInfo`]) to the authorization layer.

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore, mpsc},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Server, server::Connected};
use tower_layer::{Identity, Stack};

use crate::tls::{AuthLayer, Peer, ServerSecurity, ServerTls};

/// HTTP/2 flow-control windows, for servers and for clients of them: h2's
/// 64 KiB default stalls a stream after eight 8 KiB rollouts until the
/// peer's WINDOW_UPDATE arrives, and batches are megabytes.
pub const STREAM_WINDOW: u32 = 4 << 20;
pub const CONNECTION_WINDOW: u32 = 16 << 20;

/// A connection that sends nothing within this long is closed (also a
/// client's connect timeout). Defined with TLS, which uses it too, so the
/// dependency runs one way: transport on tls.
pub use crate::tls::HANDSHAKE_TIMEOUT;
pub const MAX_CONNECTIONS: usize = 4096;
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
pub const MAX_CONCURRENT_STREAMS: u32 = 256;
pub const MAX_CALLS_PER_CONNECTION: usize = 256;
const MAX_PENDING_RESETS: usize = 64;

/// A server builder with the shared settings.
pub fn server() -> Server {
    Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .concurrency_limit_per_connection(MAX_CALLS_PER_CONNECTION)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_RESETS))
}

/// A server builder with the shared settings and the authorization of
/// `security` ([`crate::tls::AuthLayer`]).
pub fn secured_server(security: &ServerSecurity) -> Server<Stack<AuthLayer, Identity>> {
    server().layer(AuthLayer::new(security))
}

/// Limits of [`guarded`]; the defaults are the constants above.
#[derive(Debug, Clone, Copy)]
pub struct Guard {
    pub handshake_timeout: Duration,
    pub max_connections: usize,
}

impl Default for Guard {
    fn default() -> Self {
        Self {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// The connections of `listener` that pass `guard`, for
/// `Server::serve_with_incoming`: Nagle off (an ack ends with a small
/// trailers frame that would otherwise wait for a delayed ACK), closed if
/// silent for the handshake timeout or beyond the connection budget. The
/// accept loop ends when the stream is dropped.
pub fn guarded(
    listener: TcpListener,
    guard: Guard,
) -> ReceiverStream<io::Result<GuardedConnection>> {
    guarded_with(listener, guard, &ServerSecurity::Plaintext)
}

/// [`guarded`], and with mutual TLS the TLS handshake (within the same
/// handshake timeout). The accept loop also reloads the certificate files
/// and the blocklist every [`crate::tls::RELOAD_INTERVAL`].
pub fn guarded_with(
    listener: TcpListener,
    guard: Guard,
    security: &ServerSecurity,
) -> ReceiverStream<io::Result<GuardedConnection>> {
    let (tx, rx) = mpsc::channel(64);
    let budget = Arc::new(Semaphore::new(guard.max_connections));
    let tls = security.tls().cloned();
    tokio::spawn(async move {
        let mut reload = tokio::time::interval(crate::tls::RELOAD_INTERVAL);
        reload.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        reload.tick().await;
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    // Per-connection errors (a reset before accept, EMFILE):
                    // back off briefly and keep serving.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                },
                _ = reload.tick(), if tls.is_some() => {
                    if let Some(t) = &tls
                        && let Err(e) = t.reload()
                    {
                        tracing::warn!("TLS files not reloaded ({e}); keeping the current ones");
                    }
                    continue;
                }
                () = tx.closed() => return,
            };
            let Ok(permit) = budget.clone().try_acquire_owned() else {
                continue; // over budget: dropped, so closed
            };
            let tx = tx.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                if let Some(c) = admit(stream, permit, guard.handshake_timeout, tls).await {
                    let _ = tx.send(Ok(c)).await;
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Waits for the first byte of a connection (and, with TLS, for its
/// handshake); `None` closes it.
async fn admit(
    stream: TcpStream,
    permit: OwnedSemaphorePermit,
    timeout: Duration,
    tls: Option<Arc<ServerTls>>,
) -> Option<GuardedConnection> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut first = [0u8; 1];
    match tokio::time::timeout_at(deadline, stream.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => return None,
    }
    stream.set_nodelay(true).ok()?;
    let tcp = stream.connect_info();
    let Some(tls) = tls else {
        return Some(GuardedConnection {
            io: Io::Plain(stream),
            info: ConnInfo { tcp, peer: None },
            _permit: permit,
        });
    };
    let remote = tcp.remote_addr();
    let conn = match tokio::time::timeout_at(deadline, tls.acceptor().accept(stream)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            tracing::warn!(peer = ?remote, "TLS handshake refused: {e}");
            return None;
        }
        Err(_) => return None,
    };
    let peer = conn
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| Arc::new(Peer::from_cert(c)));
    Some(GuardedConnection {
        io: Io::Tls(Box::new(conn)),
        info: ConnInfo { tcp, peer },
        _permit: permit,
    })
}

pub use crate::tls::ConnInfo;

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// A served connection; it holds its place in the connection budget until
/// it closes.
pub struct GuardedConnection {
    io: Io,
    info: ConnInfo,
    _permit: OwnedSemaphorePermit,
}

impl Connected for GuardedConnection {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

/// Dispatches an I/O call to the plain or the TLS stream.
macro_rules! io {
    ($self:ident, $s:ident => $e:expr) => {
        match &mut $self.io {
            Io::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Io::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
        }
    };
}

impl AsyncRead for GuardedConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        io!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for GuardedConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        io!(self, s => s.poll_write(cx, buf))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        io!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        io!(self, s => s.poll_shutdown(cx))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        io!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    use super::*;

    /// Whether the server side closes `s` within `limit`.
    async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
        let mut b = [0u8; 16];
        matches!(
            tokio::time::timeout(limit, s.read(&mut b)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn connections_past_the_budget_are_closed_and_a_freed_place_is_reused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let guard = Guard {
            handshake_timeout: Duration::from_secs(5),
            max_connections: 2,
        };
        let mut incoming = guarded(listener, guard);
        let mut clients = Vec::new();
        let mut served = Vec::new();
        for _ in 0..2 {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(b"x").await.unwrap();
            served.push(incoming.next().await.unwrap().unwrap());
            clients.push(c);
        }
        let mut third = TcpStream::connect(addr).await.unwrap();
        third.write_all(b"x").await.unwrap();
        assert!(
            closed_within(&mut third, Duration::from_secs(5)).await,
            "over budget yet open"
        );

        // Closing a served connection frees its place.
        drop(served.pop());
        let mut fourth = TcpStream::connect(addr).await.unwrap();
        fourth.write_all(b"x").await.unwrap();
        let admitted = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(
            matches!(admitted, Ok(Some(Ok(_)))),
            "a freed place was not reused"
        );
    }
}
