//! The TLS of an `https` OTLP endpoint beyond the system's trust store: the
//! CA and client certificate files that `OTEL_EXPORTER_OTLP_[TRACES_]
//! CERTIFICATE`, `_CLIENT_CERTIFICATE` and `_CLIENT_KEY` name. They are read
//! and checked once, at start, so that a wrong path or a file that is not
//! what it should be stops the service with the variable and the path in
//! the message — instead of every export failing later with a handshake
//! error that names neither. Then they are handed to the gRPC (tonic) and
//! the HTTP (reqwest) client in each one's own form; both keep trusting the
//! system's roots as well.

use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use crate::env::{FileVar, TlsFiles};

/// Installs ring as the process's rustls crypto provider, as NATS uses, for
/// the clients built without a default one (reqwest, Redis over TLS, the
/// OTLP HTTP exporter). Once per process: when one is installed already,
/// nothing changes.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// TLS material that was checked, kept as the PEM both clients take.
#[derive(Debug, Clone, Default)]
pub(crate) struct ExportTls {
    /// CA certificates trusted besides the system's.
    ca: Option<Vec<u8>>,
    /// Client certificate chain and its private key (mTLS).
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl ExportTls {
    /// Reads and checks the files `files` names. The error says which
    /// variable, which path and what is wrong with it.
    pub(crate) fn load(files: &TlsFiles) -> anyhow::Result<Self> {
        let ca = files.certificate.as_ref().map(read_ca).transpose()?;
        let identity = match (&files.client_certificate, &files.client_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(read_identity(cert, key)?),
            (Some(set), None) | (None, Some(set)) => bail!(
                "{}={} is set without its pair: a client certificate needs both \
                 OTEL_EXPORTER_OTLP_[TRACES_]CLIENT_CERTIFICATE and _CLIENT_KEY",
                set.var,
                set.path.display()
            ),
        };
        Ok(Self { ca, identity })
    }

    /// True when there is nothing beyond the system's roots.
    pub(crate) fn is_empty(&self) -> bool {
        self.ca.is_none() && self.identity.is_none()
    }

    /// The gRPC client's TLS: the system's roots, the CA, the identity.
    pub(crate) fn tonic(&self) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new().with_enabled_roots();
        if let Some(ca) = &self.ca {
            config = config.ca_certificate(Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &self.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        config
    }

    /// The HTTP exporter's blocking client, trusting the system's roots and
    /// the CA and presenting the identity, each request bounded by
    /// `timeout` (what the SDK's own client would be given).
    pub(crate) fn http_client(
        &self,
        timeout: Duration,
    ) -> anyhow::Result<reqwest::blocking::Client> {
        let mut builder = reqwest::blocking::Client::builder().timeout(timeout);
        if let Some(ca) = &self.ca {
            let certs = reqwest::Certificate::from_pem_bundle(ca).context("the CA certificate")?;
            builder = builder.tls_certs_merge(certs);
        }
        if let Some((cert, key)) = &self.identity {
            let pem = [cert.as_slice(), b"\n", key.as_slice()].concat();
            builder = builder
                .identity(reqwest::Identity::from_pem(&pem).context("the client certificate")?);
        }
        // A blocking client owns a runtime of its own: it cannot be built
        // (nor dropped) on a thread that drives one.
        std::thread::spawn(move || builder.build())
            .join()
            .map_err(|_| anyhow!("building the HTTP client panicked"))?
            .context("building the HTTP client")
    }
}

/// The CA file of `file`: PEM certificates, each usable as a trust anchor.
fn read_ca(file: &FileVar) -> anyhow::Result<Vec<u8>> {
    let pem = read(file)?;
    let mut roots = RootCertStore::empty();
    for cert in certificates(file, &pem)? {
        roots
            .add(cert)
            .map_err(|e| invalid(file, &format!("not a usable CA certificate ({e})")))?;
    }
    Ok(pem)
}

/// The client certificate chain and key: both PEM, and matching.
fn read_identity(cert: &FileVar, key: &FileVar) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let chain = certificates(cert, &cert_pem)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| invalid(key, &format!("no PEM private key in it ({e})")))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, private, &provider).map_err(|e| {
        invalid(key, &format!("not the key of {}={} ({e})", cert.var, cert.path.display()))
    })?;
    Ok((cert_pem, key_pem))
}

/// The PEM certificates of a file; at least one.
fn certificates(file: &FileVar, pem: &[u8]) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(file, &format!("not PEM ({e})")))?;
    if certs.is_empty() {
        return Err(invalid(file, "no PEM certificate in it"));
    }
    Ok(certs)
}

fn read(file: &FileVar) -> anyhow::Result<Vec<u8>> {
    std::fs::read(&file.path).map_err(|e| invalid(file, &format!("cannot be read ({e})")))
}

fn invalid(file: &FileVar, what: &str) -> anyhow::Error {
    anyhow!("{}={}: {what}", file.var, file.path.display())
}
