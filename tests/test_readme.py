"""The README's commands run as written.

Every `llama-parity ...` line of its bash blocks and table cells and every Python block is
collected. `path/to/hf-folder` (the README's placeholder for the user's checkpoint) becomes a
tiny random checkpoint with SmolLM2's tokenizer, and /tmp/ a test folder; each runs in an
empty working directory. Lines on a tiny checkpoint and `--help` run here in seconds; lines on
the real model (no checkpoint argument: the cached SmolLM2) are marked smollm2 and slow. The
two `make` lines build the environment and run this suite, so they are checked against the
Makefile's targets instead of run.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from llama_parity.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PLACEHOLDER = "path/to/hf-folder"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str) -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang]


def _commands() -> list[tuple[int, str]]:
    """(line, command) for the bash blocks' lines (comments dropped, `\\` continuations joined)
    and the inline `llama-parity ...` spans outside code blocks."""
    out = []
    for line, body in _blocks("bash"):
        for k, cmd in enumerate(body.replace("\\\n", " ").splitlines()):
            cmd = cmd.split(" #")[0].strip()
            if cmd:
                out.append((line + 1 + k, cmd))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), README.read_text())
    for k, text in enumerate(prose.splitlines()):
        out += [(k + 1, span) for span in re.findall(r"`(llama-parity [^`]+)`", text)]
    return out


def _kind(cmd: str) -> str:
    if cmd.startswith("make "):
        return "make"
    if "--help" in cmd:
        return "help"
    return "tiny" if PLACEHOLDER in cmd else "smollm2"


def _params(kinds):
    marks = {"smollm2": [pytest.mark.smollm2, pytest.mark.slow]}
    return [pytest.param(cmd, id=f"line{line}", marks=marks.get(_kind(cmd), []))
            for line, cmd in _commands() if _kind(cmd) in kinds]


@pytest.fixture(scope="module")
def tokenized_tiny(smollm2, tmp_path_factory):
    """A tiny random checkpoint whose vocabulary fits SmolLM2's tokenizer, with that tokenizer."""
    from llamaspec.testing import make_checkpoint
    folder = make_checkpoint(tmp_path_factory.mktemp("tiny_tokenized"), vocab_size=49152, tie_word_embeddings=True,
                             max_position_embeddings=2048)   # room for the built-in 258-token prompt
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2 / name).is_file():
            shutil.copyfile(smollm2 / name, Path(folder) / name)
    return Path(folder)


def _as_written(text: str, folder: Path, tmp: Path) -> str:
    return text.replace("/tmp/", f"{tmp}/").replace(PLACEHOLDER, str(folder))


def test_the_readme_has_commands_of_every_kind():
    kinds = {_kind(cmd) for _, cmd in _commands()}
    assert {"make", "help", "tiny", "smollm2"} <= kinds, kinds
    assert _blocks("python"), "no Python block found"


@pytest.mark.parametrize("cmd", _params({"make"}))
def test_make_lines_name_makefile_targets(cmd):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert shlex.split(cmd)[1] in targets


@pytest.mark.parametrize("cmd", _params({"help"}))
def test_help_lines_print_help(cmd, capsys):
    with pytest.raises(SystemExit) as done:
        main(shlex.split(cmd)[1:])
    assert done.value.code == 0 and "usage: llama-parity" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", _params({"tiny", "smollm2"}))
def test_llama_parity_lines_run(cmd, tokenized_tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(_as_written(cmd, tokenized_tiny, tmp_path))
    assert Path(argv[0]).name == "llama-parity", cmd
    if _needs_devices(argv):     # a mesh needs host devices, fixed when JAX starts: a process of its own
        import subprocess
        import sys
        done = subprocess.run([sys.executable, "-c", "import sys; from llama_parity.cli import main; "
                               "sys.exit(main())", *argv[1:]], capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return
    rc = main(argv[1:])
    assert rc == 0, capsys.readouterr()


def _needs_devices(argv) -> bool:
    """A command that shards jaxmodel (--mesh, probe where's sharding circumstance)."""
    return "--mesh" in argv or "sharding" in argv


@pytest.mark.parametrize("line,code", [pytest.param(line, code, id=f"line{line}") for line, code in _blocks("python")])
def test_python_blocks_run(line, code, tokenized_tiny, tmp_path, monkeypatch):
    """Each block in a fresh namespace; the test functions a block defines are called."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"readme_line{line}"}
    exec(compile(_as_written(code, tokenized_tiny, tmp_path), f"README.md:{line}", "exec"), namespace)
    for name, fn in list(namespace.items()):
        if name.startswith("test_") and callable(fn):
            fn()
