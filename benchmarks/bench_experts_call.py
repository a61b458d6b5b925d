"""A token's experts in one native call against the same experts run one by one, on the
DeepSeek-V3-shaped Q4_0 GGUF of ``bench_moe_gguf.py`` built with --experts experts (all
resident), and against the routed experts in one call with the shared expert computed apart:
decode milliseconds a step of one prompt, each way --turns times in turns in one process,
and the medians. --against REV adds the one call of a git revision's kernels (built
here; its packed-matrix descriptors must be this tree's) as a fourth way.

    python benchmarks/bench_experts_call.py [--experts 16] [--dir /var/tmp/tiergen-moe16] [--turns 4]
        [--against REV]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe_gguf  # noqa: E402

import tiergen.models.moe as moe  # noqa: E402
from bench_int8 import build_at  # noqa: E402
from tiergen import LLM, SamplingParams, kernels  # noqa: E402
from tiergen.bench import cpu_description  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dir", default="/var/tmp/tiergen-moe16")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--against", metavar="REV")
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    bench_moe_gguf.EXPERTS = args.experts
    llm = LLM(str(bench_moe_gguf.build(Path(args.dir) / bench_moe_gguf.file_name())))
    prompt, steps = [list(range(100, 116))], 32
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    llm.generate(prompt, params)  # warm-up
    one_call, this = moe._one_token, kernels.library()
    ways = {"one call": (one_call, this), "one by one": (lambda *a, **k: None, this),
            "shared expert apart": (lambda *a, shared=None: None if shared else one_call(*a),
                                    this)}
    if args.against:
        built = tempfile.TemporaryDirectory()  # (removed at exit)
        tmp = Path(built.name) / "rev"  # (build_at writes its sources beside it)
        tmp.mkdir()
        ways[f"one call at {args.against}"] = (one_call,
                                               kernels.bind(build_at(args.against, tmp / "k.so")))
    took: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.turns):
        for name, (way, lib) in ways.items():
            moe._one_token, kernels._lib = way, lib
            llm.generate(prompt, params)
            took[name].append(llm.last_stats.decode_seconds / steps * 1e3)
    moe._one_token, kernels._lib = one_call, this
    for name, ms in took.items():
        print(f"{name}: ms a decode step {[round(t, 1) for t in ms]}, median "
              f"{statistics.median(ms):.1f}")
    for other in ("one by one", "shared expert apart"):
        print(f"one call against {other}: "
              f"{statistics.median(took[other]) / statistics.median(took['one call']):.2f}x")
    if args.against:
        rev = statistics.median(took[f"one call at {args.against}"])
        print(f"this tree against {args.against}: {rev / statistics.median(took['one call']):.2f}x")


if __name__ == "__main__":
    main()
