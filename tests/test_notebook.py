"""Results drawn in a notebook: ``_repr_html_`` of a diagnosis, a watch history and a
comparison, parsed as HTML: the verdict in the heading, the key numbers, the table of what
is not ok and an inline PNG that decodes; a healthy result as the negative control."""

from __future__ import annotations

import base64
import math
from html.parser import HTMLParser

import pytest
import torch

import tinylm
from diagnostics import CompareOptions, OptionsError, Watch, compare, diagnose
from diagnostics.jobs.comparison import Comparison
from diagnostics.jobs.watch import History, first_departure, loss_summary, verdicts
from tinylm import functional as F

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=4, num_heads=2, d_ff=32)


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
