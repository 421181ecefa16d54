import gc
import importlib.util
import os
import sys

# A 2-thread OpenMP team spins at its barriers: when another process holds one of the two cores,
# a 1-rank sweep went from 0.6 s to 13-35 s. Waiting threads that sleep keep the suite's time
# stable on a shared machine; set before torch loads (here, and in every rank through the
# forkserver's environment).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The sampler's passes compile on first use in each process (seconds each); the suite's many short
# rank processes run them eager, which gives the same bits. tests/test_fused.py compiles them and
# checks compiled == eager == reference.
os.environ.setdefault("VOCABPAR_COMPILE", "0")

from vocabpar import launch  # noqa: E402

collect_ignore = [] if importlib.util.find_spec("vllm") else ["in_vllm"]
"""tests/in_vllm runs in the environment with vLLM (``make test-vllm``)."""


def pytest_collection_finish(session) -> None:
    """What every rank of a local launch would import on its own, the forkserver imports once,
    before it forks the first rank (launches come after collection). A rank unpickles its job
    from a test module, which imports pytest (0.1 s of CPU; ~200 ranks in the suite) and often
    the demo; transformers' model code takes seconds per process, and only test files that import
    transformers (the demo's Hugging Face models) need it. (hypothesis, 1.3 s, is imported only by
    a file that starts no ranks.)"""
    launch.preload("pytest", "vocabpar.demo", "vocabpar.integrations.hf")
    # what this process imported and collected lives for the whole session: the garbage collector's
    # full passes then scan only what the tests create, not the ~370k objects of torch,
    # transformers and the test modules (0.17 s per pass)
    gc.freeze()
    if "transformers" in sys.modules:
        launch.preload("transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
                       "transformers.models.qwen2.modeling_qwen2")


LONGEST_FIRST = ("test_fused.py", "test_demo.py", "test_engine.py", "test_head.py", "test_readme.py",
                 "test_host_work.py")
"""The files that take longest (15-60 s each with ``--durations``), in that order. The Makefile
turns off xdist's own order (most tests first), which started the 3-test, 20 s README file
last; a long file started early leaves short ones to even out the two workers' ends."""


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
