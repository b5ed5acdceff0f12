"""The bundle that takes the GPU check to a bare GPU machine (benchmarks/gpu_bundle.py,
benchmarks/gpu-check.sh --dry-run), checked without the network or a GPU.

- benchmarks/gpu-wheels.txt pins what constraints.txt pins;
- a wheel's tags say whether it installs on the machine's Python;
- ``check`` finds every way a bundle can be wrong: a wheel missing, at another version,
  twice, for another Python, not asked for, over the size limit, no tokenizer;
- ``gpu-check.sh --dry-run`` passes a good bundle and prints its plan, and refuses a bad
  one or an unknown argument before it installs anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_bundle
from benchmarks.gpu_bundle import check, installable, wanted

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_list_pins_what_the_constraints_pin() -> None:
    constraints = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            constraints[gpu_bundle.normalise(name)] = version.strip()
    pins = wanted()
    assert {"grpcio", "grpcio_status", "grpcio_health_checking", "grpcio_reflection", "protobuf"} <= set(pins)
    for name, version in pins.items():
        if name in constraints:
            assert version == constraints[name], (
                f"{name}: gpu-wheels.txt {version}, constraints.txt {constraints[name]}"
            )


@pytest.mark.parametrize(
    ("tags", "python", "ok"),
    [
        (("cp312", "cp312"), "3.12", True),
        (("cp312", "cp312"), "3.11", False),
        (("cp310", "abi3"), "3.12", True),  # protobuf's: any CPython from 3.10 on
        (("cp313", "abi3"), "3.12", False),
        (("py3", "none"), "3.12", True),
        (("py2.py3", "none"), "3.11", True),
    ],
)
def test_a_wheels_tags_say_which_python_it_installs_on(tags: tuple[str, str], python: str, ok: bool) -> None:
    assert installable(*tags, python) is ok


def fake_bundle(root: Path, tokenizer_from: Path | None, python_tag: str = "cp312") -> Path:
    """Empty wheel files named as pip would save the pinned ones, and the tokenizer files."""
    bundle = root / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    for name, version in wanted().items():
        tags = f"{python_tag}-{python_tag}-manylinux_2_17_x86_64" if name == "grpcio" else "py3-none-any"
        (bundle / "wheels" / f"{name}-{version}-{tags}.whl").write_bytes(b"x" * 1024)
    if tokenizer_from is not None:
        gpu_bundle.pack(bundle, tokenizer_from)
    else:
        (bundle / "tokenizer").mkdir()
        for name in gpu_bundle.REQUIRED_TOKENIZER_FILES:
            (bundle / "tokenizer" / name).write_text("{}")
    return bundle


def test_check_passes_a_complete_bundle_and_names_everything_wrong_with_others(tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path, None)
    assert check(bundle, "3.12") == []
    wheels = bundle / "wheels"
    # for another Python
    assert check(bundle, "3.11") == [f"grpcio: {next(wheels.glob('grpcio-*')).name} does not install on CPython 3.11"]
    # over the limit
    assert check(bundle, "3.12", limit_mib=0) == ["the wheels take 0.0 MiB, over the 0 MiB they may take"]
    # one missing, one at another version, one twice, one not asked for, no tokenizer
    next(wheels.glob("protobuf-*")).unlink()
    status = next(wheels.glob("grpcio_status-*"))
    status.rename(wheels / status.name.replace(wanted()["grpcio_status"], "1.0.0"))
    reflection = next(wheels.glob("grpcio_reflection-*"))
    shutil.copy(reflection, wheels / reflection.name.replace("py3-none-any", "py2.py3-none-any"))
    (wheels / "gguf-0.10.0-py3-none-any.whl").write_bytes(b"x")
    (bundle / "tokenizer" / "tokenizer.json").unlink()
    problems = "\n".join(check(bundle, "3.12"))
    assert "protobuf==7.36.2: no wheel in" in problems
    assert "grpcio_status-1.0.0-py3-none-any.whl is 1.0.0, gpu-wheels.txt pins 1.85.3" in problems
    assert "grpcio_reflection: 2 wheels" in problems
    assert "gguf: gguf-0.10.0-py3-none-any.whl is not in gpu-wheels.txt" in problems
    assert "tokenizer.json: missing" in problems


def run_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu-check.sh"), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PY": sys.executable, **(env or {})},
    )  # fmt: skip


def test_the_dry_run_checks_the_bundle_and_prints_the_plan(tmp_path: Path, tokenizer_dir: Path) -> None:
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    bundle = fake_bundle(tmp_path, tokenizer_dir, python_tag="cp" + python.replace(".", ""))
    done = run_check("--dry-run", "--device", "cpu", "--bundle", str(bundle))
    assert done.returncode == 0, done.stderr
    assert f"gpu bundle {bundle}: {len(wanted())} wheels for CPython {python}" in done.stdout
    assert "timeout 210 " in done.stdout and " -m pytest tests/gpu" in done.stdout
    assert "benchmarks.gpu_bench --device cpu --random-weights 135m" in done.stdout
    assert "torch " in done.stdout  # what the machine holds, said before anything is installed
    # A bundle without its tokenizer is refused, before anything installs.
    shutil.rmtree(bundle / "tokenizer")
    refused = run_check("--dry-run", "--bundle", str(bundle))
    assert refused.returncode == 1 and "tokenizer.json: missing" in refused.stderr
    assert "plan" not in refused.stdout


def test_an_unknown_argument_is_a_usage_error() -> None:
    done = run_check("--fast")
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr
    done = run_check("--device", "tpu")
    assert done.returncode == 2 and "--device cuda or cpu" in done.stderr
