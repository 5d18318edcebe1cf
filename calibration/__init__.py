"""Measures this machine once (loopback gRPC between workers, the Redis offload store, the
runtime's overheads, its cores when oversubscribed) and caches it as the cluster
description of `pipefb local`: `calibration.cluster.local_cluster`, or
`python -m calibration [--workers N] [--refresh] [--out FILE]`.

One module per probe (`links`, `store`, `overheads`, `crowding` with its worker process
`crowd`), the CPU meter they share (`cpu`), the line through their times (`fit`), the
cache (`cache`), and `cluster`, which runs them and builds the cluster. The package
imports nothing here, so `python -m calibration.crowd` starts with torch and the model only.
"""
