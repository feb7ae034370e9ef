"""Triton kernels under TRITON_INTERPRET=1 (CPU tensors), as ordinary tests.

TRITON_INTERPRET must be set before triton is imported, and the test process may have imported it already, so the
checks run in one subprocess: `run(script, names)` runs `python SCRIPT interpreter NAME ...`, whose `main(checks,
names)` runs each named check on its own (a failure does not hide the next) and prints one line per check, `ok NAME`
or `FAIL NAME: error`; each parametrized test then asserts its own line (`assert_ok`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(checks: dict, names: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    torch.set_num_threads(1)
    for name in names or list(checks):
        try:
            torch.manual_seed(0)  # each check draws the same inputs whichever checks ran before it
            checks[name]()
            print(f"ok {name}", flush=True)
        except Exception as e:  # one line per check; the traceback's last frames say where
            where = " | ".join(traceback.format_exc().strip().splitlines()[-4:])
            print(f"FAIL {name}: {type(e).__name__}: {e} [{where}]", flush=True)


def run(script: Path | str, names) -> dict[str, str]:
    """name -> its line, for every check that reported; "<stderr>": the end of the process's stderr."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script), "interpreter", *names], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    results = {}
    for line in out.stdout.splitlines():
        status, _, rest = line.partition(" ")
        name = rest.split(":")[0]
        if status in ("ok", "FAIL") and name in names:
            results[name] = line
    results["<stderr>"] = out.stderr[-3000:]
    return results


def assert_ok(results: dict[str, str], name: str) -> None:
    line = results.get(name)
    assert line is not None, f"{name} did not report (the process ended early): {results['<stderr>']}"
    assert line == f"ok {name}", line


def pytest_cases(script: Path | str, checks: dict):
    """The module-scoped fixture that runs `checks` of `script` in one interpreter subprocess, and the slow test
    parametrized over them that asserts each one's line. A test module binds both at its top level:

        interpreter_results, test_triton_kernels_interpreter = interpreter.pytest_cases(__file__, CHECKS)
    """
    import pytest

    @pytest.fixture(scope="module")
    def interpreter_results() -> dict[str, str]:
        return run(script, list(checks))

    @pytest.mark.slow
    @pytest.mark.parametrize("name", list(checks))
    def test_triton_kernels_interpreter(name, interpreter_results):
        assert_ok(interpreter_results, name)

    return interpreter_results, test_triton_kernels_interpreter
