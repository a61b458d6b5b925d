"""Resident packed weights keep the integer kernels' tiles for batched decode steps
(Policy.keep_tiles): the same tokens as building them at every product, none at batch 1,
within the host budget, and none for weights streamed through reused buffers."""

from __future__ import annotations

from tiergen import LLM, Policy, SamplingParams
from tiergen.kernels import reads_tiles, tile_bytes
from tiergen.weights.packed import Packed

# six sequences: more than the row kernels take (up to four with AVX-512), so every
# product reads tiles
PROMPTS = [[1, 250, 3000, 77, 9], [1, 42], [1, 600, 601, 602], [1, 8000, 8001, 8002, 8003, 8004],
           [1, 5, 6], [1, 9000, 12]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def matrices(llm: LLM) -> list[Packed]:
    """The packed matrices that stay in place: the globals and the layers read where they live."""
    seen = {id(t): t for t in llm.executor.globals.values() if isinstance(t, Packed)}
    for layer in llm.executor.weights._views.values():
        seen.update({id(t): t for t in layer.values() if isinstance(t, Packed)})
    return list(seen.values())


def kept(llm: LLM) -> int:
    return sum(m.tiles.numel() for m in matrices(llm) if m.tiles is not None)


def test_kept_tiles_give_the_same_tokens_and_only_for_batches():
    llm = LLM("smollm2", device="cpu", activations="int8")
    llm.generate(PROMPTS[:1], GREEDY)
    assert kept(llm) == 0  # batch 1: the row kernels, nothing kept
    llm.generate(PROMPTS[:3], GREEDY)  # tiles for the products of three rows that read them
    assert all((m.tiles is not None) == reads_tiles(m, 3) for m in matrices(llm))
    with_tiles = llm.generate(PROMPTS, GREEDY)
    assert all(m.tiles is not None for m in matrices(llm))
    assert kept(llm) == sum(tile_bytes(m) for m in matrices(llm))
    again = llm.generate(PROMPTS, GREEDY)
    without = LLM("smollm2", device="cpu", activations="int8", policy=Policy(keep_tiles=False))
    plain = without.generate(PROMPTS, GREEDY)
    assert kept(without) == 0
    assert [r.token_ids for r in with_tiles] == [r.token_ids for r in plain] \
        == [r.token_ids for r in again]
    exact = LLM("smollm2", device="cpu", activations="float32")
    exact.generate(PROMPTS, GREEDY)
    assert kept(exact) == 0  # the float path has no tiles


def test_kept_tiles_stay_within_half_of_what_the_budget_leaves():
    llm = LLM("smollm2", device="cpu", activations="int8", host_memory="300M")
    needs = llm.executor.weight_plan.needs()
    left = 300 * 2**20 - needs["host"] - needs["device"]
    llm.generate(PROMPTS, GREEDY)
    assert 0 < kept(llm) <= left // 2
    assert kept(llm) < sum(tile_bytes(m) for m in matrices(llm))


def test_weights_streamed_from_disk_keep_no_tiles(tmp_path):
    llm = LLM("smollm2", device="cpu", activations="int8",
              policy=Policy(weights=(0, 0), offload_dir=str(tmp_path)))
    out = llm.generate(PROMPTS, GREEDY)
    assert not llm.executor.weights._views  # every layer came through the buffers
    head = llm.executor.globals["lm_head"]
    assert kept(llm) == tile_bytes(head) > 0  # the globals stay in host RAM, and keep them
    resident = LLM("smollm2", device="cpu", activations="int8")
    assert [r.token_ids for r in out] == [r.token_ids for r in resident.generate(PROMPTS, GREEDY)]
