"""Plans on paper: models and machines that are not here.

A model is given by its Hugging Face ``config.json`` (a path, or the name of one that ships in
``planner/configs``: Llama-3.1-8B/70B, Qwen2.5-72B, Mixtral-8x22B, DeepSeek-V2), so that no
weights are needed. A machine is a *profile*: a calibration as ``tiergen calibrate`` saves it
(``~/.cache/tiergen/calibration.json`` or one entry of it), or the same fields written by hand
for hardware one does not have, optionally with ``device_memory`` and ``host_memory`` (sizes such
as "24G"); without them the budgets are the GPU's memory and the RAM its fingerprint records.
Profiles that ship live in ``planner/machines``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tiergen.calibration import Calibration, _from_dict
from tiergen.config import ModelConfig, from_hf_config
from tiergen.devices import cpu_auto_dtype
from tiergen.errors import TiergenError
from tiergen.offload.memory import Budgets
from tiergen.offload.policy import parse_size
from tiergen.weights import config_dtype, read_json

HERE = Path(__file__).parent
CONFIGS, MACHINES = HERE / "configs", HERE / "machines"


def names(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json"))


def _resolve(spec: str, directory: Path, what: str) -> Path:
    """A shipped file by name, else a path (a directory holding config.json for configs)."""
    if (directory / f"{spec}.json").is_file():
        return directory / f"{spec}.json"
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    raise TiergenError(f"{what} {spec!r} not found: pass a JSON file or one of "
                       f"{', '.join(names(directory))}")


def load_config(spec: str) -> tuple[ModelConfig, torch.dtype | None]:
    """The model of a config.json (or a shipped name) and the dtype its checkpoint declares."""
    raw = read_json(_resolve(spec, CONFIGS, "model config"))
    return from_hf_config(raw), config_dtype(raw)


@dataclass
class Machine:
    name: str
    calibration: Calibration
    budgets: Budgets  # what the machine has; --device-memory / --host-memory override it
    note: str = ""


def load_machine(spec: str) -> Machine:
    """A machine profile by shipped name or path."""
    path = _resolve(spec, MACHINES, "machine profile")
    raw = read_json(path)
    if "hardware" not in raw:  # calibrate's cache file: one entry per device type
        entry = raw.get("cuda") or raw.get("cpu")
        if not isinstance(entry, dict):
            raise TiergenError(f"{path} is not a machine profile: it needs the fields of a "
                               "calibration (see tiergen calibrate), or its 'cpu'/'cuda' entries")
        raw = entry
    try:
        cal = _from_dict(raw)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TiergenError(f"{path} is not a valid machine profile ({e}); it needs the fields "
                           "tiergen calibrate writes") from None
    hw = cal.hardware

    def size(key: str, gib: str | None) -> int | None:
        if raw.get(key) is not None:
            return parse_size(str(raw[key]))
        return int(float(gib) * 2**30) if gib else None

    device = size("device_memory", hw.get("gpu_memory_gib")) if cal.device_type == "cuda" else None
    return Machine(str(raw.get("name") or path.stem), cal,
                   Budgets(device, size("host_memory", hw.get("ram_gib"))), str(raw.get("note", "")))


def default_dtype(cal: Calibration, checkpoint: torch.dtype | None,
                  packed: bool = False) -> torch.dtype:
    """What ``dtype="auto"`` would pick on that machine: on a GPU a half precision it has
    figures for, the checkpoint's first; on a CPU float32 for a model whose matrices stay
    packed (as ``resolve_dtype``), else bfloat16 for a bfloat16 checkpoint or where it was
    measured faster, else float32."""
    if cal.device_type == "cuda":  # the checkpoint's half type, else one the GPU was measured in
        halves = [d for d in (checkpoint, torch.bfloat16, torch.float16)
                  if d in (torch.float16, torch.bfloat16)]
        return next((d for d in halves if str(d).removeprefix("torch.") in cal.matmul), halves[0])
    if packed:
        return torch.float32
    return cpu_auto_dtype(checkpoint, cal.matmul.get("bfloat16", 0) > cal.matmul.get("float32", 0))
