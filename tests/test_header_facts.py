"""Every fact of the report's text header is in the JSON document's header.

Derived generally: the header the command line prints is drawn again from the JSON file alone
(``DiagnoseResult.from_dict``, no context from the command line) and must come out line for line
the same; whatever the text says, the JSON holds. Grouped-query attention (the K/V head count) is
in both. The negative control removes facts from the document and shows the redraw then differs.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from rich.console import Console

import tinylm
from diagnostics import DiagnoseResult
from reports.cli import main
from reports.render import ReportContext, header_table
from tinylm import checkpoint, hf

WIDTH = 220
GQA = tinylm.ModelConfig(vocab_size=300, context_length=8, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         d_ff=64)
FAST = ["--batch-size", "1", "--batches", "1", "--seq-len", "4", "--no-progress", "--width", str(WIDTH)]


def _bf16_gqa_directory(tmp_path):
    model = tinylm.TransformerLM(GQA, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return hf.save_pretrained(model, tmp_path / "hf")


def _checkpoint_and_data(tmp_path):
    path = tmp_path / "m.pt"
    checkpoint.save(path, tinylm.TransformerLM(GQA, generator=torch.Generator().manual_seed(1)))
    data = tmp_path / "d.npy"
    np.save(data, np.arange(500, dtype=np.int64) % 300)
    return [path, "--data", data, "--dtype", "bfloat16"]


def _text_header(out: str) -> list[str]:
    lines = out.splitlines()
    return [s.rstrip() for s in lines[:lines.index("")]]


def _drawn(doc: dict) -> list[str]:
    buf = io.StringIO()
    Console(width=WIDTH, file=buf, color_system=None).print(header_table(DiagnoseResult.from_dict(doc),
                                                                         ReportContext()))
    return [s.rstrip() for s in buf.getvalue().splitlines()]


@pytest.mark.parametrize("case", ["bf16-gqa-hf-directory", "checkpoint-data-dtype"])
def test_the_json_header_holds_every_fact_of_the_text_header(tmp_path, capsys, case):
    argv = [_bf16_gqa_directory(tmp_path)] if case.startswith("bf16") else _checkpoint_and_data(tmp_path)
    report = tmp_path / "r.json"
    assert main(["diagnose", *map(str, argv), "--json", str(report), *FAST]) == 0
    text = _text_header(capsys.readouterr().out)
    doc = json.loads(report.read_text())
    assert _drawn(doc) == text  # every line of the text header, from the JSON alone
    joined = " ".join(text)
    assert "dtype bfloat16 (stored)" in joined if case.startswith("bf16") else "dtype bfloat16 (--dtype)" in joined
    assert doc["header"]["dtype"] == "bfloat16"
    # grouped-query attention in both: 4 query heads share 2 K/V heads
    assert re.search(r"\bH=4 KV=2\b", joined) and doc["header"]["kv_heads"] == 2
    assert doc["header"]["config"]["num_kv_heads"] == 2


def test_a_fact_missing_from_the_json_is_caught(tmp_path, capsys):  # negative control
    report = tmp_path / "r.json"
    assert main(["diagnose", str(_bf16_gqa_directory(tmp_path)), "--json", str(report), *FAST]) == 0
    text = _text_header(capsys.readouterr().out)
    doc = json.loads(report.read_text())
    for key in ("dtype", "dtype_note", "source", "data"):
        less = json.loads(json.dumps(doc))
        del less["header"][key]
        assert _drawn(less) != text, key
    mha = json.loads(json.dumps(doc))
    mha["header"]["config"]["num_kv_heads"] = None
    mha["header"]["kv_heads"] = None
    assert "KV=" not in " ".join(_drawn(mha))  # multi-head attention: no K/V count drawn
