"""One registry of circumstances (compare.probes.where_plan.CIRCUMSTANCES: a new one is one
entry, and the CLI, plan() and the budget check follow it) and one layer streamer
(compare.adapters.streaming: probe where's StreamSource and the streamed ladder's
stream_capture walk the same reader and runs, and give the same numbers bit for bit)."""

import argparse
import inspect
import re

import numpy as np
import pytest

from compare.adapters import fp64_policy
from compare.adapters.streaming import HEAD_CHUNK_BYTES, CheckpointModel, LayerReader, head_chunk
from compare.ladder.stream import stream_capture
from compare.probes.where_plan import CIRCUMSTANCES, Circumstance, check_budget, circumstance, plan, plan_append
from compare.probes.where_sources import StreamSource, stages
from llama_parity import probe_cli
from llamaspec import InputError, LlamaConfig, Policy

TARGET = np.random.default_rng(1).integers(3, 90, (1, 9))
OPTIONS = {"batch": {"batch_sizes": (3,)}, "decode": {"batch_sizes": (3,)}, "sharding": {"meshes": [{"tensor": 2}]}}


def probe_parser() -> argparse.ArgumentParser:
    """`llama-parity probe` as the CLI builds it."""
    parser = argparse.ArgumentParser(prog="llama-parity")
    probe_cli.add_parser(parser.add_subparsers(dest="command"), argparse.ArgumentParser(add_help=False))
    return parser


# ----- one registry of circumstances ----------------------------------------------------------------

def test_the_cli_offers_exactly_the_registrys_circumstances_with_their_help(capsys):
    parser = probe_parser()
    for name in CIRCUMSTANCES:
        assert parser.parse_args(["probe", "where", "--circumstance", name]).circumstance == name
    with pytest.raises(SystemExit):
        parser.parse_args(["probe", "where", "--circumstance", "nope"])
    offered = capsys.readouterr().err.partition("choose from")[2]
    assert re.findall(r"[\w-]+", offered) == list(CIRCUMSTANCES)
    with pytest.raises(SystemExit):
        parser.parse_args(["probe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{c.name}: {c.help}" in text for c in CIRCUMSTANCES.values())


def test_an_unknown_circumstance_is_refused_with_the_list():
    listed = re.escape(f"unknown circumstance 'nope' (one of {', '.join(CIRCUMSTANCES)})")
    for refuse in (lambda: plan("nope", TARGET, 96), lambda: circumstance("nope"),
                   lambda: check_budget("nope", 9, 64, 96)):
        with pytest.raises(ValueError, match=listed):
            refuse()


@pytest.mark.parametrize("name", list(CIRCUMSTANCES))
def test_each_entry_names_its_plans_options_and_bounds_its_calls(name):
    """The entry's options are its plan's keyword options, and its largest_call bounds every
    call the plan makes (a decode run's call is its prompt and the step)."""
    c = CIRCUMSTANCES[name]
    assert tuple(inspect.signature(c.plan).parameters)[4:] == c.options
    runs, pairs = plan(name, TARGET, 96, **OPTIONS.get(name, {}))
    rows, slots = c.largest_call(TARGET.shape[1], **OPTIONS.get(name, {}))
    assert runs and pairs
    assert max(r.rows for r in runs) <= rows
    assert max(r.width + (r.step is not None) for r in runs) <= slots


def test_a_new_circumstance_is_one_entry(monkeypatch):
    """One entry in CIRCUMSTANCES: plan() runs its plan, the budget check uses its bound, the
    CLI offers it and fills the options it has flags for."""
    entry = Circumstance("append-many", plan_append, lambda T, **_: (1, 10 ** 12), ("appended",),
                         "a sequence vs the same with many tokens appended")
    monkeypatch.setitem(CIRCUMSTANCES, entry.name, entry)
    runs, pairs = plan("append-many", TARGET, 96, appended=(3,))
    assert [r.width for r in runs] == [9, 12] and len(pairs) == 1
    with pytest.raises(InputError, match="append-many"):
        check_budget("append-many", 9, 10 ** 13, 96)
    args = probe_parser().parse_args(["probe", "where", "--circumstance", "append-many"])
    assert probe_cli.where_options(args) == {}    # no flag of the CLI sets appended
    args = probe_parser().parse_args(["probe", "where", "--circumstance", "padding", "--pad", "3"])
    assert probe_cli.where_options(args) == {"pad": 3}


# ----- one layer streamer ----------------------------------------------------------------------------

def small_chunk(folder) -> int:
    """A head chunk of 7 rows (the vocabulary in several chunks, the last one shorter)."""
    cfg = LlamaConfig.from_file(f"{folder}/config.json")
    assert head_chunk(cfg, 7 * 8 * cfg.hidden_size) == 7 and cfg.vocab_size % 7
    return 7 * 8 * cfg.hidden_size


def test_the_reader_gives_the_lm_head_in_chunks_that_cover_it(tiny_dir):
    folder = tiny_dir("gqa")
    reader = LayerReader([folder], small_chunk(folder))
    chunks = list(reader.head(folder))
    whole = reader.tensors(folder, ["lm_head.weight"])["lm_head.weight"]
    assert [start for start, _ in chunks] == list(range(0, whole.shape[0], 7))
    assert np.array_equal(np.concatenate([rows for _, rows in chunks]), whole)
    assert len(list(LayerReader([folder]).head(folder))) == 1     # the default: one piece


@pytest.mark.parametrize("package", ["torchref", "jaxmodel"])
@pytest.mark.parametrize("chunk", ["default", "small"])
def test_probe_wheres_streamed_rows_are_stream_captures_taps_bit_for_bit(package, chunk, tiny_dir):
    """Every run of a batch plan and its float64 twin, every stage: StreamSource's target rows
    are stream_capture's taps of that run (the logits where the run is the one target row:
    StreamSource multiplies only the target rows by the lm_head)."""
    folder = tiny_dir("gqa")
    chunk_bytes = HEAD_CHUNK_BYTES if chunk == "default" else small_chunk(folder)
    policy = Policy.get("bf16")
    runs, pairs = plan("batch", TARGET, 96, batch_sizes=(3,), kinds=("mixed",))
    rows_of = {r.key: sorted({s.row for p in pairs for s in (p.a, p.b) if s.run == r.key}) for r in runs}
    source = StreamSource(package, folder, policy, runs, rows_of, head_chunk_bytes=chunk_bytes)
    got = {}
    for stage in stages(source.cfg.num_hidden_layers):
        for key, acts in source.rows(stage).items():
            got.setdefault(key, {}).update(acts)
    for r in runs:
        for twin in (False, True):
            at = CheckpointModel(package, folder, fp64_policy(policy) if twin else policy)
            logits, taps = stream_capture(at, r.ids, r.mask, ["*"], head_chunk_bytes=chunk_bytes)
            for row in rows_of[r.key]:
                mine = got[(r.key, twin, row)]
                assert set(mine) == set(taps), (r.key, twin)
                differ = [t for t in taps if t != "logits" and not np.array_equal(mine[t], taps[t][row])]
                assert not differ, (r.key, twin, row, differ)
                if r.rows == 1:
                    assert np.array_equal(mine["logits"], logits[row]), (r.key, twin)


@pytest.mark.parametrize("policy,rtol", [("fp32", 1e-6), ("fp64", 1e-13)])
def test_the_lm_head_in_chunks_gives_the_same_logits(policy, rtol, tiny_dir):
    """Chunks change nothing before the lm_head, and its products only by the order of a
    matmul's sums (a chunk of other width may be blocked otherwise: docs/streaming.md)."""
    folder = tiny_dir("gqa")
    ids = np.random.default_rng(2).integers(3, 90, (2, 11))
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    impl = CheckpointModel("torchref", folder, policy)
    whole, taps = stream_capture(impl, ids, mask, ["*"])
    chunked, chunked_taps = stream_capture(impl, ids, mask, ["*"], head_chunk_bytes=small_chunk(folder))
    assert [t for t in taps if t != "logits" and not np.array_equal(taps[t], chunked_taps[t])] == []
    assert chunked.dtype == whole.dtype and chunked.shape == whole.shape
    np.testing.assert_allclose(chunked, whole, rtol=rtol, atol=rtol * np.abs(whole).max())
