"""The router: Tandem's public gRPC entry point.

A request's path through the modules:
- ``service``   the ``tandem.v1.Tandem`` servicer: the gRPC edge;
- ``frontend``  validation, chat template and tokenization (tokenizer only, no weights);
- ``admission`` the bound on requests in flight (RESOURCE_EXHAUSTED beyond it);
- ``relay``     opens Decode, calls Prefill, relays first token then the decode stream;
- ``placement`` which worker of a pool (least-loaded, round-robin);
- ``registry``  worker membership, Status polling, health, load counts;
- ``server``    ``Router``: the gRPC server with health and reflection;
- ``__main__``  ``python -m tandem.router``.
"""

from tandem.router.placement import Pool
from tandem.router.server import Router

__all__ = ["Pool", "Router"]
