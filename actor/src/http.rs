//! One plain-HTTP/1 JSON exchange on tonic's hyper stack: the actor's
//! sidecar servers (vLLM, an OpenEnv server) speak it on loopback or in
//! the pod network, or on a Unix socket (a vLLM server the actor started,
//! reachable by nobody else).

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo},
};
use serde_json::Value;

/// A pooled HTTP/1 client whose answers are read up to a bound.
#[derive(Clone)]
pub struct Http {
    client: Transport,
    max_body: usize,
}

#[derive(Clone)]
enum Transport {
    Tcp(Client<HttpConnector, Full<Bytes>>),
    Unix(Client<UnixConnector, Full<Bytes>>),
}

/// Connects every request to one Unix socket, whatever its URL's host.
#[derive(Clone)]
struct UnixConnector(Arc<PathBuf>);

impl tower_service::Service<hyper::Uri> for UnixConnector {
    type Response = TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move { Ok(TokioIo::new(tokio::net::UnixStream::connect(&*path).await?)) })
    }
}

impl Http {
    /// A client that reads at most `max_body` bytes of any response body:
    /// a longer one is an error naming the bound, and nothing past it is
    /// kept in memory.
    pub fn new(max_body: usize) -> Self {
        Self {
            client: Transport::Tcp(Client::builder(TokioExecutor::new()).build_http()),
            max_body,
        }
    }

    /// The same, every request sent to the Unix socket at `path` (the
    /// URL's host is then only a name: `http://localhost/health`).
    pub fn unix(path: &Path, max_body: usize) -> Self {
        let connector = UnixConnector(Arc::new(path.to_path_buf()));
        Self {
            client: Transport::Unix(Client::builder(TokioExecutor::new()).build(connector)),
            max_body,
        }
    }

    /// `method url` with an optional JSON body: the status and the body as
    /// text, or why there was no answer within `timeout`.
    pub async fn exchange(
        &self,
        method: &str,
        url: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<(u16, String), String> {
        let mut req = hyper::Request::builder().method(method).uri(url);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        let req = req
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let resp = match &self.client {
                Transport::Tcp(c) => c.request(req).await,
                Transport::Unix(c) => c.request(req).await,
            }
            .map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let max = self.max_body;
            let body = Limited::new(resp.into_body(), max)
                .collect()
                .await
                .map_err(|e| match e.downcast::<http_body_util::LengthLimitError>() {
                    Ok(_) => format!("a response body over {max} bytes"),
                    Err(e) => e.to_string(),
                })?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// An HTTP server on a real socket answering one request with a body
    /// of `bytes` bytes.
    async fn answering(bytes: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = tcp.read(&mut buf).await;
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {bytes}\r\n\r\n");
            let _ = tcp.write_all(head.as_bytes()).await;
            let _ = tcp.write_all(&vec![b'x'; bytes]).await;
        });
        format!("http://{addr}/")
    }

    #[tokio::test]
    async fn a_unix_socket_carries_the_exchange() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"GET /health HTTP/1.1"));
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await;
        });
        let http = Http::unix(&path, 1000);
        let t = Duration::from_secs(5);
        let got = http
            .exchange("GET", "http://localhost/health", None, t)
            .await;
        assert_eq!(got, Ok((200, "ok".to_string())));
    }

    #[tokio::test]
    async fn a_body_over_the_bound_is_an_error_naming_it() {
        let http = Http::new(1000);
        let t = Duration::from_secs(5);
        let (status, body) = http
            .exchange("GET", &answering(1000).await, None, t)
            .await
            .unwrap();
        assert_eq!((status, body.len()), (200, 1000));
        let e = http
            .exchange("GET", &answering(1001).await, None, t)
            .await
            .unwrap_err();
        assert!(e.contains("over 1000 bytes"), "{e}");
    }
}
