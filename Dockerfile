# syntax=docker/dockerfile:1.7
#
# shelfsync: one multi-stage build for every binary.
#
#   docker build -t shelfsync .                      # all binaries, ENTRYPOINT = the `shelfsync` CLI
#   docker build --target storage -t shelfsync-storage .   # same image, ENTRYPOINT = shelfsync-storage
#
# Targets (each one the runtime image with its own ENTRYPOINT): ingest, storage, validator,
# aggregator, recommender, picks, cli. The last stage (`runtime`, the default) holds every binary
# too; Kubernetes uses that single image and picks the binary with `command:`.
#
# Every binary takes `--config FILE` (or SHELFSYNC_CONFIG) and SHELFSYNC__SECTION__KEY overrides.
# In a container the HTTP listen addresses must be 0.0.0.0:<port> (set them through env).

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

############################################################################ builder
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
WORKDIR /build
ENV CARGO_TERM_COLOR=never \
    CARGO_INCREMENTAL=0
# The whole workspace (see .dockerignore): every member must be present for cargo to resolve it.
COPY . .
# The git commit the binaries report (`vcs.ref.head.revision` on their spans, the `revision` label of
# shelfsync_build_info): the build context has no .git, so give it, e.g.
# `docker build --build-arg SHELFSYNC_GIT_COMMIT=$(git rev-parse HEAD) .`; empty: `unknown`.
ARG SHELFSYNC_GIT_COMMIT=""
# The registry, git checkouts and the target dir are BuildKit cache mounts: a rebuild after a code
# change recompiles only what changed. The cache mount is not part of the image, so the binaries
# are copied out of it in the same step.
RUN --mount=type=cache,id=shelfsync-cargo-registry,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,id=shelfsync-cargo-git,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,id=shelfsync-target-${RUST_VERSION},target=/build/target,sharing=locked \
    cargo build --release --locked --bins \
 && mkdir -p /out \
 && find target/release -maxdepth 1 -type f -perm -u+x -name 'shelfsync*' -exec cp -v {} /out/ \; \
 && test -x /out/shelfsync && test -x /out/shelfsync-storage && test -x /out/shelfsync-ingest
# The release profile keeps line tables (readable panic backtraces); compressing the debug
# sections keeps them and divides the binaries' size by ~2.5.
RUN for f in /out/*; do objcopy --compress-debug-sections=zlib "$f"; done

############################################################################ runtime
FROM debian:${DEBIAN_RELEASE}-slim AS base
# ca-certificates: HTTPS partner feeds (ingest). Nothing else: no curl, no shell tools beyond
# bash and coreutils, which the health check below needs. ca-certificates is not pinned on
# purpose: it should follow the distribution's security updates at every rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 shelfsync \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin shelfsync \
 && mkdir -p /etc/shelfsync

# A tiny HTTP probe without curl: `shelfsync-healthcheck PORT [PATH]` exits 0 when
# GET http://127.0.0.1:PORT/PATH (default /readyz) answers 200 within 5 s (bash /dev/tcp).
COPY --chmod=0755 <<'EOF' /usr/local/bin/shelfsync-healthcheck
#!/bin/bash
set -eu
port=${1:?usage: shelfsync-healthcheck PORT [PATH]}
path=${2:-/readyz}
exec 3<>"/dev/tcp/127.0.0.1/${port}"
printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "$path" >&3
IFS= read -r -t 5 status <&3 || exit 1
[[ $status =~ ^HTTP/1\.[01]\ 200 ]]
EOF

COPY --from=builder /out/ /usr/local/bin/
USER 10001:10001
WORKDIR /tmp
STOPSIGNAL SIGTERM

# One target per service: `docker build --target <name>`, or `target:` in compose.
FROM base AS ingest
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/shelfsync-ingest"]

FROM base AS storage
EXPOSE 8081
ENTRYPOINT ["/usr/local/bin/shelfsync-storage"]

FROM base AS validator
EXPOSE 8082
ENTRYPOINT ["/usr/local/bin/shelfsync-validator"]

FROM base AS aggregator
EXPOSE 8083
ENTRYPOINT ["/usr/local/bin/shelfsync-aggregator"]

FROM base AS recommender
EXPOSE 8084
ENTRYPOINT ["/usr/local/bin/shelfsync-recommender"]

FROM base AS picks
ENTRYPOINT ["/usr/local/bin/shelfsync-picks"]

FROM base AS cli
ENTRYPOINT ["/usr/local/bin/shelfsync"]

# Default target: every binary, the operator CLI as entrypoint (`docker run IMAGE setup`).
FROM base AS runtime
ENTRYPOINT ["/usr/local/bin/shelfsync"]
CMD ["--help"]
