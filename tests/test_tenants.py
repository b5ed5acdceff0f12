"""Tenants without a model: the admission queue's fair share, priorities and per-tenant
limits; the tenant configuration and token file; the quota ledger; who a caller is.

The queue is driven the way an engine drives it (``put``, ``take``, ``release``) with the
scheduler tests' fake requests, so every figure here is a count, not a time."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
from test_scheduler import FakeSeq, run_to_end
from tokenwire_server.config import ServerConfig, check_files
from tokenwire_server.domain import DEFAULT_TENANT, EngineOverloaded, Priority, TenantOverLimit
from tokenwire_server.engine.base import AdmissionQueue, EngineLimits
from tokenwire_server.engine.blocks import BLOCK_SIZE, BlockPool
from tokenwire_server.engine.scheduler import Scheduler
from tokenwire_server.security import Identities, read_tokens
from tokenwire_server.tenancy import (
    QUOTA_WINDOW_S,
    QuotaLedger,
    TenantConfigError,
    TenantPolicy,
    Tenants,
    tenants_from_mapping,
)


def queue(*policies: TenantPolicy, max_active: int = 4, max_queue: int = 64) -> AdmissionQueue:
    return AdmissionQueue(EngineLimits(max_active, max_queue, kv_cache_tokens=1 << 20, tenants=Tenants(policies)))


def seq(
    tenant: str = DEFAULT_TENANT,
    priority: Priority = Priority.NORMAL,
    prompt: int = 8,
    new: int = 32,
    name: str = "",
    done: int = 0,
) -> Any:
    """A fake request; ``done``: tokens it has already generated (a resumed stream's, counted as its progress)."""
    return FakeSeq(list(range(1, prompt + 1)), new, name=name, resumed=(7,) * done, tenant=tenant, priority=priority)


def take_one(q: AdmissionQueue) -> Any:
    """The next request the engine admits, as an engine would: only into a free slot."""
    if q.active >= q._limits.max_active:
        return None
    taken = q.dequeue(lambda s: True, block=False, max_count=1)
    return taken[0] if taken else None


def finish(q: AdmissionQueue, s: Any) -> None:
    s.generated = [7] * s.request.max_new_tokens
    q.vacate(s)


def saturate(
    q: AdmissionQueue, make: dict[str, Any], steps: int, backlog: int = 8
) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Keep every tenant of ``make`` backlogged and run ``steps`` engine steps: each step
    fills the free slots from the queue, then every running stream generates one token and
    those that reach their ``max_new_tokens`` leave. (tokens, admissions) per tenant."""
    for tenant, build in make.items():
        for _ in range(backlog):
            q.put(build(tenant))
    running: list[Any] = []
    tokens: collections.Counter[str] = collections.Counter()
    admissions: collections.Counter[str] = collections.Counter()
    for _ in range(steps):
        while (s := take_one(q)) is not None:
            admissions[s.request.tenant] += 1
            running.append(s)
            q.put(make[s.request.tenant](s.request.tenant))  # its tenant stays backlogged
        for s in running:
            s.generated.append(7)
            tokens[s.request.tenant] += 1
        done = [s for s in running if len(s.generated) >= s.request.max_new_tokens]
        running = [s for s in running if s not in done]
        for s in done:
            q.vacate(s)
    return tokens, admissions


# -- fair share --------------------------------------------------------------------


def test_weights_three_to_one_share_the_tokens_three_to_one() -> None:
    q = queue(TenantPolicy("a", weight=3), TenantPolicy("b", weight=1), max_active=8)
    tokens, _ = saturate(q, {"a": seq, "b": seq}, steps=2000)
    assert tokens["a"] / tokens["b"] == pytest.approx(3.0, rel=0.05)


def test_equal_weights_share_by_tokens_not_by_streams() -> None:
    """A tenant whose requests ask for twice the tokens gets half the admissions, and both
    get the same tokens."""
    q = queue(TenantPolicy("long"), TenantPolicy("short"), max_active=8)

    def long(t: str) -> Any:
        return seq(t, prompt=8, new=120)

    def short(t: str) -> Any:
        return seq(t, prompt=8, new=60)

    tokens, admissions = saturate(q, {"long": long, "short": short}, steps=3000)
    assert tokens["short"] / tokens["long"] == pytest.approx(1.0, rel=0.05)
    assert admissions["short"] / admissions["long"] == pytest.approx(2.0, rel=0.1)


def test_a_busy_tenant_does_not_delay_a_newcomer_behind_its_backlog() -> None:
    """A keeps 64 requests waiting; B's one request goes at the next free slot, not after A's 64."""
    q = queue(TenantPolicy("a"), TenantPolicy("b"), max_active=2, max_queue=80)
    for _ in range(64):
        q.put(seq("a"))
    running = [take_one(q), take_one(q)]
    assert take_one(q) is None  # only two slots
    for _ in range(3):  # A alone for a while: its tag runs ahead
        finish(q, running.pop(0))
        running.append(take_one(q))
    q.put(seq("b", name="b1"))
    finish(q, running.pop(0))
    assert take_one(q).request.request_id == "b1"


def test_an_idle_tenant_banks_no_credit() -> None:
    """B idle while A ran 50 requests: when B comes back it alternates with A, it does not take
    the next 50 slots."""
    q = queue(TenantPolicy("a"), TenantPolicy("b"), max_active=1)
    for _ in range(50):
        q.put(seq("a"))
        finish(q, take_one(q))
    for _ in range(10):
        q.put(seq("a"))
        q.put(seq("b"))
    order = []
    for _ in range(10):
        s = take_one(q)
        order.append(s.request.tenant)
        finish(q, s)
    assert order.count("b") <= 6 and order.count("a") >= 4
    # and B is served: at once, then in turn with A (a tenant charged for its idle time would wait)
    assert "b" in order[:2] and order.count("b") >= 4
    assert all(x != y for x, y in zip(order[:-1], order[1:], strict=True)), order


def test_what_a_request_did_not_generate_goes_back_to_its_tenant() -> None:
    """Two tenants ask for 100 tokens each time; A's answers stop after 1 token (EOS), B's run
    to 100. Charged by what they asked, A would get half the slots; refunded, A gets most."""
    q = queue(TenantPolicy("a"), TenantPolicy("b"), max_active=1)
    for _ in range(4):
        q.put(seq("a", new=100))
        q.put(seq("b", new=100))
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(60):
        s = take_one(q)
        counts[s.request.tenant] += 1
        s.generated = [7] if s.request.tenant == "a" else [7] * 100
        q.vacate(s)
        q.put(seq(s.request.tenant, new=100))
    assert counts["a"] > 3 * counts["b"]


# -- priority ----------------------------------------------------------------------


def test_high_goes_before_every_waiting_low_of_any_tenant() -> None:
    q = queue(TenantPolicy("a"), TenantPolicy("b"), max_active=2)
    running = [q.put(seq("a", Priority.LOW)) or take_one(q) for _ in range(2)]
    for i in range(6):
        q.put(seq("a" if i % 2 else "b", Priority.LOW, name=f"low{i}"))
    q.put(seq("b", Priority.HIGH, name="high"))
    finish(q, running.pop())
    assert take_one(q).request.request_id == "high"
    q.put(seq("a", Priority.NORMAL, name="normal"))
    finish(q, running.pop())
    assert take_one(q).request.request_id == "normal"  # normal before low too


def test_within_a_priority_a_tenant_is_served_in_arrival_order() -> None:
    q = queue(max_active=1)
    for i in range(5):
        q.put(seq(name=f"r{i}"))
    names = []
    for _ in range(5):
        s = take_one(q)
        names.append(s.request.request_id)
        finish(q, s)
    assert names == [f"r{i}" for i in range(5)]


def test_a_request_that_does_not_fit_yet_is_not_overtaken_by_a_smaller_one_behind_it() -> None:
    """docs/architecture.md: within its tenant and priority nobody behind it overtakes it.
    The pool cannot promise the first request its blocks yet; the small one queued after it
    (same tenant and priority) would fit, and still waits: a large request is not starved by
    a stream of small ones. Once it fits, it goes first."""
    q = queue(max_active=4)
    for s in (seq(prompt=1000, name="large"), seq(name="small")):
        q.put(s)
    assert q.dequeue(lambda s: s.request.request_id != "large", block=False, max_count=4) == []
    taken = q.dequeue(lambda s: True, block=False, max_count=4)
    assert [s.request.request_id for s in taken] == ["large", "small"]


def test_a_tenant_may_be_capped_below_high() -> None:
    normal = TenantPolicy("batch", max_priority=Priority.NORMAL)
    assert normal.allows(Priority.NORMAL) and normal.allows(Priority.LOW)
    assert not normal.allows(Priority.HIGH)


# -- limits ------------------------------------------------------------------------


def test_a_tenant_at_its_max_active_waits_while_another_is_admitted() -> None:
    q = queue(TenantPolicy("a", max_active=1), TenantPolicy("b"), max_active=4)
    q.put(seq("a"))
    q.put(seq("a", name="a2"))
    q.put(seq("b", name="b1"))
    first = take_one(q)
    assert first.request.tenant == "a"
    assert take_one(q).request.request_id == "b1"
    assert take_one(q) is None  # a2 waits for a's own slot although the server has two free
    finish(q, first)
    assert take_one(q).request.request_id == "a2"


def test_a_tenant_past_its_max_queued_is_refused_naming_the_limit_and_others_are_not() -> None:
    q = queue(TenantPolicy("a", max_queued=2), TenantPolicy("b"))
    q.put(seq("a"))
    q.put(seq("a"))
    with pytest.raises(TenantOverLimit) as refused:
        q.put(seq("a"))
    assert refused.value.limit == "max_queued" and refused.value.subject == "tenant:a"
    q.put(seq("b"))  # b is unaffected


def test_a_full_queue_still_takes_a_tenant_below_its_share() -> None:
    """A fills the whole queue; B, holding nothing, is still queued (its share of max_queue),
    and A's next request is refused. The queue overruns its bound by at most B's share."""
    q = queue(TenantPolicy("a"), TenantPolicy("b"), max_active=1, max_queue=8)
    for _ in range(9):
        q.put(seq("a"))
    with pytest.raises(EngineOverloaded) as refused:
        q.put(seq("a"))
    assert not isinstance(refused.value, TenantOverLimit)
    for _ in range(4):  # b's weighted share of 8 among a and b
        q.put(seq("b"))
    with pytest.raises(EngineOverloaded):
        q.put(seq("b"))
    assert q.queued == 9 + 4


def test_one_tenant_alone_keeps_the_old_bound() -> None:
    q = queue(max_active=1, max_queue=2)
    for _ in range(3):
        q.put(seq())
    with pytest.raises(EngineOverloaded):
        q.put(seq())


def test_per_tenant_loads_are_reported_by_priority() -> None:
    q = queue(TenantPolicy("a"), max_active=1)
    q.put(seq("a", Priority.HIGH))
    q.put(seq("a", Priority.LOW))
    take_one(q)
    loads = {(x.tenant, x.priority): (x.active, x.queued) for x in q.by_tenant()}
    assert loads[("a", "high")] == (1, 0)
    assert loads[("a", "low")] == (0, 1)
    assert loads[("a", "normal")] == (0, 0)


def test_cancelled_and_drained_requests_leave_the_counts_right() -> None:
    q = queue(TenantPolicy("a"), max_active=1)
    gone = seq("a")
    q.put(gone)
    q.put(seq("a", name="kept"))
    gone.handle.cancelled = True
    assert take_one(q).request.request_id == "kept"
    assert q.queued == 0 and q.active == 1
    q.put(seq("a"))
    assert len(q.drain_waiting()) == 1 and q.queued == 0


def test_a_full_queue_drops_cancelled_waiters_before_it_refuses() -> None:
    """The samples of an n-call refused whole are cancelled while they wait; the next caller
    is not refused for the places they hold (the engine would drop them only at its next step)."""
    q = queue(max_active=1, max_queue=2)
    running = take_one(q) if q.put(seq(name="running")) is None else None
    assert running is not None
    samples = [seq(name=f"sample{i}") for i in range(2)]
    for sample in samples:
        q.put(sample)
    with pytest.raises(EngineOverloaded):
        q.put(seq(name="next"))
    for sample in samples:
        sample.handle.cancelled = True
    q.put(seq(name="next"))
    assert q.queued == 1 and all(sample.finished for sample in samples)
    assert take_one(q) is None  # the slot is still the running one's
    finish(q, running)
    assert take_one(q).request.request_id == "next"


# -- configuration -----------------------------------------------------------------


def test_a_tenant_config_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(
        "[tenants.search]\nweight = 3\nmax_active = 8\nmax_queued = 32\ntokens_per_minute = 200000\n"
        '[tenants.batch]\nweight = 1\nmax_priority = "normal"\n'
    )
    config = ServerConfig(tenant_config=str(path))
    assert check_files(config) == []
    from tokenwire_server.tenancy import tenants_of

    tenants = tenants_of(config, ["reporting"])
    assert set(tenants.names) == {"default", "search", "batch", "reporting"}
    search = tenants.policy("search")
    assert (search.weight, search.max_active, search.max_queued, search.tokens_per_minute) == (3.0, 8, 32, 200000)
    assert tenants.policy("batch").max_priority is Priority.NORMAL
    assert tenants.resolve("nobody-configured") == DEFAULT_TENANT
    assert tenants.resolve("reporting") == "reporting"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"tenants": {"a": {"weight": 0}}}, "weight must be a number > 0"),
        ({"tenants": {"a": {"weight": True}}}, "weight must be a number > 0"),
        ({"tenants": {"a": {"max_active": -1}}}, "max_active must be an integer >= 0"),
        ({"tenants": {"a": {"tokens_per_minute": 1.5}}}, "tokens_per_minute must be an integer"),
        ({"tenants": {"a": {"max_priority": "urgent"}}}, "max_priority must be one of"),
        ({"tenants": {"a": {"wieght": 2}}}, "unknown key(s) ['wieght']"),
        ({"tenants": {"a\nb": {}}}, "a tenant name is"),
        ({"tenant": {"a": {}}}, "unknown table(s) ['tenant']"),
        ({"tenants": {}}, "no [tenants.NAME] table"),
    ],
)
def test_a_bad_tenant_config_names_the_tenant_and_key(data: dict[str, Any], says: str) -> None:
    with pytest.raises(TenantConfigError) as bad:
        tenants_from_mapping(data, "t.toml")
    assert says in str(bad.value) and "t.toml" in str(bad.value)


def test_a_bad_tenant_config_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a\n")
    assert "tenants.toml" in check_files(ServerConfig(tenant_config=str(path)))[0]
    assert check_files(ServerConfig(tenant_config=str(tmp_path / "missing.toml")))


def test_the_token_file_maps_tokens_to_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# token tenant\ns3cret-a search\n\ns3cret-b   batch  # the nightly jobs\nold-single-token\n")
    assert read_tokens(str(path)) == {"s3cret-a": "search", "s3cret-b": "batch", "old-single-token": DEFAULT_TENANT}
    path.write_text("a x\na y\n")
    with pytest.raises(ValueError, match=r"tokens:2: this token is listed twice"):
        read_tokens(str(path))
    path.write_text("a b c\n")
    with pytest.raises(ValueError, match="expected 'TOKEN \\[TENANT\\]'"):
        read_tokens(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="is empty"):
        read_tokens(str(path))


class FakeContext:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), common_name: str = "") -> None:
        self._metadata = metadata
        self._auth = {"x509_common_name": [common_name.encode()]} if common_name else {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


def test_a_callers_tenant_comes_from_its_credentials() -> None:
    tenants = Tenants([TenantPolicy("search"), TenantPolicy("tls-client")]).with_names(["batch"])
    who = Identities(tenants, {"tok-a": "search", "tok-b": "batch"})
    assert who.tenant_of(FakeContext((("authorization", "Bearer tok-a"),))) == "search"  # type: ignore[arg-type]
    assert who.tenant_of(FakeContext((("authorization", "Bearer tok-b"),))) == "batch"  # type: ignore[arg-type]
    assert who.tenant_of(FakeContext(common_name="tls-client")) == "tls-client"  # type: ignore[arg-type]
    # the token wins over the certificate; an unknown certificate name is the default tenant
    both = FakeContext((("authorization", "Bearer tok-a"),), common_name="tls-client")
    assert who.tenant_of(both) == "search"  # type: ignore[arg-type]
    assert who.tenant_of(FakeContext(common_name="stranger")) == DEFAULT_TENANT  # type: ignore[arg-type]
    assert who.tenant_of(FakeContext()) == DEFAULT_TENANT  # type: ignore[arg-type]
    # what a request could claim (another metadata key) is never read
    assert who.tenant_of(FakeContext((("x-tenant", "search"),))) == DEFAULT_TENANT  # type: ignore[arg-type]


# -- quota -------------------------------------------------------------------------


def test_the_quota_refuses_a_tenant_past_its_tokens_per_minute_until_the_window_frees() -> None:
    tenants = Tenants([TenantPolicy("a", tokens_per_minute=100), TenantPolicy("b", tokens_per_minute=100)])
    ledger = QuotaLedger(tenants, retry_floor_s=0.5)
    ledger.check("a", now=0.0)
    ledger.charge("a", 60, now=1.0)
    ledger.check("a", now=2.0)
    ledger.charge("a", 50, now=10.0)
    with pytest.raises(TenantOverLimit) as refused:
        ledger.check("a", now=11.0)
    assert refused.value.limit == "tokens_per_minute" and "110 of its 100" in str(refused.value)
    # dropping the first charge (at 1.0) brings it under: retry when it leaves the window
    assert refused.value.retry_after_s == pytest.approx(1.0 + QUOTA_WINDOW_S - 11.0)
    ledger.check("b", now=11.0)  # another tenant at the same moment is served
    ledger.check("a", now=1.0 + QUOTA_WINDOW_S + 0.01)
    assert ledger.used("a", now=1.0 + QUOTA_WINDOW_S + 0.01) == 50


def test_no_quota_means_nothing_is_counted() -> None:
    ledger = QuotaLedger(Tenants())
    ledger.charge(DEFAULT_TENANT, 10**9, now=0.0)
    ledger.check(DEFAULT_TENANT, now=0.0)
    assert ledger.used(DEFAULT_TENANT, now=0.0) == 0


# -- preemption (the batched engine's scheduler) ----------------------------------------


def tenant_scheduler(*policies: TenantPolicy, max_active: int = 4, blocks: int = 64) -> Scheduler:
    limits = EngineLimits(max_active, 64, kv_cache_tokens=blocks * BLOCK_SIZE, tenants=Tenants(policies))
    pool = BlockPool(blocks, BLOCK_SIZE, prefix_cache=True)
    return Scheduler(AdmissionQueue(limits), pool, max_active, 20, span_columns=1e9, batch_window_s=0.0)


def step(s: Scheduler, times: int = 1, token: int = 7) -> None:
    for _ in range(times):
        s.admit()
        plan = s.schedule()
        assert plan is not None
        s.postprocess(plan, [(token, None, (), ())] * len(plan.emitters))


def test_a_newcomer_below_its_share_takes_a_slot_from_the_tenant_above_its_own() -> None:
    """The slot comes from a's least advanced row (``Scheduler.preempt``: it has the least to
    lose). a's running rows stand at different points (resumed streams: 5, 0, 3 and 8 tokens in
    when admitted), and the least advanced is neither the first nor the last admitted, so
    neither the most advanced row nor a row picked by its place in the batch passes for it."""
    s = tenant_scheduler(TenantPolicy("a"), TenantPolicy("b"), max_active=4)
    a_seqs = [seq("a", new=40, name=f"a{i}", done=done) for i, done in enumerate([5, 0, 3, 8, 0, 0])]
    for x in a_seqs:
        s.queue.put(x)
    step(s, 3)
    late = seq("a", new=40, name="a-late")  # admitted last of a's: it has the least to lose
    assert [row.seq.request.request_id for row in s.rows] == ["a0", "a1", "a2", "a3"]
    s.queue.put(seq("b", new=4, name="b0"))
    progress = {row.seq.request.request_id: len(row.seq.generated) for row in s.rows}
    assert progress == {"a0": 8, "a1": 3, "a2": 6, "a3": 11}
    s.admit()
    names = [row.seq.request.request_id for row in s.rows]
    assert "b0" in names and len(names) == 4
    (gone,) = [x for x in a_seqs[:4] if x.request.request_id not in names]
    assert gone.request.request_id == "a1"  # the least advanced gave way
    assert gone.preemptions == 1
    assert len(gone.generated) == progress[gone.request.request_id] == min(progress.values())
    # it waits at the front of a's queue, to read its prompt and tokens again
    assert gone.context_ids == gone.request.prompt_ids + gone.generated
    assert s.queue.victim() is None  # b has nothing more waiting: no more slots change hands
    s.queue.put(late)
    run_to_end(s)
    while s.queue.queued:
        s.admit()
        run_to_end(s)
    for x in [*a_seqs, late]:
        assert len(x.generated) == 40, x.request.request_id  # every stream ran to its end


def test_high_takes_a_low_slot_of_its_own_tenant_but_normal_never_preempts_normal() -> None:
    s = tenant_scheduler(TenantPolicy("a"), max_active=2)
    s.queue.put(seq("a", Priority.LOW, new=40, name="low0"))
    s.queue.put(seq("a", Priority.NORMAL, new=40, name="normal0"))
    step(s, 2)
    s.queue.put(seq("a", Priority.NORMAL, name="normal1"))
    s.admit()
    assert s.queue.victim() is None  # one tenant, no HIGH waiting: nothing is preempted
    assert sorted(row.seq.request.request_id for row in s.rows) == ["low0", "normal0"]
    s.queue.put(seq("a", Priority.HIGH, name="high"))
    s.admit()
    assert sorted(row.seq.request.request_id for row in s.rows) == ["high", "normal0"]


def test_fair_share_never_preempts_a_more_urgent_request() -> None:
    """b's NORMAL newcomer is below its share, but a runs only HIGH: a keeps its slots."""
    s = tenant_scheduler(TenantPolicy("a"), TenantPolicy("b"), max_active=2)
    for i in range(2):
        s.queue.put(seq("a", Priority.HIGH, new=40, name=f"high{i}"))
    step(s, 2)
    s.queue.put(seq("b", Priority.NORMAL, name="b0"))
    s.admit()
    assert s.queue.victim() is None
    assert sorted(row.seq.request.request_id for row in s.rows) == ["high0", "high1"]


# -- the client's side -----------------------------------------------------------------


def test_the_client_sets_a_priority_by_name_and_refuses_an_unknown_one() -> None:
    from tokenwire.errors import InvalidArgument
    from tokenwire.request import build_generate_request
    from tokenwire.v1 import generation_pb2 as pb

    assert build_generate_request("hi", options={"priority": "low"}).priority == pb.PRIORITY_LOW
    assert build_generate_request("hi", options={"priority": "high"}).priority == pb.PRIORITY_HIGH
    assert build_generate_request("hi", options={"priority": "normal"}).priority == pb.PRIORITY_UNSPECIFIED
    with pytest.raises(TypeError, match="priority must be one of high, normal, low"):
        build_generate_request("hi", options={"priority": "urgent"})  # type: ignore[typeddict-item]
    with pytest.raises(InvalidArgument) as bad:
        build_generate_request("hi", options={"priority": 7})
    assert "priority" in str(bad.value)


def test_the_cli_passes_priority() -> None:
    from tokenwire.cli import _options, build_parser

    args = build_parser().parse_args(["generate", "--target", "localhost:1", "--priority", "low", "hello"])
    assert _options(args)["priority"] == "low"


def test_deadline_aware_admission_sees_fair_share_not_the_whole_queue() -> None:
    """The check before queuing learns how many go first: behind A's 64 queued requests a
    newcomer of B is next (it preempts: None), and with B's own 3 waiting, those 3 and
    about as many of A's; in one tenant, the whole queue."""
    seen: list[int | None] = []
    q = queue(TenantPolicy("a"), TenantPolicy("b"), max_active=4, max_queue=80)
    for _ in range(68):
        q.put(seq("a"))
    for _ in range(4):
        take_one(q)
    q.put(seq("b"), check=seen.append)
    assert seen == [None]
    for _ in range(2):  # b's first still waits: the test runs no engine to preempt for it
        q.put(seq("b"))
    q.put(seq("b"), check=seen.append)
    assert seen[-1] == 3 + 4  # b's 3 waiting, and a's turns while they go
    alone = queue(max_active=4, max_queue=80)
    for _ in range(68):
        alone.put(seq())
    for _ in range(4):
        take_one(alone)
    alone.put(seq(), check=seen.append)
    assert seen[-1] == 64


def test_a_newcomer_keeps_preempting_up_to_its_share_and_no_further() -> None:
    """B's second request arrives while its first still runs: it too takes a slot at once
    (B holds 1 of its 2), and the third waits (B holds its share). Without a refund of the
    preempted requests' charge, A's tag stays behind B's, which would hand A the slot."""
    s = tenant_scheduler(TenantPolicy("a"), TenantPolicy("b"), max_active=4)
    for i in range(10):
        s.queue.put(seq("a", new=40, name=f"a{i}"))
    step(s, 3)
    for i in range(3):
        s.queue.put(seq("b", new=40, name=f"b{i}"))
        s.admit()
        step(s)
    names = sorted(row.seq.request.request_id for row in s.rows)
    assert [n for n in names if n.startswith("b")] == ["b0", "b1"]
    assert s.queue.victim() is None
    assert sum(row.seq.request.tenant == "a" for row in s.rows) == 2


def test_a_call_that_preempted_has_its_prompt_read_alone_in_the_next_step() -> None:
    """Its first token waits for one light step, not a whole batch's; then everyone decodes."""
    s = tenant_scheduler(TenantPolicy("a"), TenantPolicy("b"), max_active=4)
    for i in range(6):
        s.queue.put(seq("a", new=40, name=f"a{i}"))
    step(s, 3)
    s.queue.put(seq("b", prompt=12, new=8, name="b0"))
    s.admit()
    plan = s.schedule()
    assert plan is not None
    assert [(p.row.seq.request.request_id, p.count, p.decodes) for p in plan.parts] == [("b0", 12, False)]
    s.postprocess(plan, [(7, None, (), ())])
    plan = s.schedule()
    assert plan is not None and len(plan.parts) == 4 and all(p.decodes for p in plan.parts)
    # the preempted row, admitted again later, is read with the others as usual (not alone)
    assert not any(row.urgent for row in s.rows)
