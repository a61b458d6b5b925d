"""Tensor parallelism over processes on loopback (gloo): every layer's heads, MLP columns
and experts split over ranks give the same tokens as one process and logits within 1e-4,
for every architecture, alone and in a grid with pipeline stages."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tiergen import LLM, SamplingParams
from tiergen.config import ModelConfig, MoEConfig
from tiergen.errors import TiergenError
from tiergen.offload.policy import Policy
from tiergen.parallel.shard import ShardPlan, even_ranges
from tiergen.weights.packed import Packed, cat_rows, narrow
from tiergen.weights.quant import GGMLType

from test_packed import random_packed
from test_pipeline import case  # noqa: F401,F811  (the fixture: each architecture, its reference)
from test_pipeline import GREEDY, LONG, OPTIONS, PROMPTS, SAMPLED, TEXT, _when_running, disk
from tiny_models import build


def test_two_shards_match_one_process(case, tmp_path):
    """Shard 1 holds its weights and cache on disk; shard 0 everything in memory."""
    directory, one, greedy, sampled = case
    logits = one.logits(TEXT)
    cfg = one.executor.cfg
    if cfg.qk_norm_across_heads or cfg.linear:  # refused before any rank starts
        with pytest.raises(TiergenError, match="all heads together|linear-attention layers"):
            LLM(directory, **OPTIONS, tensor_parallel=2)
        return
    with LLM(directory, **OPTIONS, tensor_parallel=2, policy=[Policy(), disk(tmp_path)]) as llm:
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == greedy
        assert [r.token_ids for r in llm.generate(PROMPTS, SAMPLED)] == sampled
        torch.testing.assert_close(llm.logits(TEXT), logits, rtol=1e-4, atol=1e-4)
        workers = llm.group.workers
    assert all(p.poll() is not None for p in workers), "a rank outlived close()"


@pytest.mark.parametrize("name,pipeline,tensor", [
    ("deepseek-v2", 1, 3),  # MLA: heads 2+1+1 over one replicated latent
    ("llama-mha", 1, 3),  # KV heads 2+1+1 with their query heads
    ("gemma3-window8-linear", 1, 3),  # one KV head shared by all three
    ("qwen2-moe", 2, 2),  # a grid: two stages of two shards, experts dealt out
    ("gpt-oss", 1, 2),  # sinks split with their heads, experts with their biases dealt out
    ("deepseek-v3", 1, 2),  # the bias-corrected router replicated, experts dealt out
])
def test_more_ranks_match_one_process(name, pipeline, tensor, tmp_path):
    build(name, tmp_path / "model")
    one = LLM(tmp_path / "model", **OPTIONS)
    expected = [r.token_ids for r in one.generate(PROMPTS, GREEDY)]
    policies = [Policy()] * (pipeline * tensor - 1) + [disk(tmp_path / "disk")]
    with LLM(tmp_path / "model", **OPTIONS, pipeline_parallel=pipeline, tensor_parallel=tensor,
             policy=policies) as llm:
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected
        torch.testing.assert_close(llm.logits(TEXT), one.logits(TEXT), rtol=1e-4, atol=1e-4)
        assert llm.perplexity(TEXT) == pytest.approx(one.perplexity(TEXT), rel=1e-5)


def test_the_packaged_gguf_splits_nine_heads_over_two_shards():
    """SmolLM2's 3 KV groups of 3 heads go 2 groups + 1; its Q4_1 blocks are cut, not
    decoded, wherever a cut falls on a block boundary."""
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=8, temperature=0)
    # the float path: the shards' partial sums round otherwise than one matrix, which the
    # integer path's 8-bit steps could turn into a different greedy token
    expected = [r.token_ids for r in
                LLM("smollm2", activations="float32").generate(prompts, params)]
    with LLM("smollm2", activations="float32", tensor_parallel=2) as llm:
        assert [r.token_ids for r in llm.generate(prompts, params)] == expected
        qkv = llm.executor.weights.take(0)["qkv"]
        llm.executor.weights.release(0)
        assert isinstance(qkv, Packed) and qkv.shape == ((6 + 2 * 2) * 64, 576)


def _cfg(heads: int, kv: int, inter: int = 96, moe: MoEConfig | None = None) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=inter,
                       num_layers=2, num_heads=heads, num_kv_heads=kv, head_dim=16,
                       max_position=64, moe=moe)


def test_each_rank_gets_whole_heads_with_their_kv_heads():
    plans = [ShardPlan.make(_cfg(9, 3, 1536), 2, r) for r in range(2)]
    assert [(p.heads, p.kv_heads, p.columns) for p in plans] == [
        (range(0, 6), range(0, 2), range(0, 768)), (range(6, 9), range(2, 3), range(768, 1536))]
    plans = [ShardPlan.make(_cfg(8, 2), 4, r) for r in range(4)]  # two ranks per KV head
    assert [(p.heads, p.kv_heads) for p in plans] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    moe = MoEConfig(num_experts=6, top_k=2, intermediate_size=32, shared_intermediate_size=80)
    plans = [ShardPlan.make(_cfg(4, 4, moe=moe), 3, r) for r in range(3)]
    assert [p.experts for p in plans] == [range(0, 2), range(2, 4), range(4, 6)]
    assert [len(p.shared_columns) for p in plans] == [27, 27, 26]
    assert [len(r) for r in plans[0].vocab] == [34, 33, 33]
    assert plans[1].config(_cfg(4, 4, moe=moe)).moe.local_experts == range(2, 4)
    assert even_ranges(1536, 3, "columns", 256) == [range(0, 512), range(512, 1024),
                                                   range(1024, 1536)]


def test_splits_that_cannot_work_are_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(TiergenError, match="cannot share the model's 2 key-value heads"):
        ShardPlan.make(_cfg(4, 2), 3, 0)
    with pytest.raises(TiergenError, match="cannot split the model's 4 query heads per key-value head over tensor_parallel=5"):
        ShardPlan.make(_cfg(4, 1), 5, 0)
    build("qwen2", tmp_path)
    started = time.monotonic()
    for bad, match in ((3, "cannot share"), (0, "must be a positive integer")):
        with pytest.raises(TiergenError, match=match):
            LLM(tmp_path, tensor_parallel=bad)
    assert time.monotonic() - started < 10


def test_packed_rows_and_columns_are_cut_without_decoding():
    q = random_packed(GGMLType.Q4_K, 6, 512, seed=1)
    k = random_packed(GGMLType.Q6_K, 4, 512, seed=2)
    qk = cat_rows([q, k])
    dense = qk.dequantize()
    rows = qk.narrow(0, 4, 8)  # across the two block types
    assert rows.parts == ((GGMLType.Q4_K, 2), (GGMLType.Q6_K, 2))
    torch.testing.assert_close(rows.dequantize(), dense[4:8], rtol=0, atol=0)
    cols = qk.narrow(1, 256, 512)
    torch.testing.assert_close(cols.dequantize(), dense[:, 256:], rtol=0, atol=0)
    assert qk.narrow(1, 0, 128) is None  # through a 256-value block: the caller decodes
    decoded = narrow(qk, 1, range(0, 128))
    torch.testing.assert_close(decoded, dense[:, :128], rtol=0, atol=0)


def test_every_weight_source_answers_the_protocol(tmp_path):
    """Safetensors, GGUF and a shard of either answer every WeightSource method."""
    from tiergen.parallel.shard import ShardedSource
    from tiergen.weights import open_model

    build("qwen2", tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    for files in (open_model(tmp_path), open_model("smollm2")):
        shard = ShardedSource(files.source, ShardPlan.make(files.config, 1, 0), files.config)
        for source in (files.source, shard):
            full = source.get(name)
            dense = full.dequantize() if isinstance(full, Packed) else full
            part = source.get_slice(name, 0, range(1, 3))
            part = part.dequantize() if isinstance(part, Packed) else part
            torch.testing.assert_close(part, dense[1:3], rtol=0, atol=0)
            meta = source.meta(name)
            if isinstance(full, Packed):
                assert (meta.shape, meta.parts) == (full.shape, full.parts)
            else:
                assert meta is None
            where = source.locate(name)
            assert where is None or tuple(where[3]) == tuple(full.shape)
        assert shard.locate(name) is None


def test_a_killed_shard_stops_the_others_with_its_name(tmp_path):
    build("llama-gqa-tied", tmp_path)
    llm = LLM(tmp_path, dtype="float32", tensor_parallel=2)
    thread = _when_running(llm, lambda pid: os.kill(pid, signal.SIGKILL))
    started = time.monotonic()
    with pytest.raises(TiergenError, match="parallel rank 1 was killed by signal 9"):
        while True:  # until the kill lands
            llm.generate(PROMPTS * 4, LONG)
    thread.join()
    assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in llm.group.workers)


def test_the_command_line_runs_tensor_parallel(capsys):
    from tiergen import cli

    args = ["generate", "--json", "--max-tokens", "6", "The capital of France is", "Hello"]
    assert cli.main(args) == 0
    one = capsys.readouterr().out
    assert cli.main(args + ["--tensor-parallel", "2"]) == 0
    assert capsys.readouterr().out == one


@pytest.mark.parametrize("pipeline,tensor", [(1, 2), (2, 1)])
def test_the_server_scheduler_runs_over_ranks(pipeline, tensor, tmp_path):
    """Staggered requests (admitted chunk by chunk, merged as they decode, one cancelled) get
    the tokens one process gives them; the other ranks replay every admission, merge and
    cancellation."""
    import threading

    from tiergen._platform import on_short_lived_thread
    from tiergen.engine.scheduler import CANCELLED, Scheduler

    build("qwen2-moe", tmp_path)
    policy = Policy(gpu_batch_size=3, num_gpu_batches=2)
    one = LLM(tmp_path, **OPTIONS | dict(max_batch_size=3), policy=policy)
    prompts = [[5 + i] * (1 + 4 * i) for i in range(8)]
    lengths = [4 + (i % 4) * 3 for i in range(8)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    expected = [one.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    # loaded as `tiergen serve` loads it, on a thread that ends (the ranks must outlive it)
    with on_short_lived_thread(lambda: LLM(
            tmp_path, **OPTIONS | dict(max_batch_size=3), policy=policy,
            pipeline_parallel=pipeline, tensor_parallel=tensor)) as llm:
        sched = Scheduler(llm).start()
        try:
            requests = []
            for p, q in zip(prompts, params):
                requests.append(sched.submit(p, q))
                time.sleep(0.01)
            doomed, doomed_events = sched.submit([9] * 5, LONG), []

            def cancel_once_decoding() -> None:  # (a timer lost the race on a fast machine)
                for ev in doomed.events(timeout=60):
                    doomed_events.append(ev)
                    if len(doomed_events) == 1:
                        doomed.cancel()

            reader = threading.Thread(target=cancel_once_decoding)
            reader.start()
            for req, want in zip(requests, expected):
                assert [e.token_id for e in req.events(timeout=60)] == want
            reader.join(60)
            assert doomed_events[-1].finish_reason == CANCELLED
            assert max(sched.metrics.batch_sizes) > 1
            again = sched.submit(prompts[3], params[3])  # the ranks are still in step
            assert [e.token_id for e in again.events(timeout=60)] == expected[3]
        finally:
            sched.stop()
