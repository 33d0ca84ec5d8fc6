"""The router: Tandem's public gRPC entry point.

A request's path through the modules:
- ``public_port`` TLS and the exposure rule of the public port, read at start-up;
- ``auth``      API keys: the keys file, the interceptor (UNAUTHENTICATED), the caller's key;
- ``service``   the ``tandem.v1.Tandem`` servicer: the gRPC edge;
- ``limits``    input limits checked before tokenizing (INVALID_ARGUMENT);
- ``frontend``  validation, chat template and tokenization (tokenizer only, no weights,
  in a small thread pool off the event loop);
- ``admission`` the bounds on requests in flight, per API key and for the router, and
  each key's rate (RESOURCE_EXHAUSTED beyond them);
- ``relay``     opens Decode, calls Prefill, relays first token then the decode stream;
- ``placement`` which worker of a pool (least-loaded, round-robin, prefix-aware);
- ``registry``  worker membership, Status polling, health, load counts;
- ``server``    ``Router``: the gRPC server with health and reflection;
- ``__main__``  ``python -m tandem.router``.
"""

from tandem.router.placement import Pool
from tandem.router.server import Router

__all__ = ["Pool", "Router"]
