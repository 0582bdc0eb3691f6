#!/bin/sh
# Starts redis-server with shelfsync's ACL users: users.acl beside this script, its comment lines
# dropped and each ${REDIS_<USER>_PASSWORD} replaced with that environment variable, is written
# to a file only this user can read (on a tmpfs/emptyDir, never the data volume), then
# redis-server runs with it and the arguments given. A password that is not set stops the start:
# an ACL user without one would be refused anyway, but better said here.
# The same script is in k8s/base/redis.yaml (scripts/validate-deploy.sh checks it).
set -eu
acl_in="$(dirname "$0")/users.acl"
acl_out="${REDIS_ACL_FILE:-/tmp/shelfsync-users.acl}"
umask 077
awk '
  /^#/ || NF == 0 { next }
  {
    while (match($0, /\$\{[A-Z0-9_]+\}/)) {
      name = substr($0, RSTART + 2, RLENGTH - 3)
      if (ENVIRON[name] == "") { print "start-redis: " name " is not set" > "/dev/stderr"; exit 1 }
      $0 = substr($0, 1, RSTART - 1) ENVIRON[name] substr($0, RSTART + RLENGTH)
    }
    print
  }' "$acl_in" > "$acl_out"
exec redis-server "$@" --aclfile "$acl_out"
