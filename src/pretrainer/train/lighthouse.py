"""`pretrainer lighthouse --bind HOST:PORT --min-replicas M`: torchft's lighthouse, which tells the replica groups of a
fault-tolerant run (`fault_tolerance`) who takes part in each step. It runs until SIGTERM or SIGINT."""

from __future__ import annotations

import os
import re
import signal
import threading

from ..config import ConfigError


def serve(bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> int:
    if not re.fullmatch(r"[^\s:/]+:\d{1,5}", bind):
        raise ConfigError(f"--bind {bind!r}: expected HOST:PORT, e.g. 0.0.0.0:29510 (the groups' "
                          "fault_tolerance.lighthouse names this machine and port)")
    os.environ.setdefault("RUST_LOG", "warn")  # not a line per quorum
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise ConfigError("pretrainer lighthouse needs torchft: pip install torchft (it brings the lighthouse)") \
            from None
    try:
        server = LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  heartbeat_timeout_ms=heartbeat_timeout_ms)
    except Exception as exc:  # the port taken, an address not of this machine
        raise ConfigError(f"--bind {bind}: the lighthouse cannot listen there ({exc})") from None
    stop = threading.Event()
    for name in (signal.SIGTERM, signal.SIGINT):
        signal.signal(name, lambda *_: stop.set())
    print(f"pretrainer lighthouse: listening on {bind}; a step needs at least {min_replicas} replica group(s); a "
          f"group is gone {heartbeat_timeout_ms} ms after its last heartbeat", flush=True)
    stop.wait()
    server.shutdown()
    return 0
