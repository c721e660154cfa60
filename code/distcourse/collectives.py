"""Rank functions and helpers of chapter 03 (collective communication).

Functions ending in ``_demo`` run inside ranks started by ``distcourse.launch``
and return plain Python lists, so that the notebook can print and assert them.
Their data follow one rule, so that every number in a table tells where it came
from: rank r starts with ``[10r + 0, 10r + 1, ...]``.

The second half is a ring all-reduce written with point-to-point messages only,
a byte counter to measure its cost, and an in-process simulation of the same
ring that the exercise's self-check runs.
"""

from __future__ import annotations

import inspect
import math
import operator
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .common import numerics
from .common.timing import best_of
from .runtime.hardware import rank_device
from .runtime.i18n import number, tr


def _start(numel: int | None = None) -> torch.Tensor:
    """This rank's tensor ``[10r + 0, 10r + 1, ...]`` (world_size elements by default)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = n if numel is None else numel
    return torch.arange(numel, dtype=torch.float32, device=rank_device()) + 10 * rank


def _list(t: torch.Tensor) -> list:
    return t.cpu().tolist()


# --- 1. Vocabulary ----------------------------------------------------------------------


def whoami(gpus_per_node: int = 2) -> dict:
    """What a rank knows about itself, and where it would sit on nodes of ``gpus_per_node`` GPUs."""
    rank = dist.get_rank()
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "env": {key: int(os.environ[key]) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        # Launchers fill node 0 first, then node 1, ...: that is the whole rule.
        "node_if_2x2": rank // gpus_per_node,
        "local_rank_if_2x2": rank % gpus_per_node,
    }


def subgroup_demo(members=(0, 2)) -> dict:
    """All-reduce among ``members`` only; the other ranks keep their value."""
    rank = dist.get_rank()
    # Every rank must call new_group, members or not: creating a group is itself collective.
    group = dist.new_group(list(members))
    t = torch.tensor([10.0**rank], device=rank_device())  # 1, 10, 100, 1000: sums show who took part
    before = _list(t)
    if rank in members:
        dist.all_reduce(t, group=group)
    in_group = dist.get_rank(group)  # -1 on ranks outside the group
    return {"member": rank in members, "rank_in_group": in_group, "before": before, "after": _list(t)}


# --- 2. Point to point --------------------------------------------------------------------


def send_recv_demo() -> dict:
    """Rank 0 sends to rank 1 (blocking); rank 1 answers with isend/irecv (non-blocking)."""
    rank, device = dist.get_rank(), rank_device()
    t = torch.tensor([1.0, 2.0, 3.0], device=device) if rank == 0 else torch.zeros(3, device=device)
    before = _list(t)
    if rank == 0:
        # gloo: returns once rank 1 has taken the data. nccl: returns at once; only the GPU
        # stream waits (Work.wait() orders the current stream after the transfer).
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)
    received = _list(t)

    reply = t * 10 if rank == 1 else torch.zeros(3, device=device)
    if rank == 1:
        work = dist.isend(reply, dst=0)  # returns at once: a handle to wait on
    elif rank == 0:
        work = dist.irecv(reply, src=1)
    if rank in (0, 1):
        # ... free to compute here while the message travels ...
        work.wait()  # only now may the buffer be read (receiver) or reused (sender)
    return {"before": before, "after send/recv": received, "after isend/irecv": _list(reply)}


def everyone_sends_first() -> None:
    """Each rank sends to its right neighbour, then receives: a deadlock."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.send(_start(2), dst=(rank + 1) % n)  # blocks until the neighbour receives...
    dist.recv(torch.empty(2, device=rank_device()), src=(rank - 1) % n)  # ...which it never reaches


def ring_shift_demo() -> dict:
    """Each rank passes its tensor to the right neighbour and receives the left one's."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = _start(2)
    incoming = torch.empty_like(mine)
    # Post the send and the receive together, then wait for both: nobody waits for anybody first.
    ops = [dist.P2POp(dist.isend, mine, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"before": _list(mine), "after": _list(incoming)}


# --- 3. Collectives -------------------------------------------------------------------------


def broadcast_demo() -> dict:
    t = _start()
    before = _list(t)
    dist.broadcast(t, src=0)  # everyone ends with rank 0's tensor
    return {"before": before, "after": _list(t)}


def reduce_demo() -> dict:
    t = _start()
    before = _list(t)
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's result is defined
    return {"before": before, "after": _list(t)}


def all_reduce_sum_demo() -> dict:
    t = _start()
    before = _list(t)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {"before": before, "after": _list(t)}


def all_reduce_max_demo() -> dict:
    rank = dist.get_rank()
    t = torch.tensor([float(rank), float(-rank)], device=rank_device())
    before = _list(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # element by element
    return {"before": before, "after": _list(t)}


def gather_demo() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    t = _start(2)
    slots = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None
    dist.gather(t, gather_list=slots, dst=0)
    return {"before": _list(t), "after": [_list(s) for s in slots] if slots else None}


def scatter_demo() -> dict:
    rank, n, device = dist.get_rank(), dist.get_world_size(), rank_device()
    pieces = [torch.tensor([2.0 * i, 2.0 * i + 1], device=device) for i in range(n)] if rank == 0 else None
    t = torch.zeros(2, device=device)
    dist.scatter(t, scatter_list=pieces, src=0)
    return {"before": [_list(p) for p in pieces] if pieces else None, "after": _list(t)}


def reduce_scatter(output: torch.Tensor, inputs: list, native: bool = True) -> str:
    """``dist.reduce_scatter``, or the same result through all_reduce where a backend lacks it.

    Returns which one ran. (gloo has it in every release the course supports, 2.11 and later,
    and nccl always has; the fallback is for older releases, and for the forced comparison.)
    """
    if native:
        try:
            dist.reduce_scatter(output, inputs)
            return "native dist.reduce_scatter"
        except (RuntimeError, NotImplementedError):
            pass
    # Sum everything everywhere, keep our own chunk: right answer, twice the traffic.
    total = torch.stack(inputs)
    dist.all_reduce(total)
    output.copy_(total[dist.get_rank()])
    return "all_reduce, then keep own chunk"


def how_label(how: str) -> str:
    """What a demo's ``"how"`` says, for the reader: API names as they are, the words translated."""
    words = {
        "native dist.reduce_scatter": tr("native dist.reduce_scatter"),
        "all_reduce, then keep own chunk": tr("all_reduce, then keep own chunk"),
        "SUM, then / world size": tr("SUM, then / world size"),
    }
    return words.get(how, how)


def reduce_scatter_demo(native: bool = True) -> dict:
    t = _start()
    out = torch.empty(t.numel() // dist.get_world_size(), device=t.device)
    how = reduce_scatter(out, list(t.chunk(dist.get_world_size())), native=native)
    return {"before": _list(t), "after": _list(out), "how": how}


def reduce_scatter_fallback_demo() -> dict:
    return reduce_scatter_demo(native=False)


def all_gather_demo() -> dict:
    """All-gather the chunks that reduce-scatter left on each rank."""
    n = dist.get_world_size()
    t = _start()
    mine = torch.empty(t.numel() // n, device=t.device)
    reduce_scatter(mine, list(t.chunk(n)))
    slots = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(slots, mine)
    return {"before": _list(mine), "after": _list(torch.cat(slots))}


# The single-tensor names are new in PyTorch 2.13; older releases have only the names they
# replace (same arguments), so the course falls back to those there.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def single_tensor_demo() -> dict:
    """reduce_scatter and all_gather on one flat tensor each, as sharded training does."""
    n = dist.get_world_size()
    t = _start()
    piece = torch.empty(t.numel() // n, device=t.device)
    reduce_scatter_single(piece, t)  # input: n pieces back to back; rank r keeps the sum of piece r
    whole = torch.empty_like(t)
    all_gather_single(whole, piece)  # output: every rank's piece, back to back in rank order
    # The names these replace still work, but warn and say what to call instead.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_piece, old_whole = torch.empty_like(piece), torch.empty_like(t)
        dist.reduce_scatter_tensor(old_piece, t)
        dist.all_gather_into_tensor(old_whole, old_piece)
    return {
        "before": _list(t),
        "piece": _list(piece),
        "after": _list(whole),
        "old names, same result": torch.equal(old_piece, piece) and torch.equal(old_whole, whole),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)],
    }


def all_reduce_avg_demo() -> dict:
    """``ReduceOp.AVG`` where the backend has it, and the SUM-then-divide it stands for."""
    n = dist.get_world_size()
    t = _start()
    by_sum = t.clone()
    dist.all_reduce(by_sum, op=dist.ReduceOp.SUM)
    by_sum /= n
    avg = t.clone()
    try:
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        how = "ReduceOp.AVG"
    except (RuntimeError, ValueError):  # gloo before 2.11: "Cannot use ReduceOp.AVG with Gloo"
        avg, how = by_sum, "SUM, then / world size"
    return {"before": _list(t), "after": _list(avg), "sum / world size": _list(by_sum), "how": how}


DEMOS = {
    "broadcast": broadcast_demo,
    "reduce": reduce_demo,
    "all_reduce SUM": all_reduce_sum_demo,
    "all_reduce MAX": all_reduce_max_demo,
    "gather": gather_demo,
    "scatter": scatter_demo,
    "reduce_scatter": reduce_scatter_demo,
    "reduce_scatter via all_reduce": reduce_scatter_fallback_demo,
    "all_gather": all_gather_demo,
    "single-tensor": single_tensor_demo,
    "all_reduce AVG": all_reduce_avg_demo,
}


def tour() -> dict:
    """Run every demo once, in the same order on every rank (collectives must match up)."""
    return {name: demo() for name, demo in DEMOS.items()}


# --- 4. A ring all-reduce from point-to-point messages ----------------------------------------


@dataclass
class Traffic:
    """What one rank sent: number of messages and bytes."""

    messages: int = 0
    bytes: int = 0

    def count(self, t: torch.Tensor) -> None:
        self.messages += 1
        self.bytes += t.numel() * t.element_size()


def reduce_scatter_chunk(rank: int, step: int, n: int) -> int:
    """Index of the chunk ``rank`` sends to its right neighbour at ``step`` of the reduce-scatter phase."""
    return (rank - step) % n


def all_gather_chunk(rank: int, step: int, n: int) -> int:
    """Index of the chunk ``rank`` sends to its right neighbour at ``step`` of the all-gather phase."""
    return (rank + 1 - step) % n


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, traffic: Traffic | None) -> None:
    """Send one chunk to ``dst`` while receiving one from ``src``.

    Both are posted before either is waited on, so a ring of ranks cannot block
    each other. Empty chunks (tensor smaller than the ring) are skipped; sender
    and receiver agree on chunk sizes, so both skip the same message.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst))
        if traffic is not None:
            traffic.count(send)
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ring_all_reduce(tensor: torch.Tensor, traffic: Traffic | None = None) -> torch.Tensor:
    """Sum ``tensor`` (contiguous) over all ranks, in place, with sends and receives only."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)  # n views; sizes differ by at most one element

    # Reduce-scatter: pass partial sums around; after n-1 steps this rank holds the
    # complete sum of one chunk, (rank + 1) % n.
    for step in range(n - 1):
        send, recv = reduce_scatter_chunk(rank, step, n), reduce_scatter_chunk(left, step, n)
        incoming = torch.empty_like(chunks[recv])
        exchange(chunks[send], right, incoming, left, traffic)
        chunks[recv].add_(incoming)

    # All-gather: pass the complete chunks around; each arrives straight in place.
    for step in range(n - 1):
        send, recv = all_gather_chunk(rank, step, n), all_gather_chunk(left, step, n)
        exchange(chunks[send], right, chunks[recv], left, traffic)
    return tensor


def naive_all_reduce(tensor: torch.Tensor, traffic: Traffic | None = None) -> torch.Tensor:
    """Everybody sends its whole tensor to rank 0, which sums and sends the result back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    count = traffic.count if traffic is not None else (lambda t: None)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(incoming, src=src)
            tensor += incoming
        for dst in range(1, n):
            dist.send(tensor, dst=dst)
            count(tensor)
    else:
        dist.send(tensor, dst=0)
        count(tensor)
        dist.recv(tensor, src=0)
    return tensor


def ring_matches_builtin(sizes, seed: int = 0) -> list:
    """Compare ring_all_reduce with dist.all_reduce on integer-valued and on random floats."""
    rank, device = dist.get_rank(), rank_device()
    generator = torch.Generator().manual_seed(seed + rank)  # different data on every rank
    rows = []
    for numel in sizes:
        integers = torch.randint(-1000, 1000, (numel,), generator=generator).float()
        floats = torch.randn(numel, generator=generator)
        for kind, x in (("integers", integers), ("floats", floats)):
            x = x.to(device)
            theirs = x.clone()
            dist.all_reduce(theirs)
            ours = ring_all_reduce(x.clone())
            rows.append(
                {
                    "numel": numel,
                    "values": kind,
                    "equal": torch.equal(ours, theirs),
                    "max_abs_diff": (ours - theirs).abs().max().item(),
                    "relative_gap": numerics.relative_gap(ours, theirs),  # for numerics.rounding_bound
                }
            )
    return rows


def traffic_report(numel: int) -> dict:
    """Bytes and messages this rank sends in one ring and in one naive all-reduce of ``numel`` floats."""
    x = _start(numel)
    ring, naive = Traffic(), Traffic()
    ring_result = ring_all_reduce(x.clone(), ring)
    naive_result = naive_all_reduce(x.clone(), naive)
    return {
        "nbytes": x.numel() * x.element_size(),
        "ring": vars(ring),
        "naive": vars(naive),
        "same_result": torch.equal(ring_result, naive_result),
    }


# --- 5. Bandwidth ---------------------------------------------------------------------------


def bus_bandwidth(nbytes: float, seconds: float, n: int) -> float:
    """Bytes per second through each rank's link: what a ring all-reduce must move, over time."""
    return 2 * (n - 1) / n * nbytes / seconds


# How far (a factor) the knee must lie from both ends of a sweep for the curve to bend visibly in it.
KNEE_MARGIN = 4


def log_log_slope(xs, ys) -> float:
    """Least-squares slope of log(ys) against log(xs): 1 = proportional, 0 = flat."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def knee(sizes, seconds, n: int) -> dict:
    """Fit the α-β model T = α + 2(n-1)/n · S/β to one all-reduce curve and say where its knee lies.

    ``s_half`` is the size at which both terms are equal. ``where`` is ``"inside"`` when it lies
    at least KNEE_MARGIN times from both ends of ``sizes``: only then can the measured bus
    bandwidth bend within the sweep. ``"beyond"``: even the largest message is still overhead-bound
    (a Python ring on fast GPU links); ``"below"``: already the smallest is bandwidth-bound.
    ``small`` and ``large`` are the measured log-log slopes of bus bandwidth over the first and
    the last five sizes.
    """
    # Fit T = a + b·S with each point weighted by its relative error (divide by T), so that a
    # 1 KiB message counts as much as a 16 MiB one: a·(1/T) + b·(S/T) = 1, two normal equations.
    scale = max(sizes)  # sizes in units of the largest: keeps the 2 x 2 system well conditioned
    u = [1 / t for t in seconds]
    v = [s / scale / t for s, t in zip(sizes, seconds)]
    uu, uv, vv = sum(x * x for x in u), sum(x * y for x, y in zip(u, v)), sum(y * y for y in v)
    det = uu * vv - uv * uv
    a = (sum(u) * vv - sum(v) * uv) / det
    b = (sum(v) * uu - sum(u) * uv) / det / scale
    alpha = max(a, 0.0)
    s_half = alpha / b if b > 0 else math.inf  # α = S·b there; no size term at all: never
    if s_half > max(sizes) / KNEE_MARGIN:
        where = "beyond"
    elif s_half < min(sizes) * KNEE_MARGIN:
        where = "below"
    else:
        where = "inside"
    bw = [bus_bandwidth(s, t, n) for s, t in zip(sizes, seconds)]
    return {
        "alpha": alpha,
        "beta": 2 * (n - 1) / n / b if b > 0 else math.inf,
        "s_half": s_half,
        "where": where,
        "small": log_log_slope(sizes[:5], bw[:5]),
        "large": log_log_slope(sizes[-5:], bw[-5:]),
    }


def _best_seconds(op, x: torch.Tensor, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls: the one least disturbed by other programs.

    (On a busy 2-core machine single calls are sometimes descheduled for milliseconds;
    the fastest call estimates what the operation itself costs.)
    """

    def fresh_buffer_together():
        buffer = x.clone()
        dist.barrier()  # start together, so nobody's clock includes waiting for a late peer
        return buffer

    # The first round is a warm-up (allocations, connections).
    return best_of(op, repeats, x.device, warmup=1, setup=fresh_buffer_together)


def bandwidth_sweep(sizes_bytes, repeats) -> dict:
    """Best time of ring_all_reduce and dist.all_reduce for float32 messages of each size."""
    device = rank_device()
    result = {"sizes": list(sizes_bytes), "ring": [], "dist.all_reduce": [], "equal": []}
    for nbytes, reps in zip(sizes_bytes, repeats):
        x = torch.randint(0, 100, (nbytes // 4,), dtype=torch.float32).to(device)
        result["ring"].append(_best_seconds(ring_all_reduce, x, reps))
        result["dist.all_reduce"].append(_best_seconds(dist.all_reduce, x, reps))
        ours, theirs = ring_all_reduce(x.clone()), x.clone()
        dist.all_reduce(theirs)
        result["equal"].append(torch.equal(ours, theirs))  # integers: exact in any order
    return result


# --- The same ring, simulated in one process ----------------------------------------------------


def _chunk_index(schedule, rank: int, step: int, n: int) -> int:
    value = schedule(rank, step, n)
    try:
        index = operator.index(value)  # int, numpy or torch integer; not float, not None
    except TypeError:
        index = None
    if isinstance(value, bool) or index is None or not 0 <= index < n:
        name = getattr(schedule, "__name__", "schedule")
        raise ValueError(
            tr("{call} returned {value}, not a chunk index 0..{last}").format(
                call=f"{name}(rank={rank}, step={step}, n={n})", value=repr(value), last=n - 1
            )
        )
    return index


def simulate_ring(values, rs_chunk=reduce_scatter_chunk, ag_chunk=all_gather_chunk, direction: int = +1):
    """Run a ring all-reduce on ``len(values)`` simulated ranks; return each rank's final tensor.

    ``direction=+1``: rank r sends to r+1 (as ``ring_all_reduce``); ``-1``: to r-1.
    ``rs_chunk(rank, step, n)`` / ``ag_chunk(rank, step, n)`` say which chunk each rank sends.
    All ranks send at once; the receiver adds (reduce-scatter) or stores (all-gather)
    what it gets into the chunk with the same index.
    """
    n = len(values)
    chunks = [v.clone().tensor_split(n) for v in values]
    for phase, schedule in (("reduce-scatter", rs_chunk), ("all-gather", ag_chunk)):
        for step in range(n - 1):
            messages = [(r, _chunk_index(schedule, r, step, n)) for r in range(n)]
            payloads = [chunks[r][i].clone() for r, i in messages]  # what is on the wire
            for (r, i), data in zip(messages, payloads):
                target = chunks[(r + direction) % n][i]
                if phase == "reduce-scatter":
                    target.add_(data)
                else:
                    target.copy_(data)
    return [torch.cat(c) for c in chunks]


def ring_schedule(n: int) -> list:
    """Rows (phase, step, chunk sent by each rank) of ``ring_all_reduce`` on ``n`` ranks."""
    rows = []
    for phase, schedule in (("reduce-scatter", reduce_scatter_chunk), ("all-gather", all_gather_chunk)):
        rows += [(phase, step, [schedule(r, step, n) for r in range(n)]) for step in range(n - 1)]
    return rows


# --- Notebook display helpers -------------------------------------------------------------------


def _fmt(value) -> str:
    """Numbers as short as they can be (60.0 -> 60), in the reader's decimal sign; lists stay lists
    (items apart by "; " where a decimal comma would blur them); None is a dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}".replace(".", number(0.5, 1)[1])  # "0.5" or "0,5": the reader's decimal sign
    if isinstance(value, (list, tuple)):
        comma = any(isinstance(v, float) and "," in _fmt(v) for v in value)
        return "[" + ("; " if comma else ", ").join(_fmt(v) for v in value) + "]"
    return str(value)


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def before_after(results, name: str) -> str:
    """Markdown table of one demo's before/after per rank, from ``tour()`` results."""
    rows = [(rank, res[name]["before"], res[name]["after"]) for rank, res in enumerate(results)]
    return markdown_table([tr("rank"), tr("before"), tr("after")], rows)


def source(fn) -> str:
    """A function's source as a Markdown code block: what the ranks actually ran."""
    return "```python\n" + inspect.getsource(fn).rstrip() + "\n```"
