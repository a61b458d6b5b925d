"""Command line: ``tiergen generate`` for batches of prompts, ``tiergen chat`` to talk,
``tiergen serve`` for an OpenAI-compatible HTTP server, ``tiergen run-batch`` for a file of
OpenAI batch requests, ``tiergen plan`` for the fastest policy that fits, ``tiergen
calibrate`` to measure this machine, ``tiergen bench`` for throughput."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tiergen._platform import on_short_lived_thread  # (first: before torch)
from tiergen.errors import TiergenError


def _opt(*flags: str, **kwargs: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One option of a table below: add_argument's arguments."""
    return flags, kwargs


def _group(p: argparse.ArgumentParser, title: str,
           options: list[tuple[tuple[str, ...], dict[str, Any]]]) -> argparse._ArgumentGroup:
    g = p.add_argument_group(title)
    for flags, kwargs in options:
        g.add_argument(*flags, **kwargs)
    return g


MODEL_OPTIONS = [
    _opt("-m", "--model", default="smollm2",
         help="short name (smollm2), a Hugging Face model directory, a .gguf file, "
              "or a hub id org/name (default: smollm2)"),
    _opt("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
         help="compute dtype (auto: bfloat16 on CPUs with native bfloat16, else float32; "
              "the checkpoint's half type on GPU)"),
    _opt("--device", default=None,
         help="compute device, e.g. cpu or cuda (default: cuda if present, else cpu)"),
    _opt("--dequantize", action="store_true",
         help="decode a GGUF's quantised matrices to --dtype at load instead of keeping "
              "them packed (more memory; the float path)"),
    _opt("--activations", default="auto", choices=["auto", "float32", "int8", "int16"],
         help="how products with a GGUF's quantised matrices treat their inputs: int8 "
              "or int16 (quantised per row and multiplied by the integer kernels, on a "
              "CPU), float32 (decode-then-multiply) or auto (int8 on a CPU; default)"),
    _opt("--exact", action="store_const", const="float32", dest="activations",
         help="the float path for quantised matrices: --activations float32"),
    _opt("--batch-invariant", action="store_true",
         help="a prompt's tokens and log-probabilities the same whatever runs beside it "
              "(alone, in any batch, among concurrent requests) on the integer path too; "
              "decode steps of one or two sequences are slower, and prompts are computed "
              "whole"),
    _opt("--compile", action="store_true",
         help="compile batch-1 CPU matmuls: faster single-stream decode after a few "
              "seconds of compilation on first use"),
    _opt("--prefill-chunk-size", type=int, default=None,
         help="feed prompts in chunks of this many tokens, bounding prefill memory "
              "(default: 1024 on a CPU, 512 on a GPU; whole prompts with --batch-invariant)"),
    _opt("--no-share-prefixes", action="store_false", dest="share_prefixes", default=None,
         help="compute every prompt whole, even the prefix the prompts of a batch "
              "share (default: once, but not with --batch-invariant)"),
    _opt("--speculative-config", default=None, metavar="JSON",
         help='decode speculatively, checking each step\'s proposals in one pass (the output '
              'is the model\'s own): {"method": "ngram", "num_speculative_tokens": 8} copies '
              'what followed the text\'s last tokens earlier in it; {"method": "draft_model", '
              '"model": PATH, "num_speculative_tokens": 4} runs a smaller model of the same '
              'vocabulary ahead'),
    _opt("--max-batch-size", type=int, default=64,
         help="most prompts run together in one batch when --gpu-batch-size is not "
              "given (default: 64)"),
]


PARALLEL_OPTIONS = [
    _opt("--pipeline-parallel", type=int, default=1, metavar="P",
         help="split the layers over P processes that work at once; under "
              "torchrun, P defaults to its world size over T (default: 1)"),
    _opt("--tensor-parallel", type=int, default=1, metavar="T",
         help="split every layer's heads, MLP columns and experts over T "
              "processes (P x T in all; default: 1)"),
    _opt("--parallel-timeout", type=float, default=60.0, metavar="SECONDS",
         help="stop every rank when one has not answered for SECONDS (default: 60)"),
]


POLICY_OPTIONS = [
    _opt("--policy", choices=["auto"], default=None,
         help="auto: plan the fastest policy that fits the budgets for these prompts "
              "(see `tiergen plan`); also used when no --percent is given and the "
              "model does not fit the budgets on the device"),
    _opt("--percent", type=float, nargs=6, metavar=("WD", "WH", "CD", "CH", "HD", "HH"),
         help="percent of weights, KV cache and hidden states on the device (xD) and in "
              "host RAM (xH); disk takes the rest (default: 100 0 100 0 100 0)"),
    _opt("--gpu-batch-size", type=int, default=None,
         help="sequences per micro-batch (default: --max-batch-size)"),
    _opt("--num-gpu-batches", type=int, default=1,
         help="micro-batches per block sharing one trip of each layer's weights (default: 1)"),
    _opt("--no-pin-memory", action="store_true",
         help="do not pin host buffers (pinning speeds host-to-GPU copies)"),
    _opt("--no-keep-tiles", action="store_true",
         help="do not keep the integer kernels' weight tiles for batched decode steps "
              "on a CPU (they take 1.5 bytes a weight in host RAM)"),
    _opt("--cpu-attention", action="store_true",
         help="keep the KV cache in host RAM and run attention there"),
    _opt("--offload-dir", default=None,
         help="directory for weights converted for disk streaming and for spill files "
              "(default: ~/.cache/tiergen/offload)"),
    _opt("--device-memory", default=None, metavar="SIZE",
         help="budget for the compute device, e.g. 8G or 512M; plans that exceed it are refused"),
    _opt("--host-memory", default=None, metavar="SIZE",
         help="budget for host RAM, e.g. 16G; plans that exceed it are refused"),
    _opt("--experts", choices=["device", "host", "disk"], default=None,
         help="put the routed experts of mixture-of-experts models on this tier (off "
              "the device they run where they are when few tokens chose them; from "
              "disk only the chosen experts are read)"),
    _opt("--expert-cache", default=None, metavar="SIZE",
         help="host RAM that keeps routed experts read from disk for reuse, e.g. 2G "
              "(default: half of what --host-memory leaves after the weights)"),
    _opt("--compress-weights", action="store_true",
         help="store layer weight matrices quantised (see --compress-bits)"),
    _opt("--compress-cache", action="store_true",
         help="store the KV cache quantised (see --compress-bits)"),
    _opt("--compress-bits", type=int, default=4, choices=[4, 8],
         help="bits per number of compressed weights and cache (default: 4)"),
    _opt("--compress-group-size", type=int, default=64,
         help="numbers sharing one scale and minimum (default: 64)"),
    _opt("--attn-sparsity", type=float, default=1.0,
         help="fraction of the largest attention weights each decode query keeps "
              "(default: 1.0 = dense)"),
    _opt("--verbose", action="store_true",
         help="after the run, report time per layer as well as the totals"),
]


CONSTRAINT_OPTIONS = [
    _opt("--json-schema", default=None, metavar="SCHEMA",
         help="output JSON valid against this schema: its JSON text, or a file holding it"),
    _opt("--flexible-json", action="store_true",
         help="let --json-schema's output hold whitespace between tokens (default: "
              "compact JSON)"),
    _opt("--regex", default=None, metavar="PATTERN",
         help="output that matches this regular expression"),
    _opt("--grammar", default=None, metavar="LARK",
         help="output in this Lark grammar: its text, or a file holding it"),
]


# what the server and batch files take for requests that do not say
REQUEST_DEFAULTS = [
    _opt("--default-max-tokens", type=int, default=256,
         help="max_tokens of requests that give none (default: 256)"),
    _opt("--chat-template", help="a Jinja chat template to use instead of the model's"),
]


SERVER_OPTIONS = [*REQUEST_DEFAULTS,
    _opt("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"),
    _opt("--port", type=int, default=8000, help="port to listen on (default: 8000)"),
    _opt("--max-queue", type=int, default=256,
         help="most requests waiting for a place in the batch; more are answered with "
              "429 (default: 256)"),
    _opt("--api-key", metavar="KEY",
         help="require 'Authorization: Bearer KEY' on every /v1/ request (default: "
              "$TIERGEN_API_KEY; none: open)"),
    _opt("--queue-timeout", type=float, metavar="SECONDS",
         help="answer a request still waiting for a place after SECONDS with 503 "
              "(default: wait)"),
    _opt("--prefix-cache", default="1G", metavar="SIZE",
         help="prompt prefixes kept for the requests that follow, least recently used "
              "out first: a repeated system prompt or few-shot preamble skips its "
              "prefill (default: 1G; 0: none)"),
    _opt("--prefix-cache-disk", default="0", metavar="SIZE",
         help="prompt prefixes that leave the prefix cache go on to spill files in "
              "the offload directory, up to SIZE (default: 0, none)"),
]


BATCH_OPTIONS = [*REQUEST_DEFAULTS,
    _opt("-i", "--input", required=True, metavar="FILE", help="the requests (JSON lines)"),
    _opt("-o", "--output", required=True, metavar="FILE",
         help="the results (JSON lines), appended to; created if missing"),
]


def _add_model_options(p: argparse.ArgumentParser) -> None:
    _add_quantize_option(_group(p, "model", MODEL_OPTIONS))
    _group(p, "parallelism (several processes, each with its own share of the cores and of "
              "the budgets)", PARALLEL_OPTIONS)
    _group(p, "offloading policy", POLICY_OPTIONS)


def _add_quantize_option(g: argparse._ActionsContainer) -> None:
    from tiergen.weights.quantize import QUANTIZE_TYPES

    g.add_argument("--quantize", default=None, choices=list(QUANTIZE_TYPES),
                   help="quantise a float checkpoint's layer matrices into these GGML blocks at "
                        "load, to run them on the packed kernels; done once and cached "
                        "(default: keep them float)")


def _add_sampling_options(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most new tokens per prompt (default: 256)")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy; higher = more random (default: {temperature})")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already seen (default: 1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text appears (repeatable); the text is not returned")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    _group(p, "constrained output (at most one)", CONSTRAINT_OPTIONS)


def _params(args: argparse.Namespace):
    from tiergen.engine.sampler import SamplingParams

    if args.max_tokens < 1:  # 0 scores a prompt only, which the command line has no use for
        raise TiergenError(f"invalid sampling parameter: max_tokens must be a positive integer, "
                           f"got {args.max_tokens}")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=args.stop, ignore_eos=args.ignore_eos,
                          json_schema=_text_or_file(args.json_schema),
                          flexible_json=args.flexible_json, regex=args.regex,
                          grammar=_text_or_file(args.grammar))


def _text_or_file(value: str | None) -> str | None:
    """A constraint given inline, or the text of the file it names."""
    if value is None or not Path(value).is_file():
        return value
    try:
        return Path(value).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TiergenError(f"cannot read {value}: {e}") from None


def _policy(args: argparse.Namespace):
    from tiergen.offload.policy import Policy

    options = dict(gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches,
                   pin_memory=not args.no_pin_memory, cpu_attention=args.cpu_attention,
                   offload_dir=args.offload_dir, experts=args.experts,
                   expert_cache=args.expert_cache,
                   compress_weights=args.compress_weights, compress_cache=args.compress_cache,
                   compress_bits=args.compress_bits,
                   compress_group_size=args.compress_group_size, attn_sparsity=args.attn_sparsity,
                   keep_tiles=not args.no_keep_tiles)
    if args.percent:
        return Policy.from_percent(args.percent, **options)
    return Policy(**options)


def _load(args: argparse.Namespace, prompts: list[str] | None = None):
    """The LLM of the command line, with a planned policy under --policy auto (or when the
    default policy does not fit the budgets and no --percent was given)."""
    from tiergen.engine.llm import LLM
    from tiergen.weights import open_model

    files = open_model(args.model, packed=not args.dequantize,
                       quantize=args.quantize)  # once, planned or not
    chunk = "auto" if args.prefill_chunk_size is None else args.prefill_chunk_size

    def load(policy):
        return LLM(files, dtype=args.dtype, device=args.device,
                   max_batch_size=args.max_batch_size, policy=policy,
                   device_memory=args.device_memory, host_memory=args.host_memory,
                   compile=args.compile, prefill_chunk_size=chunk,
                   share_prefixes=args.share_prefixes, speculative_config=args.speculative_config,
                   activations=args.activations, batch_invariant=args.batch_invariant,
                   pipeline_parallel=getattr(args, "pipeline_parallel", 1),
                   tensor_parallel=getattr(args, "tensor_parallel", 1),
                   parallel_timeout=getattr(args, "parallel_timeout", 60.0))

    args.estimate = None
    if args.policy != "auto":
        try:
            return load(_policy(args))
        except TiergenError as e:
            if args.percent is not None or "budget" not in str(e):
                raise
            print("tiergen: the model does not fit the budgets on the device; planning a policy "
                  "(--policy auto)", file=sys.stderr)
    policy, args.estimate = _plan(args, files, prompts or [])
    return load(policy)


def _plan(args: argparse.Namespace, files, prompts: list[str]):
    from tiergen.devices import resolve_device, resolve_dtype
    from tiergen.engine.config import resolve_prefill_chunk
    from tiergen.offload.memory import Budgets
    from tiergen.planner import calibrate
    from tiergen.planner.cost import Workload
    from tiergen.planner.search import choose_policy, format_plan

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, files.default_dtype, files.packed)
    lengths = [len(files.tokenizer.encode(p)) if files.tokenizer else 1 for p in prompts] or [1]
    workload = Workload(max(lengths), args.max_tokens, len(lengths))
    budgets = Budgets.parse(args.device_memory, args.host_memory)
    cal = calibrate.get(device, progress=True)
    stages, tensor = _ranks(args)
    if stages * tensor > 1:
        from tiergen.planner.parallel import format_parallel, plan_parallel, with_link

        estimate = plan_parallel(files.config, dtype, workload, with_link(cal, True), budgets,
                                 stages, tensor, max_batch_size=args.max_batch_size,
                                 source=files.source)
        policy = estimate.policies
        text = format_parallel(estimate, files.config, dtype)
    else:
        chunk = resolve_prefill_chunk(args.prefill_chunk_size or "auto", args.batch_invariant,
                                      device.type)
        policy, estimate = choose_policy(files.config, dtype, workload, cal, device.type,
                                         budgets.for_tensors(device.type), args.max_batch_size,
                                         source=files.source, prefill_chunk=chunk)
        text = format_plan(estimate, files.config, dtype)
    for p in policy if isinstance(policy, list) else [policy]:
        p.offload_dir = args.offload_dir or p.offload_dir
    print(text, file=sys.stderr)
    return policy, estimate


def _ranks(args: argparse.Namespace) -> tuple[int, int]:
    """(pipeline stages, tensor shards) of the command, counted as the run counts them."""
    from tiergen.parallel.group import run_stages

    tensor = getattr(args, "tensor_parallel", 1)
    return run_stages(getattr(args, "pipeline_parallel", 1), tensor), tensor


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    source = "standard input" if args.file == "-" else args.file
    try:
        if args.file:
            stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
            with stream:
                prompts += [line.rstrip("\n") for line in stream if line.strip()]
        elif not prompts and not sys.stdin.isatty():
            source = "standard input"
            prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    except OSError as e:
        raise TiergenError(f"cannot read prompts from {source}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TiergenError(f"cannot read prompts from {source}: it is not UTF-8 text (byte "
                           f"{e.object[e.start:e.start + 1]!r} at offset {e.start})") from None
    if not prompts:
        raise TiergenError("no prompts: pass them as arguments, with --file FILE (one per line), "
                           "or on standard input")
    return prompts


def cmd_generate(args: argparse.Namespace) -> None:
    prompts = _read_prompts(args)
    params = _params(args)
    llm = _load(args, prompts)
    inputs = [llm.chat_prompt([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    if len(prompts) == 1 and not args.json:
        for ev in llm.stream(inputs, params):
            print(ev.text, end="", flush=True)
        print()
        if args.verbose:
            print(llm.last_stats.report(verbose=True), file=sys.stderr)
        return
    results = llm.generate(inputs, params, use_tqdm=True)
    print(llm.last_stats.report(args.verbose), file=sys.stderr)
    if getattr(args, "estimate", None) is not None:
        s = llm.last_stats
        measured = s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0
        print(f"planned policy: predicted decode {args.estimate.decode_tok_s:.1f} tok/s, "
              f"measured {measured:.1f} tok/s", file=sys.stderr)
    for prompt, r in zip(prompts, results):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": r.text, "finish_reason": r.finish_reason,
                              "prompt_tokens": r.num_prompt_tokens,
                              "completion_tokens": r.num_generated_tokens}, ensure_ascii=False))
        else:
            print(f"### {prompt}\n{r.text}\n")


def cmd_chat(args: argparse.Namespace) -> None:
    params = _params(args)
    llm = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    # Fail now, not after the first message, if the model cannot chat (no tokenizer, no
    # chat template, a template that does not render).
    llm.chat_prompt(messages + [{"role": "user", "content": "Hello"}], args.chat_template)
    print(f"Chatting with {llm.name}. /reset clears the conversation, /exit or Ctrl-D quits.",
          file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if user.strip() == "/exit":
            return
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        reply = []
        try:
            for ev in llm.stream([llm.chat_prompt(messages, args.chat_template)], params):
                print(ev.text, end="", flush=True)
                reply.append(ev.text)
        except KeyboardInterrupt:
            pass
        except TiergenError as e:  # e.g. the conversation outgrew the context: keep chatting
            messages.pop()
            print(f"tiergen: error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _serve_extra(command: str, module: str):
    """``module``, which needs the serve extra; a clear error for ``command`` without it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TiergenError(f"tiergen {command} needs the serve extra ({e.name} is missing): "
                           "pip install 'tiergen[serve]'") from None


def _check_default_max_tokens(args: argparse.Namespace) -> None:
    if args.default_max_tokens < 1:
        raise TiergenError(f"--default-max-tokens must be a positive integer, got "
                           f"{args.default_max_tokens}")


def _check_chat_template(llm, args: argparse.Namespace) -> None:
    """A --chat-template that does not render fails now, not on the first chat request."""
    if args.chat_template is not None:
        llm.chat_prompt([{"role": "user", "content": "Hello"}], args.chat_template)


def cmd_serve(args: argparse.Namespace) -> None:
    serve = _serve_extra("serve", "tiergen.server").serve
    if args.max_queue < 1:
        raise TiergenError(f"--max-queue must be a positive integer, got {args.max_queue}")
    _check_default_max_tokens(args)
    if args.queue_timeout is not None and not args.queue_timeout > 0:
        raise TiergenError(f"--queue-timeout must be a positive number of seconds, got "
                           f"{args.queue_timeout}")
    from tiergen.offload.policy import parse_size

    # a bad size fails before the model loads
    prefix_cache, prefix_cache_disk = parse_size(args.prefix_cache), parse_size(args.prefix_cache_disk)
    api_key = args.api_key or os.environ.get("TIERGEN_API_KEY") or None
    llm = on_short_lived_thread(lambda: _load(args))  # see on_short_lived_thread
    _check_chat_template(llm, args)
    serve(llm, args.host, args.port, model_names=[args.model], max_queue=args.max_queue,
          default_max_tokens=args.default_max_tokens, chat_template=args.chat_template,
          verbose=args.verbose, api_key=api_key, queue_timeout=args.queue_timeout,
          prefix_cache=prefix_cache, prefix_cache_disk=prefix_cache_disk)


def cmd_run_batch(args: argparse.Namespace) -> None:
    batch = _serve_extra("run-batch", "tiergen.batch")
    _check_default_max_tokens(args)
    source, output = Path(args.input), Path(args.output)
    if output.exists() and output.resolve() == source.resolve():
        raise TiergenError("--output must be another file than --input")
    lines = batch.read_input(source)  # a duplicate custom_id stops us before the model loads
    args.max_tokens = args.default_max_tokens  # what a planned policy's cache must hold
    llm = _load(args, batch.planning_texts(lines))
    _check_chat_template(llm, args)
    s = batch.run_batch(llm, lines, output, model_names=[args.model],
                  default_max_tokens=args.default_max_tokens, chat_template=args.chat_template)
    print(f"tiergen: {s.total} requests: {s.ok} answered now, {s.failed} with an error, "
          f"{s.skipped} already in {output}", file=sys.stderr)


# ----------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace) -> int:
    """``tiergen plan``: the fastest policy for a workload under the memory budgets, for the
    model and machine here, or on paper (``--config``, ``--machine``)."""
    from tiergen.offload.memory import Budgets, fmt
    from tiergen.planner import paper
    from tiergen.planner.cost import Workload
    from tiergen.planner.parallel import format_parallel, plan_parallel, with_link
    from tiergen.planner.search import (SearchRequest, format_plan, nothing_fits, policy_flags,
                                        search)
    from tiergen.weights import open_model

    for name in ("prompt_len", "gen_len", "batch", "top", "pipeline_parallel",
                 "tensor_parallel"):
        if getattr(args, name) < 1:
            raise TiergenError(f"--{name.replace('_', '-')} must be a positive integer, "
                               f"got {getattr(args, name)}")
    if args.config:
        (cfg, checkpoint_dtype), source, packed = paper.load_config(args.config), None, False
    else:
        files = open_model(args.model, packed=not getattr(args, "dequantize", False),
                           quantize=args.quantize)
        cfg, checkpoint_dtype, source = files.config, files.default_dtype, files.source
        packed = files.packed
    workload = Workload(args.prompt_len, args.gen_len, args.batch)
    if workload.prompt_len + workload.gen_len > cfg.context_length:
        raise TiergenError(f"--prompt-len {workload.prompt_len} plus --gen-len "
                           f"{workload.gen_len} exceeds the model's context of "
                           f"{cfg.context_length} tokens")
    cal, budgets, dtype = _machine(args, checkpoint_dtype, packed)
    device_type = cal.device_type
    compress = not args.no_compression
    stages, tensor = args.pipeline_parallel, args.tensor_parallel
    if stages * tensor > 1:
        if args.host_memory is None and budgets.host is not None:  # ranks share the RAM
            budgets = Budgets(budgets.device, budgets.host // (stages * tensor))
        e = plan_parallel(cfg, dtype, workload, cal if args.machine else with_link(cal, True),
                          budgets, stages, tensor, allow_compression=compress, source=source)
        print(format_parallel(e, cfg, dtype))
        return 0
    request = SearchRequest(cfg, dtype, workload, cal, device_type,
                            budgets.for_tensors(device_type), allow_compression=compress,
                            source=source)
    found = search(request)
    if not found.fits:
        raise nothing_fits(found, request)
    print(format_plan(found.fits[0], cfg, dtype))
    for e in found.fits[1:args.top]:
        print(f"  or         {policy_flags(e.policy)}: {e.total_tok_s:.1f} tok/s, "
              + ", ".join(f"{t} {fmt(n)}" for t, n in e.memory.items()))
    return 0


def _machine(args: argparse.Namespace, checkpoint_dtype, packed: bool):
    """The calibration, budgets and compute dtype of the plan (``packed``: the model's
    matrices stay packed): a machine profile's, or this machine's (measured now if it was
    never calibrated)."""
    import torch

    from tiergen.devices import resolve_device, resolve_dtype
    from tiergen.offload.memory import Budgets, available_ram
    from tiergen.offload.policy import parse_size
    from tiergen.planner import calibrate, paper

    def budget(text: str | None, default: int | None) -> int | None:
        return parse_size(text) if text else default

    if args.machine:
        m = paper.load_machine(args.machine)
        if args.device:
            raise TiergenError("--device and --machine exclude each other: the profile says "
                               f"which device it describes ({m.calibration.device})")
        dtype = (paper.default_dtype(m.calibration, checkpoint_dtype, packed)
                 if args.dtype == "auto" else getattr(torch, args.dtype))
        print(f"machine: {m.name}" + (f" ({m.note})" if m.note else ""))
        return (m.calibration, Budgets(budget(args.device_memory, m.budgets.device),
                                       budget(args.host_memory, m.budgets.host)), dtype)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, checkpoint_dtype, packed)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    cal = calibrate.load(device)
    if cal is None:
        print(f"tiergen: note: {device} is not calibrated yet; measuring it now (saved for "
              "next time, or run tiergen calibrate)", file=sys.stderr)
        cal = calibrate.get(device, progress=True)
    return cal, Budgets(budget(args.device_memory, gpu),
                        budget(args.host_memory, available_ram())), dtype


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from tiergen.planner import paper

    p = sub.add_parser(
        "plan", help="choose the fastest offloading policy that fits the memory budgets",
        description="Search offloading policies (weights, KV cache and hidden states over device, "
                    "host RAM and disk; micro-batch and block sizes; compression) for a workload, "
                    "predict each one's memory and speed from this machine's calibration, and "
                    "print the fastest that fits as tiergen generate flags.")
    p.add_argument("-m", "--model", default="smollm2",
                   help="short name (smollm2), a model directory or a .gguf file "
                        "(default: smollm2)")
    p.add_argument("--config", metavar="CONFIG",
                   help="plan on paper for a model's Hugging Face config.json instead of --model "
                        "(no weights needed), or a shipped one: " + ", ".join(paper.names(paper.CONFIGS)))
    p.add_argument("--machine", metavar="PROFILE",
                   help="plan for another machine: a profile JSON (tiergen calibrate's output, "
                        "or the same fields by hand) or a shipped one: "
                        + ", ".join(paper.names(paper.MACHINES)))
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default: 512)")
    p.add_argument("--gen-len", type=int, default=128,
                   help="tokens generated per prompt (default: 128)")
    p.add_argument("--batch", type=int, default=1, help="number of prompts (default: 1)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="device budget, e.g. 8G (default: the GPU's memory; none on a CPU)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host RAM budget, e.g. 16G (default: the RAM available now, or the "
                        "profile's under --machine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: auto, as tiergen generate picks it)")
    _add_quantize_option(p)
    p.add_argument("--device", default=None,
                   help="compute device, e.g. cpu or cuda (default: cuda if present, else cpu)")
    p.add_argument("--no-compression", action="store_true",
                   help="consider only uncompressed weights and KV cache")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="P",
                   help="plan P pipeline stages, each a process with its span of layers, its "
                        "share of the cores and its own budgets (default: 1)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="plan T tensor-parallel shards per stage (default: 1)")
    p.add_argument("--top", type=int, default=1, metavar="N",
                   help="also show the next best plans, N in all (default: 1)")
    p.set_defaults(func=cmd_plan)


# ----------------------------------------------------------------------------- calibrate


def _busy() -> str:
    """Why the measurements would run slow now (other processes on the CPUs), or ''."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    cores = os.cpu_count() or 1
    if load >= max(0.5, 0.25 * cores):
        return f"the machine is busy (load average {load:.1f} on {cores} logical cores)"
    return ""


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``tiergen calibrate``: measure afresh, print the result, save it to the cache."""
    import torch

    from tiergen.offload.policy import parse_size
    from tiergen.parallel import link
    from tiergen.parallel.group import under_torchrun
    from tiergen.planner.calibrate import calibrate, format_calibration, save

    if under_torchrun() and os.environ["RANK"] != "0":  # rank 0 measures, with this one
        link.measure_link(timeout=300.0)
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = parse_size(args.size)
    directory = Path(args.dir).expanduser() if args.dir else None
    busy = _busy()
    if busy:
        print(f"tiergen: note: {busy}; the numbers will be low, calibrate again when it is idle",
              file=sys.stderr)
    cal = calibrate(device, directory, size, progress=True)
    path = save(cal)
    print(format_calibration(cal))
    print(f"saved to {path}")
    return 0


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="measure disk, memory, transfer and compute speeds of this machine",
        description="Measure disk read, host memory and host<->device copy bandwidth, matmul "
                    "speed at large and few-row shapes (dense and packed), CPU decode "
                    "attention and the link between two parallel ranks, print them and save "
                    "them to ~/.cache/tiergen/calibration.json for the offload planner. "
                    "Always measures afresh (tens of seconds).")
    p.add_argument("--device", default=None,
                   help="compute device to measure, e.g. cpu, cuda or cuda:1 "
                        "(default: cuda if present, else cpu)")
    p.add_argument("--size", default="256M", metavar="SIZE",
                   help="size of the disk test file, e.g. 256M or 1G; larger is more accurate "
                        "on disks with big caches (default: 256M)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="directory on the disk to measure, where the test file is written and "
                        "removed (default: ~/.cache/tiergen)")
    p.set_defaults(func=cmd_calibrate)


# ----------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from tiergen import bench

    if min(args.batch + [args.prompt_len, args.gen_len, args.turns]) < 1:
        raise TiergenError("--batch, --prompt-len, --gen-len and --turns must be positive integers")
    peers = [p.strip() for p in args.against.split(",") if p.strip()] if args.against else []
    for peer in peers:
        if peer not in bench.PEERS:
            raise TiergenError(f"--against: unknown peer {peer!r}; choose from "
                               + ", ".join(bench.PEERS))
    started = time.perf_counter()
    llm = _load(args)
    load_seconds = time.perf_counter() - started
    threads = torch.get_num_threads()
    info = {**bench.cpu_description(), "threads": threads, "model": llm.name,
            "dtype": str(llm.dtype).removeprefix("torch."), "activations": llm.activations,
            "device": str(llm.device), "load_seconds": load_seconds, "runs": []}
    bench.run(llm, 1, min(8, args.prompt_len), 2)  # warm-up: kernels built, caches touched
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    if peers:
        results = bench.against(llm, args.model, peers, args.batch, args.prompt_len,
                                args.gen_len, args.turns, threads, say)
        info["runs"] = [bench.median_run(r["tiergen"]) for r in results.values()]
        info["against"] = {str(b): {p: runs for p, runs in r.items() if p != "tiergen"}
                           for b, r in results.items()}
        info["turns"] = {str(b): r["tiergen"] for b, r in results.items()}
    else:
        for batch in args.batch:
            info["runs"].append(bench.run(llm, batch, args.prompt_len, args.gen_len))
    if args.json:
        print(json.dumps(info))
        return
    print(f"{info['model']} on {info['device']} ({info['dtype']}); CPU: {info['cpu']} "
          f"[{' '.join(info['simd'])}], {threads} threads; loaded in {load_seconds:.2f}s")
    if peers:
        print(bench.table(results, args.prompt_len, args.gen_len))
        return
    print(f"{'batch':>5} {'prompt':>6} {'gen':>4} {'decode tok/s':>12} {'total tok/s':>11} "
          f"{'peak RSS':>9}")
    for r in info["runs"]:
        print(f"{r['batch']:5d} {r['prompt_len']:6d} {r['gen_len']:4d} {r['decode_tok_s']:12.1f} "
              f"{r['total_tok_s']:11.1f} {r['peak_rss_mb']:7.0f}MB")
    sys.stdout.flush()


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from tiergen import bench

    p = sub.add_parser("bench", help="measure throughput on this machine, batch size by batch size",
                       description=" ".join(bench.__doc__.split("\n\n")[1:3]).replace("\n", " "))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32],
                   help="batch sizes to run (default: 1 32)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default: 128)")
    p.add_argument("--gen-len", type=int, default=64, help="new tokens per prompt (default: 64)")
    p.add_argument("--against", default=None, metavar="PEERS",
                   help="also run these peers on the same workload, comma-separated: "
                        + ", ".join(bench.PEERS))
    p.add_argument("--turns", type=int, default=3,
                   help="with --against: turns of every engine; ratios are each turn's, "
                        "their median reported (default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    _add_model_options(p)
    p.set_defaults(func=cmd_bench)


def cmd_perplexity(args: argparse.Namespace) -> None:
    from tiergen.perplexity import SavedRun, evaluate, report, tokenize

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except OSError as e:
        raise TiergenError(f"cannot read {args.file}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TiergenError(f"cannot read {args.file}: it is not UTF-8 text") from None
    reference = None if args.kl_divergence is None else SavedRun(args.kl_divergence)
    args.max_tokens = args.ctx  # what a planned policy's cache must hold
    llm = _load(args)
    ids, bos = tokenize(llm, text)
    result = evaluate(llm, ids, args.ctx, args.chunks, progress=True, bos=bos,
                      save=args.save_logits, reference=reference)
    print(report(result, args.kl_divergence))
    if args.save_logits:
        print(f"saved the log-probabilities to {args.save_logits}", file=sys.stderr)


def add_perplexity_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perplexity", help="perplexity of a text; KL divergence against a saved run",
        description="Perplexity of a text file in windows of --ctx tokens, each run from an "
                    "empty cache and scored on its second half, as llama.cpp's llama-perplexity "
                    "does. --save-logits keeps the log-probabilities; --kl-divergence compares "
                    "this run with a saved one (e.g. a quantised model or another path against "
                    "the float path).")
    g = p.add_argument_group("perplexity")
    g.add_argument("-f", "--file", required=True, help="the text file (UTF-8)")
    g.add_argument("--ctx", type=int, default=512,
                   help="tokens per window; the second half of each is scored (default: 512)")
    g.add_argument("--chunks", type=int, default=None, metavar="K",
                   help="score only the first K windows (default: all of the text)")
    g.add_argument("--save-logits", metavar="FILE",
                   help="save the tokens and the scored log-probabilities to FILE "
                        "(safetensors) for a later --kl-divergence")
    g.add_argument("--kl-divergence", metavar="FILE",
                   help="compare with a run saved by --save-logits on the same text: mean, p99 "
                        "and max KL divergence, same top token, both perplexities")
    _add_model_options(p)
    p.set_defaults(func=cmd_perplexity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiergen", description="Run large language models across device memory, host RAM "
                                    "and disk at the highest throughput the hardware allows.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or many prompts",
                         description="Generate for prompts given as arguments, from a file (one "
                                     "per line) or from standard input. One prompt streams its "
                                     "text; many run in batches with a progress bar.")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("-f", "--file", help="read prompts from FILE, one per line ('-' = stdin)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (prompt, text, finish_reason, token counts)")
    _add_model_options(gen)
    _add_sampling_options(gen, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk with a model interactively (streams its replies)")
    chat.add_argument("--system", help="system message that opens the conversation")
    chat.add_argument("--chat-template", help="a Jinja chat template to use instead of the model's")
    _add_model_options(chat)
    _add_sampling_options(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="serve a model over HTTP with OpenAI's API",
                         description="Serve /v1/completions, /v1/chat/completions and /v1/models "
                                     "(OpenAI's API, streaming included), vLLM's /tokenize and "
                                     "/detokenize, /health and /metrics "
                                     "(Prometheus). Requests are batched continuously; --verbose logs "
                                     "every request.")
    _group(srv, "server", SERVER_OPTIONS)
    _add_model_options(srv)
    srv.set_defaults(func=cmd_serve)

    rb = sub.add_parser(
        "run-batch", help="run a file of OpenAI batch requests, writing a file of results",
        description="Run every request of an OpenAI batch file (JSON lines of {custom_id, "
                    "method, url, body} for /v1/completions and /v1/chat/completions) through "
                    "the offline engine, many at a time, and append each result line to the "
                    "output as tiergen serve would answer it. Results are saved group by group: "
                    "running the same command again resumes, skipping the custom_ids the "
                    "output already has.")
    _group(rb, "batch", BATCH_OPTIONS)
    _add_model_options(rb)
    rb.set_defaults(func=cmd_run_batch)

    add_calibrate_parser(sub)
    add_plan_parser(sub)
    add_bench_parser(sub)
    add_perplexity_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except TiergenError as e:
        print(f"tiergen: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        pass
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
