"""Two "nodes" for real: two network namespaces joined by a veth pair, one torchrun agent in each.

Node A (10.213.0.1) hosts the c10d rendezvous; node B (10.213.0.2) reaches it over the veth
link only. Both namespaces, and so both addresses, exist only inside this test. Each attempt
trains chapter 07's script (`python -m distcourse.train`) with one process per node and must
end with the same weights as one process on the whole batch. Needs root and `ip`
(iproute2); skipped with the reason otherwise. Part of the stress suite.
"""

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

pytestmark = pytest.mark.stress
ATTEMPTS = int(os.environ.get("TWO_NODE_ATTEMPTS", os.environ.get("STRESS_ATTEMPTS", "20")))
NODES = {"A": "10.213.0.1", "B": "10.213.0.2"}
TRAIN = ["-m", "distcourse.train", "--steps", "6", "--timeout", "30"]


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
    return int(subprocess.run(in_namespace(namespace, sys.executable, "-c", code), capture_output=True,
                              text=True, check=True).stdout)


def run_two_nodes(names, links, out) -> list[subprocess.CompletedProcess]:
    port, run_id = free_port(names["A"]), uuid.uuid4().hex[:8]
    agents = []
    for node_rank, node in enumerate(NODES):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": links[node], "OMP_NUM_THREADS": "1"}
        command = in_namespace(
            names[node], sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={NODES['A']}:{port}",
            f"--rdzv-id={run_id}", "--max-restarts=0",
            # torchrun decides who hosts the rendezvous store by matching the endpoint against
            # the machine's hostname, which knows nothing of the namespaces: say it explicitly.
            # Likewise the address peers use to reach this node (by default its hostname, which
            # both namespaces share): each node's own veth address.
            f"--rdzv-conf=is_host={int(node == 'A')}", f"--local-addr={NODES[node]}", *TRAIN, "--batch-size", "8", "--out", str(out),
        )
        agents.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
    done = []
    for agent in agents:
        try:
            output = agent.communicate(timeout=90)[0]
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, 9)
            output = agent.communicate()[0] + "\n[killed after 90 s]"
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, output))
    return done


def final_weights(out):
    return torch.load(out / "final.pt", weights_only=True)


def test_two_node_rendezvous_over_veth(namespaces, tmp_path):
    names, links = namespaces
    reference = tmp_path / "one-process"
    subprocess.run([sys.executable, *TRAIN, "--batch-size", "16", "--out", str(reference)], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    expected = final_weights(reference)
    passed, worst, failures = 0, 0.0, []
    for attempt in range(ATTEMPTS):
        out = tmp_path / f"attempt{attempt}"
        start = time.monotonic()
        agents = run_two_nodes(names, links, out)
        worst = max(worst, time.monotonic() - start)
        ok = all(a.returncode == 0 for a in agents) and (out / "final.pt").exists()
        if ok:
            got = final_weights(out)
            ok = got.keys() == expected.keys() and all(torch.allclose(got[k], expected[k], atol=1e-6) for k in got)
        passed += ok
        if not ok:
            failures.append("\n".join(a.stdout[-1500:] for a in agents))
    import test_stress

    test_stress.RESULTS["two nodes (netns + veth), c10d rendezvous"] = (passed, ATTEMPTS, worst)
    assert passed == ATTEMPTS, f"{passed}/{ATTEMPTS}; first failure:\n{failures[:1]}"
