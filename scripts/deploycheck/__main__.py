"""Entry point: `python -m deploycheck [--no-live]` runs every check and prints a summary."""
import os
import sys
import traceback

from . import core
from .compose import check_compose
from .dockerfile import check_dockerfile
from .k8s import check_k8s
from .live import check_live
from .monitoring import check_monitoring
from .nats_checks import check_nats
from .redisacl import check_redis_acl
from .settings_schema import check_settings_files


def main(argv):
    live = "--no-live" not in argv and os.environ.get("SHELFSYNC_VALIDATE_LIVE", "1") != "0"
    print(f"shelfsync deployment validation ({core.ROOT})", flush=True)
    checks = [("Dockerfile", check_dockerfile), ("settings", check_settings_files),
              ("compose", check_compose), ("NATS", check_nats), ("Redis ACL", check_redis_acl), ("k8s", check_k8s),
              ("monitoring", check_monitoring)]
    if live:
        checks.append(("live", check_live))
    for name, fn in checks:
        try:
            fn()
        except Exception:  # noqa: BLE001
            core.fail(f"{name}: the check itself crashed", traceback.format_exc())
    from .settings_schema import PENDING_SEEN, pending_known
    for key in sorted(PENDING_SEEN):
        core.note(f"NOTE  settings files set {key}, which shared/settings does not have yet (pending: being added)")
    for key in pending_known():
        core.note(f"NOTE  shared/settings has {key} now: drop it from deploycheck's PENDING_KEYS")
    for n in core.NOTES:
        print(n, flush=True)
    if core.FAILS:
        print(f"\nFAILED: {'; '.join(core.FAILS)}", flush=True)
    print(f"\nvalidate-deploy: {len(core.PASSED)} passed, {len(core.FAILS)} failed", flush=True)
    return 1 if core.FAILS else 0


sys.exit(main(sys.argv[1:]))
