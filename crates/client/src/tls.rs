//! The rustls client configuration both remote clients use: the ring provider, trusting only the
//! CA certificates the caller gives.

use crate::{ClientError, Result};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

/// The CA certificates in `ca_pem` (PEM text; may be empty for a configuration that never
/// connects), parsed; a clear error if there are none or they do not parse.
pub(crate) fn ca_certificates(ca_pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(ca_pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| ClientError::Usage(format!("the CA certificate is not valid PEM: {e}")))?;
    if certs.is_empty() && !ca_pem.is_empty() {
        return Err(ClientError::Usage(
            "the CA certificate holds no PEM certificate (a '-----BEGIN CERTIFICATE-----' section)".into(),
        ));
    }
    Ok(certs)
}

/// A client configuration trusting the CA certificates in `ca_pem`, offering ALPN `alpn`.
pub(crate) fn client_config(ca_pem: &[u8], alpn: &[&[u8]]) -> Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in ca_certificates(ca_pem)? {
        roots.add(cert).map_err(|e| ClientError::Usage(format!("the CA certificate cannot be used: {e}")))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Usage(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// What both remote clients' builders take besides the url: the model-control key and the CA
/// certificate to trust; each builder's setters fill it, its build checks it here.
#[derive(Clone, Default)]
pub(crate) struct RemoteOptions {
    pub(crate) control_key: Option<String>,
    pub(crate) ca_pem: Option<Vec<u8>>,
}

impl RemoteOptions {
    /// The CA certificate (PEM text) in the file at `path`.
    pub(crate) fn read_ca_file(path: &Path) -> Result<Vec<u8>> {
        std::fs::read(path).map_err(|e| ClientError::Usage(format!("CA certificate file {}: {e}", path.display())))
    }

    /// The CA certificate to trust for `url` (taken out): one for an `https://` url (an error if
    /// none was given; `client` names the client type in it), none for any other (an error if one
    /// was given).
    pub(crate) fn take_ca_for(&mut self, url: &str, client: &str) -> Result<Option<Vec<u8>>> {
        match (self.ca_pem.take(), url.starts_with("https://")) {
            (Some(pem), true) => Ok(Some(pem)),
            (None, true) => Err(ClientError::Usage(format!(
                "'{url}' is an https:// url: give the CA certificate to trust ({client}::builder(url).tls_ca_pem(..))"
            ))),
            (Some(_), false) => Err(ClientError::Usage(format!("a CA certificate was given but '{url}' is not an https:// url"))),
            (None, false) => Ok(None),
        }
    }

    /// The control key (taken out) as the value that carries it (a header or gRPC metadata, named
    /// by `carrier` in the error): printable ASCII only.
    pub(crate) fn take_control_key<T: FromStr>(&mut self, carrier: &str) -> Result<Option<T>> {
        self.control_key
            .take()
            .map(|k| k.parse::<T>())
            .transpose()
            .map_err(|_| ClientError::Usage(format!("a control key must be printable ASCII (it travels in {carrier})")))
    }
}
