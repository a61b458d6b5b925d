"""The integer path against the float path on the packaged models and a real text
(tests/data/perplexity.txt), judged as quantisation is: the KL divergence of each scored
position's next-token distribution from the float path's, and the share of positions whose
top token agrees (what ``tiergen perplexity --kl-divergence`` prints). Both the integer
kernels' paths are measured: prompt chunks of 32 rows (the interleaved tiles) and one token
at a time (the row kernel, as in a decode step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiergen import LLM, kernels
from tiergen.perplexity import kl_stats, tokenize, window_logprobs

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
CTX, WINDOWS = 512, 2

# llama.cpp on the same tokens, against the same float path (benchmarks/bench_kld.py, in
# docs/BENCHMARKS.md): mean KLD and same top token. The integer path must stay at or below
# half that KLD and agree on the top token more often.
LLAMA_CPP = {"smollm2": (0.00449, 0.971), "gemma3-270m": (0.01138, 0.971)}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(kernels.library() is None, reason="needs the C kernels")]


def run(model: str, activations: str, chunk: int) -> tuple[list[int], torch.Tensor]:
    llm = LLM(model, dtype="float32", activations=activations, prefill_chunk_size=chunk)
    ids, bos = tokenize(llm, TEXT)
    return ids, torch.cat([lp for _, lp in window_logprobs(llm, ids, CTX, WINDOWS, bos=bos)])


@pytest.fixture(scope="module", params=sorted(LLAMA_CPP))
def float_path(request):
    return request.param, run(request.param, "float32", 32)


@pytest.mark.parametrize("chunk", [32, 1], ids=["tiles", "rows"])
def test_integer_path_stays_close_to_the_float_path(float_path, chunk):
    model, (ids, ref) = float_path
    got_ids, got = run(model, "int8", chunk)
    assert got_ids == ids
    stats = kl_stats(ref, got)
    llama_kld, llama_same = LLAMA_CPP[model]
    assert 0 < stats.mean <= llama_kld / 2, stats
    assert stats.same_top > llama_same, stats


def test_16_bit_activations_are_nearly_the_float_path(float_path):
    model, (ids, ref) = float_path
    stats = kl_stats(ref, run(model, "int16", 32)[1])
    assert stats.mean < 1e-4 and stats.same_top > 0.99, stats


def test_only_the_8_bit_integer_path_keeps_a_float16_cache():
    """The 8-bit integer path's KV cache is float16 (its closeness to the float path above is
    measured with it); the float path's and the 16-bit path's stay float32, and so do the
    caches of layers whose weights the integer kernels do not take (FP8: tests/test_fp8.py)."""
    assert LLM("smollm2", device="cpu").executor.kv_dtype == torch.float16
    cache = LLM("smollm2", device="cpu").executor.new_cache(2, 8)
    assert all(layer.dtype == torch.float16 for layer in cache.layers)
    cache.close()
    for activations in ("float32", "int16"):
        llm = LLM("smollm2", device="cpu", activations=activations)
        assert llm.executor.kv_dtype == torch.float32
