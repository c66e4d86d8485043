//! One plain-HTTP/1 JSON exchange on tonic's hyper stack: the actor's
//! sidecar servers (vLLM, an OpenEnv server) speak it on loopback or in
//! the pod network.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use serde_json::Value;

/// A pooled HTTP/1 client whose answers are read up to a bound.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    max_body: usize,
}

impl Http {
    /// A client that reads at most `max_body` bytes of any response body:
    /// a longer one is an error naming the bound, and nothing past it is
    /// kept in memory.
    pub fn new(max_body: usize) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
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
            let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
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
