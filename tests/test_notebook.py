"""Results drawn in a notebook: ``_repr_html_`` of a diagnosis, a watch history and a
comparison, parsed as HTML: the verdict in the heading, the key numbers, the table of what
is not ok and an inline PNG that decodes; a healthy result as the negative control.

diagnostics finds the renderer through the ``tinylm.renderers`` entry point that
pyproject.toml declares; the tests read that declaration and serve it as the installed entry
points (so they hold whether or not the checkout was reinstalled since), and check the lookup,
the ``use`` override, the repr fallback when nothing is registered, and that diagnostics
never imports the drawing package itself."""

from __future__ import annotations

import ast
import base64
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from importlib import metadata
from pathlib import Path

import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency reads TOML there
    import tomli as tomllib

import tinylm
from diagnostics import CompareOptions, History, OptionsError, Watch, compare, diagnose
from diagnostics.jobs.comparison import Comparison
from diagnostics.jobs.history import loss_summary
from diagnostics.judge.over_time import first_departure, verdicts
from tinylm import functional as F

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=4, num_heads=2, d_ff=32)
ROOT = Path(__file__).resolve().parents[1]


def declared_renderers() -> list[metadata.EntryPoint]:
    """The entry points of the group diagnostics.display reads, as pyproject.toml declares them."""
    from diagnostics import display

    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][display.GROUP]
    return [metadata.EntryPoint(name=name, value=value, group=display.GROUP) for name, value in table.items()]


def serve_entry_points(monkeypatch, points: list[metadata.EntryPoint]) -> None:
    """Make ``points`` the installed entry points of diagnostics.display's group, looked up afresh."""
    from diagnostics import display

    real = metadata.entry_points

    def entry_points(**params):
        if params.get("group") == display.GROUP:
            return metadata.EntryPoints(points)
        return real(**params)

    monkeypatch.setattr(display.metadata, "entry_points", entry_points)
    display.use(None)


@pytest.fixture(autouse=True)
def installed_renderer(monkeypatch):
    """The renderer registered as an installed copy of this checkout registers it."""
    from diagnostics import display

    serve_entry_points(monkeypatch, declared_renderers())
    yield
    display.use(None)


class Parsed(HTMLParser):
    """The parts a reader sees: the verdict, the text, table cells by table class, images."""

    def __init__(self, text: str):
        super().__init__()
        self.verdict, self.text, self.tables, self.images = "", [], {}, []
        self._in_verdict, self._table, self._cell = False, None, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and a.get("class") == "verdict":
            self._in_verdict = True
        elif tag == "table":
            self._table = self.tables.setdefault(a.get("class"), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(a)

    def handle_endtag(self, tag):
        if tag == "span":
            self._in_verdict = False
        elif tag == "table":
            self._table = None
        elif tag in ("td", "th") and self._table is not None:
            self._table[-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._in_verdict:
            self.verdict += data
        if self._cell is not None:
            self._cell += data
        self.text.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def png_of(img: dict) -> bytes:
    src = img["src"]
    assert src.startswith("data:image/png;base64,")
    data = base64.b64decode(src.split(",", 1)[1])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 200 and height > 100
    return data


def model(norm: str = "pre", scale: float = 1.0) -> tinylm.TransformerLM:
    m = tinylm.TransformerLM(tinylm.ModelConfig(**SMALL, norm=norm), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.startswith("layers") and p.dim() == 2:
                p.mul_(scale)
    return m


def tokens():
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))


def test_a_diagnosis_with_findings_shows_its_verdict_numbers_findings_and_plot():
    r = diagnose(model("none", 4.0), tokens())
    assert not r.healthy
    p = Parsed(r._repr_html_())
    assert p.verdict.startswith(f"{len(r.findings)} finding(s)")
    for kind in {f.kind.replace("_", "-") for f in r.findings}:
        assert kind in p.verdict
    assert f"{r.header.loss:.4g}" in p.all_text and f"{r.header.loss_uniform:.4g}" in p.all_text
    assert f"{r.header.parameter_count:,} parameters" in p.all_text
    rows = p.tables["findings"][1:]
    assert [row[:2] for row in rows] == [[f.kind, f.where] for f in r.findings]
    assert [row[3] for row in rows] == [f"{f.value:.4g}" for f in r.findings]  # the exponent kept
    assert len(p.images) == 1 and "variance over depth" in p.images[0]["alt"]
    png_of(p.images[0])


def test_a_healthy_diagnosis_says_so_and_lists_no_findings():
    r = diagnose(model(), tokens())
    assert r.healthy
    p = Parsed(r._repr_html_())
    assert p.verdict == "healthy" and "findings" not in p.tables
    stream = p.tables["stream"][1:]
    assert len(stream) == len(r.depth) and stream[0][1] == r.depth[0].name
    png_of(p.images[0])


def _watched(blow_up_at: int | None) -> Watch:
    m = model()
    w = Watch(m, every=1)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for t in range(4):
        x = torch.randint(0, 32, (2, 9), generator=g)
        if t == blow_up_at:
            with torch.no_grad():
                m.lm_head.weight.mul_(100.0)
        with w.step(t):
            loss = F.cross_entropy(m(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        w.record(loss, lr=1e-2)
    return w


def test_a_watch_history_shows_the_first_departure_its_verdicts_and_the_run():
    w = _watched(blow_up_at=2)
    h = w.history
    dep = first_departure(h)
    for html in (w._repr_html_(), History(h)._repr_html_()):
        p = Parsed(html)
        assert p.verdict == f"exploding at step {dep['step']} ({dep['site']})" and dep["step"] == 2
        k, first, last = loss_summary(h)
        assert f"loss {first:.4g} → {last:.4g}" in p.all_text and "4 steps, 4 records" in p.all_text
        rows = p.tables["verdicts"][1:]
        assert [(int(r[0]), r[1], r[2]) for r in rows] == [(v["step"], v["site"], v["verdict"]) for v in verdicts(h)]
        png_of(p.images[0])


def test_a_healthy_watch_history_says_ok_and_its_dict_still_works():
    w = _watched(blow_up_at=None)
    p = Parsed(History(w.history)._repr_html_())
    assert p.verdict == "ok at all 4 records" and "verdicts" not in p.tables
    hist = History(w.history)
    assert hist["records"] is w.history["records"] and hist.data is w.history  # the dict is the stored form
    assert len(hist.to_frame()) > 0
    with pytest.raises(OptionsError, match="not a watch history"):
        History({"format": "other"})


def test_a_comparison_is_still_a_tuple_and_shows_its_cells_and_plot():
    c = compare(CompareOptions(schemes=["cs336", "kaiming"],
                               depths=(2, 6), widths=(32,), seeds=1, seq_len=8, norm="none"))
    tidy, summary = c  # as before
    assert isinstance(c, Comparison) and c.tidy is tidy and c.summary is summary
    p = Parsed(c._repr_html_())
    bad = int((summary["verdict"] != "ok").sum())
    assert p.verdict == (f"all {len(summary)} cells ok" if bad == 0 else f"{bad} of {len(summary)} cells not ok")
    rows = p.tables["summary"][1:]
    assert len(rows) == len(summary)
    assert [r[3] for r in rows] == list(summary["verdict"])
    assert [r[4] for r in rows] == [f"{v:.4g}" if math.isfinite(v) else str(v) for v in summary["slope_forward"]]
    png_of(p.images[0])


def test_drawing_leaves_the_notebooks_matplotlib_backend_as_it_was():
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # stands in for a notebook's inline backend
    try:
        html = History(_watched(blow_up_at=None).history)._repr_html_()
        assert matplotlib.get_backend() == "svg"
        assert "data:image/png;base64," in html
    finally:
        plt.switch_backend(before)


# --------------------------------------------------------------------------- the renderer registry


def test_pyproject_registers_the_notebook_renderer_and_the_lookup_finds_it():
    from diagnostics import display
    from reports import notebook

    assert [(p.name, p.value) for p in declared_renderers()] == [("notebook", "reports.notebook:html"),
                                                                 ("text", "reports.render:report_text")]
    assert display.renderer() is notebook.html  # found through the entry point, not imported by name


def test_with_nothing_registered_a_result_has_no_html_and_shows_its_repr(monkeypatch):
    serve_entry_points(monkeypatch, [])
    h = History(_watched(blow_up_at=2).history)
    assert h._repr_html_() is None and Watch(model())._repr_html_() is None  # IPython then shows the repr
    assert repr(h).startswith("History(4 steps, 4 records")
    # negative control: the same history with the renderer registered draws
    serve_entry_points(monkeypatch, declared_renderers())
    assert Parsed(h._repr_html_()).verdict.startswith("exploding at step 2")


def test_use_overrides_the_registered_renderer_and_none_restores_it():
    from diagnostics import display
    from reports import notebook

    h = History(_watched(blow_up_at=None).history)
    seen = []
    display.use(lambda obj: seen.append(obj) or "<b>mine</b>")
    assert h._repr_html_() == "<b>mine</b>" and seen == [h]
    display.use(None)
    assert display.renderer() is notebook.html and Parsed(h._repr_html_()).verdict == "ok at all 4 records"


def test_display_never_imports_the_drawing_package():
    """Drawing a history in a fresh interpreter with no renderer registered loads no module of
    reports; and no string in diagnostics' code (docstrings aside) names it, so no importlib
    call can reach it by name."""
    code = (
        "import sys\n"
        "from importlib import metadata\n"
        "metadata.entry_points = lambda **params: metadata.EntryPoints([])\n"
        "import torch, tinylm\n"
        "from diagnostics import History, Watch\n"
        "m = tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1,"
        " num_heads=2, d_ff=32))\n"
        "w = Watch(m, every=1)\n"
        "x = torch.randint(0, 32, (2, 9))\n"
        "with w.step(0):\n"
        "    m(x[:, :-1]).logsumexp(-1).mean().backward()\n"
        "w.record(1.0)\n"
        "assert w._repr_html_() is None and History(w.history)._repr_html_() is None\n"
        "print(sorted(n for n in sys.modules if n == 'reports' or n.startswith('reports.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    named = re.compile(r"\breports(\.\w+)*")
    found = []
    for path in (ROOT / "diagnostics").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if named.search(node.value):
                    found.append((path.name, node.value))
    display_text = (ROOT / "diagnostics" / "display.py").read_text()
    assert not found and not named.search(display_text), (found, named.findall(display_text))
