"""The prefill worker: computes prompts and hands their KV to the decode worker.

A request's path (service.py; engine calls run on the engine thread, see
tandem/engine/loop.py):

    Prefill(request, destination)     parsed and checked (INVALID_ARGUMENT, nothing taken)
      engine.add_request(prefill_only)  WAITING in the scheduler; every step batches the
                                        waiting prompts under the token budget (long ones
                                        in chunks), alongside other Prefill calls
      first token sampled               the request is HELD: its prompt KV stays in its
                                        blocks (a request continuing after earlier output,
                                        output_token_ids, computes and holds their KV too)
      response 1: first token, text     streamed at once, before any KV moves (TTFT)
        ends the request? (EOS, max_tokens=1)  with finish_reason; no transfer, call over
      sender.send(destination, held blocks, first token)
                                        checksummed on the engine thread, the header sent
                                        over the worker's one connection per peer; the
                                        decode worker reads the blocks out of this worker's
                                        cache, so they stay held until the call ends
      await the decode side's ack       bounded by kv_ack_timeout_s
        DONE                            response 2: bytes and seconds; the call ends OK
        failed / timed out              ABORTED naming the reason (UNAVAILABLE if this
                                        worker's own sender closed: it is stopping)
      always, last                      transfer aborted if unfinished, engine.abort(id)
                                        frees blocks still held (also on cancel/deadline)

server.py   PrefillServer: engine + KV sender + gRPC server
__main__    ``python -m tandem.prefill_worker``
"""

from tandem.prefill_worker.server import PrefillServer, serve_prefill

__all__ = ["PrefillServer", "serve_prefill"]
