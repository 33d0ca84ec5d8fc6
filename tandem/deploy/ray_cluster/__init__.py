"""Tandem on Ray: the router and the prefill / decode workers as Ray actors.

config.py      what a deployment runs: role configs, per-pool resources, autoscaling
placement.py   Ray options per actor: resources, SPREAD, placement groups, restarts
actors.py      WorkerActor / RouterActor: the existing servers, hosted in an actor process
controller.py  the detached controller actor: pools, membership, drains, restarts, autoscaling
recovery.py    what a restarted controller rebuilds from: its checkpoint, the live actors
head.py        a local Ray head for `tandem ray up` without --address; the state file
launch.py      up / status / scale / down as functions
cli.py         the `tandem ray` subcommands

Ray itself is imported only inside functions that need it (``tandem[ray]`` is optional).
"""
