"""PrefillServer: the engine, one KV sender (one connection per decode worker), gRPC."""

from __future__ import annotations

import grpc

from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.config import PrefillConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache import KVAllocator
from tandem.kv_transfer import KVSender, make_sender
from tandem.prefill_worker.service import PrefillService
from tandem.security.cluster import ClusterCredentials
from tandem.worker.server import WorkerServer


class PrefillServer(WorkerServer):
    role = "prefill"
    service_name = "tandem.v1.PrefillWorker"
    role_proto = worker_pb2.ROLE_PREFILL

    def __init__(
        self,
        config: PrefillConfig,
        engine: LLMEngine | None = None,
        credentials: ClusterCredentials | None = None,
    ) -> None:
        super().__init__(config, engine, credentials)
        self.config: PrefillConfig = config
        self.sender: KVSender | None = None
        self.service = PrefillService(self)

    @property
    def kv_address(self) -> str:
        return ""

    def _kv_allocator(self) -> KVAllocator | None:
        if self.config.kv_backend != "ucx":
            return None
        # Decode workers on this host map the cache and copy blocks straight out of it.
        from tandem.kv_transfer.ucx.rma import allocate_kv

        return allocate_kv

    def _add_servicer(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.service, server)

    def _open_transfer(self) -> None:
        options = {"metrics": self.transfer_metrics, "secret": self.kv_secret}
        if self.config.kv_backend != "inproc":
            options["ack_timeout_s"] = self.config.kv_ack_timeout_s
            options["connect_timeout_s"] = self.config.kv_connect_timeout_s
        engine = self.engine
        self.sender = make_sender(
            self.config.kv_backend, engine.kv.tensor, engine.kv_fingerprint(), **options
        )
        if self.config.kv_layerwise:
            engine.on_prefill_layer = self.service.ship_layer
        self.loop.add_step_hook(self.service.ship_rest)

    def _close_transfer(self) -> None:
        self.engine.on_prefill_layer = None
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def _abort_all(self, engine: LLMEngine) -> None:
        self.service.end_all(engine)


async def serve_prefill(config: PrefillConfig, engine: LLMEngine | None = None) -> PrefillServer:
    """Start a prefill worker in this event loop; stop it with ``await server.stop()``."""
    server = PrefillServer(config, engine)
    await server.start()
    return server
