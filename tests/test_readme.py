"""Every code block of README.md and docs/*.md runs as written, and so does examples/engine.py.

- A ``python`` block (a fence opened with three backticks and ``python``) runs alone in a fresh
  process (forked, one per block, from a process that imported torch, transformers and vocabpar
  once). A block whose first line starts with :data:`MARK` also runs on the 2 ranks of one
  torchrun launch: the marked blocks of every page one after another, each in a fresh
  namespace; the same launch then runs examples/engine.py. A block holding the line
  :data:`TABLE` must print exactly the markdown table that follows it on its page.
- A ``bash`` block runs through ``bash -euo pipefail`` in a fresh temporary folder holding
  ``config.json`` (Llama 3.1 8B's Hugging Face config, from tests/data), with the running
  interpreter's bin folder first on ``PATH``. A block whose lines all start with ``make `` is not
  run: the targets it names must be the Makefile's. No bash block may start what this file cannot
  afford (:data:`UNAFFORDABLE`: the benchmarks, the demo, compilation, rank launches); pages show
  such commands as tables, inline code or ``text`` blocks.
- Every docs page has a block that runs and is linked from README.md; every relative link of
  these pages and of benchmarks/RESULTS.md leads to a file, and to a heading where it names one.

The python blocks, the torchrun launch and the bash blocks run as three processes started
together, each printing ``PAGE:LINE ok`` (or ``FAILED``) per block, LINE being the block's first
code line. Running this file as a script does the same by hand: ``python tests/test_readme.py
one``, ``python tests/test_readme.py bash`` or ``torchrun --nproc-per-node 2
tests/test_readme.py ranks``.
"""

from __future__ import annotations

import difflib
import os
import re
import runpy
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "# torchrun --nproc-per-node 2"
TABLE = "# prints the table below"
ENGINE = ROOT / "examples" / "engine.py"
CONFIG = ROOT / "tests" / "data" / "llama-3.1-8b" / "config.json"
UNAFFORDABLE = re.compile(r"\bvocabpar\s+(bench|demo|score|warm)\b|\btorchrun\b|^\s*make\b", re.M)
"""What a bash block may not start: minutes of benchmarks, demo or compilation, rank launches
(the suite runs its torchrun commands elsewhere), or make (only a block of make lines alone,
checked against the Makefile)."""


@dataclass(frozen=True)
class Block:
    """A fenced code block: its ``page`` (relative to the repository), the ``line`` of its first
    code line, its language and code, and, for a :data:`TABLE` block, the table it must print."""

    page: str
    line: int
    lang: str
    code: str
    table: str | None = None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def marked(self) -> bool:
        return self.code.startswith(MARK)

    @property
    def make_only(self) -> bool:
        lines = [line for line in self.code.splitlines() if line.strip()]
        return bool(lines) and all(line.startswith("make ") for line in lines)


def pages() -> list[Path]:
    """README.md, then every docs/*.md page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(path: Path) -> list[Block]:
    return parse_blocks(str(path.relative_to(ROOT)), path.read_text())


def parse_blocks(page: str, text: str) -> list[Block]:
    """The ```` ```python ```` and ```` ```bash ```` blocks of ``text`` (other fences are skipped
    whole); ``ValueError`` for a fence left open or a :data:`TABLE` block with no table after it."""
    lines = text.splitlines()
    found, start, lang = [], None, None
    for number, line in enumerate(lines, 1):
        fence = line.strip().startswith("```")
        if start is None and fence:
            start, lang = number, line.strip()[3:].strip()
        elif start is not None and line.strip() == "```":
            if lang in ("python", "bash"):
                code = "\n".join(lines[start: number - 1]) + "\n"
                prints = TABLE in code.splitlines()
                table = _table_after(lines, number, f"{page}:{start + 1}") if prints else None
                found.append(Block(page, start + 1, lang, code, table))
            start = None
    if start is not None:
        raise ValueError(f"{page}:{start}: a code fence is never closed")
    return found


def _table_after(lines: list[str], closed: int, name: str) -> str:
    """The first markdown table after line ``closed`` and before the next fence."""
    table: list[str] = []
    for line in lines[closed:]:
        if line.startswith("|"):
            table.append(line.strip())
        elif table or line.strip().startswith("```"):
            break
    if not table:
        raise ValueError(f"{name}: says it prints the table below, but no table follows it")
    return "\n".join(table)


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in page_blocks(path)]


def _exec(block: Block) -> None:
    exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})


def run_each_in_a_fresh_process(blocks: list[Block]) -> bool:
    """Fork one process per python block, its output to a file this process then prints, with
    ``PAGE:LINE ok`` or ``FAILED`` after it. All ok?"""
    import importlib

    for module in ("torch", "vocabpar.integrations.hf", "transformers.models.gpt2.modeling_gpt2"):
        importlib.import_module(module)  # once, before forking

    ok = True
    for block in blocks:
        with tempfile.TemporaryFile() as out:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the block's own process
                os.dup2(out.fileno(), 1)
                status = 0
                try:
                    _exec(block)
                except BaseException:
                    traceback.print_exc()
                    status = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
            passed = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            out.seek(0)
            printed = out.read().decode(errors="replace")
        print(printed, end="" if printed.endswith("\n") or not printed else "\n")
        if passed and block.table is not None and printed.strip() != block.table:
            print(f"{block.name} prints a table other than the one that follows it on its page:")
            print("\n".join(difflib.unified_diff(block.table.splitlines(), printed.strip().splitlines(),
                                                 "the page", "printed", lineterm="")))
            passed = False
        print(f"{block.name} {'ok' if passed else 'FAILED'}", flush=True)
        ok &= passed
    return ok


def run_on_these_ranks(blocks: list[Block]) -> bool:
    """Under torchrun: every marked block, then examples/engine.py, on this process's rank;
    nothing sets the process group up before vocabpar's first use."""
    from vocabpar import comm

    world = comm.world_size()  # under torchrun, the first question sets the default group up
    me = comm.rank()
    if me == 0:
        print(f"first use: a world of {world}", flush=True)
    for block in blocks:
        _exec(block)
        if me == 0:
            print(f"{block.name} ok", flush=True)
    try:
        runpy.run_path(str(ENGINE), run_name="__main__")
    except SystemExit as e:
        return e.code in (0, None)
    return True


def run_in_bash(blocks: list[Block]) -> bool:
    """Each runnable bash block in its own temporary folder holding a Llama 3.1 8B config.json,
    this interpreter's bin folder first on PATH; its output, then ``PAGE:LINE ok`` or ``FAILED``.
    All ok?"""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    ok = True
    for block in blocks:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(CONFIG.read_text())
            try:
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=folder, env=env,
                                      capture_output=True, text=True, timeout=240)
                output, passed = done.stdout + done.stderr, done.returncode == 0
            except subprocess.TimeoutExpired:
                output, passed = "timed out after 240 s\n", False
        print(output, end="" if output.endswith("\n") or not output else "\n")
        print(f"{block.name} {'ok' if passed else 'FAILED'}", flush=True)
        ok &= passed
    return ok


def unaffordable(block: Block) -> str | None:
    """What a bash block starts that the suite cannot afford to run, if anything."""
    found = UNAFFORDABLE.search(block.code) if block.lang == "bash" and not block.make_only else None
    return found.group(0) if found else None


def runnable_bash(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.lang == "bash" and not b.make_only and not unaffordable(b)]


def mode_blocks(mode: str, blocks: list[Block]) -> list[Block]:
    """The blocks a launch runs: ``one`` every python block, ``ranks`` the marked ones, ``bash``
    the runnable bash blocks."""
    if mode == "bash":
        return runnable_bash(blocks)
    return [b for b in blocks if b.lang == "python" and (mode == "one" or b.marked)]


def _launch_passed(mode: str, blocks: list[Block], runs: dict[str, subprocess.CompletedProcess]) -> str:
    """Assert that launch ``mode`` exited 0 with every block of it ok, naming those that were
    not; its output."""
    done = runs[mode]
    out = done.stdout + done.stderr
    failed = [b.name for b in mode_blocks(mode, blocks) if f"{b.name} ok\n" not in done.stdout]
    assert done.returncode == 0 and not failed, f"failed: {failed}\n{out[-5000:]}"
    return out


# ---------------------------------------------------------------------- the launches
@pytest.fixture(scope="module")
def blocks() -> list[Block]:
    found = all_blocks()
    runnable = {b.name for b in found if b.lang == "python"} | {b.name for b in runnable_bash(found)}
    for page in pages()[1:]:  # every docs page has runnable examples
        name = str(page.relative_to(ROOT))
        assert any(b.page == name and b.name in runnable for b in found), name
    assert sum(b.marked for b in found) >= 4, [b.name for b in found]
    return found


@pytest.fixture(scope="module")
def runs(blocks) -> dict[str, subprocess.CompletedProcess]:
    """The three launches, started together: every python block in one process each, the
    marked blocks and the engine example on 2 ranks, the bash blocks."""
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    commands = {"one": [sys.executable, __file__, "one"],
                # standalone: torchrun picks a free port instead of its fixed default
                "ranks": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          "2", __file__, "ranks"],
                "bash": [sys.executable, __file__, "bash"]}
    started = {name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env, cwd=ROOT) for name, command in commands.items()}
    done = {}
    for name, proc in started.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = subprocess.CompletedProcess(commands[name], proc.returncode, out, err)
    return done


def test_every_python_block_runs_alone_in_one_process(blocks, runs):
    out = _launch_passed("one", blocks, runs)
    assert "rank 0 of 1" in out  # the library block, unsharded


def test_marked_blocks_run_on_two_ranks_without_an_abort_at_exit(blocks, runs):
    out = _launch_passed("ranks", blocks, runs)
    assert "first use: a world of 2" in out  # nobody initialised the group: vocabpar's first use did
    assert "rank 0 of 2" in out and "rank 1 of 2" in out  # the library block ran sharded
    assert "terminate called" not in out and "SIGABRT" not in out


def test_engine_example_passes_its_checks_on_a_tp_group(runs):
    out = runs["ranks"].stdout
    assert "2 ranks, TP groups of 2" in out and "VocabLayout(scheme='padded')" in out, out[-3000:]
    for check in ("sample", "verify", "token_logprobs", "Sampler.sample", "Sampler.verify",
                  "Sampler.token_logprobs"):
        assert f"ok   {check}\n" in out, out[-3000:]
    assert "all checks passed" in out


def test_every_bash_block_runs_in_a_folder_holding_a_config(blocks, runs):
    _launch_passed("bash", blocks, runs)


# ---------------------------------------------------------------------- checks without launches
def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M)}


def make_targets(block: Block) -> list[str]:
    """The targets of a make-only block's lines (``make demo   # ...`` names ``demo``; variable
    assignments such as ``WORKERS=0`` are not targets)."""
    words = [w for line in block.code.splitlines() for w in line.split("#")[0].split()[1:]]
    return [w for w in words if "=" not in w and not w.startswith("-")]


def test_make_blocks_name_the_makefiles_targets():
    targets = makefile_targets()
    assert {"demo", "test", "install", "bench"} <= targets, targets
    make = [b for b in all_blocks() if b.lang == "bash" and b.make_only]
    wrong = {b.name: sorted(set(make_targets(b)) - targets) for b in make if set(make_targets(b)) - targets}
    assert not wrong, f"targets the Makefile lacks: {wrong}"


def test_make_targets_of_a_line_skip_variables_and_comments():
    block = Block("x.md", 1, "bash", "make test WORKERS=0   # one process\nmake demo\n")
    assert block.make_only and make_targets(block) == ["test", "demo"]
    assert not Block("x.md", 1, "bash", "make demo\nvocabpar plan\n").make_only


def test_blocks_are_named_by_page_and_first_code_line_and_bad_fences_say_where():
    text = ("intro\n```python\nprint(1)\n```\n```text\n```python\n```\n```bash\n" + TABLE + "\necho\n```\n"
            "the table:\n\n| a |\n|---|\n| 1 |\n")
    python, bash = parse_blocks("docs/x.md", text)  # the text block's content is no block
    assert (python.name, python.code, python.table) == ("docs/x.md:3", "print(1)\n", None)
    assert (bash.name, bash.lang, bash.table) == ("docs/x.md:9", "bash", "| a |\n|---|\n| 1 |")
    with pytest.raises(ValueError, match=r"^docs/x\.md:2: a code fence is never closed$"):
        parse_blocks("docs/x.md", "intro\n```python\nprint(1)\n")
    with pytest.raises(ValueError, match=r"^docs/x\.md:3: says it prints the table below, but no table"):
        parse_blocks("docs/x.md", f"intro\n```python\n{TABLE}\n```\ntext\n```bash\n```\n| late |\n")


@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in pages()])
def test_no_bash_block_starts_what_the_suite_cannot_afford(page):
    bad = {b.name: unaffordable(b) for b in page_blocks(ROOT / page) if unaffordable(b)}
    assert not bad, f"show these as a table, inline code or a text block: {bad}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in pages()[1:]
               if not re.search(rf"\]\(docs/{re.escape(p.name)}(#[^)]*)?\)", readme)]
    assert not missing, f"README.md links no docs page named {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (outside code fences); a repeated one gets ``-1``, ``-2``."""
    found, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        fenced ^= line.strip().startswith("```")
        if not fenced and line.startswith("#"):
            base = slug(line.lstrip("#"))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def test_slug_follows_githubs_anchors():
    assert slug(" `vocabpar demo`: a recorded run") == "vocabpar-demo-a-recorded-run"
    assert slug(" Sampling: the engine `Sampler` beside the functional `sample()`") == \
        "sampling-the-engine-sampler-beside-the-functional-sample"
    assert slug(" The test suite's time: where it goes") == "the-test-suites-time-where-it-goes"


def broken_links(page: Path) -> list[str]:
    """The relative links of markdown ``page`` whose file, or heading (``#anchor``), does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # not a file of the repository
        file, _, anchor = target.partition("#")
        where = (page.parent / file).resolve() if file else page
        if not where.exists() or (anchor and where.suffix == ".md" and anchor not in anchors(where)):
            broken.append(f"{page.name}: {target}")
    return broken


def test_broken_links_names_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# A heading\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [here](#top) [web](https://x.org/y) [gone](missing.md) "
                    "[fenced](other.md#not-a-heading)\n# Top\n")
    assert broken_links(page) == ["page.md: missing.md", "page.md: other.md#not-a-heading"]


def test_relative_links_lead_to_files_and_headings():
    broken = [link for page in [*pages(), ROOT / "benchmarks" / "RESULTS.md"] for link in broken_links(page)]
    assert not broken, broken


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "one"
    chosen = mode_blocks(mode, all_blocks())
    if mode == "ranks":
        sys.exit(0 if run_on_these_ranks(chosen) else 1)
    sys.exit(0 if (run_in_bash if mode == "bash" else run_each_in_a_fresh_process)(chosen) else 1)
