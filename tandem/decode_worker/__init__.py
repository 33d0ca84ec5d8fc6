"""The decode worker: reserves KV blocks, receives the prompt's KV, decodes, streams tokens.

A request's path (service.py and admission.py; engine calls run on the engine
thread, see tandem/engine/loop.py):

    Decode(request)                  parsed and checked (INVALID_ARGUMENT, nothing taken)
      engine.reserve                 blocks for the prompt and reserve_output_tokens more
                                     (past them it grows; out of blocks, the newest
                                     running sequence is preempted and recomputed),
                                     or RESOURCE_EXHAUSTED
      receiver.expect(lease)         the reservation is WAITING for its KV
      -> first response              KvDestination(kv address, request id, block ids, lease)
    every engine iteration, the admission hook polls each waiting reservation:
      DONE (every layer verified)    engine.admit(first token): the request joins the
                                     running batch (seeded sampling needs no state from the
                                     prefill side); its first token's text was streamed by
                                     the prefill worker, not again here
      FAILED (lease expired, checksum, peer lost, aborted)
                                     reservation aborted, blocks freed, ABORTED(reason)
    running                          one TokenChunk per step output; finish_reason and
                                     completion_tokens (counting the first token and any
                                     output_token_ids) on the last; the engine frees the
                                     blocks the moment it ends
    client cancel / deadline / error the stream's clean-up, on the engine thread:
                                     receiver.release (no more writes), engine.abort (free);
                                     a read still running into the blocks is not waited
                                     for there: they are freed at a later poll, once it
                                     has ended (admission.py)

server.py   DecodeServer: engine + KV receiver + gRPC server
__main__    ``python -m tandem.decode_worker``
"""

from tandem.decode_worker.server import DecodeServer, serve_decode

__all__ = ["DecodeServer", "serve_decode"]
