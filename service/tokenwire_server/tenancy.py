"""Tenants: who shares the server, by what weight, within which limits. Plain Python.

A call's tenant comes from its credentials (``security``: the bearer token's line in
``--auth-token-file``, or a mutual-TLS client certificate's common name), never from
what the request says. ``--tenant-config FILE`` (TOML) gives each tenant:

- ``weight``: its share of the slots when several tenants wait (the admission queue's
  weighted fair queuing, ``engine.base.AdmissionQueue``);
- ``max_active`` / ``max_queued``: the most streams it may run / have waiting at once
  (0: only the server's own limits);
- ``tokens_per_minute``: prompt + completion tokens over the last 60 s (0: none);
- ``max_priority``: the highest ``GenerateRequest.priority`` it may ask for;
- ``adapters``: the LoRA adapters it may name in ``GenerateRequest.adapter`` (unset: any
  the server has loaded; ``[]``: none); another is PERMISSION_DENIED naming it;
- ``manage_adapters``: whether it may call the Adapters service (load and unload adapters).

A name not in the configuration (a certificate nobody configured) is served as the
``default`` tenant, so metric label values stay bounded by the configuration.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .domain import DEFAULT_TENANT, Priority, TenantOverLimit

if TYPE_CHECKING:
    from .config import ServerConfig

QUOTA_WINDOW_S = 60.0
PRIORITY_NAMES = {p.label: p for p in Priority}


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    name: str
    weight: float = 1.0
    max_active: int = 0  # 0: the server's --max-active
    max_queued: int = 0  # 0: the server's --max-queue
    tokens_per_minute: int = 0  # 0: no quota
    max_priority: Priority = Priority.HIGH
    adapters: tuple[str, ...] | None = None  # None: any loaded adapter
    manage_adapters: bool = False  # may call the Adapters service

    def allows(self, priority: Priority) -> bool:
        return priority >= self.max_priority  # a lower value is more urgent

    def may_use(self, adapter: str) -> bool:
        """Whether calls of this tenant may name LoRA ``adapter`` (empty: the base model, always)."""
        return not adapter or self.adapters is None or adapter in self.adapters


class TenantConfigError(ValueError):
    """A tenant configuration that cannot be used; the message names the file, tenant and key."""


class Tenants:
    """The tenants the server knows, each with its policy; ``default`` is always one."""

    def __init__(self, policies: Iterable[TenantPolicy] = ()) -> None:
        self._policies: dict[str, TenantPolicy] = {DEFAULT_TENANT: TenantPolicy(DEFAULT_TENANT)}
        for policy in policies:
            self._policies[policy.name] = policy

    def with_names(self, names: Iterable[str]) -> Tenants:
        """These tenants, plus ``names`` (from the token file) under the default policy's limits."""
        base = self._policies[DEFAULT_TENANT]
        extra = [dataclasses.replace(base, name=n) for n in names if n not in self._policies]
        return Tenants([*self._policies.values(), *extra])

    def resolve(self, name: str) -> str:
        """The tenant a credential's name is served as: itself when known, else ``default``."""
        return name if name in self._policies else DEFAULT_TENANT

    def policy(self, name: str) -> TenantPolicy:
        return self._policies.get(name) or self._policies[DEFAULT_TENANT]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._policies)

    def __len__(self) -> int:
        return len(self._policies)


_KEYS = {"weight", "max_active", "max_queued", "tokens_per_minute", "max_priority", "adapters", "manage_adapters"}


def load_tenant_config(path: str) -> Tenants:
    """Read ``--tenant-config``: one ``[tenants.NAME]`` table per tenant (see the module doc)."""
    import tomllib  # Python 3.11+; the client alone runs on 3.10

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TenantConfigError(f"--tenant-config {path}: {exc}") from exc
    return tenants_from_mapping(data, path)


def tenants_from_mapping(data: Mapping[str, object], source: str = "tenant config") -> Tenants:
    unknown_top = set(data) - {"tenants"}
    if unknown_top:
        raise TenantConfigError(f"{source}: unknown table(s) {sorted(unknown_top)}; expected [tenants.NAME]")
    tables = data.get("tenants", {})
    if not isinstance(tables, dict) or not tables:
        raise TenantConfigError(f"{source}: no [tenants.NAME] table")
    policies = []
    for name, table in tables.items():
        where = f"{source}: [tenants.{name}]"
        if not name or not name.isprintable() or len(name) > 128:
            raise TenantConfigError(
                f"{where}: a tenant name is 1-128 printable characters "
                "(a certificate's common name may hold spaces: quote it)"
            )
        if not isinstance(table, dict):
            raise TenantConfigError(f"{where}: must be a table")
        unknown = set(table) - _KEYS
        if unknown:
            raise TenantConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected some of {sorted(_KEYS)}")
        weight = table.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            raise TenantConfigError(f"{where}: weight must be a number > 0, got {weight!r}")
        counts = {}
        for key in ("max_active", "max_queued", "tokens_per_minute"):
            value = table.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TenantConfigError(
                    f"{where}: {key} must be an integer >= 0 (0: no limit of its own), got {value!r}"
                )
            counts[key] = value
        priority_name = table.get("max_priority", "high")
        if priority_name not in PRIORITY_NAMES:
            raise TenantConfigError(
                f"{where}: max_priority must be one of {sorted(PRIORITY_NAMES)}, got {priority_name!r}"
            )
        adapters = table.get("adapters")
        if adapters is not None and (
            not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters)
        ):
            raise TenantConfigError(f"{where}: adapters must be a list of adapter names, got {adapters!r}")
        manage = table.get("manage_adapters", False)
        if not isinstance(manage, bool):
            raise TenantConfigError(f"{where}: manage_adapters must be true or false, got {manage!r}")
        policies.append(
            TenantPolicy(
                name,
                float(weight),
                max_priority=PRIORITY_NAMES[str(priority_name)],
                adapters=None if adapters is None else tuple(adapters),
                manage_adapters=manage,
                **counts,
            )
        )
    return Tenants(policies)


def tenants_of(config: ServerConfig, token_tenants: Iterable[str] = ()) -> Tenants:
    """The server's tenants: ``--tenant-config``'s, plus the token file's names (default policy)."""
    tenants = load_tenant_config(config.tenant_config) if config.tenant_config else Tenants()
    return tenants.with_names(token_tenants)


class QuotaLedger:
    """Tokens each tenant used over the last minute, checked at admission, charged as calls end.

    A call in flight is charged when it ends, so a tenant may overrun its quota by what its
    streams in flight produce; its next call is then refused until the window has room.
    """

    def __init__(self, tenants: Tenants, retry_floor_s: float = 0.5) -> None:
        self._tenants = tenants
        self._retry_floor_s = retry_floor_s
        self._used: dict[str, collections.deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def _window(self, tenant: str, now: float) -> collections.deque[tuple[float, int]]:
        entries = self._used.setdefault(tenant, collections.deque())
        while entries and entries[0][0] <= now - QUOTA_WINDOW_S:
            entries.popleft()
        return entries

    def used(self, tenant: str, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            return sum(n for _, n in self._window(tenant, now))

    def check(self, tenant: str, now: float | None = None) -> None:
        """Raise ``TenantOverLimit`` when ``tenant`` has used its tokens for this minute."""
        quota = self._tenants.policy(tenant).tokens_per_minute
        if quota <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            entries = self._window(tenant, now)
            used = sum(n for _, n in entries)
            if used < quota:
                return
            # Retry when enough of the oldest charges leave the window to go below the quota.
            freed, retry_at = used, now
            for at, n in entries:
                freed -= n
                retry_at = at + QUOTA_WINDOW_S
                if freed < quota:
                    break
        raise TenantOverLimit(
            f"tenant {tenant!r} used {used} of its {quota} tokens per minute; retry later",
            max(self._retry_floor_s, retry_at - now),
            tenant,
            "tokens_per_minute",
        )

    def charge(self, tenant: str, tokens: int, now: float | None = None) -> None:
        if tokens <= 0 or self._tenants.policy(tenant).tokens_per_minute <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._window(tenant, now).append((now, tokens))
