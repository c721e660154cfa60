"""Two "nodes" for real: two network namespaces joined by a veth pair, one torchrun agent in each.

Node A (10.213.0.1) hosts the c10d rendezvous; node B (10.213.0.2) reaches it over the veth
link only. Both namespaces, and so both addresses, exist only inside this test. Each attempt
trains chapter 07's script (`python -m distcourse.train`) with one process per node. Three
scenarios, each repeated TWO_NODE_ATTEMPTS times (default STRESS_ATTEMPTS, 20; `make test`
sets 2, since one attempt takes 6-17 s: `make stress` runs all 20):

- both nodes start together: the same weights as one process on the whole batch;
- the worker on node B dies on the first attempt, `--max-restarts=3`: both agents restart,
  training resumes from the checkpoint and ends with the same weights. The two agents'
  restart counts may differ (only the agent whose worker failed counts the restart), which
  is why the agents run with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: a new store each round;
- `--nnodes=1:2`: node A starts alone, node B joins while A trains; A's agent restarts its
  worker, and both finish the job together.

Needs root and `ip` (iproute2); skipped with the reason otherwise. Part of the stress suite.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from distcourse.runtime import hardware

ATTEMPTS = int(os.environ.get("TWO_NODE_ATTEMPTS", os.environ.get("STRESS_ATTEMPTS", "20")))
# An attempt takes up to about 17 s on 2 cores; the default 300 s would cut 20 attempts short.
pytestmark = [pytest.mark.stress, pytest.mark.timeout(60 + 45 * ATTEMPTS)]
NODES = {"A": "10.213.0.1", "B": "10.213.0.2"}
TRAIN = ["-m", "distcourse.train", "--steps", "6", "--timeout", "30"]
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # what chapter 07 teaches for elastic jobs


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def namespaces():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2 (`ip`)")
    tag = uuid.uuid4().hex[:6]
    names = {node: f"dc{node}{tag}" for node in NODES}
    links = {node: f"ve{node}{tag}" for node in NODES}
    try:
        for node in NODES:
            ip("netns", "add", names[node])
        ip("link", "add", links["A"], "type", "veth", "peer", "name", links["B"])
        for node, address in NODES.items():
            ip("link", "set", links[node], "netns", names[node])
            ip("-n", names[node], "addr", "add", f"{address}/24", "dev", links[node])
            ip("-n", names[node], "link", "set", links[node], "up")
            ip("-n", names[node], "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    yield names, links
    for name in names.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def in_namespace(name: str, *command: str) -> list[str]:
    return ["ip", "netns", "exec", name, *command]


def free_port(namespace: str) -> int:  # namespace: node A's
    """A port the OS picks inside namespace A, where nothing else listens."""
    code = f"import socket; s = socket.socket(); s.bind(({NODES['A']!r}, 0)); print(s.getsockname()[1])"
    return int(
        subprocess.run(
            in_namespace(namespace, sys.executable, "-c", code), capture_output=True, text=True, check=True
        ).stdout
    )


def start_agent(
    names, links, node, port, run_id, launcher_args, script_args, env=None, rdzv_conf=""
) -> subprocess.Popen:
    """One torchrun agent in ``node``'s namespace, output to a pipe, in a session of its own.

    ``rdzv_conf``: more ``key=value`` pairs for ``--rdzv-conf`` (given once: a second
    ``--rdzv-conf`` would replace the first, ``is_host`` included).
    """
    # Both namespaces share this machine's GPUs, and both workers have LOCAL_RANK 0: each node
    # gets a GPU of its own, or none (gloo on the CPU), as chapter 07's notebook does.
    own_gpus = hardware.agent_env(None, len(NODES), 1, list(NODES).index(node))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": links[node], "OMP_NUM_THREADS": "1", **own_gpus, **(env or {})}
    command = in_namespace(
        names[node],
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={NODES['A']}:{port}",
        f"--rdzv-id={run_id}",
        # torchrun decides who hosts the rendezvous store by matching the endpoint against
        # the machine's hostname, which knows nothing of the namespaces: say it explicitly.
        # Likewise the address peers use to reach this node (by default its hostname, which
        # both namespaces share): each node's own veth address.
        f"--rdzv-conf=is_host={int(node == 'A')}{',' + rdzv_conf if rdzv_conf else ''}",
        f"--local-addr={NODES[node]}",
        *launcher_args,
        *TRAIN,
        *map(str, script_args),
    )
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(agents, timeout: float = 90) -> list[subprocess.CompletedProcess]:
    deadline, done = time.monotonic() + timeout, []
    for agent in agents:
        try:
            output = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, 9)
            output = agent.communicate()[0] + f"\n[killed after {timeout:g} s]"
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, output))
    return done


def run_two_nodes(names, links, out, launcher_args=("--nnodes=2", "--max-restarts=0"), script_args=(), env=None):
    port, run_id = free_port(names["A"]), uuid.uuid4().hex[:8]
    agents = [
        start_agent(
            names, links, node, port, run_id, launcher_args, ["--batch-size", "8", "--out", out, *script_args], env
        )
        for node in NODES
    ]
    return finish(agents)


def final_weights(out):
    return torch.load(out / "final.pt", weights_only=True)


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """One process on the global batch of 16: what every two-node run must end with."""
    reference = tmp_path_factory.mktemp("one-process")
    subprocess.run(
        [sys.executable, *TRAIN, "--batch-size", "16", "--out", str(reference)],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return final_weights(reference)


def same_weights(out, expected) -> bool:
    if not (out / "final.pt").exists():
        return False
    got = final_weights(out)
    return got.keys() == expected.keys() and all(torch.allclose(got[k], expected[k], atol=1e-6) for k in got)


def worker_lines(agent_output: str, tag: str) -> list:
    """The JSON values a node's workers printed after ``[rank R] <tag> ``."""
    found = []
    for line in agent_output.splitlines():
        if line.startswith("[rank ") and f"] {tag} " in line:
            found.append(json.loads(line.split(f"] {tag} ", 1)[1]))
    return found


def record(name, passed, worst, failures):
    import test_stress

    test_stress.RESULTS[name] = (passed, ATTEMPTS, worst)
    assert passed == ATTEMPTS, f"{name}: {passed}/{ATTEMPTS}; first failure:\n{failures[:1]}"


def test_two_node_rendezvous_over_veth(namespaces, expected, tmp_path):
    names, links = namespaces
    passed, worst, failures = 0, 0.0, []
    for attempt in range(ATTEMPTS):
        out = tmp_path / f"attempt{attempt}"
        start = time.monotonic()
        agents = run_two_nodes(names, links, out)
        worst = max(worst, time.monotonic() - start)
        ok = all(a.returncode == 0 for a in agents) and same_weights(out, expected)
        passed += ok
        if not ok:
            failures.append("\n".join(a.stdout[-1500:] for a in agents))
    record("two nodes (netns + veth), c10d rendezvous", passed, worst, failures)


def test_failure_on_node_b_restarts_both_nodes(namespaces, expected, tmp_path):
    """The last rank (node B's worker) dies in step 4 of the first attempt; checkpoints every 2 steps."""
    names, links = namespaces
    passed, worst, failures, counts = 0, 0.0, [], set()
    for attempt in range(ATTEMPTS):
        out = tmp_path / f"attempt{attempt}"
        start = time.monotonic()
        agents = run_two_nodes(
            names,
            links,
            out,
            ("--nnodes=2", "--max-restarts=3"),
            env=FRESH_STORE,
            script_args=["--ckpt-dir", out, "--save-every", "2", "--crash-at", "4", "--print-env"],
        )
        worst = max(worst, time.monotonic() - start)
        logs = [a.stdout for a in agents]
        restarts = tuple(
            tuple(w["env"]["TORCHELASTIC_RESTART_COUNT"] for w in worker_lines(log, "worker")) for log in logs
        )
        counts.add(restarts)
        ok = (
            all(a.returncode == 0 for a in agents)
            and same_weights(out, expected)
            and "simulated crash in step 4" in logs[1]  # node B's worker did die
            and "resumed from step 4" in logs[0]  # and the job resumed
            and all(len(r) >= 2 for r in restarts)  # both nodes restarted
        )
        passed += ok
        if not ok:
            failures.append("\n".join(log[-2500:] for log in logs))
    print("TORCHELASTIC_RESTART_COUNT per node (A, B) over the attempts:", sorted(counts))
    record("two nodes, worker on node B dies, --max-restarts=3", passed, worst, failures)


def test_second_node_joins_a_running_job(namespaces, tmp_path):
    """--nnodes=1:2: A trains alone; B joins; A's agent restarts its worker; both finish together."""
    names, links = namespaces
    elastic = ["--nnodes=1:2", "--max-restarts=0"]
    conf = "last_call_timeout=1"  # seconds to wait for more nodes once the minimum is there
    passed, worst, failures = 0, 0.0, []
    for attempt in range(ATTEMPTS):
        out = tmp_path / f"attempt{attempt}"
        port, run_id = free_port(names["A"]), uuid.uuid4().hex[:8]
        args = [
            "--steps",
            "40",
            "--batch-size",
            "8",
            "--out",
            out,
            "--ckpt-dir",
            out,
            "--save-every",
            "1",
            "--step-seconds",
            "0.1",
            "--print-env",
        ]
        start = time.monotonic()
        a = start_agent(names, links, "A", port, run_id, elastic, args, FRESH_STORE, conf)
        deadline = start + 30
        while not (out / "losses.jsonl").exists() and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until node A's worker has trained a step
        b = start_agent(names, links, "B", port, run_id, elastic, args, FRESH_STORE, conf)
        agents = finish([a, b])
        worst = max(worst, time.monotonic() - start)
        logs = [agent.stdout for agent in agents]
        results = [r for log in logs for r in worker_lines(log, "result")]
        worlds = [w["env"]["WORLD_SIZE"] for w in worker_lines(logs[0], "worker")]
        ok = (
            all(agent.returncode == 0 for agent in agents)
            and worlds[:1] == ["1"]
            and worlds[-1:] == ["2"]  # alone first, then two
            and len(results) == 1
            and results[0]["world_size"] == 2  # finished as two nodes
            and worker_lines(logs[1], "worker")  # B's worker did train
            and any("resumed from step" in line for line in logs[0].splitlines())
        )
        passed += ok
        if not ok:
            failures.append("\n".join(log[-2500:] for log in logs))
    record("two nodes, --nnodes=1:2, node B joins a running job", passed, worst, failures)
