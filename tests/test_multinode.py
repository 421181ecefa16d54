"""Two torchrun agents on this machine act as two nodes (``--nnodes 2``, 2 processes each, c10d
rendezvous on 127.0.0.1): the recipe of docs/many-ranks.md, read from that page and run as
written with a free port, passes the smoke script on all four processes (embedding, every
collection strategy and the sharded sampler, whose tokens equal ``reference_sample`` on the full
logits in one process)."""

import os
import pathlib
import re
import subprocess
import sys

from ports import free_ports

ROOT = pathlib.Path(__file__).resolve().parents[1]


def recipe() -> list[str]:
    """The two-node commands of docs/many-ranks.md, in order."""
    lines = [line.rstrip(" &") for line in (ROOT / "docs" / "many-ranks.md").read_text().splitlines()
             if line.startswith("torchrun --nnodes 2 --node-rank")]
    assert len(lines) == 2, lines
    return lines


def test_readme_recipe_is_two_nodes_of_two_processes():
    node0, node1 = recipe()
    for rank, line in enumerate((node0, node1)):
        assert f"--node-rank {rank} " in line and "--nproc-per-node 2 " in line
        assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$PORT" in line
    assert re.sub("--node-rank [01]", "", node0) == re.sub("--node-rank [01]", "", node1)


def test_two_torchrun_agents_pass_the_smoke_script():
    port = str(free_ports(1)[0])
    torchrun = str(pathlib.Path(sys.executable).with_name("torchrun"))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen([torchrun if word == "torchrun" else word.replace("$PORT", port)
                                for word in line.split()], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for line in recipe()]
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    text = "\n".join(outputs)
    assert "4 ranks on cpu: all checks passed" in text, text
    assert "ok   sample tokens" in text and "FAIL" not in text
    assert "terminate called" not in text and "leaked" not in text, text  # a clean exit, every process
