"""Python graders that attack the host, for the attack suites run through the API and a training job.

Each raises (so it scores 0 with its error recorded) when the attack is stopped; when it gets through it
returns 1.0 or raises an error starting with ``LEAK`` that carries what it read."""

from __future__ import annotations

import json
import socket
import tempfile
import uuid
from pathlib import Path

MARKER = "gspo-planted-marker"
_PLANT_DIRS = (
    "['/tmp', '/dev/shm', '/var/tmp', '/run', os.getcwd(), os.path.expanduser('~'), '/', '/work'] + item['host_dirs']"
)

WALK = """
import os
def grade(sample, item):
    got = []
    files = [root for root in item['roots'] if os.path.isfile(root)]
    for root in item['roots']:
        for d, subdirs, names in os.walk(root):
            if d.startswith(item['env']):  # the grader environment, bound read-only: not the host's
                subdirs[:] = []
                continue
            files += [os.path.join(d, f) for f in names]
    for path in files[:2000]:
        try:
            with open(path, 'rb') as fh:
                got.append(path + '=' + fh.read(200).decode('latin-1'))
        except OSError:
            pass
    if got:
        raise RuntimeError('LEAK ' + ' | '.join(got)[:450])
    raise PermissionError('nothing of the host is readable')
"""

PROC = """
import os
def grade(sample, item):
    pids = sorted({p for p in os.listdir('/proc') if p.isdigit()} | {str(p) for p in item['host_pids']})
    got = []
    for pid in pids:
        for name in ('environ', 'cmdline'):
            try:
                data = open('/proc/%s/%s' % (pid, name), 'rb').read().decode('latin-1')
            except OSError:
                continue
            if any(m in data for m in ('pytest', 'celery', 'uvicorn', 'DATABASE_URL', 'GSPO_', 'REDIS')):
                got.append(pid + ':' + data[:200])
    if got:
        raise RuntimeError('LEAK ' + ' | '.join(got)[:450])
    raise PermissionError('only the sandbox processes are visible: ' + ','.join(pids))
"""

PLANT = f"""
import os
def grade(sample, item):
    placed = []
    for d in {_PLANT_DIRS}:
        try:
            with open(os.path.join(d, '{MARKER}'), 'w') as fh:
                fh.write('x')
            placed.append(d)
        except OSError:
            pass
    raise RuntimeError('planted only where it vanishes: ' + ','.join(sorted(set(placed))))
"""

FIND = f"""
import os
def grade(sample, item):
    found = [d for d in {_PLANT_DIRS} if os.path.exists(os.path.join(d, '{MARKER}'))]
    if found:
        return 1.0
    raise FileNotFoundError('no marker of an earlier run')
"""

CONNECT = """
import socket
def grade(sample, item):
    last = None
    for host, port in item['ports']:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return 1.0
        except OSError as exc:
            last = exc
    for path in ['/var/run/postgresql/.s.PGSQL.5432', '/tmp/.s.PGSQL.5432', '/var/run/redis/redis.sock',
                 '/var/run/docker.sock']:
        try:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(1)
            s.connect(path)
            return 1.0
        except OSError:
            pass
    raise ConnectionError('no port reachable: %s' % last)
"""

SIGNAL = """
import os, signal
def grade(sample, item):
    os.kill(-1, signal.SIGKILL)  # every process it may signal (in its PID namespace: none but itself)
    hit = []
    for pid in item['host_pids']:
        try:
            os.kill(pid, signal.SIGTERM)
            hit.append(pid)
        except OSError:
            pass
    if hit:
        return 1.0
    raise ProcessLookupError('no host process reachable')
"""

FORK_BOMB = """
import os, time
def grade(sample, item):
    while True:
        try:
            if os.fork() == 0:
                os.setsid()
                time.sleep(600)
                os._exit(0)
        except OSError:
            pass
"""

MEMORY_HOG = """
def grade(sample, item):
    blocks = []
    while True:
        blocks.append(bytearray(64 * 1024 * 1024))
"""

LOOP = """
def grade(sample, item):
    while True:
        pass
"""

DISK_FILL = """
import os
def grade(sample, item):
    for d in ['/tmp', '/dev/shm', os.getcwd()]:
        for k in range(1000):
            with open(os.path.join(d, 'fill%d' % k), 'wb') as fh:
                fh.write(b'0' * (8 * 1024 * 1024))
    return 1.0
"""

ATTACKS = {
    "walk": WALK,
    "proc": PROC,
    "plant": PLANT,
    "connect": CONNECT,
    "signal": SIGNAL,
    "fork_bomb": FORK_BOMB,
    "memory_hog": MEMORY_HOG,
    "loop": LOOP,
    "disk_fill": DISK_FILL,
}


#: Attacks that only the grader's clock stops; every other attack ends by itself (an error or a return).
CLOCKED = {"fork_bomb", "loop"}


def attack_spec(names=None, timeout_s: float = 1.0, ends_by_itself_s: float = 10.0) -> dict:
    """A `multi` reward whose sub-graders are the attacks (the reward is always 0). The clocked attacks get
    ``timeout_s``; the others ``ends_by_itself_s``, a margin for a sandbox that starts slowly on a loaded
    machine (a memory hog timed out at 1 s there instead of failing on its memory limit)."""
    names = list(names or ATTACKS)
    graders = {
        n: {
            "type": "python",
            "source": ATTACKS[n],
            "timeout_s": timeout_s if n in CLOCKED else ends_by_itself_s,
            "memory_mb": 256,
        }
        for n in names
    }
    return {"type": "multi", "graders": graders, "calculate_output": "0 * (" + " + ".join(names) + ")"}


def find_spec() -> dict:
    return {"type": "python", "name": "find", "source": FIND, "timeout_s": 2.0}


def listening_port() -> tuple[socket.socket, int]:
    """A real TCP server on loopback (stands in for the API's port): the sandbox must not reach it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv, srv.getsockname()[1]


def attack_item(data_dir: Path, host_pids: list[int], api_port: int, env: str) -> dict:
    """What the attacks aim at: the data directory (database, every tenant's files and checkpoints),
    the home directories, the checkout and its surroundings, host processes, the service's ports."""
    repo = Path(__file__).resolve().parents[1]
    roots = [
        str(data_dir),
        str(data_dir / "gspo.db"),
        "/root",
        "/home",
        str(repo),
        str(repo.parent),
        "/etc",
        "/var",
        "/srv",
        "/opt",
        "/run",
        tempfile.gettempdir(),
    ]
    return {
        "roots": roots,
        "env": env,
        "host_pids": host_pids,
        "host_dirs": [str(data_dir), str(repo)],
        "ports": [["127.0.0.1", api_port], ["127.0.0.1", 6379], ["127.0.0.1", 5432], [socket.gethostname(), 5432]],
    }


def new_secret() -> str:
    return f"s3cr3t-{uuid.uuid4().hex}"


def check_attack_results(results: list[dict], secrets: list[str], names=None) -> None:
    """Every attack scored 0 with its error recorded; nothing leaked into any text returned."""
    text = json.dumps(results)
    for secret in secrets:
        assert secret not in text, f"secret leaked: {text[:2000]}"
    assert "LEAK" not in text and "SQLite format" not in text, text[:3000]
    for r in results:
        for name in names or ATTACKS:
            assert r["scores"][name] == 0.0 and r["errors"].get(name), (name, r)


def planted_markers(*dirs: Path) -> list[str]:
    """Markers the attacks left on the host (there must be none)."""
    hits = []
    for d in {*dirs, Path(tempfile.gettempdir()), Path("/tmp"), Path("/dev/shm"), Path("/var/tmp")}:
        hits += [str(p) for p in Path(d).rglob(MARKER)] if Path(d).is_dir() else []
    return hits


def assert_expected_errors(errors: dict[str, str]) -> None:
    """The attacks failed the way the sandbox stops them (not by an accident of the test)."""
    expect = {
        "walk": "PermissionError",
        "proc": "PermissionError",
        "plant": "planted only",
        "connect": "ConnectionError",
        "signal": "ProcessLookupError",
        "fork_bomb": "timeout",
        "memory_hog": "memory",
        "loop": "timeout",
        "disk_fill": "No space left",
    }
    for name, needle in expect.items():
        if name in errors:
            assert needle in errors[name], (name, errors[name])
    if "plant" in errors:
        placed = errors["plant"].rsplit(": ", 1)[-1].split(",")
        assert set(placed) <= {"/tmp", "/dev/shm"}, errors["plant"]
