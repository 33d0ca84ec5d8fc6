"""What the prefill and decode worker processes share.

request.py   a WorkerRequest off the wire, checked before any KV block is taken
server.py    the gRPC server around an engine: health, Status, start and drain
main.py      the process entry: flags and YAML onto the role config, READY line, signals
"""
