"""DecodeServer: the engine, the KV receiver and its admission hook, gRPC."""

from __future__ import annotations

import grpc

from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.config import DecodeConfig
from tandem.decode_worker.admission import KvAdmission
from tandem.decode_worker.service import DecodeService
from tandem.engine.engine import LLMEngine
from tandem.errors import ConfigError, TandemError
from tandem.kv_transfer import KVReceiver, make_receiver
from tandem.security.cluster import ClusterCredentials
from tandem.worker.server import WorkerServer


class DecodeServer(WorkerServer):
    role = "decode"
    service_name = "tandem.v1.DecodeWorker"
    role_proto = worker_pb2.ROLE_DECODE

    def __init__(
        self,
        config: DecodeConfig,
        engine: LLMEngine | None = None,
        credentials: ClusterCredentials | None = None,
    ) -> None:
        super().__init__(config, engine, credentials)
        self.config: DecodeConfig = config
        self.receiver: KVReceiver | None = None
        self.admission: KvAdmission | None = None
        self.service = DecodeService(self)

    @property
    def kv_address(self) -> str:
        return self.receiver.address if self.receiver is not None else ""

    def _add_servicer(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self.service, server)

    def _open_transfer(self) -> None:
        cfg, engine = self.config, self.engine
        try:
            self.receiver = make_receiver(
                cfg.kv_backend,
                engine.kv.tensor,
                engine.kv_fingerprint(),
                cfg.host,
                cfg.kv_port,
                metrics=self.transfer_metrics,
                secret=self.kv_secret,
                # The largest reservation a request can need (and so a header may name).
                max_request_blocks=engine.kv.blocks_for(engine.max_model_len),
            )
        except TandemError:
            raise
        except Exception as exc:  # the transport's own errors (UCX: "Device is busy")
            raise ConfigError(f"cannot listen for KV on {cfg.host}:{cfg.kv_port} "
                              f"(host/kv_port): {type(exc).__name__}: {exc}") from exc  # fmt: skip
        self.admission = KvAdmission(self.receiver, cfg.kv_lease_s)
        self.loop.add_hook(self.admission.poll)
        # A transfer's end wakes the engine thread, which admits (or fails) the request.
        self.receiver.notify(self.loop.wake)

    def _close_transfer(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def _waiting_outside_engine(self) -> int:
        return self.admission.num_waiting  # waiting for their KV to arrive

    def _abort_all(self, engine: LLMEngine) -> None:
        self.admission.end_all(engine)


async def serve_decode(config: DecodeConfig, engine: LLMEngine | None = None) -> DecodeServer:
    """Start a decode worker in this event loop; stop it with ``await server.stop()``."""
    server = DecodeServer(config, engine)
    await server.start()
    return server
