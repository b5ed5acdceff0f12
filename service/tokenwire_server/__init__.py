"""tokenwire_server: serves a causal language model over gRPC (tokenwire.v1.TextGeneration).

Rooms: ``servicer`` (transport), ``engine`` (generation), ``text`` (detokenizing,
stop sequences), ``model`` (loading), ``server``/``config`` (bootstrap).
"""
