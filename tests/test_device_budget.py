"""A step's device peak: the transient accounting against what torch's profiler records, the
prefill chunk cut to fit the device budget, and the planner within it."""

import pytest
import torch

from tiergen import LLM, SamplingParams, TiergenError
from tiergen.cache.step import StepMeta
from tiergen.offload.memory import Budgets, largest_step, step_transient
from tiergen.planner import search
from tiergen.planner.cost import Workload
from test_planner import GPU, SMOL, needs_of

# predicted / measured peak of a forward step on a CPU: at least 1 (a budget is a promise),
# at most this (measured 1.0-2.1 over the cases below)
TOLERANCE = 2.5
CASES = ["llama-gqa-tied", "qwen3", "mixtral", "gemma3-window4", "deepseek-v2", "gpt-oss",
         "qwen3-next", "kimi-linear"]


def profiled_peak(fn) -> int:
    """Most bytes that ``fn`` held at once beyond what existed before, from the allocations
    and frees torch's profiler records, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transient_covers_the_profiled_step(models, case, dtype):
    ex = LLM(models(case), dtype=dtype, device="cpu").executor
    for rows, tokens, start in [(1, 8, 0), (4, 32, 0), (2, 200, 0), (8, 1, 40), (3, 16, 16)]:
        capacity = start + tokens + 4
        valid = torch.zeros(rows, capacity, dtype=torch.bool)
        valid[:, :start + tokens] = True
        valid[0, :(start + tokens) // 2] = False  # a left-padded row: the masked paths
        ids = torch.randint(0, ex.cfg.vocab_size, (rows, tokens))
        meta = StepMeta.build(valid, start, tokens)
        for warm in (True, False):  # the first run builds kernels and scratch buffers
            cache = ex.new_cache(rows, capacity)
            try:
                measured = profiled_peak(lambda: ex.forward(ids, meta, cache))
            finally:
                cache.close()
        predicted = rows * tokens * ex.cfg.hidden_size * 4 + step_transient(
            ex.cfg, ex.dtype, rows, tokens, capacity, device_type="cpu")
        assert measured <= predicted <= TOLERANCE * measured, (rows, tokens, start, measured, predicted)


def test_largest_step():
    assert largest_step(lambda n: n <= 37, 512) == 37
    assert largest_step(lambda n: True, 512) == 512
    assert largest_step(lambda n: False, 512) == 0


def test_prefill_chunk_is_cut_to_the_device_budget(models):
    path = models("llama-gqa-tied")
    prompts = [list(range(1, 121)), list(range(5, 95))]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = [r.token_ids for r in LLM(path, dtype="float32").generate(prompts, params)]
    ex = LLM(path, dtype="float32").executor
    shapes = [(2, 124)]
    budget = ex._block_needs(shapes, 16)["device"]
    llm = LLM(path, dtype="float32", device_memory=budget)
    steps = []
    forward = llm.executor.forward_block
    llm.executor.forward_block = lambda block, *a, **k: (
        steps.append(max(mb.ids.shape[1] for mb in block)), forward(block, *a, **k))[1]
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    assert max(steps) == 16 < 120
    assert llm.last_stats.planned["device"] <= budget


def test_what_cannot_fit_is_refused_with_the_fix(models):
    path = models("llama-gqa-tied")
    ex = LLM(path, dtype="float32").executor
    budget = ex._block_needs([(8, 104)], 1)["device"] - 1
    llm = LLM(path, dtype="float32", device_memory=budget)
    with pytest.raises(TiergenError, match=r"device memory.*--gpu-batch-size.*--device-memory"):
        llm.generate([list(range(1, 101))] * 8, SamplingParams(max_tokens=4, ignore_eos=True))


@pytest.mark.parametrize("fraction", [0.5, 0.2, 0.12])
def test_planner_never_plans_a_step_over_the_device_budget(fraction):
    work = Workload(prompt_len=512, gen_len=32, batch=64)
    full = needs_of(SMOL, torch.bfloat16, search.Policy(gpu_batch_size=64), work, "cuda")
    budgets = Budgets(device=int(fraction * full["device"]), host=64 << 30)
    found = search.plan(SMOL, torch.bfloat16, work, GPU, "cuda", budgets)
    assert found
    for e in found:
        needs = needs_of(SMOL, torch.bfloat16, e.policy, work, "cuda", e.prefill_chunk)
        assert e.memory == needs and needs["device"] <= budgets.device
