//! Certificates for the TLS tests, made on the spot.

use std::path::Path;

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
    let ext = ("ext.cnf", "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
    signed_by_the_ca(dir.path(), "/CN=127.0.0.1", ["key.pem", "req.csr", "cert.pem"], ext);
    let (ca, cert, key) = (p("ca.pem"), p("cert.pem"), p("key.pem"));
    (dir, ca, cert, key)
}

/// A client certificate (`CN=shelfsync test client`, for TLS client
/// authentication) signed by the CA that [`test_certificates`] made in
/// `dir`: `(client.pem, client-key.pem)`.
pub fn test_client_certificate(dir: &Path) -> (String, String) {
    let p = |f: &str| dir.join(f).display().to_string();
    let ext = ("client.cnf", "extendedKeyUsage=clientAuth\n");
    let files = ["client-key.pem", "client.csr", "client.pem"];
    signed_by_the_ca(dir, "/CN=shelfsync test client", files, ext);
    (p("client.pem"), p("client-key.pem"))
}

/// A new key for `subject` and a certificate for it signed by the CA in
/// `dir` (`ca.pem`, `ca-key.pem`): `files` are the key, the signing request
/// and the certificate, `extensions` the extensions file and what it holds.
fn signed_by_the_ca(dir: &Path, subject: &str, files: [&str; 3], extensions: (&str, &str)) {
    let p = |f: &str| dir.join(f).display().to_string();
    let [key, request, cert] = files.map(p);
    openssl(&[
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out", &request,
    ]);
    let (ext_file, ext) = extensions;
    std::fs::write(p(ext_file), ext).expect("ext");
    let (ca, ca_key, ext_file) = (p("ca.pem"), p("ca-key.pem"), p(ext_file));
    openssl(&[
        "x509",
        "-req",
        "-in",
        &request,
        "-CA",
        &ca,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &ext_file,
        "-out",
        &cert,
    ]);
}
