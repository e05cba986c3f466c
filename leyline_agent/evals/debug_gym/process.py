"""``driver.py`` run in debug-gym's own venv: its environment, its events, ``prepare``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leyline_agent.evals.debug_gym.backend import EvalError
from leyline_agent.evals.debug_gym.spec import EvalSpec
from leyline_agent.evals.debug_gym.venv import DebugGymVenv

DRIVER = Path(__file__).with_name("driver.py")
Event = dict[str, Any]


def terminal_env(venv: DebugGymVenv, tmp: Path) -> dict[str, str]:
    """The terminal's whole environment: this venv's python (pytest, pandas) first on PATH, a
    ``tree`` stand-in when the host has none, and nothing else of the runner's environment."""
    path = [str(venv.bin_dir)]
    if shutil.which("tree") is None:
        path.append(str(venv.shim_dir))
    path.append(os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"))
    home = os.environ.get("HOME", str(tmp))
    return {"PATH": os.pathsep.join(path), "HOME": home, "LANG": "C.UTF-8", "TMPDIR": str(tmp)}


def run_driver(
    venv: DebugGymVenv,
    command: str,
    spec_doc: dict[str, Any],
    spec_path: Path,
    log_path: Path,
    on_event: Callable[[Event], None],
) -> list[Event]:
    """Run ``driver.py COMMAND`` in debug-gym's venv; returns its events (stdout lines)."""
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec_doc, indent=1))
    tmp = Path(spec_doc["out_dir"]) / "workdirs"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(tmp),
    }
    events: list[Event] = []
    argv = [str(venv.python), "-P", str(DRIVER), command, str(spec_path)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            for line in proc.stdout or ():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                events.append(event)
                on_event(event)
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: do not leave the driver running
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise EvalError(f"driver.py {command} failed ({rc}); log {log_path}:\n{tail}")
    return events


def prepare_data(spec: EvalSpec, venv: DebugGymVenv) -> dict[str, Any]:
    """``{"data_dir", "source", "tasks"}`` from ``driver.py prepare``."""
    out = spec.out_dir.resolve()
    doc = {"data_dir": spec.data_dir and str(Path(spec.data_dir).resolve()), "out_dir": str(out)}
    events = run_driver(
        venv, "prepare", doc, out / "prepare.json", out / "prepare.log", lambda e: None
    )
    return next(e for e in events if e.get("event") == "prepared")
