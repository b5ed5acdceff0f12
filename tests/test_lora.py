"""LoRA adapters (#41): PEFT folders read with safetensors and checked against the model
(``tokenwire_server.adapters``), applied per row in the batched engine's native pass
(``engine/lora.py``): exact against PEFT's unmerged model, batch-invariant across adapters, and
never sharing prefix-cache blocks between adapters."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import Recorder, kernel_choices, make_adapter, run_all
from tokenwire_server.adapters import AdapterError, read_adapter
from tokenwire_server.config import parse_lora_flag
from tokenwire_server.domain import FinishEvent, GenerationRequest, NotSupported, SamplingOptions, UnknownAdapter
from tokenwire_server.engine import create_engine, lora
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import load_model

KERNELS = kernel_choices()
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn8": make_adapter(tiny_model_dir, root / "attn8", 8, ATTENTION, seed=1),
        "mlp16": make_adapter(tiny_model_dir, root / "mlp16", 16, MLP, seed=2),
        "all8": make_adapter(tiny_model_dir, root / "all8", 8, ATTENTION + MLP, seed=3),
    }


def engine_with(loaded: Any, adapters: dict[str, Path], **options: Any) -> Any:
    engine = create_engine("batched", loaded, EngineLimits(16, 32, 16 * 1024), **options)
    for name, folder in adapters.items():
        engine.add_adapter(read_adapter(name, folder, loaded.model.config, 64))
    engine.start()
    return engine


def prompts_of(tokenizer: Any) -> list[list[int]]:
    texts = ["Once upon a time", "The weather today is", "Hello there", "List three colors:", "A haiku:", "Why?"]
    return [tokenizer(text)["input_ids"] for text in texts]


def request(rid: str, prompt: list[int], tokens: int, adapter: str = "", sampling: Any = None) -> GenerationRequest:
    return GenerationRequest(
        rid, list(prompt), sampling or SamplingOptions(temperature=0.0), tokens,
        min_new_tokens=tokens, want_tokens=True, adapter=adapter,
    )  # fmt: skip


@pytest.mark.parametrize("kernels", KERNELS)
def test_greedy_tokens_with_an_adapter_are_peft_unmerged_models(
    tiny_model_dir: Path, adapters: dict[str, Path], kernels: str
) -> None:
    """Each adapter (rank 8 and 16; attention, MLP, both) gives the greedy tokens PEFT's
    unmerged model gives in-process; without one, the base model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    prompts = prompts_of(loaded.tokenizer)[:3]
    engine = engine_with(loaded, adapters, kernels=kernels)
    try:
        names = ["", *adapters]
        ours = run_all(engine, [request(f"{n}-{i}", p, 16, n) for n in names for i, p in enumerate(prompts)], 120)
    finally:
        engine.close()
    got = {(rec.request.adapter, i % len(prompts)): rec.token_ids for i, rec in enumerate(ours)}
    assert all(isinstance(rec.last, FinishEvent) for rec in ours)
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if name:
            model = PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                    pad_token_id=loaded.pad_token_id,
                )  # fmt: skip
            assert got[(name, i)] == out[0, len(prompt) :].tolist(), (name, i)
    for name in adapters:  # each adapter moves the answers: it is applied
        assert any(got[(name, i)] != got[("", i)] for i in range(len(prompts))), name


@pytest.mark.parametrize("gemm", ["auto", "onednn", "int8"])
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_batch_over_three_adapters_and_none_gives_each_row_its_tokens_alone(
    tiny_model_dir: Path, adapters: dict[str, Path], kernels: str, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve rows, greedy and seeded, spread over three adapters and the base model: each gets
    in the batch the tokens it gets alone. With the compiled ops, on both GEMMs: the panels
    (AVX-512F) take the adapters in the GEMM's own call (``panel_linear_lora``), oneDNN's (an
    AVX2 host, here forced) one ``lora_add_`` after it; and over int8 weights (the 8-bit panels
    where the CPU runs them, also in ``panel_linear_lora``)."""
    from tokenwire_server.engine import native

    if gemm == "onednn":
        if kernels != "compiled":
            pytest.skip("stock torch ops run oneDNN's GEMM already")
        monkeypatch.setattr(native, "panel_library", lambda: None)
    loaded = load_model(str(tiny_model_dir), dtype="float32", quantization="int8" if gemm == "int8" else "none")
    prompts = prompts_of(loaded.tokenizer)
    names = ["", *adapters]
    kinds = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.9, top_p=0.95, seed=7)]
    requests = [
        request(f"r{i}", prompts[i % len(prompts)], 12 + i % 3 * 4, names[i % 4], kinds[i // 4 % 2]) for i in range(12)
    ]
    engine = engine_with(loaded, adapters, kernels=kernels)
    # The compiled ops apply adapters in one lora_add_ per site, stock torch ops as masked GEMMs.
    way = lora.RowSite if kernels == "compiled" else lora.Site
    assert all(isinstance(site, way) for adapter in engine.adapters() for site in adapter.sites.values())
    pass_gemm = engine.runner.native.gemm
    if gemm == "int8":
        assert pass_gemm == "int8"
    else:
        assert pass_gemm == (
            "panels" if kernels == "compiled" and gemm == "auto" and native.panel_library() else "onednn"
        )
    try:
        alone = [run_all(engine, [req], 120)[0] for req in requests]
        together = run_all(engine, requests, 120)
    finally:
        engine.close()
    for req, a, t in zip(requests, alone, together, strict=True):
        assert isinstance(t.last, FinishEvent), t.last
        assert t.token_ids == a.token_ids, (req.adapter, req.sampling)
        assert len(t.token_ids) == req.max_new_tokens


def test_two_adapters_over_one_prompt_never_share_kv_blocks(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    """The prefix cache keys blocks by adapter: the same 64-token prompt finds its blocks cached
    under its own adapter, never under another's or the base model's."""
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    prompt = list(range(100, 164))
    engine = engine_with(loaded, adapters, prefix_cache=True)
    try:
        cached = {}
        for step, name in enumerate(["", "attn8", "mlp16", "attn8", "", "mlp16"]):
            [rec] = run_all(engine, [request(f"s{step}", prompt, 4, name)], 60)
            cached[step] = rec.last.usage.cached_prompt_tokens
    finally:
        engine.close()
    assert [cached[s] for s in range(3)] == [0, 0, 0]  # first read under each: nothing shared
    assert [cached[s] for s in range(3, 6)] == [48, 48, 48]  # again under each: its own 3 full blocks


def test_an_unknown_adapter_is_refused_at_submit(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    engine = engine_with(loaded, {"attn8": adapters["attn8"]})
    try:
        with pytest.raises(UnknownAdapter, match=r"adapter 'nope' is not loaded here \(loaded: attn8"):
            engine.submit(request("u", [1, 2, 3], 4, "nope"), Recorder())
    finally:
        engine.close()
    simple = create_engine("simple", loaded, EngineLimits(2, 2, 2048))
    with pytest.raises(NotSupported, match="simple engine does not apply LoRA adapters"):
        simple.submit(request("s", [1, 2, 3], 4, "attn8"), Recorder())


def test_rank_over_the_limit_is_refused(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    with pytest.raises(AdapterError, match=r"adapter_config.json: rank 16 is over --max-lora-rank 8"):
        read_adapter("m", adapters["mlp16"], loaded.model.config, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("wrong-shape", r"q_proj.lora_A.weight' is \(8, 32\), the model's q_proj with rank 8 takes \(8, 64\)"),
        ("dora", r"use_dora = True is not applied"),
        ("not-lora", r"peft_type 'PREFIX_TUNING'; only LORA"),
        ("no-config", r"adapter_config.json: no such file"),
        ("bin-weights", r"adapter_model.safetensors: no such file"),
        ("unknown-target", r"target_modules \['lm_head'\] are not projections"),
    ],
)
def test_a_folder_that_is_not_a_matching_adapter_names_the_file_and_why(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path, change: str, message: str
) -> None:
    from transformers import AutoConfig

    folder = tmp_path / "adapter"
    if change == "wrong-shape":  # made for a model of another width
        from safetensors.torch import load_file, save_file

        shutil.copytree(adapters["attn8"], folder)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        tensors = {
            k: torch.zeros(8, 32) if k.endswith("0.self_attn.q_proj.lora_A.weight") else v for k, v in tensors.items()
        }
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    else:
        shutil.copytree(adapters["attn8"], folder)
        settings = json.loads((folder / "adapter_config.json").read_text())
        if change == "dora":
            settings["use_dora"] = True
        elif change == "not-lora":
            settings["peft_type"] = "PREFIX_TUNING"
        elif change == "unknown-target":
            settings["target_modules"] = ["q_proj", "lm_head"]
        (folder / "adapter_config.json").write_text(json.dumps(settings))
        if change == "no-config":
            (folder / "adapter_config.json").unlink()
        if change == "bin-weights":
            (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match=message):
        read_adapter("x", folder, AutoConfig.from_pretrained(tiny_model_dir), 64)


@pytest.mark.parametrize(
    ("value", "message"),
    [("a", "expected NAME=PATH"), ("=p", "expected NAME=PATH"), ("a b=p", "a name is"), ("-x=p", "a name is")],
)
def test_the_lora_flag_is_name_equals_path(value: str, message: str) -> None:
    assert parse_lora_flag("sql-v2=/adapters/sql") == ("sql-v2", "/adapters/sql")
    with pytest.raises(ValueError, match=message):
        parse_lora_flag(value)


@pytest.mark.parametrize("sampling", [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.9, seed=11)])
def test_a_resumed_adapter_stream_continues_exactly(
    tiny_model_dir: Path, adapters: dict[str, Path], sampling: SamplingOptions
) -> None:
    """A stream cut after 9 tokens and resumed (on a fresh engine: another replica) with its
    adapter gives the tokens the uncut stream gave."""
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    prompt = prompts_of(loaded.tokenizer)[0]
    engine = engine_with(loaded, adapters)
    try:
        [whole] = run_all(engine, [request("w", prompt, 24, "all8", sampling)], 60)
    finally:
        engine.close()
    cut = whole.token_ids[:9]
    fresh = engine_with(loaded, adapters)
    try:
        resumed = dataclasses.replace(request("r", prompt, 24, "all8", sampling), resume_ids=tuple(cut))
        [rest] = run_all(fresh, [resumed], 60)
    finally:
        fresh.close()
    assert cut + rest.token_ids == whole.token_ids


def run_server(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tokenwire_server", "--port", "0", "--host", "127.0.0.1", "--log-format", "text"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=180)


def test_a_server_serves_its_adapters_and_refuses_an_unknown_one(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """``--lora`` at start: ModelInfo lists the adapters and the limits, a call with an adapter
    gets the engine's tokens for it, and a name not loaded is NOT_FOUND naming it, before any chunk."""
    import grpc
    from servers import ServerProcess
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc

    loaded = load_model(str(tiny_model_dir), dtype="float32")
    prompt = prompts_of(loaded.tokenizer)[1]
    engine = engine_with(loaded, {"mlp16": adapters["mlp16"]})
    try:
        [expected] = run_all(engine, [request("e", prompt, 12, "mlp16")], 60)
    finally:
        engine.close()
    flags = ["--lora", f"mlp16={adapters['mlp16']}", "--lora", f"attn8={adapters['attn8']}", "--max-loras", "4"]
    with ServerProcess(["--model", str(tiny_model_dir), "--dtype", "float32", *flags]) as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = generation_pb2_grpc.TextGenerationStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert [(a.name, a.rank) for a in info.adapters] == [("attn8", 8), ("mlp16", 16)]
            assert sorted(info.adapters[0].target_modules) == sorted(ATTENTION)
            assert (info.limits.max_loras, info.limits.max_lora_rank) == (4, 64)
            call = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_new_tokens=12, min_new_tokens=12),
                output=pb.OutputOptions(token_ids=True),
                adapter="mlp16",
            )
            chunks = list(stub.Generate(call, timeout=60))
            assert [t.id for c in chunks for t in c.tokens] == expected.token_ids
            call.adapter = "nope"
            received = []
            with pytest.raises(grpc.RpcError) as caught:
                for chunk in stub.Generate(call, timeout=60):
                    received.append(chunk)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert "adapter 'nope' is not loaded here (loaded: attn8, mlp16" in caught.value.details()
            assert received == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "x={missing}"], "--lora x: {missing}/adapter_config.json: no such file"),
        (["--lora", "m={mlp16}", "--max-lora-rank", "8"], "--lora m: {mlp16}/adapter_config.json: rank 16 is over"),
        (["--lora", "m={mlp16}", "--engine", "simple"], "the simple engine does not apply LoRA adapters"),
        (["--lora", "m={mlp16}", "--lora", "m={mlp16}"], "--lora names one adapter twice: ['m']"),
        (["--lora", "a={mlp16}", "--lora", "b={mlp16}", "--max-loras", "1"], "more than --max-loras 1"),
        (["--lora", "m={mlp16}", "--forward", "transformers"], "LoRA adapters run in the native pass"),
        (["--lora", "m={mlp16}", "--engine", "vllm", "--max-lora-rank", "1024"], "vLLM takes ranks up to 512"),
    ],
    ids=["missing", "rank", "simple-engine", "twice", "max-loras", "transformers-forward", "vllm-rank"],
)
def test_an_adapter_the_server_cannot_apply_stops_it_with_status_2(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path, flags: list[str], message: str
) -> None:
    paths = {"missing": str(tmp_path / "missing"), "mlp16": str(adapters["mlp16"])}
    result = run_server("--model", str(tiny_model_dir), *(flag.format(**paths) for flag in flags))
    assert result.returncode == 2, result.stderr[-2000:]
    assert message.format(**paths) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_client_names_the_adapter_and_reads_the_servers_list() -> None:
    from tokenwire.request import build_generate_request
    from tokenwire.results import ModelInfo
    from tokenwire.v1 import generation_pb2 as pb

    assert build_generate_request("hi", options={"adapter": "sql"}).adapter == "sql"
    assert build_generate_request("hi").adapter == ""
    info = pb.ModelInfo(
        adapters=[pb.AdapterInfo(name="sql", rank=8, target_modules=["q_proj"])],
        limits=pb.RequestLimits(max_json_schema_depth=32, max_loras=4, max_lora_rank=64),
    )
    parsed = ModelInfo.from_proto(info)
    assert (parsed.adapters, parsed.max_loras, parsed.max_lora_rank) == ({"sql": 8}, 4, 64)


def test_a_tenant_may_name_only_the_adapters_its_configuration_lists(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """``adapters = ["attn8"]`` in a tenant's table: its calls may name attn8 (and the base
    model), another adapter is PERMISSION_DENIED naming it, before any chunk; a tenant without
    the key may name any loaded adapter."""
    import grpc
    from servers import ServerProcess
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc

    from benchmarks.launcher import tenant_flags

    tenants = '[tenants.team]\nadapters = ["attn8"]\n\n[tenants.platform]\nweight = 1\n'
    flags = tenant_flags(tmp_path, "team-token team\nplatform-token platform\n", tenants)
    loras = ["--lora", f"attn8={adapters['attn8']}", "--lora", f"mlp16={adapters['mlp16']}"]
    with ServerProcess(["--model", str(tiny_model_dir), *flags, *loras]) as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = generation_pb2_grpc.TextGenerationStub(channel)

            def call(token: str, adapter: str) -> list[pb.TokenChunk]:
                request = pb.GenerateRequest(
                    prompt="Hi", adapter=adapter, stopping=pb.StoppingCriteria(max_new_tokens=3)
                )
                return list(stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {token}")]))

            assert call("team-token", "attn8")[-1].usage.completion_tokens == 3
            assert call("team-token", "")[-1].usage.completion_tokens == 3
            assert call("platform-token", "mlp16")[-1].usage.completion_tokens == 3
            with pytest.raises(grpc.RpcError) as caught:
                call("team-token", "mlp16")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert caught.value.details() == "adapter: tenant 'team' may not use adapter 'mlp16' (its adapters: attn8)"


def test_the_adapters_key_must_list_names() -> None:
    from tokenwire_server.tenancy import TenantConfigError, tenants_from_mapping

    policy = tenants_from_mapping({"tenants": {"t": {"adapters": ["a", "b"]}}}).policy("t")
    assert (policy.may_use("a"), policy.may_use("c"), policy.may_use("")) == (True, False, True)
    assert tenants_from_mapping({"tenants": {"u": {"weight": 2}}}).policy("u").may_use("anything")
    with pytest.raises(TenantConfigError, match=r"\[tenants.t\]: adapters must be a list of adapter names"):
        tenants_from_mapping({"tenants": {"t": {"adapters": "a"}}})


def test_unloading_lets_the_streams_in_flight_finish_and_refuses_new_calls(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """remove_adapter with a stream running on the adapter: the stream finishes with it, token
    for token what it gives uncut; a new request naming it is refused; it can be loaded again."""
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    prompt = prompts_of(loaded.tokenizer)[2]
    long = request("long", prompt, 400, "attn8")
    engine = engine_with(loaded, {"attn8": adapters["attn8"]})
    try:
        [reference] = run_all(engine, [long], 120)
        running = Recorder()
        running.request = long
        engine.submit(dataclasses.replace(long, request_id="running"), running)
        deadline = time.monotonic() + 60
        while not running.events and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.remove_adapter("attn8") == 1
        with pytest.raises(UnknownAdapter):
            engine.submit(request("after", prompt, 4, "attn8"), Recorder())
        assert running.done.wait(120) and isinstance(running.last, FinishEvent)
        assert running.token_ids == reference.token_ids
        with pytest.raises(UnknownAdapter):
            engine.remove_adapter("attn8")
        engine.add_adapter(read_adapter("attn8", adapters["attn8"], loaded.model.config, 64))
        [again] = run_all(engine, [long], 120)
        assert again.token_ids == reference.token_ids
    finally:
        engine.close()


@pytest.fixture(scope="module")
def adapter_server(tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server with --lora-dir (adapters attn8 and mlp16 in it, a bad one, a symlink out), and
    tenants: ``admin`` may manage adapters, ``user`` may not."""
    from servers import ServerProcess

    from benchmarks.launcher import tenant_flags

    root = tmp_path_factory.mktemp("lora-server")
    lora_dir = root / "adapters"
    lora_dir.mkdir()
    for name in ("attn8", "mlp16"):
        shutil.copytree(adapters[name], lora_dir / name)
    shutil.copytree(adapters["attn8"], lora_dir / "dora")
    settings = json.loads((lora_dir / "dora" / "adapter_config.json").read_text())
    (lora_dir / "dora" / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    shutil.copytree(adapters["all8"], root / "outside")
    (lora_dir / "escape").symlink_to(root / "outside")
    tenants = "[tenants.admin]\nmanage_adapters = true\n\n[tenants.user]\nweight = 1\n"
    flags = tenant_flags(root, "admin-token admin\nuser-token user\n", tenants)
    args = [
        "--model", str(tiny_model_dir), "--dtype", "float32", *flags, "--lora-dir", str(lora_dir), "--max-loras", "2",
        "--metrics-port", "-1",
    ]  # fmt: skip
    with ServerProcess(args) as server:
        yield server, root


def test_the_adapters_service_loads_lists_serves_and_unloads(
    adapter_server: Any, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    from tokenwire import Client
    from tokenwire.errors import NotFound

    server, _ = adapter_server
    admin = Client(server.target, token="admin-token")
    user = Client(server.target, token="user-token")
    try:
        assert admin.adapters() == {}
        assert admin.load_adapter("sql", "attn8") == 8
        assert admin.adapters() == {"sql": 8} and user.model_info().adapters == {"sql": 8}
        loaded = load_model(str(tiny_model_dir), dtype="float32")
        prompt = prompts_of(loaded.tokenizer)[0]
        engine = engine_with(loaded, {"sql": adapters["attn8"]})  # what --lora-dir's attn8 is a copy of
        try:
            [expected] = run_all(engine, [request("e", prompt, 10, "sql")], 60)
        finally:
            engine.close()
        chunks = list(user.generate(input_ids=prompt, adapter="sql", temperature=0, max_new_tokens=10,
                                    min_new_tokens=10, token_ids=True))  # fmt: skip
        assert [t.id for c in chunks for t in c.tokens] == expected.token_ids
        assert admin.unload_adapter("sql") == 0
        assert admin.adapters() == {} and user.model_info().adapters == {}
        with pytest.raises(NotFound, match="adapter 'sql' is not loaded"):
            list(user.generate(input_ids=prompt, adapter="sql", max_new_tokens=4))
    finally:
        admin.close()
        user.close()
    assert server.wait_for("lora adapter loaded") and server.wait_for("lora adapter unloaded")


@pytest.mark.parametrize(
    ("who", "name", "path", "code", "message"),
    [
        ("user-token", "x", "attn8", "PERMISSION_DENIED", "tenant 'user' may not manage adapters"),
        ("admin-token", "x", "../outside", "PERMISSION_DENIED", "resolves outside the server's --lora-dir"),
        ("admin-token", "x", "escape", "PERMISSION_DENIED", "resolves outside the server's --lora-dir"),
        ("admin-token", "x", "/etc", "PERMISSION_DENIED", "resolves outside the server's --lora-dir"),
        ("admin-token", "x", "dora", "INVALID_ARGUMENT", "use_dora = True is not applied"),
        ("admin-token", "x", "nothing-here", "INVALID_ARGUMENT", "adapter_config.json: no such file"),
        ("admin-token", "bad name", "attn8", "INVALID_ARGUMENT", "an adapter name is 1-64 letters"),
    ],
    ids=["not-a-manager", "dot-dot", "symlink-out", "absolute", "mismatched", "missing", "bad-name"],
)
def test_a_load_the_server_refuses_says_why(
    adapter_server: Any, who: str, name: str, path: str, code: str, message: str
) -> None:
    import grpc
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc

    server, _ = adapter_server
    with grpc.insecure_channel(server.target) as channel:
        stub = generation_pb2_grpc.AdaptersStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.LoadAdapter(
                pb.LoadAdapterRequest(name=name, path=path), timeout=60, metadata=[("authorization", f"Bearer {who}")]
            )
    assert caught.value.code().name == code
    assert message in caught.value.details()
    if path in ("../outside", "escape", "/etc"):
        assert server.wait_for("adapter path outside --lora-dir refused", lambda line: line.get("path") == path)


def test_loading_past_max_loras_is_resource_exhausted_and_twice_already_exists(adapter_server: Any) -> None:
    import grpc
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc

    server, _ = adapter_server
    auth = [("authorization", "Bearer admin-token")]
    with grpc.insecure_channel(server.target) as channel:
        stub = generation_pb2_grpc.AdaptersStub(channel)
        try:
            stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path="attn8"), timeout=60, metadata=auth)
            with pytest.raises(grpc.RpcError) as twice:
                stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path="mlp16"), timeout=60, metadata=auth)
            stub.LoadAdapter(pb.LoadAdapterRequest(name="b", path="mlp16"), timeout=60, metadata=auth)
            with pytest.raises(grpc.RpcError) as full:
                stub.LoadAdapter(pb.LoadAdapterRequest(name="c", path="attn8"), timeout=60, metadata=auth)
        finally:
            for name in ("a", "b"):
                stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=60, metadata=auth)
    assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "adapter 'a' is loaded already" in twice.value.details()
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 adapters are loaded, the server's most (--max-loras 2)" in full.value.details()


def test_the_adapters_service_is_off_without_credentials_unless_the_flag_opens_it(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """No tokens, no mutual TLS: --lora-dir alone leaves the service off (UNIMPLEMENTED, and a
    warning says why); --adapter-service-without-auth opens it to every caller, with a warning,
    and ``tokenwire adapters`` drives it."""
    import grpc
    from servers import ServerProcess
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc

    shutil.copytree(adapters["mlp16"], tmp_path / "mlp16")
    base = ["--model", str(tiny_model_dir), "--lora-dir", str(tmp_path)]
    with ServerProcess(base) as server:
        with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as caught:
            generation_pb2_grpc.AdaptersStub(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        [off] = server.find("adapters service off")
        assert off["why"].startswith("--lora-dir is set but no caller can be told apart")
    with ServerProcess([*base, "--adapter-service-without-auth"]) as server:
        [opened] = server.find("adapters service open to every caller")
        assert opened["why"].startswith("--adapter-service-without-auth: anyone who can reach this port")
        cli = [sys.executable, "-m", "tokenwire.cli", "adapters"]
        common = ["--target", server.target]
        loaded = subprocess.run([*cli, "load", "m", "mlp16", *common], capture_output=True, text=True, timeout=60)
        assert loaded.returncode == 0 and loaded.stdout.strip() == "loaded m (rank 16)", loaded.stderr
        listed = subprocess.run([*cli, "list", *common], capture_output=True, text=True, timeout=60)
        assert listed.stdout.strip() == "m\trank 16"
        gone = subprocess.run([*cli, "unload", "m", *common], capture_output=True, text=True, timeout=60)
        assert gone.stdout.strip() == "unloaded m (0 streams in flight finish with it)"


@pytest.mark.e2e
def test_the_default_model_with_a_peft_adapter_answers_as_peft_does(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A rank-16 PEFT adapter over attention and MLP on the real model: greedy tokens equal PEFT's
    unmerged model's (float32, the native pass on its compiled ops), and differ from the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = make_adapter(
        default_model_dir, tmp_path_factory.mktemp("default-lora") / "a", 16, ATTENTION + MLP, seed=4, scale=1.0
    )
    loaded = load_model(str(default_model_dir), dtype="float32")
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in ("What is the capital of France?", "Name a color.")
    ]
    engine = engine_with(loaded, {"a": folder})
    try:
        ours = run_all(engine, [request(f"{n}{i}", p, 16, n) for n in ("", "a") for i, p in enumerate(prompts)], 120)
    finally:
        engine.close()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32), folder
    )
    model.eval()
    for rec, prompt in zip(ours[2:], prompts, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert rec.token_ids == out[0, len(prompt) :].tolist()
    assert [r.token_ids for r in ours[:2]] != [r.token_ids for r in ours[2:]]


def adapter_series(server: Any, name: str) -> list[str]:
    """The /metrics lines of adapter ``name``."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return [line for line in text.splitlines() if f'adapter="{name}"' in line and not line.startswith("#")]


def test_each_adapters_tokens_and_streams_are_counted_until_it_is_unloaded(adapter_server: Any) -> None:
    """tokenwire_adapter_tokens_total{adapter} counts each adapter's completion tokens, and the
    active-streams gauge comes back to 0 once its calls end. Unloaded, its series go (the label
    values stay bounded by --max-loras however many adapters come and go); unloaded with a
    stream in flight, they go when that stream ends."""
    import grpc
    from tokenwire import Client
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc

    server, _ = adapter_server
    admin = Client(server.target, token="admin-token")
    auth = [("authorization", "Bearer admin-token")]
    try:
        admin.load_adapter("counted", "mlp16")
        for _ in range(2):
            list(admin.generate("Hi", adapter="counted", max_new_tokens=5, ignore_eos=True))
        list(admin.generate("Hi", max_new_tokens=3, ignore_eos=True))
        lines = adapter_series(server, "counted")
        assert 'tokenwire_adapter_tokens_total{adapter="counted"} 10.0' in lines
        assert 'tokenwire_adapter_active_streams{adapter="counted"} 0.0' in lines
        admin.unload_adapter("counted")
        assert adapter_series(server, "counted") == []

        admin.load_adapter("held", "mlp16")
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]  # a reader that stalls
        with grpc.insecure_channel(server.target, options=options) as channel:
            stub = generation_pb2_grpc.TextGenerationStub(channel)
            request = pb.GenerateRequest(
                prompt="Hi", adapter="held", stopping=pb.StoppingCriteria(max_new_tokens=1000, ignore_eos=True),
                output=pb.OutputOptions(token_ids=True, logprobs=True, top_logprobs=5),
            )  # fmt: skip
            held = stub.Generate(request, timeout=60, metadata=auth)
            next(held)
            admin.unload_adapter("held")
            assert 'tokenwire_adapter_active_streams{adapter="held"} 1.0' in adapter_series(server, "held")
            held.cancel()
        deadline = time.monotonic() + 10  # the server sees the cancel a moment later
        while adapter_series(server, "held") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert adapter_series(server, "held") == []
    finally:
        admin.close()


def test_vllm_reserves_lora_slots_for_the_smallest_rank_it_takes_that_holds_max_lora_rank() -> None:
    """``--max-lora-rank`` on --engine vllm: rounded up to one of vLLM's slot ranks (ModelInfo.notes says which)."""
    from tokenwire_server.engine.vllm_backend import VLLM_LORA_RANKS, vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 8, 16, 17, 64, 65, 300, 512)] == [1, 8, 8, 16, 32, 64, 128, 320, 512]
    assert all(vllm_lora_rank(r) == r for r in VLLM_LORA_RANKS)
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora_rank(513)


def test_a_steps_adapters_in_the_one_call_layers_give_the_python_loops_bits(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """Where the pass runs every layer in one compiled call (``decoder_layers``: panels, compiled
    ops), a step's adapters ride in it (each adapted GEMM as ``panel_linear_lora``): the same
    logits, bit for bit, as the Python loop with ``RowAdapters``, for rows of two adapters and
    none, one adapter alone, and a prompt chunk beside decoding rows."""
    from engine_support import fresh_cache, slot_segment
    from tokenwire_server.engine.native import NativeForward, panel_library

    if panel_library() is None:
        pytest.skip("the compiled ops' panels need an x86 CPU with AVX-512F and a C++ compiler")
    model = load_model(str(tiny_model_dir), dtype="float32").model
    passes = []
    for _ in range(2):
        native = NativeForward(model, fresh_cache(model), batch_hint=4, kernel_choice="compiled")
        assert native.fused_layers
        packed = {
            name: lora.pack(read_adapter(name, adapters[name], model.config, 64), native, 4)
            for name in ("all8", "mlp16")
        }
        passes.append((native, packed))
    passes[1][0].fused_layers = False

    def no_loop(*args: object, **kwargs: object) -> None:
        raise AssertionError("the one-call pass ran the Python loop")

    passes[0][0]._layers = no_loop  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(8)
    prompt = torch.randint(10, 200, (12,), generator=generator).tolist()
    steps = [  # (ids, positions, segments, emit, each token's adapter)
        (prompt, list(range(12)), [slot_segment(0, 0, 12)], [11], ["all8"] * 12),
        (prompt[:5], list(range(5)), [slot_segment(1, 0, 5)], [4], ["mlp16"] * 5),
        (prompt[:5], list(range(5)), [slot_segment(2, 0, 5)], [4], [None] * 5),
        (
            [3, 4, 5, *prompt[:4]], [12, 5, 5, *range(4)],
            [slot_segment(0, 12, 1), slot_segment(1, 5, 1), slot_segment(2, 5, 1), slot_segment(3, 0, 4)],
            [0, 1, 2, 6], ["all8", "mlp16", None, *["all8"] * 4],
        ),
    ]  # fmt: skip
    for ids, positions, segments, emit, names in steps:
        logits = []
        for native, packed in passes:
            step = lora.StepAdapters.of([None if n is None else packed[n] for n in names], torch.device("cpu"))
            assert isinstance(step, lora.RowAdapters) or not any(names)
            logits.append(native(torch.tensor(ids), torch.tensor(positions), segments, emit, lora=step))
        assert torch.equal(logits[0], logits[1])
    fused, packed = passes[0]
    base = fused(torch.tensor(prompt), torch.arange(12), [slot_segment(4, 0, 12)], [11])
    adapted = lora.StepAdapters.of([packed["all8"]] * 12, torch.device("cpu"))
    assert not torch.equal(
        base, fused(torch.tensor(prompt), torch.arange(12), [slot_segment(5, 0, 12)], [11], lora=adapted)
    )
