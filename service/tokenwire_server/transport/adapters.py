"""The Adapters service: LoRA adapters loaded and unloaded while the server runs.

Registered only with ``--lora-dir``. A caller may use it when its tenant's configuration says
``manage_adapters = true``, or, on a server without credentials, when the operator started it
with ``--adapter-service-without-auth``. A LoadAdapter path resolves inside ``--lora-dir``
(symlinks followed); one that lands anywhere else is PERMISSION_DENIED and logged. The
reading and packing run off the event loop; each change refreshes what ModelInfo lists.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import FieldViolation

from ..backend import AdapterHost
from ..domain import ADAPTER_NAME, AdapterDescription, NotSupported
from .calls import Call, check_decoded, lenient, register
from .status import RpcFailure, invalid_argument

if TYPE_CHECKING:
    from .calls import Context
    from .servicer import TextGenerationServicer

log = logging.getLogger("tokenwire.adapters")

SERVICE_NAME = "tokenwire.v1.Adapters"


def info(adapter: AdapterDescription) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=adapter.name, rank=adapter.rank, target_modules=list(adapter.modules))


def inside(root: Path, path: str) -> Path | None:
    """``path`` (relative to ``root``, or absolute) resolved, symlinks followed; None when it
    lands outside ``root``."""
    resolved = (root / path).resolve()
    return resolved if resolved.is_relative_to(root.resolve()) else None


class AdaptersServicer:
    def __init__(self, text: TextGenerationServicer, lora_dir: Path, *, open_to_all: bool = False) -> None:
        self._text = text
        self._root = lora_dir
        self._open_to_all = open_to_all

    def add_to_server(self, server: grpc.aio.Server) -> None:
        calls = self._text.calls
        handlers = {
            "ListAdapters": grpc.unary_unary_rpc_method_handler(
                calls.unary("ListAdapters", self._list),
                request_deserializer=lenient(pb.ListAdaptersRequest),
                response_serializer=pb.ListAdaptersResponse.SerializeToString,
            ),
            "LoadAdapter": grpc.unary_unary_rpc_method_handler(
                calls.unary("LoadAdapter", self._load),
                request_deserializer=lenient(pb.LoadAdapterRequest),
                response_serializer=pb.AdapterInfo.SerializeToString,
            ),
            "UnloadAdapter": grpc.unary_unary_rpc_method_handler(
                calls.unary("UnloadAdapter", self._unload),
                request_deserializer=lenient(pb.UnloadAdapterRequest),
                response_serializer=pb.UnloadAdapterResponse.SerializeToString,
            ),
        }
        register(server, SERVICE_NAME, handlers)

    def _host(self, context: Context, call: Call) -> AdapterHost:
        """The backend, once the caller may manage adapters (PERMISSION_DENIED otherwise)."""
        tenant = call.tenant = self._text.tenant_of(context)
        if not self._open_to_all and not self._text.tenants.policy(tenant).manage_adapters:
            raise RpcFailure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant!r} may not manage adapters (its configuration's manage_adapters is not true)",
            )
        backend, _ = self._text.serving()
        if not isinstance(backend, AdapterHost):
            raise NotSupported("this engine does not load LoRA adapters; serve them with --engine batched or vllm")
        return backend

    async def _list(self, request: pb.ListAdaptersRequest, context: Context, call: Call) -> pb.ListAdaptersResponse:
        check_decoded(request)
        self._host(context, call)
        _, description = self._text.serving()
        return pb.ListAdaptersResponse(adapters=[info(a) for a in description.adapters])

    async def _load(self, request: pb.LoadAdapterRequest, context: Context, call: Call) -> pb.AdapterInfo:
        check_decoded(request)
        host = self._host(context, call)
        if not re.fullmatch(ADAPTER_NAME, request.name):
            why = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            raise invalid_argument([FieldViolation("name", f"an adapter name is {why}")])
        if not request.path or "\0" in request.path:
            raise invalid_argument(
                [FieldViolation("path", "the adapter's folder, relative to the server's --lora-dir")]
            )
        call.fields.update(adapter=request.name)
        folder = inside(self._root, request.path)
        if folder is None:
            log.warning(
                "adapter path outside --lora-dir refused",
                extra={"tenant": call.tenant, "adapter": request.name, "path": request.path[:512]},
            )
            raise RpcFailure(
                grpc.StatusCode.PERMISSION_DENIED,
                f"path: {request.path[:256]!r} resolves outside the server's --lora-dir; adapters load from inside it",
            )
        loaded = await asyncio.get_running_loop().run_in_executor(None, host.load_adapter, request.name, folder)
        self._text.refresh()
        log.info(
            "lora adapter loaded",
            extra={"adapter": loaded.name, "path": str(folder), "rank": loaded.rank, "tenant": call.tenant},
        )
        return info(loaded)

    async def _unload(self, request: pb.UnloadAdapterRequest, context: Context, call: Call) -> pb.UnloadAdapterResponse:
        check_decoded(request)
        host = self._host(context, call)
        call.fields.update(adapter=request.name[:64])
        running = host.unload_adapter(request.name)
        self._text.refresh()
        log.info("lora adapter unloaded", extra={"adapter": request.name, "streams_in_flight": running})
        return pb.UnloadAdapterResponse(streams_in_flight=running)
