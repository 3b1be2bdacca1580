"""`parse --gpus N` (one engine process per device, pages pulled in shards) and `parse --ray` (Ray
Data, one engine actor per device), on CPU engine workers: every page parsed exactly once, the
same markdown as one engine, a killed worker loses only the pages it held and a rerun parses them."""

import os
import shutil
import signal

import pytest
from typer.testing import CliRunner

from ocriaquant import parse as parse_mod
from ocriaquant.cli import app
from ocriaquant.data import BUNDLED_PAGES
from ocriaquant.parse import parse
from ocriaquant.scale.pool import shards

SETTINGS = {"max_new_tokens": 8, "max_batch": 2}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """4 bundled pages, and their markdown from one engine in this process."""
    root = tmp_path_factory.mktemp("scale")
    folder = root / "pages"
    folder.mkdir()
    for p in [p for p in sorted(BUNDLED_PAGES.glob("page-*")) if p.suffix != ".md"][:4]:
        shutil.copy(p, folder / p.name)
    s = parse(None, folder, root / "single", **SETTINGS)
    assert s["parsed"] == 4
    return folder, {f.name: f.read_text() for f in (root / "single").glob("*.md")}


def _markdown(out):
    return {f.name: f.read_text() for f in out.glob("*.md")}


def test_shards_cover_every_page_exactly_once():
    items = list(range(23))
    for size in (1, 4, 7, 23, 50):
        got = shards(items, size)
        assert [i for s in got for i in s] == items and all(0 < len(s) <= size for s in got)
    with pytest.raises(ValueError):
        shards(items, 0)


class DieAfterFirstPage:
    """Stands in for parse's engine worker (same pickled-by-reference target): the first worker
    to finish a page is killed with SIGKILL right after reporting it, holding the rest of its shard."""

    def __call__(self, device, feed, emit, job):
        from ocriaquant.parse import _engine_worker  # in the worker: the module as it is, unpatched

        def emit_then_die(kind, key=None, **data):
            emit(kind, key, **data)
            if kind == "done":
                try:
                    os.close(os.open(os.path.join(os.environ["OCRIAQUANT_TEST_VICTIM"], "claimed"),
                                     os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return
                os.kill(os.getpid(), signal.SIGKILL)
        _engine_worker(device, feed, emit_then_die, job)


def test_two_workers_parse_each_page_once_and_a_killed_one_loses_only_its_pages(pages, tmp_path, monkeypatch):
    """`--gpus 2 --device cpu`: two engine processes pull shards of 2 pages; the first to finish a
    page is killed. The other finishes its own shard; the summary names the victim's unfinished
    page; a rerun skips the finished pages and parses that one; the markdown is one engine's."""
    folder, single = pages
    monkeypatch.setenv("OCRIAQUANT_TEST_VICTIM", str(tmp_path))
    monkeypatch.setattr(parse_mod, "_engine_worker", DieAfterFirstPage())
    monkeypatch.setattr(parse_mod, "SHARD_PAGES", 2)
    out = tmp_path / "out"
    s = parse(None, folder, out, gpus=2, **SETTINGS)
    dead = [w for w in s["workers"] if w["exit_code"] != 0]
    assert len(dead) == 1 and dead[0]["exit_code"] == -signal.SIGKILL
    lost = dead[0]["lost"]
    assert dead[0]["pages"] == 1 and lost  # it held the rest of its shard (or more) when it died
    assert [x["page"] for x in s["lost"]] == lost and not s["failed"] and s["not_started"] == 0
    written = _markdown(out)
    assert sorted(written) == sorted(set(single) - {parse_mod.markdown_name(p) for p in lost})
    # every page once: done by exactly one worker (a page done twice would count twice), or lost
    assert s["parsed"] == sum(w["pages"] for w in s["workers"]) == len(written) == 4 - len(lost)
    assert written == {k: single[k] for k in written}
    monkeypatch.undo()
    again = parse(None, folder, out, **SETTINGS)  # the rerun: finished pages skipped, the lost ones parsed
    assert again["already_done"] == len(written) and again["parsed"] == len(lost)
    assert _markdown(out) == single


def test_ray_local_with_two_cpu_actors_gives_one_engines_markdown(pages, tmp_path):
    pytest.importorskip("ray.data")
    folder, single = pages
    s = parse(None, folder, tmp_path / "out", ray="local", gpus=2, **SETTINGS)
    assert s["parsed"] == 4 and not s["failed"]
    assert _markdown(tmp_path / "out") == single


def test_gpus_errors_name_the_fix(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--gpus", "2", "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 2 and "no CUDA device is visible" in res.output and "--device cpu" in res.output
    res = runner.invoke(app, ["parse", "--gpus", "all", "--device", "cpu", "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and "--gpus 2 --device cpu" in res.output
    res = runner.invoke(app, ["parse", "--gpus", "0", "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and "--gpus takes `all` or a number" in res.output
