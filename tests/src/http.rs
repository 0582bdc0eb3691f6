//! HTTP from a test to a service (on reqwest), and reading one sample of
//! the Prometheus text a `/metrics` answers.

use std::sync::LazyLock;

/// One client for every request of the test process. No idle connection
/// is kept: each request opens its own, so a test that stops a service
/// sees its port as it is, not a pooled connection. (Plain HTTP still needs
/// a crypto provider installed: reqwest is built without a default one.)
static CLIENT: LazyLock<reqwest::Client> = LazyLock::new(|| {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("an HTTP client")
});

/// A GET on `addr`: `(status, body)`.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let response = CLIENT.get(format!("http://{addr}{path}")).send().await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

/// The value of a Prometheus sample `name{labels}` in `text` (labels as
/// written, e.g. `consumer="x"`; empty for none).
pub fn metric_value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let wanted = if labels.is_empty() { name.to_string() } else { format!("{name}{{{labels}}}") };
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(&wanted)?.strip_prefix(' ')?.trim().parse().ok())
}
