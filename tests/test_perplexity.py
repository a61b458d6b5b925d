import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# tiergen perplexity: windows as llama.cpp's, saved runs, KL statistics, the command.

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tiergen import LLM, Policy, cli
from tiergen.errors import TiergenError
from tiergen.perplexity import (KLStats, SavedRun, evaluate, kl_stats, scored_per_window,
                                window_logprobs)
from tiny_models import build

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
CTX = 32
IDS = torch.randint(0, 128, (4 * CTX + 7,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ppl") / "tiny"
    build("llama-gqa-tied", directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> LLM:
    return LLM(tiny_dir, dtype="float32")


@pytest.fixture(scope="module")
def compressed(tiny_dir) -> LLM:
    return LLM(tiny_dir, dtype="float32",
               policy=Policy(compress_weights=True, compress_bits=4, compress_group_size=32))


def direct_nll(llm: LLM, ids: list[int], ctx: int, windows: int, bos=None) -> torch.Tensor:
    """Each scored token's NLL, from LLM.logits on each window on its own."""
    nll = []
    for w in range(windows):
        window = ids[w * ctx:(w + 1) * ctx]
        if bos is not None:
            window = [bos] + window[1:]
        logp = torch.log_softmax(llm.logits(window).double(), dim=-1)
        for i in range(ctx // 2, ctx - 1):
            nll.append(-logp[i, window[i + 1]].item())
    return torch.tensor(nll, dtype=torch.float64)


def test_perplexity_is_exp_mean_nll_over_windows(tiny):
    result = evaluate(tiny, IDS, CTX)
    assert result.windows == 4  # the 7 tokens after the last whole window are left out
    nll = direct_nll(tiny, IDS, CTX, 4)
    assert result.perplexity.positions == len(nll) == 4 * (CTX - 1 - CTX // 2)
    assert result.perplexity.value == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
    error = math.exp(nll.mean().item()) * math.sqrt(nll.var(unbiased=False).item() / (len(nll) - 1))
    assert result.perplexity.error == pytest.approx(error, rel=1e-4)


def test_chunks_and_bos(tiny):
    result = evaluate(tiny, IDS, CTX, chunks=2, bos=3)
    assert result.windows == 2
    nll = direct_nll(tiny, IDS, CTX, 2, bos=3)
    assert result.perplexity.value == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
    # a window's result does not depend on the windows before it (each starts empty)
    second = [lp for _, lp in window_logprobs(tiny, IDS[CTX:], CTX, chunks=1)][0]
    first_two = [lp for _, lp in window_logprobs(tiny, IDS, CTX, chunks=2)]
    torch.testing.assert_close(second, first_two[1], atol=1e-5, rtol=1e-5)


def test_run_against_itself(tiny, tmp_path):
    path = tmp_path / "run.safetensors"
    saved = evaluate(tiny, IDS, CTX, save=path)
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"]
    data = load_file(path)
    assert data["tokens"].tolist() == IDS[:4 * CTX]
    expected = torch.cat([lp for _, lp in window_logprobs(tiny, IDS, CTX)])
    assert data["logprobs"].shape == (4 * scored_per_window(CTX), 128)
    torch.testing.assert_close(data["logprobs"], expected)

    again = evaluate(tiny, IDS, CTX, reference=path)
    assert again.kl.mean == pytest.approx(0, abs=1e-7) and again.kl.max < 1e-6
    assert again.kl.same_top == 1.0
    assert again.reference.value == pytest.approx(saved.perplexity.value, rel=1e-9)
    assert again.perplexity.value == pytest.approx(saved.perplexity.value, rel=1e-9)


def test_run_against_compressed_weights(tiny, compressed, tmp_path):
    path = tmp_path / "float.safetensors"
    evaluate(tiny, IDS, CTX, save=path)
    result = evaluate(compressed, IDS, CTX, reference=path)
    ref = torch.cat([lp for _, lp in window_logprobs(tiny, IDS, CTX)]).double()
    ours = torch.cat([lp for _, lp in window_logprobs(compressed, IDS, CTX)]).double()
    kl = torch.nn.functional.kl_div(ours, ref, log_target=True, reduction="none").sum(-1)
    assert result.kl.mean > 1e-4
    assert result.kl.mean == pytest.approx(kl.mean().item(), rel=1e-4)
    assert result.kl.max == pytest.approx(kl.max().item(), rel=1e-4)
    assert result.kl.p99 == pytest.approx(torch.quantile(kl, 0.99).item(), rel=1e-4)
    assert result.kl.same_top == (ref.argmax(-1) == ours.argmax(-1)).double().mean().item()
    assert result.kl.positions == len(kl)
    assert result.reference.value != result.perplexity.value


def test_kl_stats_of_perturbed_logprobs():
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(300, 1000) * 3, dim=-1)
    ours = torch.log_softmax(ref + torch.randn(300, 1000) * 0.3, dim=-1)
    stats = kl_stats(ref, ours)
    kl = (ref.double().exp() * (ref.double() - ours.double())).sum(-1)
    assert isinstance(stats, KLStats) and stats.positions == 300
    assert stats.mean == pytest.approx(kl.mean().item(), rel=1e-5)
    assert stats.max == pytest.approx(kl.max().item(), rel=1e-5)
    assert stats.p99 == pytest.approx(np.percentile(kl.numpy(), 99), rel=1e-5)
    assert stats.median == pytest.approx(kl.median().item(), rel=1e-2)
    assert stats.same_top == (ref.argmax(-1) == ours.argmax(-1)).double().mean().item()
    assert 0 < stats.same_top < 1
    itself = kl_stats(ref, ref)
    assert itself.max == 0 and itself.same_top == 1


def test_mismatched_runs_are_refused(tiny, tmp_path):
    path = tmp_path / "run.safetensors"
    evaluate(tiny, IDS, CTX, chunks=2, save=path)
    other = list(IDS)
    other[40] = (other[40] + 1) % 128
    with pytest.raises(TiergenError, match=r"other tokens than this run \(token 40 is "
                                           r".*same text file"):
        evaluate(tiny, other, CTX, reference=path)
    with pytest.raises(TiergenError, match="made with --ctx 32, this run has --ctx 16; "
                                           "pass --ctx 32"):
        evaluate(tiny, IDS, 16, reference=path)
    with pytest.raises(TiergenError, match="holds 2 windows, --chunks asks for 3"):
        evaluate(tiny, IDS, CTX, chunks=3, reference=path)
    assert evaluate(tiny, IDS, CTX, chunks=1, reference=path).kl.positions == 15
    with pytest.raises(TiergenError, match="other tokens.*this text has 40 tokens"):
        evaluate(tiny, IDS[:40], CTX, reference=path)
    with pytest.raises(TiergenError, match="no such file"):
        SavedRun(tmp_path / "missing.safetensors")
    (tmp_path / "text.txt").write_text("not a saved run")
    with pytest.raises(TiergenError, match="cannot read .* as a saved perplexity run"):
        SavedRun(tmp_path / "text.txt")


def test_an_interrupted_run_leaves_no_file(tiny, tmp_path, monkeypatch):
    calls = []

    def logits(ids):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return LLM.logits(tiny, ids)

    monkeypatch.setattr(tiny, "logits", logits)
    with pytest.raises(KeyboardInterrupt):
        evaluate(tiny, IDS, CTX, save=tmp_path / "run.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_window_checks(tiny):
    with pytest.raises(TiergenError, match="fewer than one window of --ctx 32"):
        evaluate(tiny, IDS[:20], CTX)
    with pytest.raises(TiergenError, match="more than the model's context of 256"):
        evaluate(tiny, IDS * 3, 512)
    with pytest.raises(TiergenError, match="--ctx must be at least 3"):
        evaluate(tiny, IDS, 2)


@pytest.mark.slow
def test_command_saves_then_compares(tmp_path, capsys):
    saved = tmp_path / "smol.safetensors"
    common = ["perplexity", "-f", str(TEXT), "--ctx", "64", "--chunks", "2"]
    assert cli.main([*common, "--save-logits", str(saved)]) == 0
    out, err = capsys.readouterr()
    first = out.splitlines()
    assert len(first) == 1 and first[0].startswith("perplexity: ")
    assert "(62 tokens scored in 2 windows of 64)" in first[0]
    assert "window" in err and "tok/s" in err  # the progress bar
    assert saved.exists() and not (tmp_path / "smol.safetensors.tmp").exists()

    assert cli.main([*common, "--kl-divergence", str(saved)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == first[0]
    assert lines[1] == f"saved run's perplexity: {first[0].split(': ')[1].split('  ')[0]}  " \
                       f"({saved})"
    assert [line.split(":")[0] for line in lines[2:]] == [
        "mean KLD", "median KLD", "p99 KLD", "max KLD", "same top token"]
    assert lines[2] == "mean KLD: 0.000000" and lines[-1] == "same top token: 100.00 %"

    assert cli.main([*common, "--ctx", "32", "--kl-divergence", str(saved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tiergen: error: {saved} (saved from SmolLM2-135M-Instruct.Q4_1) was made "
                   f"with --ctx 64, this run has --ctx 32; pass --ctx 64"]
