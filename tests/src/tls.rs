//! Certificates for the TLS tests, made on the spot.

/// Runs the `openssl` CLI; a failure fails the test with its stderr.
fn openssl(args: &[&str]) {
    let ok = std::process::Command::new("openssl").args(args).output().expect("openssl");
    assert!(ok.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&ok.stderr));
}

/// A private CA and a certificate for 127.0.0.1 signed by it, made with the
/// `openssl` CLI: `(dir, ca.pem, cert.pem, key.pem)`.
pub fn test_certificates() -> (tempfile::TempDir, String, String, String) {
    let dir = tempfile::tempdir().expect("tmp");
    let p = |f: &str| dir.path().join(f).display().to_string();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=shelfsync test CA",
        "-keyout",
        &p("ca-key.pem"),
        "-out",
        &p("ca.pem"),
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        &p("key.pem"),
        "-out",
        &p("req.csr"),
    ]);
    std::fs::write(p("ext.cnf"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").expect("ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p("req.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca-key.pem"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &p("ext.cnf"),
        "-out",
        &p("cert.pem"),
    ]);
    let (ca, cert, key) = (p("ca.pem"), p("cert.pem"), p("key.pem"));
    (dir, ca, cert, key)
}

/// A client certificate (`CN=shelfsync test client`, for TLS client
/// authentication) signed by the CA that [`test_certificates`] made in
/// `dir`: `(client.pem, client-key.pem)`.
pub fn test_client_certificate(dir: &std::path::Path) -> (String, String) {
    let p = |f: &str| dir.join(f).display().to_string();
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=shelfsync test client",
        "-keyout",
        &p("client-key.pem"),
        "-out",
        &p("client.csr"),
    ]);
    std::fs::write(p("client.cnf"), "extendedKeyUsage=clientAuth\n").expect("ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p("client.csr"),
        "-CA",
        &p("ca.pem"),
        "-CAkey",
        &p("ca-key.pem"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &p("client.cnf"),
        "-out",
        &p("client.pem"),
    ]);
    (p("client.pem"), p("client-key.pem"))
}
