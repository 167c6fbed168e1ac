"""What a sandboxed grader may use (the grader environment, the standard library) and what the operator
decides: refusal where the host cannot isolate, weak isolation when allowed, maxima, the memory budget."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

import pytest

from gspo_core.rewards import RewardSpecError, build_reward
from gspo_core.rewards.isolation import BUBBLEWRAP, IS_ROOT, REFUSED, WEAK, SandboxLimits, isolation_for
from gspo_core.rewards.sandbox import preimports, run_sandboxed
from tests.conftest import grader_policy
from tests.core.test_sandbox import OK, run

POSITIVE = {
    "datetime": (
        "import datetime\ndef grade(sample, item):\n"
        "    d = datetime.date.fromisoformat(sample['output_text'])\n"
        "    return float((d - datetime.date(2024, 1, 1)).days)\n",
        "2024-01-31",
        30.0,
    ),
    "dataclasses": (
        "from dataclasses import dataclass, asdict\n@dataclass\nclass P:\n    x: int\n    y: int\n"
        "def grade(sample, item):\n    return float(sum(asdict(P(2, 3)).values()))\n",
        "",
        5.0,
    ),
    "re_json": (
        "import json, re\ndef grade(sample, item):\n"
        "    m = re.search(r'\\{.*\\}', sample['output_text'])\n"
        "    return float(json.loads(m.group(0))['answer'] == item['answer'])\n",
        'so {"answer": "4"}',
        1.0,
    ),
    "numpy": (
        "import numpy as np\ndef grade(sample, item):\n    return np.mean(np.array([1.0, 2.0, 3.0]) * 2)\n",
        "",
        4.0,
    ),
    "sympy": (
        "import sympy\ndef grade(sample, item):\n"
        "    x = sympy.Symbol('x')\n"
        "    ok = sympy.simplify(sympy.sympify(sample['output_text']) - (x + 1) ** 2) == 0\n"
        "    return float(ok)\n",
        "x**2 + 2*x + 1",
        1.0,
    ),
    "rapidfuzz": (
        "from rapidfuzz import fuzz\ndef grade(sample, item):\n"
        "    return fuzz.ratio(sample['output_text'], item['answer']) / 100\n",
        "4",
        1.0,
    ),
    "jsonschema": (
        "import json, jsonschema\nS = {'type': 'object', 'required': ['a'], 'properties': {'a': {'type': 'integer'}}}\n"
        "def grade(sample, item):\n"
        "    try:\n        jsonschema.validate(json.loads(sample['output_text']), S)\n        return 1.0\n"
        "    except jsonschema.ValidationError:\n        return 0.0\n",
        '{"a": 3}',
        1.0,
    ),
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_graders_written_for_openai_environment_work(name):
    src, text, expected = POSITIVE[name]
    res = run(src, [text], items=[{"answer": "4"}], timeout_s=20)
    assert not res[0].errors, res[0].errors
    assert res[0].reward == pytest.approx(expected)


def test_grader_package_set_and_every_stdlib_module_import():
    src = (
        "import contextlib, importlib, io, sys\n"
        "GUI_OR_OTHER_OS = {'antigravity', 'this', 'tkinter', '_tkinter', 'turtle', 'turtledemo', 'idlelib',\n"
        "                   'msilib', '_msi', 'msvcrt', 'nt', 'winreg', 'winsound', '_winapi', '_overlapped',\n"
        "                   '_scproxy', '_wmi'}\n"
        "def grade(sample, item):\n"
        "    bad = {}\n"
        "    for name in sorted(set(sys.stdlib_module_names) - GUI_OR_OTHER_OS) + item['packages']:\n"
        "        try:\n"
        "            with contextlib.redirect_stdout(io.StringIO()):\n"
        "                importlib.import_module(name)\n"
        "        except BaseException as exc:\n"
        "            bad[name] = repr(exc)\n"
        "    assert not bad, bad\n"
        "    return 1.0\n"
    )
    packages = [
        "numpy",
        "scipy",
        "sympy",
        "pandas",
        "rapidfuzz",
        "sklearn",
        "jsonschema",
        "pydantic",
        "yaml",
        "sqlparse",
        "deepdiff",
        "rouge_score.rouge_scorer",
        "nltk",
    ]
    out = run_sandboxed(
        src, [[{}, {"packages": packages}]], SandboxLimits(timeout_s=60, memory_mb=1024), grader_policy()
    )
    assert out == [1.0], out


def test_over_max_specs_are_spec_errors_naming_the_field():
    policy = grader_policy(max_timeout_s=10, max_memory_mb=512, max_concurrency=2, sandbox_memory_budget_mb=400)
    for spec, field in [
        ({"timeout_s": 11}, "timeout_s"),
        ({"memory_mb": 600}, "memory_mb"),
        ({"max_concurrency": 3}, "max_concurrency"),
        ({"memory_mb": 400}, "memory_mb"),
    ]:
        with pytest.raises(RewardSpecError) as exc:
            build_reward({"type": "python", "source": OK, **spec}, policy)
        assert exc.value.field == field, (spec, exc.value)
    fn = build_reward({"type": "python", "source": OK}, policy)  # the default fits the budget
    assert fn.parts["python"].limits.memory_mb == 400 - 80 and fn.parts["python"].concurrency == 1
    fn.close()


def test_no_isolation_refuses_python_graders_unless_the_operator_allows_weak():
    missing = grader_policy(bwrap="/nonexistent/bwrap")
    assert isolation_for(missing).mode == REFUSED and "not installed" in isolation_for(missing).reason
    with pytest.raises(RewardSpecError) as exc:
        build_reward(
            {"type": "multi", "graders": {"py": {"type": "python", "source": OK}}, "calculate_output": "py"}, missing
        )
    assert exc.value.field == "graders.py.type" and "cannot isolate" in exc.value.message
    broken = grader_policy(bwrap="/bin/false")  # installed, but cannot build a sandbox
    assert isolation_for(broken).mode == REFUSED
    weak = grader_policy(bwrap="/nonexistent/bwrap", allow_weak_isolation=True)
    assert isolation_for(weak).mode == WEAK
    res = run(OK + "import socket\n", ["x", "y"], policy=weak)
    assert [r.reward for r in res] == [1.0, 0.0] and not any(r.errors for r in res)
    assert isolation_for(grader_policy(allow_weak_isolation=True)).mode == BUBBLEWRAP


def test_a_grader_environment_under_tmp_is_not_hidden_by_the_sandboxs_own_tmp():
    """A checkout under /tmp: the grader environment is bound over the sandbox's fresh /tmp, not under it."""
    import subprocess

    base = grader_policy().python or sys.executable
    env = tempfile.mkdtemp(prefix="grader-env-", dir="/tmp")
    os.chmod(env, 0o755)  # readable by the sandbox's unprivileged uid, as a checkout's would be
    try:
        subprocess.run([base, "-m", "venv", "--without-pip", env], check=True, timeout=120)
        policy = grader_policy(python=f"{env}/bin/python")
        iso = isolation_for(policy)
        assert iso.mode == BUBBLEWRAP, iso.reason
        assert any(b.startswith("/tmp/") for b in iso.binds), iso.binds
        res = run(OK, ["x", "y"], policy=policy)
        assert [r.reward for r in res] == [1.0, 0.0] and not any(r.errors for r in res), res
    finally:
        subprocess.run(["rm", "-rf", env], check=False)


def test_a_niced_sandbox_is_niced_in_its_sessions_autogroup_too():
    """Each sandbox is a session of its own; Linux gives each session's autogroup an equal CPU share whatever
    the nice values inside, so the niceness must reach the autogroup too (the fairness bench's cause)."""
    src = (
        "import os\n"
        "def grade(sample, item):\n"
        "    try:\n"
        "        group = float(open('/proc/self/autogroup').read().split()[-1])\n"
        "    except OSError:\n"
        "        group = -1.0\n"
        "    return os.nice(0) * 100 + group\n"
    )
    res = run(src, ["x"], policy=grader_policy(niceness=19))
    assert not res[0].errors, res[0].errors
    nice, group = divmod(res[0].reward, 100)
    assert nice == 19, res[0].reward
    if os.path.exists("/proc/self/autogroup"):
        assert group == 19, res[0].reward


def test_reading_a_sources_imports_never_parses_it_in_the_service():
    """The imports to load early are read from the source's lines in the service's threads: a source nested
    past the parser's depth, read by many threads at once (a step's tool calls), yields its imports and raises
    nothing (ast.parse there raised RecursionError, or CPython 3.11's "AST constructor recursion depth
    mismatch" SystemError for concurrent parses)."""
    deep = "import numpy\nx = " + "(" * 5000 + ")" * 5000 + "\n"
    found, errors = [], []

    def read() -> None:
        try:
            for _ in range(20):
                found.append(preimports(deep))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and found == [["numpy"]] * 160


def test_the_environments_packages_a_source_imports_load_before_its_niced_code():
    """A niced dry run on a loaded host took 16-32 s to import numpy and sympy (over the 20 s module limit):
    the packages the source names are imported at the service's priority, and then the source's own code,
    its module code included, runs niced (its autogroup too)."""
    src = (
        "import os, sys\n"
        "before = 'numpy' in sys.modules and 'sympy' in sys.modules\n"
        "module_nice = os.nice(0)\n"
        "from sympy import Rational\n"
        "import numpy.linalg\n"
        "def grade(sample, item):\n"
        "    path = '/proc/self/autogroup'\n"
        "    group = float(open(path).read().split()[-1]) if os.path.exists(path) else 19\n"
        "    return before * 10000 + module_nice * 100 + group\n"
    )
    assert preimports(src) == ["numpy", "sympy"]
    assert preimports("import os\nimport torch\nfrom . import x\n") == [] and preimports("def (") == []
    res = run(src, ["x"], policy=grader_policy(niceness=19))
    assert not res[0].errors, res[0].errors
    assert res[0].reward == 10000 + 19 * 100 + 19, res[0].reward


def test_the_service_interpreter_is_the_default():
    iso = isolation_for(grader_policy(python=None))
    assert os.path.samefile(iso.python, sys.executable) and iso.mode in (BUBBLEWRAP, REFUSED)


def _sandbox_children() -> int:
    """bwrap processes whose parent is this process, read from /proc."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        n += comm == "bwrap" and int(fields[1]) == os.getpid()
    return n


def test_concurrent_graders_wait_for_the_memory_budget():
    """Three graders at once, two children each, in a budget that holds two children: never more than
    two sandboxes are alive, and the work takes three rounds instead of one."""
    limits = SandboxLimits(timeout_s=5.0, memory_mb=200)
    policy = grader_policy(sandbox_memory_budget_mb=2 * limits.reserve_mb)
    src = "import time\ndef grade(sample, item):\n    time.sleep(0.6)\n    return 1.0\n"
    fns = [
        build_reward({"type": "python", "source": src, "memory_mb": 200, "max_concurrency": 2}, policy)
        for _ in range(3)
    ]
    assert all(fn.parts["python"].concurrency == 2 for fn in fns)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _sandbox_children())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.perf_counter()
    outs: list = [None] * 3
    threads = [
        threading.Thread(target=lambda k=k: outs.__setitem__(k, fns[k].score_batch([{}] * 2, [{}] * 2)))
        for k in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    elapsed = time.perf_counter() - t0
    stop.set()
    watcher.join()
    for fn in fns:
        fn.close()
    assert all(r.reward == 1.0 for out in outs for r in out), outs
    assert peak[0] == 2, f"{peak[0]} sandboxes alive at once in a budget for 2"
    assert elapsed > 3 * 0.6, f"6 children of 0.6 s, 2 at a time, took only {elapsed:.2f} s"


@pytest.mark.skipif(not IS_ROOT, reason="the throw-away uid needs root")
def test_weak_mode_unreachable_workdir_is_a_clear_error(monkeypatch, tmp_path):
    """Weak mode keeps the old uid switch: a working directory the throw-away uid cannot enter is a
    clear set-up error, not a crash."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # under pytest's root-only base
    res = run(OK, ["x"], policy=grader_policy(bwrap="/nonexistent/bwrap", allow_weak_isolation=True))
    assert res[0].reward == 0.0 and res[0].errors["py"].startswith("killed: sandbox set-up failed")
