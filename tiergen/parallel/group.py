"""The processes of a parallel run and the links between them, on torch.distributed (gloo).

Ranks form a grid: ``pipeline`` stages of ``tensor`` ranks each; rank r is shard
``r % tensor`` of stage ``r // tensor``. A stage's shards share its layers (tensor
parallelism, summing over their own group); stage s's shard t passes hidden states to stage
s+1's shard t.

On one machine rank 0 is the caller's process and starts the other ranks itself; across
machines every rank runs the same command under ``torchrun``, which sets RANK and
WORLD_SIZE. Rank 0 drives: it sends each command to the other ranks on a control group
(which may wait idle for as long as the user does), and every run's tensors travel point
to point on a data group whose waits end after ``timeout`` seconds, so a rank that dies or
stops answering stops the others with one error that names it.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tiergen.errors import TiergenError

# message tags: hidden states stage to stage, sampled tokens to all, log-probabilities to 0
HIDDEN, TOKENS, LOGPROBS = 0, 1, 2
IDLE = timedelta(days=365)  # the control group waits for the user's next command
# A new rank's interpreter imports torch before it can check in, which on a loaded machine
# takes longer than a short answer timeout; a rank that exits instead is reported at once.
START_TIMEOUT = 120.0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_stages(stages: int, tensor: int) -> int:
    """A run's pipeline stages: as asked, except that under torchrun one stage means the
    ranks torchrun started, over the tensor shards."""
    if under_torchrun() and stages == 1 and isinstance(tensor, int) and tensor > 0:
        size = int(os.environ["WORLD_SIZE"])
        if size % tensor == 0:
            return size // tensor
    return stages


class Group:
    """This process's place in the grid of ranks and its links to the others."""

    def __init__(self, rank: int, size: int, timeout: float, tensor: int = 1,
                 workers: list[subprocess.Popen] | None = None) -> None:
        self.rank, self.size, self.timeout, self.tensor = rank, size, timeout, tensor
        self.pipeline, self.stage, self.shard = size // tensor, rank // tensor, rank % tensor
        self.sampler = (self.pipeline - 1) * tensor  # samples; its tokens go to all
        self.workers = workers or []  # the ranks this process started (rank 0, one machine)
        answer = timedelta(seconds=timeout)
        # commands: the other ranks wait for rank 0's next one as long as the user pauses,
        # rank 0 for their taking it only as long as a rank answers
        self.control = dist.new_group(backend="gloo", timeout=answer if rank == 0 else IDLE)
        # agreeing during a run (every rank at work: one that does not answer has failed),
        # and while loading (one rank can take far longer than another)
        self.agreement = dist.new_group(backend="gloo", timeout=answer)
        self.loading = dist.new_group(backend="gloo", timeout=IDLE)
        self.shards = None  # this stage's tensor-parallel group (every rank makes every one)
        for s in range(self.pipeline if tensor > 1 else 0):
            g = dist.new_group(list(range(s * tensor, (s + 1) * tensor)), backend="gloo",
                               timeout=timedelta(seconds=timeout))
            self.shards = g if s == self.stage else self.shards
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.closed = False
        self.threads_before = 0  # this process's thread count before the pipeline shared cores

    # -- the data links ------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        """Send tensors as one message without waiting for it to arrive."""
        data = torch.cat([t.detach().reshape(-1).cpu().view(torch.uint8) for t in tensors])
        self._sends = [(w, d) for w, d in self._sends if not w.is_completed()]
        try:
            self._sends.append((dist.isend(data, dst, tag=tag), data))
        except RuntimeError as e:
            raise self.fault(dst, e) from None

    def recv(self, layouts: list[tuple[tuple[int, ...], torch.dtype]], src: int,
             tag: int) -> list[torch.Tensor]:
        """Receive one message holding tensors of the given shapes and dtypes."""
        sizes = [torch.Size(s).numel() * d.itemsize for s, d in layouts]
        data = torch.empty(sum(sizes), dtype=torch.uint8)
        try:
            dist.irecv(data, src, tag=tag).wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self.fault(src, e) from None
        return [part.view(d).reshape(s) for part, (s, d) in zip(data.split(sizes), layouts)]

    def share(self, tokens: list[torch.Tensor]) -> None:
        """The sampler: send a step's sampled tokens (if any) to every other rank."""
        for r in range(self.size) if tokens else ():
            if r != self.sampler:
                self.send(tokens, r, TOKENS)

    def send_object(self, obj: object, dst: int, tag: int) -> None:
        """Send a picklable object: its length, then its bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send([torch.tensor([len(data)])], dst, tag)
        self.send([data], dst, tag)

    def recv_object(self, src: int, tag: int) -> object:
        (size,) = self.recv([((1,), torch.long)], src, tag)
        (data,) = self.recv([((int(size),), torch.uint8)], src, tag)
        return pickle.loads(data.numpy().tobytes())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over this stage's shards (in float32, returned in x's dtype)."""
        total = x.float().cpu().contiguous()
        self._wait(dist.all_reduce(total, group=self.shards, async_op=True))
        return total.to(x.device, x.dtype)

    def all_gather(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every shard's x, whose last dims are ``widths``, joined along the last dim."""
        most = max(widths)
        mine = torch.nn.functional.pad(x.cpu(), (0, most - x.shape[-1])).contiguous()
        parts = [torch.empty_like(mine) for _ in widths]
        self._wait(dist.all_gather(parts, mine, group=self.shards, async_op=True))
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], -1).to(x.device)

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            peers = [r for r in range(self.stage * self.tensor, (self.stage + 1) * self.tensor)
                     if r != self.rank]
            raise self.fault(peers[0] if len(peers) == 1 else None, e) from None

    def flush(self) -> None:
        """Wait until every message sent has arrived."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            try:
                work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise self.fault(None, e) from None

    def fault(self, peer: int | None, error: Exception) -> TiergenError:
        """The error for a link that failed: it names the rank that died (one this process
        started and that was killed or exited), else the peer it was talking to; every rank
        this process started is stopped."""
        culprit, how = peer, "stopped answering"
        # a killed rank's sockets close a moment before its exit status can be read
        deadline = time.monotonic() + (1.0 if self.workers else 0.0)
        while not (dead := [(r, p.poll()) for r, p in enumerate(self.workers, 1)
                            if p.poll() is not None]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:  # one killed by a signal died first; the others exited on losing it
            culprit, code = min(dead, key=lambda d: (d[1] >= 0, d[0]))
            how = f"was killed by signal {-code}" if code < 0 else f"exited (code {code})"
        elif any(w in str(error).lower() for w in ("timed out", "timeout")):
            how = f"did not answer within {self.timeout:g} s"
        self.stop_workers()
        who = f"parallel rank {culprit}" if culprit is not None else "a parallel rank"
        return TiergenError(f"{who} {how}; rank {self.rank} stopped ({str(error).strip()[:200]})")

    # -- commands from rank 0 ------------------------------------------------------------
    def _collective(self, collective: Callable, *args, group) -> None:
        """A collective over one of the groups of every rank; a rank lost meanwhile (killed,
        or silent past the group's timeout) is a fault, named."""
        try:
            collective(*args, group=group)
        except RuntimeError as e:  # which rank failed is known only when there is one other
            raise self.fault(1 - self.rank if self.size == 2 else None, e) from None

    def command(self, obj: object) -> None:
        """Rank 0: hand every other rank a command (None: shut down)."""
        self._collective(dist.broadcast_object_list, [obj], 0, group=self.control)

    def next_command(self) -> object:
        """Any other rank: wait for rank 0's next command."""
        box = [None]
        self._collective(dist.broadcast_object_list, box, 0, group=self.control)
        return box[0]

    def agree(self, work: Callable[[], object], patient: bool = False) -> object:
        """Run ``work`` on every rank; if it fails on any, raise the first failure on all
        (rank 0 says which rank), so that no rank goes on alone. A rank that does not
        answer within the timeout has failed, unless ``patient`` (loading a model, which can
        take one rank far longer than another)."""
        try:
            result, failure = work(), None
        except Exception as e:
            result, failure = None, e
        errors: list[str | None] = [None] * self.size
        self._collective(dist.all_gather_object, errors, failure and str(failure),
                         group=self.loading if patient else self.agreement)
        if failure is not None:
            raise failure
        for r, e in enumerate(errors):
            if e is not None:
                raise TiergenError(f"parallel rank {r}: {e}")
        return result

    def close(self, graceful: bool = True) -> None:
        """Rank 0: tell the other ranks to stop and wait for them (``graceful=False``, after
        a failure: stop those it started at once); then leave the process group."""
        if self.closed:
            return
        self.closed = True
        if graceful and self.rank == 0 and all(p.poll() is None for p in self.workers):
            try:
                self.command(None)
                for p in self.workers:
                    p.wait(timeout=self.timeout)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        self.stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)

    def stop_workers(self) -> None:
        _stop(self.workers)


def _stop(workers: list[subprocess.Popen]) -> None:
    for p in workers:
        if p.poll() is None:
            p.kill()
        p.wait()


def _die_with_parent(parent: int) -> None:
    """Exit when rank 0's process is gone, so that no rank outlives it. (Linux's
    PR_SET_PDEATHSIG would fire when the *thread* that started this process ends, and a
    server loads its model on a thread that ends.)"""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="tiergen-parent-watch", daemon=True).start()


def launch(size: int, tensor: int, timeout: float, worker: Callable[[Group], None],
           threads: int) -> Group:
    """Rank 0 on one machine: start ranks 1..size-1 (fresh interpreters, so the caller's
    script is never imported again), each running ``worker`` on its own Group, and join
    them in a process group over loopback."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    workers = []
    for r in range(1, size):
        p = subprocess.Popen([sys.executable, "-m", "tiergen.parallel"], stdin=subprocess.PIPE)
        p.stdin.write(pickle.dumps((r, size, tensor, store.port, timeout, worker, threads,
                                    os.getpid())))
        p.stdin.close()
        workers.append(p)
    try:
        _wait_started(store, workers, timeout)
        dist.init_process_group("gloo", store=store, rank=0, world_size=size,
                                timeout=timedelta(seconds=timeout))
    except BaseException as e:
        failed = [f"rank {r} (exit code {p.returncode})"
                  for r, p in enumerate(workers, 1) if p.poll() is not None]
        _stop(workers)
        if failed:
            raise TiergenError(f"parallel {', '.join(failed)} failed to start; its output above "
                               "says why") from None
        raise TiergenError(f"the parallel ranks did not join ({e})") from None
    return Group(0, size, timeout, tensor, workers)


def _wait_started(store: dist.TCPStore, workers: list[subprocess.Popen], timeout: float) -> None:
    """Until every started rank has said so through the store; a rank that exits first (its
    arguments could not be unpickled, its interpreter failed) ends the wait at once, where
    joining the process group would wait out the whole timeout."""
    limit = max(timeout, START_TIMEOUT)
    deadline = time.monotonic() + limit
    waiting = set(range(1, len(workers) + 1))
    while waiting:
        if any(p.poll() is not None for p in workers):
            raise RuntimeError("a rank exited")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks {sorted(waiting)} did not start within {limit:g} s")
        waiting = {r for r in waiting if not store.check([f"tiergen/started/{r}"])}
        time.sleep(0.02)


def join_torchrun(timeout: float, tensor: int) -> Group:
    """Any rank started by torchrun: join the others through its environment."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout))
    return Group(dist.get_rank(), dist.get_world_size(), timeout, tensor)


def worker_main() -> None:
    """A rank started by :func:`launch` (``python -m tiergen.parallel``)."""
    rank, size, tensor, port, timeout, worker, threads, parent = pickle.load(sys.stdin.buffer)
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=timedelta(seconds=timeout))
    store.set(f"tiergen/started/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))
    try:
        worker(Group(rank, size, timeout, tensor))
    except TiergenError as e:
        print(f"tiergen: parallel rank {rank}: {e}", file=sys.stderr)
        sys.exit(1)

