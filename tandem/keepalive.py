"""gRPC keepalive: how a hop notices a peer that went silent without closing its socket.

A worker whose host loses power or network, or whose process is frozen, sends no
TCP reset: without keepalive the router would wait on its streams until each
request's deadline. The router pings every worker it has a call open to; a ping
unanswered within the timeout fails the channel's calls with UNAVAILABLE, which
ends the request with UNAVAILABLE and frees its blocks elsewhere.

Servers accept pings at any rate (gRPC's default answers frequent pings with
GOAWAY "too_many_pings", which would turn keepalive into a connection killer).
"""

from __future__ import annotations

# A server stopping, once its calls have drained: how long what is left (health
# watches, which never end by themselves; a last reply on its way) gets before it is
# cut. gRPC's own graceful stop waited the whole grace for a watch.
LAST_REPLIES_S = 0.5
# The longest ping interval or timeout: gRPC takes them in int32 milliseconds (a longer
# one, or inf, fails the channel's creation with OverflowError).
MAX_KEEPALIVE_S = 2**31 // 1000

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


def channel_options(keepalive_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Options for a channel that pings its server every ``keepalive_s`` while calls are open."""
    return [
        ("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000))),
        ("grpc.keepalive_timeout_ms", max(1, round(timeout_s * 1000))),
        # What gRPC >= 1.6x actually waits for a ping's ack (default: a minute); without
        # it the keepalive timeout above is not enforced.
        ("grpc.http2.ping_timeout_ms", max(1, round(timeout_s * 1000))),
        # Keep pinging a stream that carries no data (a frozen worker sends none).
        ("grpc.http2.max_pings_without_data", 0),
    ]
