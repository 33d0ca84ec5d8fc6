"""Security: TLS credentials, the cluster's own CA, and who may talk to whom.

pki.py      a throw-away cluster CA and the member certificate it signs (cryptography)
tls.py      gRPC server and channel credentials from PEM; the loopback rule
cluster.py  ClusterCredentials: CA, member certificate and key, KV secret, in memory
files.py    secrets written owner-only
"""
