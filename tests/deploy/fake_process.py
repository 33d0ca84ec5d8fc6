"""A stand-in for a Tandem process, steered by env vars, for launcher tests.

FAKE_MODE: "ok" (print READY, serve until SIGTERM), "crash" (exit 3 before READY),
"silent" (never READY), "stubborn" (READY, then ignore SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys
import time

if __name__ == "__main__":
    config = sys.argv[sys.argv.index("--config") + 1]
    role = os.path.basename(config).split("-")[0].removesuffix(".yaml")
    mode = os.environ.get(f"FAKE_MODE_{role.upper()}", "ok")
    print(f"fake {role} starting with {config}", file=sys.stderr, flush=True)
    if mode == "crash":
        print("a library's reason, on stdout", flush=True)  # as UCX prints it by default
        print("boom: cannot load the model", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode != "silent":
        port = 10000 + os.getpid() % 5000
        metrics = f" metrics=127.0.0.1:{port + 5000}" if os.environ.get("FAKE_METRICS") else ""
        print(f"READY {role} grpc=127.0.0.1:{port} kv=x{metrics}", flush=True)
        print(f"{role} printed this after READY", flush=True)
    stop = []
    if mode != "stubborn":
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.02)
