"""UCX backend (ucxx): shared memory / TCP on one host, CUDA-IPC / RDMA on GPU clusters.

runtime.py   one asyncio loop thread per process that owns ucxx
wire.py      what travels on a connection, in order
mailbox.py   same-host control: frames and acks through rings in shared memory
receiver.py  listener; per-connection reader: stage, deliver, ack
sender.py    one connection per peer; per-connection writer and ack reader
"""
