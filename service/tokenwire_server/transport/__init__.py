"""Transport: protobuf in, protobuf out. ``servicer`` (the three RPCs), ``conversion``
(pure proto <-> domain functions), ``calls`` (status, metrics and the log line of
every call, in one place) and ``status`` (outcomes -> gRPC status with details).

It holds one ``GenerationBackend`` and never imports torch or transformers.
"""
