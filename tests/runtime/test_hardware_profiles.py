"""Hardware decisions checked on machines we do not have: CPU only, a Colab T4, 1-8 GPUs, two nodes.

Every decision (backend, devices, precision, pinning, threads) is a function of a ``Hardware``
description, so a GPU mistake shows up on a CPU. The second half scans what the course really
launches (``distcourse.launch`` calls in the English chapters and the package, torchrun command
lines with their ``--nnodes`` and ``--nproc-per-node``) and checks each launch on every profile:
no two NCCL ranks on one GPU, gloo on the CPU when the GPUs are too few, tensors on the
backend's device type, and runs that a cell compares with each other in the same precision.
"""

from __future__ import annotations

import ast
import operator
import pathlib
import re
from dataclasses import dataclass, field

import nbformat
import pytest
import torch
import torch.distributed as dist

from distcourse.runtime import hardware
from distcourse.runtime.hardware import Hardware, agent_env, conflicts, node_plan, plan

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROFILES = {
    "cpu": Hardware(cores=2),
    "colab-t4": Hardware(cores=2, gpus=1, gpu_bf16=False, gpu_names=("Tesla T4",), nccl_available=True),
    "1xA100": Hardware(cores=12, gpus=1, gpu_bf16=True, gpu_names=("NVIDIA A100-SXM4-40GB",)),
    "2xH100": Hardware(cores=32, gpus=2, gpu_bf16=True, gpu_names=("NVIDIA H100 80GB HBM3",) * 2),
    "4xA100": Hardware(cores=64, gpus=4, gpu_bf16=True, gpu_names=("NVIDIA A100-SXM4-80GB",) * 4),
    "8xH100": Hardware(cores=96, gpus=8, gpu_bf16=True, gpu_names=("NVIDIA H100 80GB HBM3",) * 8),
}
GPUS = [name for name, hw in PROFILES.items() if hw.gpus]


# ------------------------------------------------------------------ plans for one launch


@pytest.mark.parametrize(
    "profile, world_size, backend, devices, precision",
    [
        ("cpu", 1, "gloo", ("cpu",), "fp32"),
        ("cpu", 4, "gloo", ("cpu",) * 4, "fp32"),
        ("colab-t4", 1, "nccl", ("cuda:0",), "fp32"),  # a T4 has no bf16 units: fp32, never fp16
        ("colab-t4", 2, "gloo", ("cpu", "cpu"), "fp32"),
        ("1xA100", 1, "nccl", ("cuda:0",), "bf16"),
        ("1xA100", 2, "gloo", ("cpu", "cpu"), "fp32"),
        ("2xH100", 2, "nccl", ("cuda:0", "cuda:1"), "bf16"),
        ("2xH100", 3, "gloo", ("cpu",) * 3, "fp32"),
        ("4xA100", 4, "nccl", tuple(f"cuda:{i}" for i in range(4)), "bf16"),
        ("8xH100", 4, "nccl", tuple(f"cuda:{i}" for i in range(4)), "bf16"),
        ("8xH100", 8, "nccl", tuple(f"cuda:{i}" for i in range(8)), "bf16"),
    ],
)
def test_plan_on_each_profile(profile, world_size, backend, devices, precision):
    hw = PROFILES[profile]
    p = plan(world_size, hardware=hw)
    assert (p.backend, p.devices, p.precision) == (backend, devices, precision)
    assert p.device_type == ("cuda" if backend == "nccl" else "cpu")
    assert p.pin_memory is (p.device_type == "cuda")  # pinned buffers pay only for copies to a GPU
    assert p.threads == max(1, hw.cores // world_size) and (p.cores, p.gpus) == (hw.cores, hw.gpus)


def test_asking_for_what_the_machine_lacks_is_a_clear_error():
    with pytest.raises(ValueError, match="one GPU per rank"):
        plan(2, "nccl", hardware=PROFILES["1xA100"])
    with pytest.raises(ValueError, match="not available in this PyTorch build"):
        plan(1, "nccl", hardware=Hardware(cores=4, gpus=1, nccl_available=False))
    with pytest.raises(ValueError, match="precision"):
        plan(1, hardware=PROFILES["cpu"], precision="fp8")
    assert plan(2, "gloo", hardware=PROFILES["2xH100"]).devices == ("cpu", "cpu")


def test_a_pinned_precision_wins_over_the_automatic_one():
    hw = PROFILES["1xA100"]
    assert {plan(n, hardware=hw, precision="fp32").precision for n in (1, 2, 4)} == {"fp32"}
    assert plan(1, hardware=hw, precision="fp16").precision == "fp16"  # asked for, never chosen


def test_plan_without_hardware_is_this_machine():
    here = Hardware.detect()
    assert plan(2) == plan(2, hardware=here)
    assert here.gpus == torch.cuda.device_count() and here.cores == hardware.cpu_cores()


def test_hardware_fills_its_defaults_and_rejects_nonsense():
    hw = Hardware(cores=8, gpus=2)
    assert hw.gpu_ids == ("0", "1") and hw.gpu_names == ("GPU", "GPU") and hw.nccl_available
    assert not Hardware(cores=8, gpu_bf16=True).gpu_bf16  # no GPU, no bf16
    with pytest.raises(ValueError):
        Hardware(cores=0)
    with pytest.raises(ValueError):
        Hardware(cores=4, gpus=2, gpu_ids=("0",))


# ------------------------------------------------------------------ detecting, with faked CUDA queries


def _no_cuda_context(*args, **kwargs):
    raise AssertionError("this would initialise CUDA in the notebook's process")


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch's CUDA queries answering as a machine with a T4 (index 0) and an A100 (index 1).

    Everything that would initialise CUDA fails the test: detection must go through NVML's
    count and nvidia-smi only."""

    def install(visible: str | None, count: int):
        for name in ("is_available", "get_device_properties", "is_bf16_supported", "init", "current_device"):
            monkeypatch.setattr(torch.cuda, name, _no_cuda_context)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        rows = (
            hardware.SmiGpu("0", "GPU-aaaa1111", "Tesla T4", 7.5),
            hardware.SmiGpu("1", "GPU-bbbb2222", "NVIDIA A100-SXM4-40GB", 8.0),
        )
        monkeypatch.setattr(hardware, "nvidia_smi_gpus", lambda: rows)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    return install


def test_detect_reads_the_gpus_without_a_cuda_context(fake_gpus):
    fake_gpus(None, 2)
    hw = Hardware.detect()
    assert (hw.gpus, hw.gpu_ids, hw.gpu_names) == (2, ("0", "1"), ("Tesla T4", "NVIDIA A100-SXM4-40GB"))
    assert not hw.gpu_bf16 and hw.nccl_available  # the T4 has no bf16 units: not every rank would
    assert plan(2).precision == "fp32" and plan(2).backend == "nccl"
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("visible", ["1", "GPU-bbbb"])
def test_detect_follows_cuda_visible_devices(fake_gpus, visible):
    fake_gpus(visible, 1)
    hw = Hardware.detect()
    assert (hw.gpu_ids, hw.gpu_names, hw.gpu_bf16) == ((visible,), ("NVIDIA A100-SXM4-40GB",), True)
    assert plan(1).precision == "bf16" and plan(1).devices == ("cuda:0",)
    # a worker of an agent started from here must be given the GPU by this machine's name for it
    assert agent_env(None, 1, 1, 0) == {"CUDA_VISIBLE_DEVICES": visible}


def test_nvidia_smi_is_read_for_names_and_compute_capability(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in *compute_cap*) echo "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 9.0";'
        ' echo "1, GPU-bbbb, Tesla T4, 7.5";; *) exit 2;; esac\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    hardware.nvidia_smi_gpus.cache_clear()
    try:
        rows = hardware.nvidia_smi_gpus()
        assert [(r.index, r.name, r.compute_capability) for r in rows] == [
            ("0", "NVIDIA H100 80GB HBM3", 9.0),
            ("1", "Tesla T4", 7.5),
        ]
        smi.write_text('#!/bin/sh\ncase "$1" in *compute_cap*) exit 2;; *) echo "0, GPU-aaaa, Tesla V100";; esac\n')
        hardware.nvidia_smi_gpus.cache_clear()
        assert hardware.nvidia_smi_gpus() == (hardware.SmiGpu("0", "GPU-aaaa", "Tesla V100", None),)  # old driver
    finally:
        hardware.nvidia_smi_gpus.cache_clear()


# ------------------------------------------------------------------ torchrun agents, several on one machine


def _machine(gpus: int, nodes: int = 1) -> Hardware:
    return Hardware(cores=16, gpus=gpus, gpu_bf16=gpus > 0, nodes=nodes)


def test_two_agents_sharing_all_gpus_collide_on_gpu_0():
    """The bug made visible: each agent numbers its workers from LOCAL_RANK 0, and a worker
    takes cuda:LOCAL_RANK, so two one-worker agents that both see every GPU use the same one."""
    for gpus in (1, 2):
        hw = _machine(gpus)
        everything = ",".join(hw.gpu_ids)
        shared = [node_plan(hw, 2, 1, rank, visible_devices=everything) for rank in range(2)]
        assert [p.devices for p in shared] == [("cuda:0",), ("cuda:0",)]
        assert any("Duplicate GPU detected" in problem for problem in conflicts(shared))


@pytest.mark.parametrize(
    "gpus, nproc, expected",
    [
        (0, 1, ["", ""]),
        (1, 1, ["", ""]),  # one GPU, two agents: neither gets it, both run gloo on the CPU
        (2, 1, ["0", "1"]),
        (4, 1, ["0", "1"]),
        (2, 2, ["", ""]),
        (4, 2, ["0,1", "2,3"]),
        (8, 4, ["0,1,2,3", "4,5,6,7"]),
    ],
)
def test_two_nodes_on_one_machine(gpus, nproc, expected):
    hw = _machine(gpus)
    agents = [node_plan(hw, 2, nproc, rank) for rank in range(2)]
    assert [p.visible_devices for p in agents] == expected
    assert [agent_env(hw, 2, nproc, rank) for rank in range(2)] == [{"CUDA_VISIBLE_DEVICES": v} for v in expected]
    assert conflicts(agents) == []
    on_gpus = expected[0] != ""
    for p in agents:
        assert p.backend == ("nccl" if on_gpus else "gloo") and p.pin_memory is on_gpus
        assert p.devices == (tuple(f"cuda:{i}" for i in range(nproc)) if on_gpus else ("cpu",) * nproc)
        assert p.precision == ("bf16" if on_gpus else "fp32")
        assert p.threads == max(1, hw.cores // (2 * nproc))


def test_agents_on_separate_machines_each_use_their_own_gpus():
    hw = _machine(1, nodes=2)
    agents = [node_plan(hw, 2, 1, rank) for rank in range(2)]
    assert [p.backend for p in agents] == ["nccl", "nccl"] and [p.visible_devices for p in agents] == ["0", "0"]


def test_an_agents_own_cuda_visible_devices_is_honoured():
    hw = _machine(4)
    assert node_plan(hw, 2, 1, 1, visible_devices="3").gpus == ("3",)
    assert node_plan(hw, 2, 2, 0, visible_devices="2").backend == "gloo"  # one GPU for two workers
    assert node_plan(hw, 1, 1, 0, visible_devices="7").backend == "gloo"  # no such GPU here
    with pytest.raises(ValueError, match="node_rank"):
        node_plan(hw, 2, 1, 2)


def test_agents_that_disagree_on_the_backend_are_reported():
    hw = _machine(2)
    mixed = [node_plan(hw, 2, 1, 0, visible_devices="0"), node_plan(hw, 2, 1, 1, visible_devices="")]
    assert any("different backends" in problem for problem in conflicts(mixed))


def test_gpus_named_by_the_parents_cuda_visible_devices():
    hw = Hardware(cores=8, gpus=2, gpu_ids=("4", "6"))  # this process was started with CUDA_VISIBLE_DEVICES=4,6
    assert [agent_env(hw, 2, 1, rank) for rank in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "4"},
        {"CUDA_VISIBLE_DEVICES": "6"},
    ]


@pytest.mark.parametrize(
    "command, shape",
    [
        (["torchrun", "--standalone", "--nproc-per-node=2", "train.py"], (1, 2, None)),
        (["python", "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node", "1", "-m", "x"], (2, 1, None)),
        (["torchrun", "--nnodes", "2", "--node-rank=1", "--nproc-per-node=4", "-m", "x", "--nnodes=9"], (2, 4, 1)),
        (["python", "-m", "torch.distributed.launch", "--use-env", "--nproc-per-node=1", "x.py"], (1, 1, None)),
        (["torchrun", "--nproc-per-node=gpu", "x.py"], (1, 4, None)),
        (["python", "train.py", "--nproc-per-node=2"], None),
    ],
)
def test_torchrun_shape(command, shape):
    assert hardware.torchrun_shape(command, hardware=_machine(4)) == shape


def test_torchrun_agent_env():
    node = ["torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "-m", "distcourse.train"]
    hw = _machine(2)
    assert [hardware.torchrun_agent_env(node, rank, hw) for rank in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    assert hardware.torchrun_agent_env(["python", "-m", "distcourse.train"], 0, hw) == {}


# ------------------------------------------------------------------ what the course launches, found statically


UNKNOWN = object()  # a value the scan cannot work out without running the code
ANY_WORLD_SIZE = (1, 2, 3, 4)  # the world sizes the chapters use, for a launch whose size is a parameter
_OPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}
_OPS |= {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Add: operator.add, ast.Sub: operator.sub}
_OPS |= {ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


@dataclass
class Source:
    """One unit the scan reads: a notebook cell (with the notebook's earlier assignments) or a module."""

    where: str
    tree: ast.Module
    text: str
    names: dict[str, ast.expr] = field(default_factory=dict)  # top-level NAME = value, last one wins
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)

    def __post_init__(self):
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        for stmt in self.tree.body:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
                continue
            target, value = stmt.targets[0], stmt.value
            if isinstance(target, ast.Name):
                self.names[target.id] = value
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts):  # K, LR = 2, 0.1
                    if isinstance(t, ast.Name):
                        self.names[t.id] = v

    def ancestors(self, node: ast.AST):
        while node in self.parents:
            child, node = node, self.parents[node]
            yield child, node


def _code(source: str) -> str:
    """A cell's Python: IPython magics and shell lines blanked out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def sources() -> list[Source]:
    found = []
    for path in sorted((ROOT / "chapters" / "en").glob("[0-9][0-9]-*.ipynb")):
        names: dict[str, ast.expr] = {}
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":
                src = Source(f"{path.stem} cell {i}", ast.parse(_code(cell.source)), cell.source)
                names = src.names = {**names, **src.names}  # what earlier cells defined, and this one
                found.append(src)
    for path in sorted((ROOT / "code" / "distcourse").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found.append(Source(str(path.relative_to(ROOT)), ast.parse(text), text))
    return found


class Scan:
    """Values of expressions around a launch call, on one hardware profile."""

    def __init__(self, src: Source, hw: Hardware):
        self.src, self.hw = src, hw

    def bindings(self, call: ast.AST) -> dict[str, set | object]:
        """Names bound around ``call``: loop variables (each to the set of values it takes) and
        parameters of enclosing functions (their defaults, else unknown)."""
        bound: dict[str, set | object] = {}
        for child, node in self.src.ancestors(call):
            if isinstance(node, (ast.For, ast.comprehension)) and child is not node.target:
                for name, values in self.unpack(node.target, self.items(node.iter, bound)).items():
                    bound.setdefault(name, values)
            elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                for gen in node.generators:
                    for name, values in self.unpack(gen.target, self.items(gen.iter, bound)).items():
                        bound.setdefault(name, values)
            elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
                defaults += node.args.kw_defaults
                for arg, default in zip(args, defaults):
                    bound.setdefault(arg.arg, self.value(default, bound) if default is not None else UNKNOWN)
                for stmt in node.body if isinstance(node, ast.FunctionDef) else []:
                    if isinstance(stmt, ast.Assign) and [type(t) for t in stmt.targets] == [ast.Name]:
                        bound.setdefault(stmt.targets[0].id, self.value(stmt.value, bound))
        return bound

    def items(self, node: ast.expr, bound) -> list | object:
        """The elements a loop over ``node`` visits, as Python values (UNKNOWN inside where needed)."""
        if isinstance(node, ast.Name) and node.id not in bound and node.id in self.src.names:
            return self.items(self.src.names[node.id], bound)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [self.literal(e, bound) for e in node.elts]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            mapping = node.func.value
            if isinstance(mapping, ast.Name) and mapping.id in self.src.names:
                mapping = self.src.names[mapping.id]
            if isinstance(mapping, ast.Dict) and node.func.attr in ("items", "keys", "values"):
                keys = [self.literal(k, bound) for k in mapping.keys]
                values = [self.literal(v, bound) for v in mapping.values]
                return {"items": list(zip(keys, values)), "keys": keys, "values": values}[node.func.attr]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            bounds = [self.single(a, bound) for a in node.args]
            if all(isinstance(b, int) for b in bounds):
                return list(range(*bounds))
        return UNKNOWN

    def literal(self, node: ast.expr, bound):
        if isinstance(node, ast.Tuple):
            return tuple(self.literal(e, bound) for e in node.elts)
        return self.single(node, bound)

    def single(self, node: ast.expr, bound):
        values = self.value(node, bound)
        return next(iter(values)) if isinstance(values, set) and len(values) == 1 else UNKNOWN

    def unpack(self, target: ast.expr, items) -> dict[str, set | object]:
        if isinstance(target, ast.Name):
            if items is UNKNOWN or any(i is UNKNOWN for i in items):
                return {target.id: UNKNOWN}
            try:
                return {target.id: set(items)}
            except TypeError:  # unhashable elements (lists): nothing a launch's size depends on
                return {target.id: UNKNOWN}
        if isinstance(target, ast.Tuple):
            out = {}
            for k, elt in enumerate(target.elts):
                parts = UNKNOWN
                if items is not UNKNOWN and all(isinstance(i, tuple) and len(i) == len(target.elts) for i in items):
                    parts = [i[k] for i in items]
                out |= self.unpack(elt, parts)
            return out
        return {}

    def value(self, node: ast.expr, bound, depth: int = 0) -> set | object:
        """The set of values ``node`` can take on this profile, or UNKNOWN."""
        if depth > 20:
            return UNKNOWN
        if isinstance(node, ast.Constant):
            return {node.value}
        if isinstance(node, ast.Name):
            if node.id in bound:
                return bound[node.id]
            return self.value(self.src.names[node.id], {}, depth + 1) if node.id in self.src.names else UNKNOWN
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            return {"gpu_count": {self.hw.gpus}, "cpu_cores": {self.hw.cores}}.get(name, UNKNOWN)
        if isinstance(node, ast.JoinedStr):  # an f-string: known when each of its fields is
            parts = [
                self.value(v.value if isinstance(v, ast.FormattedValue) else v, bound, depth + 1) for v in node.values
            ]
            if any(p is UNKNOWN or len(p) != 1 for p in parts):
                return UNKNOWN
            return {"".join(str(next(iter(p))) for p in parts)}
        if isinstance(node, ast.IfExp):
            test = self.value(node.test, bound, depth + 1)
            if test is UNKNOWN:
                return UNKNOWN
            branches = [node.body] * any(test) + [node.orelse] * (not all(test))
            results = [self.value(b, bound, depth + 1) for b in branches]
            return UNKNOWN if UNKNOWN in results else set().union(*results)
        return self.combine(node, bound, depth)

    def combine(self, node: ast.expr, bound, depth: int) -> set | object:
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPS:
            pair, op = (node.left, node.comparators[0]), _OPS[type(node.ops[0])]
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            pair, op = (node.left, node.right), _OPS[type(node.op)]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = self.value(node.operand, bound, depth + 1)
            return UNKNOWN if inner is UNKNOWN else {not v for v in inner}
        else:
            return UNKNOWN
        left, right = (self.value(n, bound, depth + 1) for n in pair)
        if UNKNOWN in (left, right):
            return UNKNOWN
        try:
            return {op(a, b) for a in left for b in right}
        except TypeError:
            return UNKNOWN

    def reached(self, call: ast.AST) -> bool:
        """False when an enclosing ``if`` rules the call out on this profile (e.g. ``if gpus:``)."""
        bound = self.bindings(call)
        for child, node in self.src.ancestors(call):
            if isinstance(node, (ast.If, ast.IfExp)) and child is not node.test:
                test = self.value(node.test, bound)
                if test is UNKNOWN:
                    continue
                truths = {bool(v) for v in test}
                in_body = child in (node.body if isinstance(node.body, list) else [node.body])
                if truths == {not in_body}:
                    return False
        return True


# ------------------------------------------------------------------ launches


def _called(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


@dataclass
class Launch:
    """A ``launch(fn, world_size, ...)`` call."""

    src: Source
    call: ast.Call

    @property
    def where(self) -> str:
        return self.src.where if " cell " in self.src.where else f"{self.src.where}:{self.call.lineno}"

    def world_size(self) -> ast.expr | None:
        given = {k.arg: k.value for k in self.call.keywords}
        return self.call.args[1] if len(self.call.args) > 1 else given.get("world_size")

    def requests(self, hw: Hardware) -> list[tuple[int, str | None, bool]] | None:
        """(world size, backend asked for, whether the size is known) for each way the call can
        run on ``hw``; None when an enclosing ``if`` rules it out there."""
        scan = Scan(self.src, hw)
        if not scan.reached(self.call):
            return None
        bound = scan.bindings(self.call)
        sizes = scan.value(self.world_size(), bound)
        known = sizes is not UNKNOWN and all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)
        backend = next((k.value for k in self.call.keywords if k.arg == "backend"), None)
        backends = {None} if backend is None else scan.value(backend, bound)
        backends = {None} if backends is UNKNOWN else backends
        return [(n, b, known) for n in (sorted(sizes) if known else ANY_WORLD_SIZE) for b in sorted(backends, key=str)]


def launches(found: list[Source]) -> list[Launch]:
    calls = [
        Launch(src, node)
        for src in found
        for node in ast.walk(src.tree)
        if isinstance(node, ast.Call) and _called(node) == "launch" and len(node.args) + len(node.keywords) >= 2
    ]
    return [c for c in calls if c.world_size() is not None]


SOURCES = sources()
LAUNCHES = launches(SOURCES)


def test_the_scan_finds_the_launches():
    """A scan that finds nothing would check nothing: it must see what the chapters do."""
    in_chapters = [c for c in LAUNCHES if " cell " in c.where]
    in_package = [c for c in LAUNCHES if c.where.startswith("code/")]
    assert len(in_chapters) >= 50 and len(in_package) >= 3, (len(in_chapters), len(in_package))
    cpu = PROFILES["cpu"]
    sizes = {c.where: sorted({n for n, _, known in c.requests(cpu) or [] if known}) for c in in_chapters}
    assert sizes["12-capstone-at-scale cell 6"] == [1, 2, 4]  # through a dict of layouts
    assert sizes["03-collectives cell 41"] == [2, 3, 4]  # through a comprehension
    assert sizes["04-ddp-in-practice cell 39"] == [1, 2]  # through a list of configurations
    unknown = [c.where for c in in_chapters if any(not known for _, _, known in c.requests(cpu) or [])]
    assert not unknown, f"launches in chapters whose world size the scan cannot work out: {unknown}"
    assert PROFILES["8xH100"].gpus == 8 and LAUNCHES[0].requests(PROFILES["8xH100"]) is not None


def _plan_problems(where: str, n: int, backend: str | None, known: bool, hw: Hardware) -> list[str]:
    try:
        p = plan(n, backend, hardware=hw)
    except ValueError as exc:
        return [f"{where}: world_size={n}, backend={backend!r} is refused: {exc}"] if known else []
    problems = []
    gpus = [d for d in p.devices if d.startswith("cuda")]
    if p.backend == "nccl" and (len(set(gpus)) != n or any(int(d.split(":")[1]) >= hw.gpus for d in gpus)):
        problems.append(f"{where}: {n} NCCL ranks on {p.devices}, {hw.gpus} GPU(s)")
    if backend is None and n > hw.gpus and (p.backend, set(p.devices)) != ("gloo", {"cpu"}):
        problems.append(f"{where}: {n} ranks, {hw.gpus} GPU(s), but {p.backend} on {p.devices}")
    if set(p.devices) != ({"cpu"} if p.backend == "gloo" else set(gpus)) or len(p.devices) != n:
        problems.append(f"{where}: {p.backend} with tensors on {p.devices}")  # collectives need the group's device
    return problems


@pytest.mark.parametrize("profile", PROFILES)
def test_every_launch_has_a_gpu_per_nccl_rank_or_runs_gloo_on_the_cpu(profile):
    hw = PROFILES[profile]
    problems = []
    for call in LAUNCHES:
        for n, backend, known in call.requests(hw) or []:
            problems += _plan_problems(call.where, n, backend, known, hw)
    assert not problems, "\n".join(problems)


def test_rank_device_is_the_device_of_the_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    assert hardware.rank_device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    assert hardware.rank_device() == torch.device("cpu")


# Cells that launch several world sizes whose automatic precision differs on some machines, and
# whose runs are never compared with each other: each run is checked on its own. Any other cell
# that does this must pin one precision (or backend), or the test fails.
INDEPENDENT_RUNS = {
    "03-collectives cell 41": "each world size's ring all-reduce is compared with dist.all_reduce in the same run",
    "03-collectives cell 45": "byte and message counts per world size; no arithmetic is compared across runs",
}
PINNED = re.compile(r"--precision|\bprecision\s*=|[\"']precision[\"']\s*:")


def mixed_precision_cells(hw: Hardware, calls: list[Launch] = LAUNCHES) -> dict[str, dict[int, str]]:
    """Cells whose launches of different world sizes get different precisions on ``hw``."""
    by_cell: dict[str, dict[int, set[str]]] = {}
    for call in calls:
        if " cell " not in call.where or PINNED.search(call.src.text):
            continue
        for n, backend, known in call.requests(hw) or []:
            if known:
                precision = plan(n, backend, hardware=hw).precision
                by_cell.setdefault(call.where, {}).setdefault(n, set()).add(precision)
    return {
        cell: {n: "/".join(sorted(p)) for n, p in sizes.items()}
        for cell, sizes in by_cell.items()
        if len(sizes) > 1 and len(set().union(*sizes.values())) > 1
    }


@pytest.mark.parametrize("profile", PROFILES)
def test_runs_a_cell_compares_use_one_precision(profile):
    mixed = mixed_precision_cells(PROFILES[profile])
    new = {cell: sizes for cell, sizes in mixed.items() if cell not in INDEPENDENT_RUNS}
    assert not new, f"cells comparing world sizes in different precisions (pin one): {new}"


CAPSTONE_CELL = """
base = ["--steps", "30", "--progress", "off"]
layouts = {"1 rank": (1, ["--batch-size", "16"]), "2 ranks": (2, ["--batch-size", "8"]), "4 ranks": (4, [])}
runs = {name: distcourse.launch(capstone.main, n, args=(base + extra,)) for name, (n, extra) in layouts.items()}
"""


def test_the_precision_scan_sees_a_comparison_across_precisions():
    """The capstone's tokens-per-second cell before it pinned fp32: on one A100 its 1-rank run was
    bf16 on the GPU and its 2- and 4-rank runs fp32 on the CPU."""
    cell = Source("12-capstone-at-scale cell 6", ast.parse(CAPSTONE_CELL), CAPSTONE_CELL)
    calls = launches([cell])
    assert mixed_precision_cells(PROFILES["1xA100"], calls) == {cell.where: {1: "bf16", 2: "fp32", 4: "fp32"}}
    assert mixed_precision_cells(PROFILES["4xA100"], calls) == {}  # every run on a GPU of its own
    assert mixed_precision_cells(PROFILES["colab-t4"], calls) == {}  # fp32 everywhere, but see the devices
    pinned = CAPSTONE_CELL.replace('"off"]', '"off", "--precision", "fp32"]')
    assert mixed_precision_cells(PROFILES["1xA100"], launches([Source(cell.where, ast.parse(pinned), pinned)])) == {}


# ------------------------------------------------------------------ torchrun command lines

TORCHRUN_FLAGS = ("--nproc", "--nnodes", "--standalone")
# A command line in text (a docstring, a script in a string): "torchrun ...", "# python -m torch.distributed.launch ..."
COMMAND_LINE = re.compile(
    r"^[ \t]*(?:[#$][ \t]*)?((?:torchrun|python -m torch\.distributed\.(?:launch|run))[ \t](?:[^\n]*\\\n)*[^\n]*)", re.M
)  # with "\" continuations


@dataclass
class Torchrun:
    """A torchrun command line: built by a call (``tt.torchrun(...)``, an argv list) or written in text."""

    where: str
    tokens: list[str]

    def shapes(self, hw: Hardware) -> list[tuple[int, int]]:
        """(nnodes, nproc_per_node) it can run with; sizes it cannot read count as 1 or 2."""
        options = hardware.torchrun_options(self.tokens) or {}
        nnodes = options.get("--nnodes", "1").split(":")[-1]
        nodes = [1] if "--standalone" in options else [int(nnodes)] if nnodes.isdigit() else [1, 2]
        nproc = options.get("--nproc-per-node", "1")
        named = {"gpu": hw.gpus, "cpu": hw.cores, "auto": hw.gpus or hw.cores}
        procs = [int(nproc)] if nproc.isdigit() else [named[nproc]] if nproc in named else [1, 2]
        return [(n, p) for n in nodes for p in procs if p > 0]


def _tokens(scan: Scan, node: ast.AST, bound) -> list[str]:
    if isinstance(node, ast.Call):
        return [t for a in node.args for t in _tokens(scan, a, bound)]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [t for e in node.elts for t in _tokens(scan, e, bound)]
    if isinstance(node, ast.Starred):
        return _tokens(scan, node.value, bound)
    value = scan.value(node, bound)
    return [str(next(iter(value)))] if isinstance(value, set) and len(value) == 1 else ["?"]


def _command(scan: Scan, literal: ast.AST) -> tuple[ast.AST, list[str]] | None:
    """The call (or assigned list) a torchrun option literal belongs to, and its tokens."""
    for child, node in scan.src.ancestors(literal):
        if isinstance(node, ast.Call) or (isinstance(node, ast.Assign) and child is node.value):
            target = node if isinstance(node, ast.Call) else child
            tokens = _tokens(scan, target, scan.bindings(target))
            if not any(t.endswith("torchrun") or t.startswith("torch.distributed.") for t in tokens):
                tokens = ["torchrun", *tokens]  # tt.torchrun("--standalone", ...) writes the rest itself
            return target, tokens
    return None


def torchruns(found: list[Source]) -> list[Torchrun]:
    runs = []
    for src in found:
        if src.where.endswith("runtime/hardware.py"):
            continue  # the parser of these command lines, not a launch
        scan, seen = Scan(src, PROFILES["cpu"]), set()
        for node in ast.walk(src.tree):
            if not isinstance(node, (ast.Constant, ast.JoinedStr)):
                continue
            text = node.value if isinstance(node, ast.Constant) else ast.unparse(node)
            if not isinstance(text, str) or not any(flag in text for flag in TORCHRUN_FLAGS):
                continue
            if isinstance(node, ast.Constant) and "\n" in text:  # usage in a docstring or a script's text
                lines = COMMAND_LINE.findall(text)
                runs += [Torchrun(f"{src.where}:{node.lineno}", line.replace("\\\n", " ").split()) for line in lines]
            elif (found_call := _command(scan, node)) and id(found_call[0]) not in seen:
                seen.add(id(found_call[0]))
                runs.append(Torchrun(f"{src.where}:{found_call[0].lineno}", found_call[1]))
    return runs


TORCHRUNS = torchruns(SOURCES)


def test_the_scan_finds_the_torchrun_runs():
    cpu = PROFILES["cpu"]
    shapes = {(run.where.split(":")[0], shape) for run in TORCHRUNS for shape in run.shapes(cpu)}
    assert ("12-capstone-at-scale cell 12", (2, 1)) in shapes  # two nodes on one machine
    assert ("07-torchrun cell 8", (1, 2)) in shapes  # --standalone --nproc-per-node=2
    assert ("code/distcourse/capstone/__init__.py", (2, 4)) in shapes  # its docstring: --nnodes 2 --nproc-per-node 4
    assert ("code/distcourse/libraries.py", (1, 2)) in shapes  # an argv list with an f-string
    assert len(TORCHRUNS) >= 15 and any(n > 1 for _, (n, _) in shapes)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_torchrun_run_gives_each_worker_its_own_gpu_or_the_cpu(profile):
    problems = []
    for run in TORCHRUNS:
        for nnodes, nproc in run.shapes(PROFILES[profile]):
            for machines in {1, nnodes}:  # the course's nodes on one machine, and real nodes
                hw = PROFILES[profile]
                hw = Hardware(hw.cores, hw.gpus, hw.gpu_bf16, hw.gpu_names, machines, hw.nccl_available)
                agents = [node_plan(hw, nnodes, nproc, rank) for rank in range(nnodes)]
                problems += [f"{run.where} on {machines} machine(s): {p}" for p in conflicts(agents)]
                enough = hw.gpus >= -(-nnodes // machines) * nproc
                if {(a.backend, a.visible_devices == "") for a in agents} != {
                    ("nccl" if enough else "gloo", not enough)
                }:
                    problems.append(
                        f"{run.where}: {[(a.backend, a.visible_devices) for a in agents]}, {hw.gpus} GPU(s)"
                    )
    assert not problems, "\n".join(problems)


def test_agents_started_together_get_an_environment_each():
    """Agents of one job started together on this machine need an environment each: with one
    for all, on a machine with a GPU their workers all take cuda:0 (env=tt.node_envs(2) gives
    each agent the CUDA_VISIBLE_DEVICES of hardware.agent_env)."""
    multi_node = {run.where.split(":")[0] for run in TORCHRUNS if any(n > 1 for n, _ in run.shapes(PROFILES["cpu"]))}
    missing = []
    for src in SOURCES:
        if src.where not in multi_node:
            continue
        for node in ast.walk(src.tree):
            if isinstance(node, ast.Call) and _called(node) == "run_together":
                if not any(k.arg == "env" for k in node.keywords):
                    missing.append(src.where)
    assert not missing, f"several agents of one job, one environment for all: {sorted(set(missing))}"
    assert "12-capstone-at-scale cell 12" in multi_node and "07-torchrun cell 26" in multi_node
