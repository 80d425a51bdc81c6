//! The rustls client configuration both remote clients use: the ring provider, trusting only the
//! CA certificates the caller gives.

use crate::{ClientError, Result};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
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
