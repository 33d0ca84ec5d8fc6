"""The prefill worker: computes prompts and pushes their KV to the decode worker.

A request's path (service.py; engine calls run on the engine thread, see
tandem/engine/loop.py):

    Prefill(request, destination)     parsed and checked (INVALID_ARGUMENT, nothing taken)
      engine.add_request(prefill_only)  WAITING in the scheduler; every step batches the
                                        waiting prompts under the token budget (long ones
                                        in chunks), alongside other Prefill calls
      first token sampled               the request is HELD: its prompt KV stays in its
                                        blocks (a request continuing after earlier output,
                                        output_token_ids, computes and holds their KV too)
        ends the request? (EOS, max_tokens=1)  reply with finish_reason; no transfer
      sender.send(destination, held blocks, first token)
                                        gathered on the engine thread (a consistent copy),
                                        pushed over the worker's one connection per peer
      await the decode side's ack       bounded by kv_ack_timeout_s
        DONE                            reply first token, text, bytes and seconds
        failed / timed out              UNAVAILABLE naming the reason
      always, last                      transfer aborted if unfinished, engine.abort(id)
                                        frees the held blocks (also on cancel/deadline)

server.py   PrefillServer: engine + KV sender + gRPC server
__main__    ``python -m tandem.prefill_worker``
"""

from tandem.prefill_worker.server import PrefillServer, serve_prefill

__all__ = ["PrefillServer", "serve_prefill"]
