"""Tandem on Ray: the router and the prefill / decode workers as Ray actors.

config.py      what a deployment runs: role configs, per-pool resources, autoscaling
placement.py   Ray options per actor: resources, SPREAD, placement groups, restarts
actors.py      WorkerActor / RouterActor: the existing servers, hosted in an actor process
controller.py  the detached controller actor: its remote API; coordinates the modules below
state.py       the actors' names, the controller's record of each worker, failure reports
lifecycle.py   a worker's start (placement, actor, router) and stop (drain, kill)
membership.py  the router's membership kept equal to the serving workers
loops.py       the monitor (stats, restarts, lost workers, top-ups) and autoscaler rounds
status.py      what `tandem ray status` shows
adoption.py    a restarted controller adopts the live router and workers
recovery.py    what a restarted controller rebuilds from: its checkpoint, the live actors
head.py        a local Ray head for `tandem ray up` without --address; the state file
launch.py      up / status / scale / down as functions
cli.py         the `tandem ray` subcommands

Ray itself is imported only inside functions that need it (``tandem[ray]`` is optional).
"""
