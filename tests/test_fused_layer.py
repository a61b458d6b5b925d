"""The decode layer in one native call (tiergen/kernels/layer.c) computes what the layer run
operation by operation computes: within float32 rounding on the float path, and on the
integer path as close to the float path as the operation-by-operation integer path is."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

import tiergen.models.layers as layers
from tiergen import LLM
from test_gguf_model import GGUF_ARCH, write_model_gguf
from test_offload import prefill_and_decode_logits
from tiny_models import build

TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a small village, "
        "there lived a family of four who kept bees and sold honey at the market. ")


@pytest.fixture
def calls(monkeypatch):
    """Counts the decode layers run natively; ``calls.off()`` runs them op by op instead."""
    class Calls:
        n = 0
        native = True

        def off(self):
            self.native = False

        def on(self):
            self.native = True

    c, real = Calls(), layers.decode_step

    def counted(*args, **kw):
        if not c.native:
            return None
        out = real(*args, **kw)
        c.n += out is not None
        return out

    monkeypatch.setattr(layers, "decode_step", counted)
    return c


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) of the next-token distributions."""
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("case", sorted(GGUF_ARCH))
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_fused_decode_equals_layer_by_operation(case, qtype, calls, tmp_path):
    """Every Llama-family variant (GQA, MHA, q/k/v biases, q/k norms), batches of prompts of
    different lengths (left padding, the mask), prefill then decode steps."""
    hf = build(case, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_model_gguf(hf, GGUF_ARCH[case], path, gguf.GGMLQuantizationType[qtype])
    for activations in ("float32", "int16"):
        llm = LLM(path, dtype="float32", device="cpu", activations=activations)
        fused = prefill_and_decode_logits(llm)
        assert calls.n > 0
        calls.off()
        by_op = prefill_and_decode_logits(llm)
        calls.on()
        for got, want in zip(fused, by_op):
            if activations == "float32":
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            else:  # 16-bit rounding steps of 1/32512: a step's flip moves a logit by ~1e-5
                assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("case", ["mistral-window", "qwen2-window", "gemma3-window4",
                                  "llama3-rope", "mixtral"])
def test_fused_decode_of_quantised_checkpoints(case, calls, tmp_path):
    """Float checkpoints quantised at load: sliding windows as rings (Mistral, Qwen2, Gemma 3
    with windows shorter than the prompts), Llama 3 RoPE, and a mixture of experts, whose
    layers run op by op beside fused ones."""
    build(case, tmp_path / "hf")
    llm = LLM(tmp_path / "hf", dtype="float32", device="cpu", activations="float32",
              quantize="q8_0")
    fused = prefill_and_decode_logits(llm)
    if case != "mixtral":
        assert calls.n > 0
    calls.off()
    for got, want in zip(fused, prefill_and_decode_logits(llm)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def packaged(request):
    return request.param


def token_by_token(llm: LLM) -> torch.Tensor:
    return llm.logits(TEXT)


@pytest.mark.slow
def test_packaged_models_fused_on_both_paths(packaged, calls):
    """The packaged models scored one token at a time (every step a decode layer): the fused
    layer equals the layer by operation on the float path, and on the integer path stays as
    close to the float path as the layer by operation does."""
    exact = LLM(packaged, device="cpu", activations="float32", prefill_chunk_size=1)
    fused_exact = token_by_token(exact)
    assert calls.n > 0
    calls.off()
    by_op_exact = token_by_token(exact)
    calls.on()
    scale = by_op_exact.abs().max()
    assert (fused_exact - by_op_exact).abs().max() < 1e-5 * scale
    int8 = LLM(packaged, device="cpu", activations="int8", prefill_chunk_size=1)
    fused = kl(by_op_exact, token_by_token(int8)).mean()
    calls.off()
    by_op = kl(by_op_exact, token_by_token(int8)).mean()
    assert 0 < fused < 1.5 * by_op + 1e-4, (fused, by_op)


def test_rolling_window_decode(calls, monkeypatch):
    """Gemma 3's sliding layers as rings shorter than the text: the fused layer writes the
    ring slot and masks it as the ring view does."""
    llm = LLM("gemma3-270m", device="cpu", activations="float32", prefill_chunk_size=1)
    llm.executor.cfg = cfg = dataclasses.replace(llm.executor.cfg, sliding_window=8)
    monkeypatch.setattr(llm.executor.model, "cfg", cfg)
    fused = token_by_token(llm)
    assert calls.n > 0
    calls.off()
    by_op = token_by_token(llm)
    assert (fused - by_op).abs().max() < 1e-5 * by_op.abs().max()
    full = LLM("gemma3-270m", device="cpu", activations="float32", prefill_chunk_size=1)
    assert (token_by_token(full) - by_op).abs().max() > 1e-2  # the window did bite


@pytest.mark.slow
def test_weights_streamed_from_disk(calls, tmp_path):
    """Weights on disk come through reused buffers, one layer's matrices after another's, of
    other block types and sizes in a Q4_K_M file: every layer is still computed with its own,
    as where they stay resident."""
    from tiergen import Policy

    llm = LLM("gemma3-270m", device="cpu", activations="float32", prefill_chunk_size=1,
              policy=Policy(weights=(0, 0), offload_dir=str(tmp_path)))
    text = TEXT[:120]
    fused = llm.logits(text)
    assert calls.n > 0
    calls.off()
    by_op = llm.logits(text)
    assert (fused - by_op).abs().max() < 1e-5 * by_op.abs().max()
    calls.on()
    resident = LLM("gemma3-270m", device="cpu", activations="float32",
                   prefill_chunk_size=1).logits(text)
    assert torch.equal(fused, resident)


@pytest.mark.parametrize("micro", [False, True])
def test_a_decode_steps_layers_in_one_call_equal_them_one_by_one(micro, tmp_path, monkeypatch):
    """Executor._chained runs a decode step's layers in one native call, each layer described
    once and kept: the same numbers as the layers run one call each, bit for bit, with rows
    finishing at different lengths (the cache shrinks; kept descriptions of the old cache
    must not be used) and in micro-batches."""
    import tiergen.engine.executor as executor
    from tiergen import Policy, SamplingParams

    hf = build("llama-gqa-tied", tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_model_gguf(hf, GGUF_ARCH["llama-gqa-tied"], path, gguf.GGMLQuantizationType.Q4_1)
    kw = dict(policy=Policy(gpu_batch_size=2, num_gpu_batches=2)) if micro else {}
    llm = LLM(path, dtype="float32", device="cpu", activations="int8", **kw)
    prompts = [[5, 9, 14, 2, 7], [3, 4], [8, 1, 1, 6, 2, 9, 30], [11]]
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=n, logprobs=3, ignore_eos=True)
              for n in (12, 5, 9, 3)]
    runs = {"chained": 0}
    real_run = executor.run_steps

    def counted(steps, h):
        runs["chained"] += 1
        return real_run(steps, h)

    monkeypatch.setattr(executor, "run_steps", counted)
    chained = llm.generate(prompts, params)
    assert runs["chained"] >= 11  # every decode step of the longest row at least
    real_chained = executor.Executor._chained
    monkeypatch.setattr(executor.Executor, "_chained", lambda *a: False)
    alone = llm.generate(prompts, params)
    for a, b in zip(chained, alone):
        assert a.token_ids == b.token_ids
        assert [{t: p.logprob for t, p in x.items()} for x in a.logprobs] == \
            [{t: p.logprob for t, p in x.items()} for x in b.logprobs]
    monkeypatch.setattr(executor.Executor, "_chained", real_chained)
    assert [c.token_ids for c in llm.generate(prompts, params)] == [c.token_ids for c in chained]


def test_a_speculative_steps_checks_take_a_decode_steps_numbers(tmp_path, monkeypatch):
    """A checking step's tokens go through the native layer together (each token one row of
    its own, at its own slot, with its own mask), and each takes what a decode step of it
    gives: plain decoding's tokens and log-probabilities, rows of different lengths."""
    from test_speculative import PROMPTS, propose_from

    from tiergen import SamplingParams

    hf = build("llama-gqa-tied", tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_model_gguf(hf, "llama", path, gguf.GGMLQuantizationType.Q8_0)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    want = LLM(path, dtype="float32", activations="float32").generate(PROMPTS, params)
    propose_from(monkeypatch, PROMPTS, [w.token_ids for w in want])
    widths, real = [], layers.decode_step

    def counted(*args, **kw):
        out = real(*args, **kw)
        widths.append(args[2].shape[1] if out is not None else 0)
        return out
    monkeypatch.setattr(layers, "decode_step", counted)
    spec = LLM(path, dtype="float32", activations="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = spec.generate(PROMPTS, params)
    assert max(widths) > 1  # checks went through the native layer
    assert spec.last_stats.accepted_tokens > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for a, b in zip(w.logprobs, g.logprobs):
            for t in a:
                assert abs(b[t].logprob - a[t].logprob) < 1e-5
