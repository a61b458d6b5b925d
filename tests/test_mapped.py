"""Handing back the pages of a mapped checkpoint that no weight reads (tiergen.weights.mapped)."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tiergen.weights.mapped import PAGE, page_out_unused
from tiergen.weights.packed import Packed
from tiergen.weights.quant import GGMLType


def _kernel() -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", platform.release())[:2])


linux = pytest.mark.skipif(platform.system() != "Linux" or _kernel() < (5, 4),
                           reason="MADV_PAGEOUT is Linux's, from 5.4")


def resident_kb(path, address: int | None = None) -> int:
    """This process's resident kB of the mappings of ``path`` (/proc/self/smaps); only the
    one holding ``address`` if given."""
    total, mine = 0, False
    for line in open("/proc/self/smaps"):
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            mine = line.rstrip().endswith(str(path)) and (
                address is None or int(m[1], 16) <= address < int(m[2], 16))
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def write_clean(path, content: np.ndarray) -> None:
    """Write and flush a file, as a downloaded checkpoint is (dirty pages cannot go back)."""
    with open(path, "wb") as f:
        f.write(content.tobytes())
        f.flush()
        os.fsync(f.fileno())


@linux
def test_pages_no_tensor_reads_go_back_and_nothing_is_lost(tmp_path):
    path = tmp_path / "weights.bin"
    content = np.arange(64 * PAGE, dtype=np.uint32).astype(np.uint8)
    write_clean(path, content)
    data = np.memmap(path, dtype=np.uint8, mode="c")
    whole = torch.from_numpy(data.view(np.ndarray))
    assert int(whole.sum()) == int(content.sum())  # every page read in
    data[40 * PAGE + 5] = 7  # changed through the copy-on-write map, read by no tensor
    live = [
        whole[:10 * PAGE],                                    # pages 0-9
        Packed(whole[20 * PAGE + 100:20 * PAGE + 200], (5, 32), ((GGMLType.Q4_1, 5),)),  # in 20
        whole[30 * PAGE:34 * PAGE].view(4, PAGE)[:, :8],      # strided: first bytes of 30-33
        torch.ones(3),                                        # not in the map
        "not a tensor",
    ]
    before = resident_kb(path)
    assert before >= 64 * PAGE // 1024
    released = page_out_unused(data, live)
    # whole pages between what the tensors read: 10-19, 21-29, 34-63 (33 only partly read)
    assert released == (10 + 9 + 30) * PAGE
    assert resident_kb(path) <= before - released // 1024 + 4 * PAGE // 1024
    assert data[40 * PAGE + 5] == 7  # a changed page keeps its change
    assert np.array_equal(np.asarray(data[:40 * PAGE]), content[:40 * PAGE])  # read back
    assert np.array_equal(np.asarray(data[40 * PAGE + 6:]), content[40 * PAGE + 6:])


@linux
def test_nothing_goes_back_where_tensors_read_every_page(tmp_path):
    path = tmp_path / "weights.bin"
    write_clean(path, np.zeros(8 * PAGE, dtype=np.uint8))
    data = np.memmap(path, dtype=np.uint8, mode="c")
    whole = torch.from_numpy(data.view(np.ndarray))
    assert page_out_unused(data, [whole[:5 * PAGE], whole[5 * PAGE - 1:]]) == 0
    assert page_out_unused(data, [whole]) == 0


_LOADS = """
import sys
import tiergen.weights.gguf_map as gguf_map
from tiergen import LLM
from test_mapped import resident_kb

path = sys.argv[1]


def resident_after_load():
    llm = LLM(path)
    embed = llm.executor.weights.globals["embed"].data.data_ptr()  # this load's map only
    return llm, resident_kb(path, embed) * 1024


llm, kept = resident_after_load()
gguf_map.page_out_unused = lambda data, live: 0
_, without = resident_after_load()
print(kept, without, llm.config.num_layers)
"""


@linux
def test_a_loaded_gguf_hands_back_the_q_k_v_it_joined(tmp_path):
    """SmolLM2's Q, K and V lie apart in its file (the output projection between them), so
    their fused matrix is a copy. The load hands back the file pages it copied them from: a
    load that does not leaves that much more of the file resident. In a process of its own
    and on a copy of the file no other process maps, since a page another map also holds is
    not handed back (the suite's other loads of SmolLM2 may hold them)."""
    from tiergen.weights import open_model

    copy = tmp_path / "smollm2.gguf"
    write_clean(copy, np.fromfile(open_model("smollm2").source.file.path, dtype=np.uint8))
    out = subprocess.run([sys.executable, "-c", _LOADS, str(copy)], capture_output=True,
                         text=True, cwd=Path(__file__).parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kept, without, n_layers = map(int, out.stdout.split()[-3:])
    copied = n_layers * (576 + 2 * 192) * 576 // 32 * 20  # Q4_1: 20 bytes a block of 32
    assert without - kept >= 0.9 * copied


def test_a_model_whose_pages_went_back_still_generates():
    from tiergen import LLM, SamplingParams

    out = LLM("smollm2").generate(["The capital of France is"],
                                  SamplingParams(max_tokens=4, temperature=0))
    assert "Paris" in out[0].text
