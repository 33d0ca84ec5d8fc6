"""What the prefill and decode worker processes share.

request.py   a WorkerRequest off the wire, checked before any KV block is taken
server.py    the gRPC server around an engine: health, Status, start and drain
main.py      the process entry: flags and YAML onto the role config, READY line, signals
"""

# A worker process's exit codes when it ends itself (server.py says when), for
# launchers to report: the router treats each as that worker's death.
EXIT_RANK_LOST = 3  # one of its tensor-parallel ranks died
EXIT_ENGINE_STALLED = 4  # its engine was stuck in one step (the watchdog)
EXIT_DEVICE_FAULT = 5  # a step failed in the device's runtime, and the device since
EXIT_REASONS = {
    EXIT_RANK_LOST: "a tensor-parallel rank died",
    EXIT_ENGINE_STALLED: "its engine hung",
    EXIT_DEVICE_FAULT: "its device failed",
}
