//! One plain-HTTP/1 JSON exchange on tonic's hyper stack: the actor's
//! sidecar servers (vLLM, an OpenEnv server) speak it on loopback or in
//! the pod network.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use serde_json::Value;

/// A pooled HTTP/1 client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

impl Http {
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
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
    }
}
